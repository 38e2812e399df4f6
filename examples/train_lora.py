"""Train a LoRA for MAGI-2's Preview transformer; run it with ``accelerate launch`` (or plain ``python``).

Objective (SandAI's sampler predicts ``v = eps - x0`` and steps ``x0 = x - sigma * v``)::

    sigma ~ U(1e-5, 1 - 1e-5)   (no shift)          x_t = (1 - sigma) x0 + sigma eps        eps ~ N(0, I)
    timestep = floor(1000 sigma)  (0-1000 scale, as at inference)
    loss = mean((v_theta(x_t, a_t, text, timestep) - (eps - x0))^2)    over the video latent only
    a_t = (1 - sigma) a0 + sigma eps_a       the audio latent is noised at the video's sigma and takes no loss

Data (``--data_dir``): either videos ``<stem>.mp4`` (``.mov``, ``.mkv``, ``.webm``) with captions ``<stem>.txt``,
turned into caches by ``--cache`` (the pipeline's own Wan VAE and text encoder), or caches
``<stem>.magi2.safetensors`` holding ``latents [48, T, H, W]`` (normalised as the pipeline's), ``text_states
[Lt, 5120]`` and optionally ``audio_latents [La, 64]`` (zeros when absent). Every file is checked before training;
a missing caption, an unreadable video or a size the VAE cannot take (height/width not multiples of 16) stops the
run naming the file.

LoRA: ``--targets`` (default ``linear_qkv,linear_proj``; add ``router`` for the MoE router gates, ``shared_experts``
for the shared experts) at ``--rank`` / ``--alpha``, also in the multimodal layers (our grouped LoRA layer). Frozen
weights stay in the load dtype (``--dtype bfloat16``; ``--expert_dtype float8_e4m3fn`` quantizes the routed experts
of a bf16 repo); LoRA parameters and the optimizer are fp32. ``--gradient_checkpointing`` recomputes each block.

Parallelism over the launched ranks: Ulysses context parallelism over all of them and expert parallelism over
``--ep_degree`` (default: all); the all-to-all exchanges and the expert op carry gradients, and LoRA gradients are
averaged over the ranks. Every ``--checkpoint_every`` steps ``<output_dir>/checkpoint-<step>/`` gets
``pytorch_lora_weights.safetensors`` (diffusers format, ``pipe.load_lora_weights`` reads it) and
``training_state.pt``; ``--resume latest`` (or a checkpoint folder) continues from one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parent
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm")
CACHE_SUFFIX = ".magi2.safetensors"
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
    p.add_argument("--model", default=None, help="converted repo (default: the tiny default pipeline, random)")
    p.add_argument("--data_dir", help="videos + <stem>.txt captions, or <stem>.magi2.safetensors (required)")
    p.add_argument("--output_dir", help="LoRA and checkpoints (required)")
    p.add_argument("--cache", action="store_true", help="encode the videos and captions into caches first")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: the rank, i.e. scale 1)")
    p.add_argument("--targets", default="linear_qkv,linear_proj", help=f"comma list of {sorted(TARGETS)}")
    p.add_argument("--max_steps", type=int, default=1000)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--checkpoint_every", type=int, default=250)
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint-<step> folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="frozen weights' dtype (default bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--expert_dtype", default=None, help="'float8_e4m3fn': FP8 routed experts (a bf16 repo)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--ep_degree", type=int, default=None, help="expert-parallel ranks (default: all launched)")
    p.add_argument("--fixed_noise", action="store_true", help="one sigma and noise for every step (overfit check)")
    p.add_argument("--device", default=None)
    p.add_argument(
        "--estimate_memory",
        action="store_true",
        help="print the per-GPU weight + LoRA-state memory of the released size (meta device) and exit",
    )
    args = p.parse_args(argv)
    if not args.estimate_memory and (args.data_dir is None or args.output_dir is None):
        p.error("--data_dir and --output_dir are required")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        p.error(f"--targets: unknown {unknown}; choose from {sorted(TARGETS)}")
    args.targets = targets
    for name in ("rank", "max_steps", "checkpoint_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


# ------------------------------------------------------------------------------------------------ data


def scan_dataset(data_dir: Path, want_videos: bool) -> list[Path]:
    """The caches (or, with ``want_videos``, the videos) of ``data_dir``, checked; raises ``ValueError`` naming the
    first bad file (a video without a caption, an empty folder)."""
    if not data_dir.is_dir():
        raise ValueError(f"--data_dir {str(data_dir)!r} is not a folder")
    videos = sorted(p for p in data_dir.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES)
    if want_videos:
        if not videos:
            raise ValueError(
                f"{data_dir}: --cache needs videos ({', '.join(VIDEO_SUFFIXES)}) with <stem>.txt captions"
            )
        for video in videos:
            caption = video.with_suffix(".txt")
            if not caption.is_file() or not caption.read_text(encoding="utf-8").strip():
                raise ValueError(f"{video}: missing or empty caption {caption.name}")
        return videos
    caches = sorted(p for p in data_dir.iterdir() if p.name.endswith(CACHE_SUFFIX))
    if not caches:
        hint = " (run with --cache to encode the videos)" if videos else ""
        raise ValueError(f"{data_dir}: no {CACHE_SUFFIX} caches{hint}")
    return caches


def read_video(path: Path, scale: int = 16):
    """``[3, T, H, W]`` float pixels in [-1, 1] (``T`` cut to ``4k + 1``); ``ValueError`` naming ``path`` for an
    unreadable file or a height/width that is not a multiple of ``scale``."""
    import av
    import numpy as np
    import torch

    try:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (av.error.FFmpegError, ValueError, IndexError) as error:
        raise ValueError(f"{path}: unreadable video ({error})") from None
    if not frames:
        raise ValueError(f"{path}: unreadable video (no frames)")
    h, w = frames[0].shape[:2]
    if h % scale or w % scale:
        raise ValueError(f"{path}: {w}x{h} frames; the VAE takes heights and widths that are multiples of {scale}")
    frames = frames[: (len(frames) - 1) // 4 * 4 + 1]
    x = torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2).float()
    return x / 127.5 - 1.0


def encode_dataset(pipe, videos: list[Path], device) -> None:
    """Write ``<stem>.magi2.safetensors`` for each video: its normalised Wan latent and its caption's text states
    (every video is read and checked before the first is encoded)."""
    import torch
    from safetensors.torch import save_file

    from diffusers_magi2.pipelines.decoding_magi2 import wan_latent_stats

    if pipe.vae is None:
        raise ValueError("--cache needs the pipeline's Wan VAE (the repo has no vae component)")
    scale = pipe.vae_scale_factor_spatial
    pixels = {v: read_video(v, scale) for v in videos}
    for video, x in pixels.items():
        with torch.no_grad():
            vae = pipe.vae
            mu = vae.encode(x[None].to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().float()
            mean, inv_std = wan_latent_stats(vae, mu.device)
            latents = ((mu - mean) * inv_std)[0]
            embeds, mask, _ = pipe.encode_text([video.with_suffix(".txt").read_text(encoding="utf-8").strip()], device)
        out = {"latents": latents.cpu().contiguous(), "text_states": embeds[0][mask[0]].float().cpu().contiguous()}
        target = video.parent / (video.stem + CACHE_SUFFIX)
        tmp = target.with_name(target.name + ".tmp")
        save_file(out, str(tmp))
        os.replace(tmp, target)


def load_cache(path: Path, transformer) -> dict:
    """A cache's tensors, checked against the transformer's widths; ``ValueError`` naming ``path`` otherwise."""
    import torch
    from safetensors.torch import load_file

    try:
        d = load_file(str(path))
    except Exception as error:  # noqa: BLE001  (safetensors raises several types)
        raise ValueError(f"{path}: unreadable cache ({error})") from None
    cfg = transformer.config
    lat, text = d.get("latents"), d.get("text_states")
    if lat is None or lat.dim() != 4 or lat.shape[0] != cfg.in_channels:
        raise ValueError(f"{path}: latents must be [{cfg.in_channels}, T, H, W], got {getattr(lat, 'shape', None)}")
    if text is None or text.dim() != 2 or text.shape[1] != cfg.text_in_channels:
        raise ValueError(
            f"{path}: text_states must be [Lt, {cfg.text_in_channels}], got {getattr(text, 'shape', None)}"
        )
    audio = d.get("audio_latents")
    if audio is None:
        audio = torch.zeros(max(1, 2 * lat.shape[1]), cfg.audio_in_channels)
    if audio.dim() != 2 or audio.shape[1] != cfg.audio_in_channels:
        raise ValueError(f"{path}: audio_latents must be [La, {cfg.audio_in_channels}], got {tuple(audio.shape)}")
    return {"latents": lat.float(), "text_states": text.float(), "audio_latents": audio.float()}


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


def load_pipeline(args):
    """``(pipe, device)``: the tiny default or ``--model``, with EP/CP over the launched ranks."""
    import torch

    from diffusers_magi2 import Magi2Pipeline
    from diffusers_magi2.parallel.expert_parallel import ep_device
    from diffusers_magi2.pipelines.tiny_default import build_tiny_default_pipeline
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
        pipe = build_tiny_default_pipeline(dtype=dtype)
        if expert_parallel is not None:
            pipe.transformer.enable_expert_parallel(expert_parallel)
        if context_parallel is not None:
            pipe.enable_context_parallel(context_parallel)
    else:
        from diffusers_magi2 import Magi2Transformer3DModel

        dtypes = {"default": dtype, "vae": torch.float32, "audio_vae": torch.float32}
        extra = {}
        if args.expert_dtype:  # FP8 routed experts: the transformer is read on its own, quantized while reading
            extra["transformer"] = Magi2Transformer3DModel.from_pretrained(
                args.model,
                subfolder="transformer",
                torch_dtype=dtype,
                expert_dtype=args.expert_dtype,
                expert_parallel=expert_parallel,
            )
        pipe = Magi2Pipeline.from_pretrained(
            args.model,
            dtype=dtypes,
            expert_parallel=None if extra else expert_parallel,
            context_parallel=context_parallel,
            **extra,
        )
    pipe.to(device)
    return pipe, device


def add_lora(transformer, args):
    """Freeze the transformer, add the LoRA (fp32 parameters); returns the trainable parameters by name."""

    transformer.requires_grad_(False)
    transformer.add_adapter(lora_config(args), "default")
    trainable = {}
    for name, param in transformer.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            param.data = param.data.float()
            param.requires_grad_(True)
            trainable[name] = param
    if not trainable:
        raise ValueError(f"--targets {args.targets} matched no projection of the transformer")
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    return trainable


def flow_matching_inputs(sample: dict, generator, device, fixed: dict | None = None):
    """``(x_t, a_t, timestep, target)`` of the module docstring's objective for one cached sample."""
    import torch

    x0 = sample["latents"][None].to(device)
    a0 = sample["audio_latents"][None].to(device)
    if fixed is not None:
        sigma, eps, eps_a = fixed["sigma"], fixed["eps"], fixed["eps_a"]
    else:
        sigma = float(torch.rand((), generator=generator)) * (1 - 2e-5) + 1e-5
        eps = torch.randn(x0.shape, generator=generator).to(device)
        eps_a = torch.randn(a0.shape, generator=generator).to(device)
    x_t = (1 - sigma) * x0 + sigma * eps
    a_t = (1 - sigma) * a0 + sigma * eps_a
    timestep = torch.full((1,), float(math.floor(1000 * sigma)), device=device)
    return x_t, a_t, timestep, eps - x0


