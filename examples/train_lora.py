"""Train a LoRA for MAGI-2's Preview transformer; run it with ``accelerate launch`` (or plain ``python``).

Objective (``train_lora_objective.py``): SandAI's flow matching, ``x_t = (1 - sigma) x0 + sigma eps`` with target
``eps - x0`` at ``timestep = floor(1000 sigma)``, the audio latent noised at the video's sigma. By default sigma is
uniform and only the video latent takes a loss; diffusers' ``--weighting_scheme`` (``logit_normal``, ``mode``,
``sigma_sqrt``, ``cosmap``) and ``--flow_shift`` choose the sigmas (the sampler's scheduler shifts its own by its
``flow_shift``), ``--audio_loss_weight`` adds the audio latent's loss and ``--cfg_dropout`` swaps in the pipeline's
negative prompt (the unconditional branch of the sampler's classifier-free guidance).

Data (``--data_dir``): either videos ``<stem>.mp4`` (``.mov``, ``.mkv``, ``.webm``) with captions ``<stem>.txt``,
turned into caches by ``--cache`` (the pipeline's own Wan VAE, audio VAE and text encoder: ``train_lora_data.py``),
or caches ``<stem>.magi2.safetensors`` holding ``latents [48, T, H, W]`` (normalised as the pipeline's), ``text_states
[Lt, 5120]`` and optionally ``audio_latents [La, 64]`` (zeros when absent, which a model trained with sound takes
for a clip unlike any it saw). Every file is checked before training;
a missing caption, an unreadable video or a size the VAE cannot take (height/width not multiples of 16) stops the
run naming the file.

LoRA: ``--targets`` (default ``linear_qkv,linear_proj``; add ``router`` for the MoE router gates, ``shared_experts``
for the shared experts) at ``--rank`` / ``--alpha``, also in the multimodal layers (our grouped LoRA layer). Frozen
weights stay in the load dtype (``--dtype bfloat16``; ``--expert_dtype`` stores the routed experts of ``--model`` in
any ``expert_dtype`` the model takes: ``float8_e4m3fn`` or ``int4``, read from a repo written so or quantized while
reading, at ``--expert_int4_group_size`` rows per scale); the LoRA parameters (``cast_training_params``) and the optimizer are fp32. Quantized experts are frozen,
and the expert op's backward makes no gradient for them (only the input's and the router's). ``--storage_dtype
float8_e4m3fn`` stores the frozen dense weights in FP8 between calls (the transformer's ``enable_layerwise_casting``,
each layer cast to ``--dtype`` for its call; the fp32 islands, the routed experts and the LoRA keep their dtypes);
``float8_e4m3fn_scaled`` stores them in e4m3 with one fp32 scale per output channel (``enable_fp8_storage``, about
half the unscaled rounding error at the released size).
``--gradient_checkpointing`` recomputes each block; with ``--offload_block_inputs`` each block's saved input waits
in host memory for its backward (``enable_gradient_checkpointing(offload_block_inputs=True)``). One 80 GB GPU at
272p takes ``--expert_dtype int4 --storage_dtype float8_e4m3fn_scaled --gradient_checkpointing
--offload_block_inputs``; one 32 GB GPU adds ``--vram_gb 32``: the blocks' frozen weights stay in host memory and
stream through a ring of device buffers (``enable_weight_streaming``), in order for the forward and in reverse order
for the recomputes of the backward, while the LoRA parameters stay on the device. ``--host_memory disk`` (with
``--vram_gb`` and ``--model``) reads each block from the repo's safetensors files through a staging ring instead of
holding the blocks in host memory (frozen weights as the files store them: no ``--storage_dtype``, and
``--expert_dtype`` only as the repo stores its experts). With ``--vram_gb``, ``--cache`` and ``--cfg_dropout``
encode under generation's rules (``train_lora_data.encode_streamed``: the text encoder streamed in the same host
memory mode), and the training pipeline, loaded after everything caching used is released, holds no encoder.

The loop is diffusers' training-script form on ``accelerate.Accelerator``: ``accelerator.accumulate`` over
``--gradient_accumulation_steps`` micro-batches, ``accelerator.backward``, an LR schedule (``--lr_scheduler``,
``--lr_warmup_steps``: diffusers' ``get_scheduler``), ``save_state`` / ``load_state`` checkpoints. ``--max_steps``
and ``--checkpoint_every`` count optimizer steps. ``--seed`` seeds everything (``accelerate.utils.set_seed``: Python,
NumPy and torch on every device, so the LoRA's initial factors too) and the noise generator, so two runs with the
same flags write the same LoRA bit for bit.

Parallelism over the launched ranks: Ulysses context parallelism over all of them and expert parallelism over
``--ep_degree`` (default: all); the all-to-all exchanges and the expert op carry gradients. Every rank trains on the
same sample (its sequence shard), so the LoRA gradients are averaged over the ranks with ``accelerator.reduce``
before each optimizer step; the transformer is not wrapped in DDP (``accelerator.prepare(model)``), which would
overwrite every rank's routed experts with rank 0's when it wraps the model. Every ``--checkpoint_every`` steps
``accelerator.save_state`` writes ``<output_dir>/checkpoint-<step>/`` (under a temporary name, renamed when every
rank is done): the optimizer, the LR schedule, the noise generator and random states, and the LoRA as
``pytorch_lora_weights.safetensors`` (diffusers format with its adapter config, ``pipe.load_lora_weights`` reads
it); ``--resume_from_checkpoint latest`` (or a checkpoint folder, a bare ``checkpoint-<step>`` in ``--output_dir``; ``--resume`` is the same flag) continues from one with
``accelerator.load_state``; ``latest`` with no checkpoint in ``--output_dir`` says so and starts a new run, as
diffusers' training scripts do, while a named folder that is not a checkpoint stops the run before any work.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parent
if str(EXAMPLES) not in sys.path:  # the modules beside this script, also when it is loaded by path
    sys.path.insert(0, str(EXAMPLES))
from train_lora_checkpoints import (  # noqa: E402
    NoiseGenerator,
    find_checkpoint,
    register_checkpoint_hooks,
    save_checkpoint,
    save_lora,
)
from train_lora_data import (  # noqa: E402
    encode_dataset,
    encode_negative_prompt,
    encode_streamed,
    load_cache,
    read_video,
    scan_dataset,
)
from train_lora_objective import WEIGHTING_SCHEMES, Objective, flow_matching_inputs  # noqa: E402


#: ``--storage_dtype`` values: FP8 formats ``enable_layerwise_casting`` stores weights in, and e4m3 with one fp32
#: scale per output channel (``enable_fp8_storage``).
STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fn_scaled")
TARGETS = {
    "linear_qkv": ["linear_qkv"],
    "linear_proj": ["linear_proj"],
    "router": [],  # target_parameters
    "shared_experts": [
        "shared_expert_fc1",
        "shared_expert_fc2",
        "modality_specific_shared_expert_fc1",
        "modality_specific_shared_expert_fc2",
    ],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="converted repo or saved pipeline folder (default: the tiny random model, build_tiny_random_pipeline)",
    )
    p.add_argument("--data_dir", help="videos + <stem>.txt captions, or <stem>.magi2.safetensors (required)")
    p.add_argument("--output_dir", help="LoRA and checkpoints (required)")
    p.add_argument("--cache", action="store_true", help="encode the videos and captions into caches first")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: the rank, i.e. scale 1)")
    p.add_argument("--targets", default="linear_qkv,linear_proj", help=f"comma list of {sorted(TARGETS)}")
    p.add_argument("--max_steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr_scheduler", default="constant", help="diffusers' get_scheduler name (constant, linear, ...)")
    p.add_argument("--lr_warmup_steps", type=int, default=0)
    p.add_argument("--checkpoint_every", type=int, default=250, help="optimizer steps")
    p.add_argument(
        "--resume_from_checkpoint",
        "--resume",
        default=None,
        help="'latest' (the newest checkpoint-<step> in --output_dir; a new run when there is none) or a "
        "checkpoint-<step> folder (a bare name is looked up in --output_dir)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds everything (accelerate's set_seed) and the noise")
    p.add_argument("--dtype", default=None, help="frozen weights' dtype (default bfloat16 on GPU, float32 on CPU)")
    p.add_argument(
        "--expert_dtype",
        default=None,
        help="routed-expert storage of --model: an expert_dtype the model takes "
        "(diffusers_magi2.moe.quantize.EXPERT_DTYPES: float8_e4m3fn, int4)",
    )
    p.add_argument(
        "--expert_int4_group_size",
        type=int,
        default=None,
        help="with --expert_dtype int4 on a bf16 repo: rows of each expert matrix's contraction dim per scale "
        "(default 128; it must divide the expert widths)",
    )
    p.add_argument(
        "--storage_dtype",
        default=None,
        choices=STORAGE_DTYPES,
        help="store the frozen dense weights in this dtype between calls, computed in --dtype (layerwise casting; "
        "float8_e4m3fn_scaled: e4m3 with one fp32 scale per output channel, enable_fp8_storage)",
    )
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument(
        "--offload_block_inputs",
        action="store_true",
        help="with --gradient_checkpointing: keep each block's saved input in host memory until its backward",
    )
    p.add_argument(
        "--vram_gb",
        type=float,
        default=None,
        help="with --gradient_checkpointing, one process: stream the transformer's block weights through a ring "
        "of device buffers for a card of this many GB (e.g. 32), each block again in reverse order for its "
        "recompute in the backward; the LoRA stays on the device (Magi2Transformer3DModel.enable_weight_streaming)",
    )
    p.add_argument(
        "--host_memory",
        choices=["pinned", "disk"],
        default=None,
        help="with --vram_gb: where the streamed weights live (default pinned: held once in page-locked host "
        "memory; disk: read from --model's safetensors files through a staging ring of a few blocks)",
    )
    p.add_argument("--ep_degree", type=int, default=None, help="expert-parallel ranks (default: all launched)")
    p.add_argument("--fixed_noise", action="store_true", help="one sigma and noise for every step (overfit check)")
    p.add_argument(
        "--weighting_scheme",
        default="none",
        choices=WEIGHTING_SCHEMES,
        help="sigma density and loss weighting (diffusers' names; none: uniform sigma, weight 1)",
    )
    p.add_argument("--logit_mean", type=float, default=0.0, help="with --weighting_scheme logit_normal")
    p.add_argument("--logit_std", type=float, default=1.0, help="with --weighting_scheme logit_normal")
    p.add_argument("--mode_scale", type=float, default=1.29, help="with --weighting_scheme mode")
    p.add_argument(
        "--flow_shift",
        type=float,
        default=1.0,
        help="shift the drawn sigmas as the scheduler shifts the sampler's, s u / (1 + (s - 1) u) (1: none)",
    )
    p.add_argument(
        "--audio_loss_weight", type=float, default=0.0, help="weight of the audio latent's loss (0: video only)"
    )
    p.add_argument(
        "--cfg_dropout",
        type=float,
        default=0.0,
        help="probability of training a sample on the pipeline's negative prompt (the unconditional branch)",
    )
    p.add_argument("--device", default=None)
    p.add_argument(
        "--estimate_memory",
        action="store_true",
        help="print the per-GPU weight + LoRA-state memory of the released size (meta device) and exit",
    )
    args = p.parse_args(argv)
    if not args.estimate_memory and (args.data_dir is None or args.output_dir is None):
        p.error("--data_dir and --output_dir are required")
    if args.offload_block_inputs and not args.gradient_checkpointing:
        p.error(
            "--offload_block_inputs moves the inputs that gradient checkpointing saves: add --gradient_checkpointing"
        )
    if args.vram_gb is not None:
        if not args.gradient_checkpointing:
            p.error(
                "--vram_gb streams each block again for its recompute in the backward: add --gradient_checkpointing"
            )
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            p.error("--vram_gb streams the weights of one process's GPU: launch one process")
        if args.vram_gb <= 0:
            p.error(f"--vram_gb must be > 0; got {args.vram_gb}")
    try:
        check_host_memory(args)
    except ValueError as error:
        p.error(str(error))
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        p.error(f"--targets: unknown {unknown}; choose from {sorted(TARGETS)}")
    args.targets = targets
    for name in ("rank", "max_steps", "checkpoint_every", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.lr_warmup_steps < 0:
        p.error("--lr_warmup_steps must be >= 0")
    if args.resume_from_checkpoint not in (None, "latest"):
        try:
            find_checkpoint(Path(args.output_dir), args.resume_from_checkpoint)
        except ValueError as error:
            p.error(str(error))
    try:  # the objective's own checks; the negative prompt's states come later
        objective(args, negative_text_states=0 if args.cfg_dropout > 0 else None)
    except ValueError as error:
        p.error(f"--{error}")
    if args.lr_scheduler != "constant":  # diffusers is imported only to check another name
        from diffusers.optimization import SchedulerType

        allowed = [t.value for t in SchedulerType if t is not SchedulerType.PIECEWISE_CONSTANT]
        if args.lr_scheduler not in allowed:
            p.error(f"--lr_scheduler {args.lr_scheduler!r}: choose from {allowed}")
    if args.expert_dtype is not None:
        if args.model is None:
            p.error(
                "--expert_dtype applies to the routed experts of --model (the tiny random model is built in --dtype)"
            )
        from diffusers_magi2.moe.quantize import parse_expert_dtype

        try:
            parse_expert_dtype(args.expert_dtype)
        except ValueError as error:
            p.error(f"--expert_dtype: {error}")
    if args.expert_int4_group_size is not None:
        if args.expert_dtype != "int4":
            p.error(f"--expert_int4_group_size applies to --expert_dtype int4; got --expert_dtype {args.expert_dtype}")
        try:
            check_int4_group_size(args.model, args.expert_int4_group_size)
        except ValueError as error:
            p.error(f"--expert_int4_group_size: {error}")
    return args


def check_host_memory(args) -> None:
    """``--host_memory`` (generate.py's rules): only with ``--vram_gb``; ``disk`` only with ``--model``, whose files
    must hold the frozen weights as trained (no ``--storage_dtype``; ``--expert_dtype`` only as the repo stores the
    experts); ``ValueError`` otherwise."""
    if args.host_memory is not None and args.vram_gb is None:
        raise ValueError("--host_memory goes with --vram_gb (it says where the streamed weights live)")
    if args.host_memory != "disk":
        return
    if args.model is None:
        raise ValueError(
            "--host_memory disk reads the streamed weights from the safetensors files of --model; pass --model (a "
            "magi2-convert folder or a Hub id), or use --host_memory pinned (the default)"
        )
    if args.storage_dtype is not None:
        raise ValueError(
            f"--host_memory disk streams the frozen weights as --model's files store them; --storage_dtype "
            f"{args.storage_dtype} would change them after loading (convert with magi2-convert --dense_storage_dtype "
            "instead, or use --host_memory pinned)"
        )
    if args.expert_dtype is not None:
        from diffusers_magi2 import Magi2Transformer3DModel
        from diffusers_magi2.moe.quantize import parse_expert_dtype

        try:  # a Hub id not yet cached: its transformer's config.json alone is fetched
            config = Magi2Transformer3DModel.load_config(args.model, subfolder="transformer")
        except OSError as error:
            raise ValueError(
                f"--host_memory disk: cannot read the transformer config of {args.model} ({error})"
            ) from None
        stored = config.get("expert_dtype") or "the load dtype"
        if parse_expert_dtype(config.get("expert_dtype")) != parse_expert_dtype(args.expert_dtype):
            raise ValueError(
                f"--host_memory disk streams the experts as {args.model} stores them ({stored}); --expert_dtype "
                f"{args.expert_dtype} would quantize them while reading (convert with magi2-convert --expert_dtype, "
                "or use --host_memory pinned)"
            )


def check_int4_group_size(model: str, group_size: int) -> None:
    """Build ``model``'s transformer on the meta device with ``group_size`` (the model's own checks: a positive
    int that divides the expert widths; the size an int4 repo was written with); ``ValueError`` otherwise. A Hub
    id not yet in the cache is checked by ``from_pretrained`` instead."""
    import torch

    from diffusers_magi2 import Magi2Transformer3DModel

    if group_size < 1:
        raise ValueError(f"must be a positive int; got {group_size}")
    try:
        config = Magi2Transformer3DModel.load_config(model, subfolder="transformer", local_files_only=True)
    except OSError:
        return
    written = config.get("expert_int4_group_size") if config.get("expert_dtype") == "int4" else None
    if written is not None and written != group_size:
        raise ValueError(f"{model} holds int4 experts written with expert_int4_group_size={written}; got {group_size}")
    with torch.device("meta"):
        Magi2Transformer3DModel.from_config(config, expert_dtype="int4", expert_int4_group_size=group_size)


# ------------------------------------------------------------------------------------------------ model


def lora_config(args):
    """The ``peft.LoraConfig`` of ``--targets`` / ``--rank`` / ``--alpha`` (``B`` starts at zero)."""
    from peft import LoraConfig

    modules = [m for t in args.targets for m in TARGETS[t]]
    return LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha if args.alpha is not None else args.rank,
        target_modules=modules or None,
        target_parameters=["mlp.moe_mlp.gate"] if "router" in args.targets else None,
    )


#: The components :func:`load_pipeline` leaves out: the encoders alone for ``--vram_gb``'s caching, the transformer
#: alone for its training.
ENCODERS_ONLY = ("transformer", "refiner", "video_decoder")
TRANSFORMER_ONLY = ("text_encoder", "vae", "audio_vae", "video_decoder", "refiner")


def load_pipeline(args, without=()):
    """``(pipe, device)``: the tiny random model or ``--model`` in host memory, with EP/CP over the launched ranks;
    the components named in ``without`` are ``None`` (not read from the repo)."""
    import torch

    from diffusers_magi2 import Magi2Pipeline
    from diffusers_magi2.parallel.expert_parallel import ep_device
    from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline
    from diffusers_magi2.utils.dtype_utils import parse_dtype

    if str(EXAMPLES) not in sys.path:  # launch_rules.py beside this script, also when it is loaded by path
        sys.path.insert(0, str(EXAMPLES))
    from launch_rules import context_parallel_from_launch, expert_parallel_from_launch, init_distributed_from_launch

    init_distributed_from_launch()
    expert_parallel = expert_parallel_from_launch(args.ep_degree)
    context_parallel = context_parallel_from_launch(None, args.ep_degree)
    device = torch.device(args.device) if args.device else ep_device(expert_parallel)
    dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.model is None:
        pipe = build_tiny_random_pipeline(dtype=dtype)
        for name in without:
            setattr(pipe, name, None)
        if expert_parallel is not None:
            pipe.transformer.enable_expert_parallel(expert_parallel)
        if context_parallel is not None:
            pipe.enable_context_parallel(context_parallel)
    else:
        from diffusers_magi2 import Magi2Transformer3DModel

        dtypes = {"default": dtype, "vae": torch.float32, "audio_vae": torch.float32}
        extra = dict.fromkeys(without)
        # FP8 / int4 routed experts: the transformer is read alone (quantized while reading)
        if args.expert_dtype and "transformer" not in without:
            group = args.expert_int4_group_size
            extra["transformer"] = Magi2Transformer3DModel.from_pretrained(
                args.model,
                subfolder="transformer",
                torch_dtype=dtype,
                expert_dtype=args.expert_dtype,
                expert_parallel=expert_parallel,
                **({} if group is None else {"expert_int4_group_size": group}),
            )
        pipe = Magi2Pipeline.from_pretrained(
            args.model,
            dtype=dtypes,
            expert_parallel=None if "transformer" in extra else expert_parallel,
            context_parallel=context_parallel,
            **extra,
        )
    return pipe, device


def add_lora(transformer, args):
    """Freeze the transformer, add the LoRA (fp32 parameters: ``cast_training_params``); returns the trainable
    parameters by name."""
    import torch
    from diffusers.training_utils import cast_training_params

    transformer.requires_grad_(False)
    transformer.add_adapter(lora_config(args), "default")
    for name, param in transformer.named_parameters():
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    cast_training_params(transformer, dtype=torch.float32)
    trainable = {name: param for name, param in transformer.named_parameters() if param.requires_grad}
    if not trainable:
        raise ValueError(f"--targets {args.targets} matched no projection of the transformer")
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing(offload_block_inputs=args.offload_block_inputs)
    transformer.train()
    return trainable


def store_dense_weights(transformer, args) -> None:
    """``--storage_dtype``: the frozen dense weights stored in it between calls, each layer run in the frozen
    weights' dtype (``enable_layerwise_casting``; ``float8_e4m3fn_scaled``: ``enable_fp8_storage``, e4m3 with one
    fp32 scale per output channel; after :func:`add_lora`; both leave the fp32 islands, the routed experts and the
    LoRA layers alone)."""
    import torch

    if args.storage_dtype == "float8_e4m3fn_scaled":
        transformer.enable_fp8_storage(compute_dtype=transformer.compute_dtype)
    elif args.storage_dtype is not None:
        compute_dtype = transformer.compute_dtype
        transformer.enable_layerwise_casting(
            storage_dtype=getattr(torch, args.storage_dtype), compute_dtype=compute_dtype
        )


def objective(args, negative_text_states=None) -> Objective:
    """The :class:`Objective` of the flags (``negative_text_states``: the negative prompt's, for ``--cfg_dropout``)."""
    names = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "flow_shift", "audio_loss_weight")
    return Objective(
        **{n: getattr(args, n) for n in names},
        cfg_dropout=args.cfg_dropout,
        negative_text_states=negative_text_states,
    )


