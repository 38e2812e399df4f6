"""Device-memory plan of a MAGI-2 generation at the released size, stage by stage, without the weights.

Each transformer stage is traced, not estimated: one block of every kind the config has (dense multimodal,
MoE) is built at the released width under ``FakeTensorMode`` and run on fake inputs of the stage's token
count under :class:`~diffusers_magi2.utils.memory_tracking.LiveStorageTracker`, which records the bytes of live
tensor storages and their peak. A stage's device peak is then::

    peak = weights on the device + max over the step of (inputs + activations live + kernel workspace)

where the weights are summed over all layers from the traced blocks (the routed experts divided among the
expert-parallel ranks), and the activations come from the real model code (norms, mHC, projections, routing,
the MoE's per-route rows, feed-forwards) except two GPU kernels, whose allocations are modelled explicitly
(``kernels="cuda"``): attention as a flash-style varlen kernel (output in the compute dtype plus an fp32
log-sum-exp per query and head; the sink correction ``out * sigmoid(lse - sink)`` one more output), and the
routed experts as the fused Triton kernel (its output only; the deterministic mode adds per-route rows).
``kernels="cpu"`` traces the CPU code of both instead (the checked mode: on a reduced config the plan equals a
CPU run's allocator peak within 10 %, ``tests/pipelines/test_memory_plan.py``).

Token counts (SandAI ``entry.py`` presets; ``magi2_reference_spec`` §5): per CFG half, video ``32 * H/16 * W/16``
(272p 14,336, 540p 57,344), audio 250, text ``text_tokens`` (512 by default: a prompt and the negative
prompt fit); one forward holds both halves. The 1080p refiner runs one 514,080-token video (+ text) forward per
CFG branch. Under context parallelism (CP ``N``) each rank holds ``ceil(tokens / N)`` of the packed sequence for
the per-token work; Ulysses attention and the MoE exchange move the same number of bytes per rank (heads
``Hq/N`` of all tokens, or ``E/N`` of the MoE heads of ``E`` ranks' tokens), so a rank's activations are those of
its shard plus the all-to-all send and receive buffers (added analytically). One GPU runs
``enable_model_cpu_offload`` (only the running model on the device); CP8 x EP4 x 2 assumes the same per rank.

Budgets: an H200 as 141 GB, an H100 as 80 GB (10^9 bytes), and 8 GB kept spare.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..models.attention_magi2 import (
    Magi2AttentionMask,
    Magi2AttnProcessor,
    Magi2ForwardContext,
    Magi2WindowAttnProcessor,
)
from ..models.modality import Magi2ModalityDispatch, Modality
from ..models.transformer_magi2 import DEFAULT_FORWARD_CHUNK_SIZE, Magi2Transformer3DModel
from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from ..moe.quantize import FP8_SCALE_NAMES
from ..parallel.expert_parallel import ep_head_layout
from ..utils.memory_tracking import LiveStorageTracker
from .decoding_magi2 import WAN22_VAE_CONFIG


__all__ = [
    "GB",
    "PLAN_RESOLUTIONS",
    "Magi2StageMemory",
    "check_plan_resolution",
    "plan_audio_decode",
    "plan_image_encode",
    "plan_preview_step",
    "plan_refiner_step",
    "plan_text_encode",
    "plan_video_decode",
    "preview_token_counts",
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
KERNELS = ("cuda", "cpu")


def check_plan_resolution(resolution: str) -> tuple:
    """``(height, width)`` of a plan resolution.

    Raises:
        ValueError: ``resolution`` is not one of :data:`PLAN_RESOLUTIONS`.
    """
    if resolution not in PLAN_RESOLUTIONS:
        raise ValueError(f"the memory plan knows resolutions {sorted(PLAN_RESOLUTIONS)}; got {resolution!r}")
    return PLAN_RESOLUTIONS[resolution]


def _check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}; got {kernels!r}")


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
    """

    stage: str
    layout: str
    weights: int
    activations: int
    capacity: int
    peak_at: Optional[str] = None
    notes: List[str] = field(default_factory=list)

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
        """Whether the peak leaves at least 8 GB of the device free."""
        return self.spare >= SPARE_BYTES

    def as_dict(self) -> dict:
        """JSON-ready row (bytes, and GB for reading)."""
        return {
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
            "fits_with_8gb_spare": self.fits,
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


# ------------------------------------------------------------------------------------------ kernel models


def _flash_attend(self, attn, query, key, value, attention_mask, heads=None):
    """A flash-style kernel's allocations: the output, an fp32 LSE per (head, query), the sink correction."""
    n, hq, _ = query.shape
    out = torch.empty_like(query)
    lse = torch.empty(hq, n, dtype=torch.float32, device=query.device)
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:
        factor = torch.sigmoid(lse - sinks.float()[0, :hq, None]).t().unsqueeze(-1)
        out = out * factor.to(out.dtype)
    return out


def _grouped_mm_output(mat_a, mat_b, offs=None, **_):
    """``torch._grouped_mm``'s output alone (its fake kernel takes bf16 only; the CPU one any float)."""
    return mat_a.new_empty(mat_a.shape[0], mat_b.shape[-1])


def _grouped_experts_traced(x, routes, weights, scales, backend, deterministic):
    """The ``torch_grouped`` expert backend run op by op (the custom op hides its temporaries from a mode)."""
    from ..moe import experts

    grouped_mm, torch._grouped_mm = torch._grouped_mm, _grouped_mm_output
    try:
        return experts._grouped_experts(x, routes, weights, scales or None)
    finally:
        torch._grouped_mm = grouped_mm


@contextlib.contextmanager
def _kernel_models(kernels: str):
    """``"cuda"``: attention as :func:`_flash_attend`; ``"cpu"``: the CPU paths, experts traced op by op."""
    from ..moe import layer as moe_layer

    saved = (Magi2AttnProcessor.attend, Magi2WindowAttnProcessor.attend, moe_layer.mh_moe_experts)
    try:
        if kernels == "cuda":
            Magi2AttnProcessor.attend = _flash_attend
            Magi2WindowAttnProcessor.attend = _flash_attend
        else:
            moe_layer.mh_moe_experts = _grouped_experts_traced
        yield
    finally:
        Magi2AttnProcessor.attend, Magi2WindowAttnProcessor.attend, moe_layer.mh_moe_experts = saved


# ------------------------------------------------------------------------------------------- the tracing


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _module_bytes(module: torch.nn.Module) -> int:
    return _nbytes(list(module.parameters()) + list(module.buffers()))


_EXPERT_TENSORS = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias", "router.expert_bias_ema") + tuple(
    FP8_SCALE_NAMES
)


