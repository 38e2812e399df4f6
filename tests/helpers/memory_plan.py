"""Device-memory plan of a MAGI-2 generation at the released size, stage by stage, without the weights: a developer
tool (``tests/benchmarks/bench_memory.py`` prints it, ``tests/pipelines/test_memory_plan.py`` checks it).

Each transformer stage is traced, not estimated (:mod:`helpers.memory_trace` says how): a model with one block of
every kind the config has (dense multimodal, MoE) is built at the released width on fake tensors, and its own
``forward_packed`` runs on inputs of the stage's token count. A stage's device peak is then::

    peak = weights on the device + max over the step of (inputs + activations live + kernel workspace)

where the weights are summed over all layers from the traced blocks (the routed experts divided among the
expert-parallel ranks). ``kernels="cuda"`` models the GPU kernels by their allocations; ``kernels="cpu"`` traces the
CPU code, the checked mode: on a reduced config the plan equals a CPU run's allocator peak within 10 %
(``tests/pipelines/test_memory_plan.py``). The LoRA training step is :mod:`helpers.memory_plan_training`, the text
encoder and the VAEs :mod:`helpers.memory_plan_codecs`.

Dense weights stored narrower (FP8 storage, layerwise casting) are traced in the compute dtype, each stored layer's
call adding what its storing hook holds (:mod:`helpers.memory_plan_storage`).

Token counts (SandAI ``entry.py`` presets; ``magi2_reference_spec`` §5): per CFG half, video ``32 * H/16 * W/16``
(272p 14,336, 540p 57,344), audio 250, text ``text_tokens`` (512 by default: a prompt and the negative
prompt fit); one forward holds both halves. The 1080p refiner runs one 514,080-token video (+ text) forward per
CFG branch. Under context parallelism (CP ``N``) each rank holds ``ceil(tokens / N)`` of the packed sequence for
the per-token work; Ulysses attention and the MoE exchange move the same number of bytes per rank (heads
``Hq/N`` of all tokens, or ``E/N`` of the MoE heads of ``E`` ranks' tokens), so a rank's activations are those of
its shard plus the all-to-all send and receive buffers (added analytically, before each block). One GPU runs
``enable_model_cpu_offload`` (only the running model on the device); CP8 x EP4 x 2 assumes the same per rank.

Budgets: an H200 as 141 GB, an H100 as 80 GB (10^9 bytes), and 8 GB kept spare.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from diffusers_magi2.models.modality import Modality
from diffusers_magi2.models.transformer_magi2 import DEFAULT_FORWARD_CHUNK_SIZE, Magi2Transformer3DModel
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from diffusers_magi2.moe.quantize import FP8_SCALE_NAMES
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES
from diffusers_magi2.parallel.expert_parallel import ep_head_layout

from .memory_plan_storage import cast_copy_bytes, layer_calls, stored_calls_traced, stored_copy, stored_layer_calls
from .memory_trace import (
    KERNELS,
    Trace,
    check_kernels,
    default_dtype,
    module_bytes,
    on_fake_tensors,
    part_peaks,
    set_kernels,
    tensor_bytes,
    traced,
)
from .memory_tracking import LiveStorageTracker


__all__ = [
    "AUDIO_LATENTS",
    "DEFAULT_TEXT_TOKENS",
    "EXPERT_NAMES",
    "GB",
    "H100_BYTES",
    "H200_BYTES",
    "LATENT_FRAMES",
    "PLAN_RESOLUTIONS",
    "REFINER_LATENT_FRAMES",
    "SPARE_BYTES",
    "Magi2StageMemory",
    "build_traced_preview",
    "check_plan_resolution",
    "plan_preview_step",
    "plan_refiner_step",
    "preview_block_bytes",
    "preview_kinds",
    "preview_token_counts",
    "preview_weights",
    "stage_row",
    "stored_weights",
    "trace_preview_forward",
    "trace_refiner_forward",
]


GB = 10**9
H200_BYTES = 141 * GB
H100_BYTES = 80 * GB
SPARE_BYTES = 8 * GB
#: Resolution presets the plan knows, (height, width) in pixels; the 1080p preview runs at 540p, then the refiner.
PLAN_RESOLUTIONS = {"272p": (256, 448), "540p": (512, 896), "1080p": (1088, 1920)}
LATENT_FRAMES = 32
REFINER_LATENT_FRAMES = 63
AUDIO_LATENTS = 250
DEFAULT_TEXT_TOKENS = 512


def check_plan_resolution(resolution: str) -> tuple:
    """``(height, width)`` of a plan resolution.

    Raises:
        ValueError: ``resolution`` is not one of :data:`PLAN_RESOLUTIONS`.
    """
    if resolution not in PLAN_RESOLUTIONS:
        raise ValueError(f"the memory plan knows resolutions {sorted(PLAN_RESOLUTIONS)}; got {resolution!r}")
    return PLAN_RESOLUTIONS[resolution]


def _check_degree(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


@dataclass
class Magi2StageMemory:
    """Device memory of one stage on one device (one GPU, or the busiest rank).

    Attributes:
        stage: what runs (e.g. ``"preview step 540p, FP8 experts"``).
        layout: ``"1 GPU"`` or ``"CP8 x EP4 x 2, per rank"``.
        weights: bytes of the weights on that device.
        activations: peak bytes above the weights (inputs, activations, kernel workspace).
        capacity: the device's bytes.
        peak_at: the op at which the peak was reached (traced stages).
        notes: assumptions of this row.
        name: a short machine name (``"preview_540p"``), for the JSON output.
        margin: bytes that must stay free at the peak (8 GB; 4 GB in the 80 GB plan).
    """

    stage: str
    layout: str
    weights: int
    activations: int
    capacity: int
    peak_at: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    name: Optional[str] = None
    margin: int = SPARE_BYTES

    @property
    def total(self) -> int:
        """Peak device bytes, weights included."""
        return self.weights + self.activations

    @property
    def spare(self) -> int:
        """Capacity left at the peak (negative: does not fit)."""
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        """Whether the peak leaves at least :attr:`margin` of the device free."""
        return self.spare >= self.margin

    def as_dict(self) -> dict:
        """JSON-ready row (bytes, and GB for reading)."""
        return {
            "name": self.name,
            "stage": self.stage,
            "layout": self.layout,
            "weights_bytes": self.weights,
            "activations_bytes": self.activations,
            "total_bytes": self.total,
            "capacity_bytes": self.capacity,
            "weights_gb": round(self.weights / GB, 2),
            "activations_gb": round(self.activations / GB, 2),
            "total_gb": round(self.total / GB, 2),
            "spare_gb": round(self.spare / GB, 2),
            "margin_gb": round(self.margin / GB, 2),
            "fits": self.fits,
            "peak_at": self.peak_at,
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------- token counts


def preview_token_counts(resolution: str, text_tokens: int = DEFAULT_TEXT_TOKENS, cfg: bool = True) -> Dict[str, int]:
    """Tokens of one preview forward: ``{"video", "audio", "text"}`` summed over the CFG halves.

    Raises:
        ValueError: unknown resolution or a negative ``text_tokens``.
    """
    height, width = check_plan_resolution(resolution)
    if resolution == "1080p":
        height, width = PLAN_RESOLUTIONS["540p"]  # the preview stage of a 1080p run
    if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be a non-negative int; got {text_tokens!r}")
    halves = 2 if cfg else 1
    video = LATENT_FRAMES * (height // 16) * (width // 16)
    return {"video": halves * video, "audio": halves * AUDIO_LATENTS, "text": halves * text_tokens}


def _add_exchange_buffers(model: torch.nn.Module, tracker: LiveStorageTracker, tokens: int) -> list:
    """Before each block, the send and receive buffers of its all-to-all exchanges (context parallelism)."""

    def before(block, args):
        width = block.attention.q_size
        tracker.add_transient(_exchange_bytes(tokens, width, args[0].element_size()), "all_to_all buffers")

    return [block.register_forward_pre_hook(before) for block in model.transformer_blocks]


_EXPERT_TENSORS = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias", "router.expert_bias_ema") + tuple(
    FP8_SCALE_NAMES + INT4_SCALE_NAMES
)


def _expert_bytes(moe) -> int:
    names = dict(moe.named_parameters())
    names.update(moe.named_buffers())
    return tensor_bytes([names[n] for n in _EXPERT_TENSORS if n in names])


def _split_counts(counts: Dict[str, int], parts: int) -> Dict[str, int]:
    """A rank's share of each modality (the packed sequence split into ``parts`` equal shards)."""
    total = sum(counts.values())
    local = math.ceil(total / parts)
    out = {k: v * local // total for k, v in counts.items()}
    out["video"] += local - sum(out.values())
    return out


def _modality_ids(counts: Dict[str, int]) -> torch.Tensor:
    """Real ``[N]`` int32 modality ids: the video tokens, then audio, then text (a packed refiner sample's order; the
    preview's forward sorts by modality whatever the order)."""
    order = (("video", Modality.VIDEO), ("audio", Modality.AUDIO), ("text", Modality.TEXT))
    return torch.cat([torch.full((counts[k],), int(m), dtype=torch.int32) for k, m in order])


def _unit_coords(n: int) -> torch.Tensor:
    """Real ``[n, 9]`` rope coordinates that pass the rope's check (position 0, size and reference 1)."""
    coords = torch.ones(n, 9)
    coords[:, :3] = 0
    return coords


def _exchange_bytes(tokens: int, width: int, itemsize: int) -> int:
    """Send + receive buffers of one all-to-all of ``[tokens, width]`` (q, k, v: three of them)."""
    return 2 * 3 * tokens * width * itemsize


def _layer_kinds(num_layers: int, **layer_lists) -> tuple:
    """``(kinds, per-layer kinds)``: a kind is which of the ``layer_lists`` (index sets) a layer is in; the kinds
    in the order of their last layers (the traced model's block order: a config whose layers are all of different
    kinds is traced as it is, and under gradient checkpointing each traced block's backward sees at least the
    saved inputs its kind's last layer sees, :func:`trace_lora_training_step`)."""
    sets = [{int(i) for i in layers} for layers in layer_lists.values()]
    per_layer = [tuple(i in s for s in sets) for i in range(num_layers)]
    last = {kind: i for i, kind in enumerate(per_layer)}
    return sorted(last, key=last.get), per_layer


def preview_kinds(transformer_config: Optional[dict]) -> tuple:
    """``(kinds, per-layer kinds)`` of a preview config, a kind ``(multimodal, moe)``."""
    cfg = transformer_config or {}
    return _layer_kinds(
        cfg.get("num_layers", 40),
        mm=cfg.get("multimodal_layers", (0, 1, 38, 39)),
        moe=cfg.get("moe_layers", range(2, 38)),
    )


def build_traced_preview(
    transformer_config: Optional[dict] = None,
    expert_dtype: Optional[str] = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    *,
    fake_mode: FakeTensorMode,
    prepare=None,
):
    """A ``Magi2Transformer3DModel`` with one block of each kind of the config (default: released) on
    ``fake_mode``'s fake tensors (``prepare(model)`` first runs on its meta build); returns ``(model, kinds,
    per-layer kinds)``, a kind ``(multimodal, moe)``."""
    cfg = dict(transformer_config or {})
    for key in ("num_layers", "multimodal_layers", "moe_layers"):
        cfg.pop(key, None)
    kinds, per_layer = preview_kinds(transformer_config)
    with torch.device("meta"):
        model = Magi2Transformer3DModel(
            num_layers=len(kinds),
            multimodal_layers=[k for k, (m, _) in enumerate(kinds) if m],
            moe_layers=[k for k, (_, e) in enumerate(kinds) if e],
            params_dtype=compute_dtype,
            expert_dtype=expert_dtype,
            **cfg,
        )
    if prepare is not None:
        prepare(model)
    return on_fake_tensors(model, fake_mode), kinds, per_layer


def preview_block_bytes(model, kinds, ep_degree: int) -> Dict[tuple, int]:
    """Weight bytes of each kind's block (``{kind: bytes}``), the routed experts split among ``ep_degree`` ranks."""
    block_bytes = {}
    for kind, block in zip(kinds, model.transformer_blocks):
        nbytes = module_bytes(block)
        if kind[1] and ep_degree > 1:
            moe_core = block.mlp.moe_mlp
            layout = ep_head_layout(moe_core.num_heads, ep_degree, 0)
            experts = _expert_bytes(moe_core)
            nbytes += experts * layout.local_num_heads // moe_core.num_heads - experts
        block_bytes[kind] = nbytes
    return block_bytes


def preview_weights(model, kinds, per_layer, ep_degree: int) -> int:
    """Weight bytes of every layer (from its kind's block), the routed experts split among ``ep_degree`` ranks."""
    block_bytes = preview_block_bytes(model, kinds, ep_degree)
    return module_bytes(model.pre_adapter) + module_bytes(model.post_adapter) + sum(block_bytes[k] for k in per_layer)


@dataclass
class _StoredWeights:
    """The model's bytes with its dense weights stored in a narrower dtype, what each stored layer's call adds
    (:func:`stored_layer_calls`), and the compute-dtype copies of all stored layers of the largest block (a
    checkpointed block's backward keeps its layers' copies until it is done)."""

    weights: int
    calls: Dict[str, Dict[str, tuple]]
    block_copy: int


def stored_weights(model, kinds, per_layer, storage_dtype, compute_dtype, ep_degree: int = 1) -> _StoredWeights:
    """:class:`_StoredWeights` of ``model`` (on meta) with its dense weights stored in ``storage_dtype``:
    ``enable_fp8_storage(compute_dtype)`` for e4m3 (the 80 GB recipe: the codes and their fp32 per-channel scales),
    ``enable_layerwise_casting(storage_dtype, compute_dtype)`` otherwise; read from a stored copy. The trace itself
    runs the layers in the compute dtype (the hooks replace the weights, which fake parameters refuse), so each
    stored layer's call adds what the hook holds (:mod:`helpers.memory_plan_storage`)."""
    stored = stored_copy(model, storage_dtype, compute_dtype)
    copies = functools.partial(cast_copy_bytes, compute_dtype=compute_dtype)
    blocks = [sum(copies(m) for m in block.modules()) for block in stored.transformer_blocks]
    return _StoredWeights(
        preview_weights(stored, kinds, per_layer, ep_degree),
        {k: layer_calls(stored, compute_dtype, k) for k in KERNELS},
        max(blocks),
    )


def trace_preview_forward(
    counts: Dict[str, int],
    segments: Sequence[int],
    transformer_config: Optional[dict] = None,
    expert_dtype: Optional[str] = None,
    *,
    cp_degree: int = 1,
    ep_degree: int = 1,
    kernels: str = "cuda",
    forward_chunk_size: Optional[int] = DEFAULT_FORWARD_CHUNK_SIZE,
    compute_dtype: torch.dtype = torch.bfloat16,
    count_inputs: bool = True,
    storage_dtype: Optional[torch.dtype] = None,
) -> Trace:
    """Weights and peak activations of one preview ``forward_packed`` on one device (module docstring).

    Args:
        counts: tokens per modality, ``{"video", "audio", "text"}``, of the whole packed sequence.
        segments: packed segment lengths (CFG halves), summing to the token count.
        transformer_config: ``Magi2Transformer3DModel`` arguments (default: released).
        expert_dtype: ``None`` (bf16 experts) or ``"float8_e4m3fn"``.
        cp_degree, ep_degree: context- and expert-parallel degrees (per-rank figures).
        kernels: ``"cuda"`` (flash attention, fused experts) or ``"cpu"`` (the CPU code paths).
        forward_chunk_size: ``enable_forward_chunking`` token chunk, or ``None`` (off).
        compute_dtype: weights and residual dtype.
        count_inputs: count the packed inputs, handed over as ``forward`` does (``forward_packed`` frees
            ``hidden_states`` once embedded); ``False``: the caller holds them and they are not counted
            (``forward_packed`` called directly).
        storage_dtype: the dense weights stored in that dtype (:func:`stored_weights`; ``None``: off): the weights
            so stored, and each stored layer's call adding its compute-dtype copy (:mod:`helpers.memory_plan_storage`).

    Raises:
        ValueError: unknown ``kernels``, bad degrees, or segments not summing to the tokens.
    """
    check_kernels(kernels)
    _check_degree("cp_degree", cp_degree)
    _check_degree("ep_degree", ep_degree)
    n_total = sum(counts.values())
    if sum(segments) != n_total:
        raise ValueError(f"segments {list(segments)} must sum to the {n_total} tokens")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    stored = []

    def cast(meta_model):
        stored.append(stored_weights(meta_model, kinds, per_layer, storage_dtype, compute_dtype, ep_degree))

    kinds, per_layer = preview_kinds(transformer_config)
    model, kinds, per_layer = build_traced_preview(
        transformer_config, expert_dtype, compute_dtype, fake_mode=fake, prepare=cast if storage_dtype else None
    )
    set_kernels(model, kernels)
    if kernels == "cuda":
        model.set_mhc_backend("fused")
    if forward_chunk_size is None:
        model.disable_forward_chunking()
    else:
        model.enable_forward_chunking(forward_chunk_size)
    if cp_degree > 1 or ep_degree > 1:  # exchanging MoE layers run one call per layer (their exchange's choice)
        for block in model.transformer_blocks:
            if hasattr(block.mlp, "moe_mlp"):
                block.mlp.chunk_size = None
    weights = stored[0].weights if stored else preview_weights(model, kinds, per_layer, ep_degree)

    config = model.config
    c_max = max(config.in_channels, config.audio_in_channels, config.text_in_channels)
    with fake:
        hidden = torch.empty(n_total, c_max)
        time_embedding = torch.empty(n_total, config.time_embed_dim)
    inputs = [hidden, _unit_coords(n_total), _modality_ids(counts), time_embedding]
    if cp_degree == 1:
        args = [hidden, inputs[1], inputs[2], torch.tensor([0, *itertools.accumulate(segments)]), time_embedding]
    else:  # this rank's contiguous shard, one segment (the forward's shard plan gives views of the inputs)
        local = _split_counts(counts, cp_degree)
        n_loc = sum(local.values())
        args = [t.narrow(0, 0, n_loc) for t in inputs]
        args[2] = _modality_ids(local)
        args.insert(3, torch.tensor([0, n_loc]))
    del hidden, time_embedding
    parts = {
        "attention": [b.attention for b in model.transformer_blocks],
        "moe": [b.mlp.moe_mlp for b in model.transformer_blocks if hasattr(b.mlp, "moe_mlp")],
        "adapters": [model.pre_adapter, model.post_adapter],
    }
    calls = stored[0].calls[kernels] if stored else {}
    with (
        traced(model, fake, kernels) as tracker,
        part_peaks(tracker, parts) as peaks,
        stored_calls_traced(model, calls, tracker, compute_dtype),
    ):
        if count_inputs:
            tracker.count(inputs)
            inputs[0] = None  # forward hands the packed input over: forward_packed holds the last reference
        else:
            tracker.ignore(inputs)
        hooks = _add_exchange_buffers(model, tracker, n_loc) if cp_degree > 1 else []
        handed = [args.pop(0)]
        out = model.forward_packed(handed.pop(), args[0], args[1], args[2], args[3])
        if cp_degree > 1:
            out = out.new_empty(n_total, out.shape[1])  # the gathered output
        del out
    for hook in hooks:
        hook.remove()
    return Trace(weights, tracker.activations, tracker.peak_op, peaks)


def _refiner_video_shape() -> tuple:
    h, w = PLAN_RESOLUTIONS["1080p"]
    return REFINER_LATENT_FRAMES, h // 16, w // 16


def trace_refiner_forward(
    video_shape: Sequence[int],
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    refiner_config: Optional[dict] = None,
    *,
    cp_degree: int = 1,
    kernels: str = "cuda",
    forward_chunk_size: Optional[int] = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    storage_dtype: Optional[torch.dtype] = None,
) -> Trace:
    """Weights and peak activations of one refiner forward (one sample, one CFG branch) on one device.

    One device traces ``forward`` as the pipeline calls it: an fp32 video latent ``[1, Cv, T, H, W]`` and
    ``text_tokens`` of text features in ``compute_dtype``. Under context parallelism a rank embeds and runs only
    its share of the packed tokens: traced as ``forward_packed`` on that share (its packed input zero-padded to the
    widest channel count, the text's; an upper bound of the rank's input bytes).

    Args:
        video_shape: latent ``(T, H, W)``; text_tokens: text tokens of the branch.
        refiner_config: model arguments (default: released).
        cp_degree: context-parallel degree; kernels: as :func:`trace_preview_forward`.
        forward_chunk_size: the MLP token chunk (``None``: the model default).
        storage_dtype: the dense weights stored in that dtype (:func:`stored_weights`; ``None``: off): each stored
            layer's call adding its compute-dtype copy (:mod:`helpers.memory_plan_storage`; the weights are traced
            in the compute dtype).

    Raises:
        ValueError: unknown ``kernels`` or a bad degree.
    """
    check_kernels(kernels)
    _check_degree("cp_degree", cp_degree)
    cfg = dict(refiner_config or {})
    num_layers = cfg.pop("num_layers", 30)
    kinds, per_layer = _layer_kinds(num_layers, mm=cfg.pop("multimodal_layers", (0, 1, 28, 29)))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"), default_dtype(compute_dtype):  # its linears take the default dtype (islands: fp32)
        model = Magi2RefinerTransformer3DModel(
            num_layers=len(kinds), multimodal_layers=[k for k, (m,) in enumerate(kinds) if m], **cfg
        )
    calls = {}
    if storage_dtype is not None:  # read on meta, before the parameters are faked
        calls = stored_layer_calls(model, storage_dtype, kernels, compute_dtype)
    model = on_fake_tensors(model, fake)
    set_kernels(model, kernels)
    if forward_chunk_size is not None:
        model.enable_forward_chunking(forward_chunk_size)
        for block in model.transformer_blocks if cp_degree > 1 else ():
            block.chunk_size = (
                None  # under context parallelism the attention runs whole (its exchange), the MLP chunks
            )
    block_bytes = {k: module_bytes(b) for k, b in zip(kinds, model.transformer_blocks)}
    weights = module_bytes(model.pre_adapter) + module_bytes(model.post_adapter)
    weights += sum(block_bytes[k] for k in per_layer)

    config = model.config
    t, h, w = video_shape
    with fake:
        video = torch.empty(1, config.in_channels, t, h, w)
        text = torch.empty(1, text_tokens, config.text_in_channels, dtype=compute_dtype)
    if cp_degree > 1:
        counts = {"video": t * h * w, "audio": 0, "text": text_tokens}
        local = _split_counts(counts, cp_degree)
        n_loc = sum(local.values())
        with fake:
            shard = torch.empty(n_loc, max(config.in_channels, config.audio_in_channels, config.text_in_channels))
        inputs = [video, text, shard, _unit_coords(n_loc)]
    else:
        inputs = [video, text]
    with traced(model, fake, kernels) as tracker, stored_calls_traced(model, calls, tracker, compute_dtype):
        tracker.count(inputs)
        if cp_degree == 1:
            out = model(hidden_states=video, encoder_hidden_states=text)
        else:
            hooks = _add_exchange_buffers(model, tracker, n_loc)
            out = model.forward_packed(shard, inputs[3], _modality_ids(local).long())
            out = out.new_empty(sum(counts.values()), out.shape[1])  # the gathered output
            for hook in hooks:
                hook.remove()
        del out
    return Trace(weights, tracker.activations, tracker.peak_op)


# ------------------------------------------------------------------------------------------- stage rows


def stage_row(
    stage: str, name: str, trace: Trace, capacity: int, margin: int, notes=(), layout: str = "1 GPU"
) -> Magi2StageMemory:
    return Magi2StageMemory(
        stage, layout, trace.weights, trace.activations, capacity, trace.peak_at, list(notes), name=name, margin=margin
    )


#: How the rows name the routed experts' storage.
EXPERT_NAMES = {None: "bf16 experts", "float8_e4m3fn": "FP8 experts", "int4": "int4 experts"}


def plan_preview_step(
    resolution: str,
    expert_dtype: Optional[str] = None,
    *,
    cp_degree: int = 1,
    ep_degree: int = 1,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    forward_chunk_size: Optional[int] = DEFAULT_FORWARD_CHUNK_SIZE,
    storage_dtype: Optional[torch.dtype] = None,
    capacity: Optional[int] = None,
    margin: int = SPARE_BYTES,
) -> Magi2StageMemory:
    """Peak device memory of one CFG preview denoising step at the released size.

    Args:
        resolution: ``"272p"`` or ``"540p"`` (``"1080p"``: its 540p preview stage).
        expert_dtype: ``None`` (bf16), ``"float8_e4m3fn"`` or ``"int4"``.
        cp_degree, ep_degree: 1 and 1 for one GPU; 8 and 4 for CP8 x EP4 x 2.
        text_tokens: text tokens per CFG half.
        forward_chunk_size: ``Magi2Transformer3DModel.enable_forward_chunking`` chunk (default: the model's;
            ``None``: off).
        storage_dtype: FP8 storage of the dense weights (:func:`stored_weights`), or ``None``.
        capacity: device bytes (default: an H200, 141 GB, on one GPU; an 80 GB GPU per rank).
        margin: bytes to keep free.

    Raises:
        ValueError: an unknown resolution (before any work), or bad degrees.
    """
    check_plan_resolution(resolution)
    counts = preview_token_counts(resolution, text_tokens)
    half = sum(counts.values()) // 2
    trace = trace_preview_forward(
        counts,
        (half, half),
        expert_dtype=expert_dtype,
        cp_degree=cp_degree,
        ep_degree=ep_degree,
        forward_chunk_size=forward_chunk_size,
        storage_dtype=storage_dtype,
    )
    layout = "1 GPU" if cp_degree == 1 else f"CP{cp_degree} x EP{ep_degree} x {cp_degree // ep_degree}, per rank"
    if capacity is None:
        capacity = H200_BYTES if cp_degree == 1 else H100_BYTES
    notes = [f"{sum(counts.values())} tokens (text {text_tokens} per CFG half)"]
    notes.append("chunking off" if forward_chunk_size is None else f"forward chunks of {forward_chunk_size} tokens")
    notes.append(
        "activations at their peak within the attention {:.2f} GB, the routed experts (router, per-route rows, the "
        "expert kernel's buffers: int4's dequantized banks) {:.2f} GB, the adapters {:.2f} GB".format(
            *(trace.parts[k] / GB for k in ("attention", "moe", "adapters"))
        )
    )
    res = "540p" if resolution == "1080p" else resolution
    what = EXPERT_NAMES[expert_dtype] + ("" if storage_dtype is None else ", FP8-stored dense weights")
    return stage_row(f"preview step {res}, {what}", f"preview_{res}", trace, capacity, margin, notes, layout)


def plan_refiner_step(
    *,
    cp_degree: int = 1,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    forward_chunk_size: Optional[int] = None,
    storage_dtype: Optional[torch.dtype] = None,
    capacity: Optional[int] = None,
    margin: int = SPARE_BYTES,
) -> Magi2StageMemory:
    """Peak device memory of one 1080p refiner forward (CFG runs two of them one after the other); ``storage_dtype``:
    as :func:`trace_refiner_forward`.

    Raises:
        ValueError: a bad degree.
    """
    video_shape = _refiner_video_shape()
    trace = trace_refiner_forward(
        video_shape,
        text_tokens,
        cp_degree=cp_degree,
        forward_chunk_size=forward_chunk_size,
        storage_dtype=storage_dtype,
    )
    layout = "1 GPU" if cp_degree == 1 else f"CP{cp_degree}, per rank"
    if capacity is None:
        capacity = H200_BYTES if cp_degree == 1 else H100_BYTES
    notes = [f"{math.prod(video_shape) + text_tokens} tokens per CFG branch"]
    return stage_row("refiner step 1080p", "refiner_1080p", trace, capacity, margin, notes, layout)