def training_loss(transformer, sample: dict, generator, device, fixed=None, objective: Objective | None = None):
    """The objective's loss (``train_lora_objective.py``; default: the original one) on one sample (fp32)."""
    import torch.nn.functional as F

    objective = objective or Objective()
    inputs = flow_matching_inputs(sample, generator, device, fixed, objective)
    dtype = transformer.compute_dtype
    out = transformer(
        hidden_states=inputs["x_t"].to(dtype),
        timestep=inputs["timestep"],
        encoder_hidden_states=inputs["text_states"].to(dtype),
        audio_hidden_states=inputs["a_t"].to(dtype),
        return_dict=True,
    )
    loss = F.mse_loss(out.sample.float(), inputs["target"].float())
    if objective.audio_loss_weight:
        audio_loss = F.mse_loss(out.audio_sample.float(), inputs["audio_target"].float())
        loss = loss + objective.audio_loss_weight * audio_loss
    return inputs["weight"] * loss


def average_gradients(accelerator, params) -> None:
    """Average the LoRA gradients over the launched ranks (``accelerator.reduce``); each rank's are those of its
    sequence shard of the same sample."""
    import torch

    if accelerator.num_processes == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for param, grad in zip(params, accelerator.reduce(grads, reduction="mean")):
        param.grad = grad