def _expert_bytes(moe) -> int:
    names = dict(moe.named_parameters())
    names.update(moe.named_buffers())
    return _nbytes([names[n] for n in _EXPERT_TENSORS if n in names])


def _index(n: int, device) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int64, device=device)


def _split_counts(counts: Dict[str, int], parts: int) -> Dict[str, int]:
    """A rank's share of each modality (the packed sequence split into ``parts`` equal shards)."""
    total = sum(counts.values())
    local = math.ceil(total / parts)
    out = {k: v * local // total for k, v in counts.items()}
    out["video"] += local - sum(out.values())
    return out


def _dispatch(counts: Dict[str, int], device) -> Magi2ModalityDispatch:
    """A modality dispatch of the traced sizes, with the index tensors ``from_modality_mapping`` builds."""
    n = sum(counts.values())
    sizes = (counts["video"], counts["audio"], counts["text"])
    ids = _index(n, device)
    return Magi2ModalityDispatch(ids, _index(n, device), _index(n, device), sizes, _index(n, device))


def _pre_adapter(adapter, hidden, coords, counts, device):
    """``Magi2PreAdapter.forward`` with the per-modality index sets of the traced sizes."""
    x = hidden.float()
    out = x.new_zeros(x.shape[0], adapter.width)
    for mod, key in ((Modality.TEXT, "text"), (Modality.AUDIO, "audio"), (Modality.VIDEO, "video")):
        if counts[key]:
            for part in _index(counts[key], device).split(adapter.chunk_size or counts[key]):
                out.index_copy_(0, part, adapter.embed(mod, x.index_select(0, part)))
    rope = torch.empty(x.shape[0], 6 * adapter.rope.head_dim // 8)  # the rope table (its data check reads values)
    return out, rope


def _post_adapter(adapter, x, counts, device):
    """``Magi2PostAdapter.forward`` with the traced sizes."""
    out = x.new_zeros(x.shape[0], max(adapter.video_in, adapter.audio_in), dtype=torch.float32)
    for key, norm, lin, cout in (
        ("video", adapter.final_norm_video, adapter.final_linear_video, adapter.video_in),
        ("audio", adapter.final_norm_audio, adapter.final_linear_audio, adapter.audio_in),
    ):
        if counts[key]:
            for part in _index(counts[key], device).split(adapter.chunk_size or counts[key]):
                y = lin(norm(x.index_select(0, part).float()).to(lin.weight.dtype)).float()
                out[:, :cout].index_copy_(0, part, y)
    return out


@dataclass
class _Trace:
    weights: int
    activations: int
    peak_at: Optional[str]


def _exchange_bytes(tokens: int, width: int, itemsize: int) -> int:
    """Send + receive buffers of one all-to-all of ``[tokens, width]`` (q, k, v: three of them)."""
    return 2 * 3 * tokens * width * itemsize


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
) -> _Trace:
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
        count_inputs: count the packed inputs (handed over by ``forward`` and freed once embedded); ``False``:
            the caller holds them and they are not counted (``forward_packed`` called directly).

    Raises:
        ValueError: unknown ``kernels``, bad degrees, or segments not summing to the tokens.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    _check_kernels(kernels)
    _check_degree("cp_degree", cp_degree)
    _check_degree("ep_degree", ep_degree)
    n_total = sum(counts.values())
    if sum(segments) != n_total:
        raise ValueError(f"segments {list(segments)} must sum to the {n_total} tokens")
    cfg = dict(transformer_config or {})
    num_layers = cfg.pop("num_layers", 40)
    mm = {int(i) for i in cfg.pop("multimodal_layers", (0, 1, 38, 39))}
    moe = {int(i) for i in cfg.pop("moe_layers", range(2, 38))}
    kinds = sorted({(i in mm, i in moe) for i in range(num_layers)})
    layer_kinds = [(i in mm, i in moe) for i in range(num_layers)]
    local = counts if cp_degree == 1 else _split_counts(counts, cp_degree)
    n_loc = sum(local.values())

    with FakeTensorMode(), _kernel_models(kernels):
        model = Magi2Transformer3DModel(
            num_layers=len(kinds),
            multimodal_layers=[k for k, (m, _) in enumerate(kinds) if m],
            moe_layers=[k for k, (_, e) in enumerate(kinds) if e],
            params_dtype=compute_dtype,
            expert_dtype=expert_dtype,
            **cfg,
        )
        if kernels == "cuda":
            model.set_mhc_backend("fused")
        if forward_chunk_size is None:
            model.disable_forward_chunking()
        else:
            model.enable_forward_chunking(forward_chunk_size)
        if cp_degree > 1 or ep_degree > 1:  # exchanging MoE layers run one call per layer
            for block in model.transformer_blocks:
                if hasattr(block.mlp, "moe_mlp"):
                    block.mlp.chunk_size = None
        # weights: every layer's block, the routed experts split among the EP ranks
        weights = _module_bytes(model.pre_adapter) + _module_bytes(model.post_adapter)
        block_bytes = {}
        for kind, block in zip(kinds, model.transformer_blocks):
            nbytes = _module_bytes(block)
            if kind[1] and ep_degree > 1:
                moe_core = block.mlp.moe_mlp
                layout = ep_head_layout(moe_core.num_heads, ep_degree, 0)
                experts = _expert_bytes(moe_core)
                nbytes += experts * layout.local_num_heads // moe_core.num_heads - experts
            block_bytes[kind] = nbytes
        weights += sum(block_bytes[k] for k in layer_kinds)

        device = torch.device("cpu")
        c_max = max(model.config.in_channels, model.config.audio_in_channels, model.config.text_in_channels)
        hidden = torch.empty(n_total, c_max)
        coords = torch.empty(n_total, 9)
        mapping = torch.empty(n_total, dtype=torch.int32)
        time_embedding = torch.empty(n_total, model.config.time_embed_dim)
        tracker = LiveStorageTracker()
        tracker.ignore(list(model.parameters()) + list(model.buffers()))
        inputs = [hidden, coords, mapping, time_embedding]
        if count_inputs:
            tracker.count(inputs)  # the packed step inputs
        else:
            tracker.ignore(inputs)
        mask = Magi2AttentionMask(tuple(segments) if cp_degree == 1 else (n_loc,))
        with torch.no_grad(), tracker:
            if cp_degree > 1:  # this rank's contiguous shard
                hidden, coords, mapping, time_embedding = (
                    t[:n_loc].clone() for t in (hidden, coords, mapping, time_embedding)
                )
            ids = mapping.to(torch.int64)
            ids = torch.where(ids == int(Modality.TIME), torch.full_like(ids, int(Modality.TEXT)), ids)
            dispatch = _dispatch(local, device)
            x, rope = _pre_adapter(model.pre_adapter, hidden, coords, local, device)
            if count_inputs:  # forward hands the packed input over; forward_packed frees it once embedded
                hidden = inputs[0] = None
            dim = model.config.time_embed_dim
            x[:, :dim] = time_embedding.to(x.dtype)
            x = x.to(model.residual_dtype)
            x = dispatch.sort(x)
            for block in model.transformer_blocks:
                if cp_degree > 1:  # all-to-all buffers of the attention and MoE exchanges
                    width = block.attention.q_size
                    tracker.add_transient(_exchange_bytes(n_loc, width, x.element_size()), "all_to_all buffers")
                x = block(x, Magi2ForwardContext(rope, dispatch, mask))
            x = dispatch.unsort(x)
            out = _post_adapter(model.post_adapter, x, local, device)
            del x
            if cp_degree > 1:
                out = out.new_empty(n_total, out.shape[1])  # gathered output
        return _Trace(weights, tracker.peak, tracker.peak_op)


def _refiner_counts(text_tokens: int) -> Dict[str, int]:
    h, w = PLAN_RESOLUTIONS["1080p"]
    return {"video": REFINER_LATENT_FRAMES * (h // 16) * (w // 16), "audio": 0, "text": text_tokens}


def trace_refiner_forward(
    counts: Dict[str, int],
    refiner_config: Optional[dict] = None,
    *,
    cp_degree: int = 1,
    kernels: str = "cuda",
    forward_chunk_size: Optional[int] = None,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> _Trace:
    """Weights and peak activations of one refiner forward (one CFG branch) on one device.

    Args:
        counts: tokens per modality of the sample; refiner_config: model arguments (default: released).
        cp_degree: context-parallel degree; kernels: as :func:`trace_preview_forward`.
        forward_chunk_size: the MLP token chunk (``None``: the model default).

    Raises:
        ValueError: unknown ``kernels`` or a bad degree.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    _check_kernels(kernels)
    _check_degree("cp_degree", cp_degree)
    cfg = dict(refiner_config or {})
    num_layers = cfg.pop("num_layers", 30)
    mm = {int(i) for i in cfg.pop("multimodal_layers", (0, 1, 28, 29))}
    kinds = sorted({i in mm for i in range(num_layers)})
    layer_kinds = [i in mm for i in range(num_layers)]
    n_total = sum(counts.values())
    local = counts if cp_degree == 1 else _split_counts(counts, cp_degree)
    n_loc = sum(local.values())
    with FakeTensorMode(), _kernel_models(kernels):
        with _default_dtype(compute_dtype):  # its linears take the default dtype; the fp32 islands are built fp32
            model = Magi2RefinerTransformer3DModel(
                num_layers=len(kinds), multimodal_layers=[k for k, m in enumerate(kinds) if m], **cfg
            )
        if forward_chunk_size is not None:
            model.enable_forward_chunking(forward_chunk_size)
        weights = _module_bytes(model.pre_adapter) + _module_bytes(model.post_adapter)
        block_bytes = {k: _module_bytes(b) for k, b in zip(kinds, model.transformer_blocks)}
        weights += sum(block_bytes[k] for k in layer_kinds)
        device = torch.device("cpu")
        c_max = max(model.config.in_channels, model.config.audio_in_channels, model.config.text_in_channels)
        hidden = torch.empty(n_total, c_max)
        coords = torch.empty(n_total, 9)
        tracker = LiveStorageTracker()
        tracker.ignore(list(model.parameters()) + list(model.buffers()))
        tracker.count([hidden, coords])
        mask = Magi2AttentionMask((n_loc,))
        with torch.no_grad(), tracker:
            if cp_degree > 1:
                hidden, coords = hidden[:n_loc].clone(), coords[:n_loc].clone()
            dispatch = _dispatch(local, device)
            x, rope = _pre_adapter(model.pre_adapter, hidden, coords, local, device)
            h = dispatch.sort(x).to(model.compute_dtype)
            del x
            for block in model.transformer_blocks:
                if cp_degree > 1:
                    width = block.attention.q_size
                    tracker.add_transient(_exchange_bytes(n_loc, width, h.element_size()), "all_to_all buffers")
                h = block(h, Magi2ForwardContext(rope, dispatch, mask))
            h = dispatch.unsort(h).float()
            out = _post_adapter(model.post_adapter, h, local, device)
            del h
            if cp_degree > 1:
                out = out.new_empty(n_total, out.shape[1])
        return _Trace(weights, tracker.peak, tracker.peak_op)


# ------------------------------------------------------------------------------------------- stage rows


def plan_preview_step(
    resolution: str,
    expert_dtype: Optional[str] = None,
    *,
    cp_degree: int = 1,
    ep_degree: int = 1,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    forward_chunk_size: Optional[int] = DEFAULT_FORWARD_CHUNK_SIZE,
    capacity: Optional[int] = None,
) -> Magi2StageMemory:
    """Peak device memory of one CFG preview denoising step at the released size.

    Args:
        resolution: ``"272p"`` or ``"540p"`` (``"1080p"``: its 540p preview stage).
        expert_dtype: ``None`` (bf16) or ``"float8_e4m3fn"``.
        cp_degree, ep_degree: 1 and 1 for one GPU; 8 and 4 for CP8 x EP4 x 2.
        text_tokens: text tokens per CFG half.
        forward_chunk_size: ``Magi2Transformer3DModel.enable_forward_chunking`` chunk (default: the model's;
            ``None``: off).
        capacity: device bytes (default: an H200, 141 GB, on one GPU; an 80 GB GPU per rank).

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
    )
    layout = "1 GPU" if cp_degree == 1 else f"CP{cp_degree} x EP{ep_degree} x {cp_degree // ep_degree}, per rank"
    experts = "FP8 experts" if expert_dtype is not None else "bf16 experts"
    if capacity is None:
        capacity = H200_BYTES if cp_degree == 1 else H100_BYTES
    notes = [f"{sum(counts.values())} tokens (text {text_tokens} per CFG half)"]
    notes.append("chunking off" if forward_chunk_size is None else f"forward chunks of {forward_chunk_size} tokens")
    res = "540p" if resolution == "1080p" else resolution
    return Magi2StageMemory(
        f"preview step {res}, {experts}", layout, trace.weights, trace.activations, capacity, trace.peak_at, notes
    )


def plan_refiner_step(
    *,
    cp_degree: int = 1,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    forward_chunk_size: Optional[int] = None,
    capacity: Optional[int] = None,
) -> Magi2StageMemory:
    """Peak device memory of one 1080p refiner forward (CFG runs two of them one after the other).

    Raises:
        ValueError: a bad degree.
    """
    counts = _refiner_counts(text_tokens)
    trace = trace_refiner_forward(counts, cp_degree=cp_degree, forward_chunk_size=forward_chunk_size)
    layout = "1 GPU" if cp_degree == 1 else f"CP{cp_degree}, per rank"
    if capacity is None:
        capacity = H200_BYTES if cp_degree == 1 else H100_BYTES
    notes = [f"{sum(counts.values())} tokens per CFG branch"]
    return Magi2StageMemory(
        "refiner step 1080p", layout, trace.weights, trace.activations, capacity, trace.peak_at, notes
    )


# --------------------------------------------------------------------------------------- encoders, decoders

#: Qwen3.5-27B: its parameter count (the full config is not in this repository), hidden size and depth.
TEXT_ENCODER_PARAMETERS = 27 * 10**9
TEXT_ENCODER_HIDDEN, TEXT_ENCODER_LAYERS = 5120, 64


def _trace_call(build, call) -> _Trace:
    """Weights of ``build()`` and the peak bytes of ``call(module)``, both on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        module = build().eval()
        tracker = LiveStorageTracker()
        tracker.ignore(list(module.parameters()) + list(module.buffers()))
        with torch.no_grad(), tracker:
            result = call(module)
            del result
        return _Trace(_module_bytes(module), tracker.peak, tracker.peak_op)


def plan_video_decode(resolution: str, *, capacity: int = H200_BYTES, dtype=torch.bfloat16) -> Magi2StageMemory:
    """Peak device memory of the TurboVAE decode of one clip (540p: 32 latents -> 125 frames; 1080p: the refined
    63 latents -> 249 frames), the decoded frames kept on the device as ``decode_video_latents`` returns them.

    Raises:
        ValueError: an unknown resolution.
    """
    from ..models.turbo_vae import Magi2TurboVAEDecoder
    from .decoding_magi2 import decode_video_latents

    height, width = check_plan_resolution(resolution)
    frames = REFINER_LATENT_FRAMES if resolution == "1080p" else LATENT_FRAMES

    def build():
        with _default_dtype(dtype):  # (a module move cannot swap fake parameters)
            return Magi2TurboVAEDecoder()

    def call(decoder):
        latents = torch.empty(1, decoder.config.latent_channels, frames, height // 16, width // 16, dtype=dtype)
        return decode_video_latents(decoder, None, latents)

    trace = _trace_call(build, call)
    notes = [f"{4 * (frames - 1) + 1} frames; the class's default widths (SandAI's TurboVAE JSON is not public)"]
    return Magi2StageMemory(
        f"TurboVAE decode {resolution}", "1 GPU", trace.weights, trace.activations, capacity, trace.peak_at, notes
    )


def plan_image_encode(resolution: str = "540p", *, capacity: int = H200_BYTES) -> Magi2StageMemory:
    """Peak device memory of the Wan2.2 VAE encoding the I2V reference image (fp32, one frame).

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers import AutoencoderKLWan

    height, width = check_plan_resolution(resolution)

    def call(vae):
        return vae.encode(torch.empty(1, 3, 1, height, width)).latent_dist.mean

    trace = _trace_call(lambda: AutoencoderKLWan(**WAN22_VAE_CONFIG), call)
    return Magi2StageMemory(
        f"Wan2.2 VAE image encode {resolution}", "1 GPU", trace.weights, trace.activations, capacity, trace.peak_at
    )


def plan_audio_decode(*, capacity: int = H200_BYTES) -> Magi2StageMemory:
    """Peak device memory of the Stable Audio Open VAE (``AutoencoderOobleck``, fp32) decoding 250 latents."""
    from diffusers import AutoencoderOobleck

    def call(vae):
        return vae.decode(torch.empty(1, vae.config.decoder_input_channels, AUDIO_LATENTS)).sample

    trace = _trace_call(AutoencoderOobleck, call)
    return Magi2StageMemory(
        "audio decode (Oobleck)", "1 GPU", trace.weights, trace.activations, capacity, trace.peak_at, ["10 s stereo"]
    )


def plan_text_encode(text_tokens: int = 7000, *, capacity: int = H200_BYTES) -> Magi2StageMemory:
    """Device memory of the Qwen3.5-27B text encoder on one prompt of ``text_tokens`` tokens, an estimate:
    bf16 weights of 27 B parameters, every layer's hidden states (``output_hidden_states``), and one layer's MLP
    (intermediate ``3.4 x`` hidden, gate and up) in flight.

    Raises:
        ValueError: a negative ``text_tokens``.
    """
    if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be a non-negative int; got {text_tokens!r}")
    hidden_states = (TEXT_ENCODER_LAYERS + 1) * text_tokens * TEXT_ENCODER_HIDDEN * 2
    mlp = 3 * text_tokens * (17408 * 2)
    notes = [f"estimate: 27 B bf16 parameters, {text_tokens} tokens (the longest prompt)"]
    return Magi2StageMemory(
        "text encoding (Qwen3.5-27B)", "1 GPU", TEXT_ENCODER_PARAMETERS * 2, hidden_states + mlp, capacity, None, notes
    )