def training_loss(transformer, sample: dict, generator, device, fixed=None):
    """The MSE of the module docstring on one sample (fp32)."""
    import torch.nn.functional as F

    x_t, a_t, timestep, target = flow_matching_inputs(sample, generator, device, fixed)
    dtype = transformer.compute_dtype
    out = transformer(
        hidden_states=x_t.to(dtype),
        timestep=timestep,
        encoder_hidden_states=sample["text_states"][None].to(device=device, dtype=dtype),
        audio_hidden_states=a_t.to(dtype),
        return_dict=True,
    ).sample
    return F.mse_loss(out.float(), target.float())


def average_gradients(params) -> None:
    """Average the LoRA gradients over the launched ranks (each rank's are those of its sequence shard)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


# ------------------------------------------------------------------------------------------------ checkpoints


def save_checkpoint(pipe, folder: Path, optimizer, step: int, generator) -> None:
    """``folder/pytorch_lora_weights.safetensors`` (diffusers LoRA format) and ``training_state.pt``."""
    import torch
    from peft import get_peft_model_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    t = pipe.transformer
    pipe.save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(t, adapter_name="default"),
        transformer_lora_adapter_metadata=t.peft_config["default"].to_dict(),
    )
    state = {"step": step, "optimizer": optimizer.state_dict(), "generator": generator.get_state()}
    tmp = folder / "training_state.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / "training_state.pt")


def find_checkpoint(output_dir: Path, resume: str) -> Path:
    """The checkpoint folder of ``--resume``; ``ValueError`` when there is none."""
    if resume == "latest":
        found = sorted(
            (p for p in output_dir.glob("checkpoint-*") if (p / "training_state.pt").is_file()),
            key=lambda p: int(p.name.split("-")[-1]),
        )
        if not found:
            raise ValueError(f"--resume latest: no checkpoint-<step> folder in {output_dir}")
        return found[-1]
    folder = Path(resume)
    if not (folder / "training_state.pt").is_file():
        raise ValueError(f"--resume {resume!r}: no training_state.pt there")
    return folder


def resume_from(pipe, folder: Path, optimizer, generator) -> int:
    """Load a checkpoint's LoRA weights, optimizer and noise generator; returns its step."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(folder / "pytorch_lora_weights.safetensors"))
    weights = {k.removeprefix("transformer."): v for k, v in weights.items()}
    result = set_peft_model_state_dict(pipe.transformer, weights, adapter_name="default")
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{folder}: LoRA keys that this model has not: {result.unexpected_keys[:5]}")
    for p in pipe.transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    state = torch.load(folder / "training_state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    return int(state["step"])


# ------------------------------------------------------------------------------------------------ memory


def estimate_memory(args) -> list[dict]:
    """Per-GPU bytes at the released size (the default config built on the meta device): frozen non-expert
    weights (bf16), this rank's routed experts (bf16 or FP8, ``1/E`` of them), and the fp32 LoRA parameters with
    their gradients and AdamW moments (16 bytes each); activations are not included. One row per EP degree."""
    import torch

    from diffusers_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE

    with torch.device("meta"):
        model = Magi2Transformer3DModel()
    experts = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, Magi2MultiHeadMoE)
        for n, p in m.named_parameters()
        if n.startswith("W_")
    )
    others = sum(p.numel() for p in model.parameters()) - experts
    model.add_adapter(lora_config(args), "default")
    lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    rows = []
    for ep in (1, 2, 4, 8):
        for expert_bytes, name in ((2, "bf16"), (1, "float8_e4m3fn")):
            rows.append(
                {
                    "ep_degree": ep,
                    "experts": name,
                    "frozen_GiB": (others * 2 + experts * expert_bytes / ep) / 2**30,
                    "lora_state_GiB": lora * 16 / 2**30,
                    "lora_params_M": lora / 1e6,
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------ main


def train(args) -> list[float]:
    """Run the training; returns the per-step losses."""
    import torch
    from tqdm.auto import tqdm

    output_dir = Path(args.output_dir)
    data_dir = Path(args.data_dir)
    # the dataset is checked before any model is built (and before any training step)
    videos = scan_dataset(data_dir, want_videos=args.cache)
    if args.cache:
        for video in videos:
            read_video(video)
    pipe, device = load_pipeline(args)
    rank = int(os.environ.get("RANK", "0"))
    if args.cache:
        if rank == 0:
            encode_dataset(pipe, videos, device)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    caches = scan_dataset(data_dir, want_videos=False)
    samples = [load_cache(p, pipe.transformer) for p in caches]

    trainable = add_lora(pipe.transformer, args)
    params = list(trainable.values())
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)  # the same on every rank: every rank sees one sample
    start = 0
    if args.resume:
        start = resume_from(pipe, find_checkpoint(output_dir, args.resume), optimizer, generator)
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
    bar = tqdm(range(start, args.max_steps), initial=start, total=args.max_steps, disable=rank != 0, desc="train")
    for step in bar:
        sample = samples[step % len(samples)]
        optimizer.zero_grad(set_to_none=True)
        loss = training_loss(pipe.transformer, sample, generator, device, fixed)
        loss.backward()
        average_gradients(params)
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.max_steps:
            if rank == 0:
                save_checkpoint(pipe, output_dir / f"checkpoint-{step + 1}", optimizer, step + 1, generator)
    if rank == 0:
        from peft import get_peft_model_state_dict

        t = pipe.transformer
        pipe.save_lora_weights(
            output_dir,
            transformer_lora_layers=get_peft_model_state_dict(t, adapter_name="default"),
            transformer_lora_adapter_metadata=t.peft_config["default"].to_dict(),
        )
    train.pipe = pipe
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.estimate_memory:
        for row in estimate_memory(args):
            print(
                f"EP {row['ep_degree']}, {row['experts']} experts: frozen weights {row['frozen_GiB']:.1f} GiB + LoRA "
                f"state {row['lora_state_GiB']:.2f} GiB ({row['lora_params_M']:.1f} M LoRA parameters) per GPU"
            )
        return 0
    losses = train(args)
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