def train_step(
    accelerator, transformer, optimizer, lr_scheduler, params, samples, generator, device, fixed=None, objective=None
):
    """One optimizer step over ``samples`` (``--gradient_accumulation_steps`` micro-batches): each loss goes
    through ``accelerator.backward`` inside ``accelerator.accumulate``; at the last one the gradients are averaged
    over the ranks and the optimizer and the LR schedule step. Returns the micro-batches' mean loss (fp32).

    A NaN or inf that reached a MoE router in a forward raises the same ``ValueError`` on every rank before its
    backward: the router check ``Magi2Pipeline`` installed on the transformer runs in each forward
    (``apply_router_input_check``; a gradient-checkpointed block's recompute runs none)."""
    total = 0.0
    for sample in samples:
        with accelerator.accumulate(transformer):
            loss = training_loss(transformer, sample, generator, device, fixed, objective)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                average_gradients(accelerator, params)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        total += float(loss.detach())
    return total / len(samples)


# ------------------------------------------------------------------------------------------------ memory


def estimate_memory(args) -> list[dict]:
    """Per-GPU bytes at the released size (the default config built on the meta device): frozen non-expert
    weights (bf16, fp32 islands; with ``--storage_dtype`` as it stores them), this
    rank's routed experts (bf16, FP8 or int4 with its group scales: 4.125 bits a weight; ``1/E`` of them), and the
    fp32 LoRA parameters with their gradients and AdamW moments (16 bytes each); activations are not included.
    One row per EP degree and expert storage."""
    import torch

    from diffusers_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE

    with torch.device("meta"):
        model = Magi2Transformer3DModel(params_dtype=torch.bfloat16)
    banks = {
        id(p)
        for m in model.modules()
        if isinstance(m, Magi2MultiHeadMoE)
        for n, p in m.named_parameters()
        if n.startswith("W_")
    }
    experts = sum(p.numel() for p in model.parameters() if id(p) in banks)
    model.add_adapter(lora_config(args), "default")
    store_dense_weights(model, args)

    def is_lora(name: str) -> bool:
        return ".lora_A." in name or ".lora_B." in name

    lora = sum(p.numel() for n, p in model.named_parameters() if is_lora(n))
    others = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if id(p) not in banks and not is_lora(n)
    )
    rows = []
    for ep in (1, 2, 4, 8):
        for expert_bytes, name in ((2, "bf16"), (1, "float8_e4m3fn"), (4.125 / 8, "int4")):
            rows.append(
                {
                    "ep_degree": ep,
                    "experts": name,
                    "frozen_GiB": (others + experts * expert_bytes / ep) / 2**30,
                    "lora_state_GiB": lora * 16 / 2**30,
                    "lora_params_M": lora / 1e6,
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------ main


def train(args):
    """Run the training; returns ``(losses, pipe)``: the loss of each optimizer step this run took (the mean over
    its micro-batches) and the pipeline with the trained adapter ``default``."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler
    from tqdm.auto import tqdm

    output_dir = Path(args.output_dir)
    data_dir = Path(args.data_dir)
    # the dataset and the checkpoint to resume are checked before any model is built
    videos = scan_dataset(data_dir, want_videos=args.cache)
    if args.cache:
        for video in videos:
            read_video(video)
    resume = find_checkpoint(output_dir, args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    streamed = args.vram_gb is not None  # one process (parse_args)
    negative = None
    if streamed and (args.cache or args.cfg_dropout > 0):  # caching's weights released before training's load
        negative = encode_streamed(
            lambda: load_pipeline(args, without=ENCODERS_ONLY),
            videos if args.cache else [],
            args.vram_gb,
            args.host_memory or "pinned",
            negative=args.cfg_dropout > 0,
        )
    set_seed(args.seed)  # python, numpy and torch (every device): the LoRA's initial factors among them
    pipe, device = load_pipeline(args, without=TRANSFORMER_ONLY if streamed else ())
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision="no",  # the dtypes are --dtype's (frozen weights) and fp32 (LoRA)
        cpu=device.type == "cpu",
    )
    if args.cache and not streamed:
        if accelerator.is_main_process:
            encode_dataset(pipe, videos, device)
        accelerator.wait_for_everyone()
    caches = scan_dataset(data_dir, want_videos=False)
    samples = [load_cache(p, pipe.transformer) for p in caches]
    if args.cfg_dropout > 0 and not streamed:
        negative = encode_negative_prompt(pipe, device)
    loss_objective = objective(args, negative)

    params = list(add_lora(pipe.transformer, args).values())
    store_dense_weights(pipe.transformer, args)
    if args.vram_gb is None:
        pipe.transformer.to(device)  # alone on the device: the encoders and decoders wait in host memory
    else:  # the blocks' frozen weights stream through a device ring; the rest, the LoRA included, moves to the device
        pipe.transformer.enable_weight_streaming(
            device, vram_gb=args.vram_gb, host_memory=args.host_memory or "pinned"
        )
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
    # diffusers' convention: the prepared schedule steps once per process at each optimizer step
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_steps * accelerator.num_processes,
    )
    optimizer, lr_scheduler = accelerator.prepare(optimizer, lr_scheduler)
    noise = NoiseGenerator(args.seed)
    accelerator.register_for_checkpointing(noise)
    register_checkpoint_hooks(accelerator, pipe)
    start = 0
    if resume is not None:
        folder, start = resume
        accelerator.load_state(str(folder))
    elif args.resume_from_checkpoint is not None:
        accelerator.print(
            f"--resume_from_checkpoint latest: no checkpoint-<step> folder in {output_dir}; starting a new training run"
        )
    fixed = None
    if args.fixed_noise:
        g = torch.Generator().manual_seed(args.seed + 1)
        x0, a0 = samples[0]["latents"], samples[0]["audio_latents"]
        fixed = {
            "sigma": 0.5,
            "eps": torch.randn(x0[None].shape, generator=g).to(device),
            "eps_a": torch.randn(a0[None].shape, generator=g).to(device),
        }

    losses = []
    k = args.gradient_accumulation_steps
    bar = tqdm(
        range(start, args.max_steps), initial=start, total=args.max_steps, disable=not accelerator.is_main_process
    )
    for step in bar:
        batch = [samples[(step * k + i) % len(samples)] for i in range(k)]
        loss = train_step(
            accelerator,
            pipe.transformer,
            optimizer,
            lr_scheduler,
            params,
            batch,
            noise.generator,
            device,
            fixed,
            loss_objective,
        )
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.max_steps:
            save_checkpoint(accelerator, output_dir, step + 1)
    if accelerator.is_main_process:
        save_lora(pipe, output_dir)
    accelerator.wait_for_everyone()
    return losses, pipe


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.estimate_memory:
        for row in estimate_memory(args):
            print(
                f"EP {row['ep_degree']}, {row['experts']} experts: frozen weights {row['frozen_GiB']:.1f} GiB + LoRA "
                f"state {row['lora_state_GiB']:.2f} GiB ({row['lora_params_M']:.1f} M LoRA parameters) per GPU"
            )
        return 0
    losses, _ = train(args)
    if int(os.environ.get("RANK", "0")) == 0 and losses:
        print(
            f"trained steps {args.max_steps - len(losses) + 1}-{args.max_steps}: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )
        print(f"LoRA written to {Path(args.output_dir) / 'pytorch_lora_weights.safetensors'}")
    return 0


if __name__ == "__main__":
    code = main()
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from launch_rules import end_distributed_run

    end_distributed_run(code)
    sys.exit(code)
