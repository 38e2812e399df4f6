"""Device-memory plan of a MAGI-2 generation at the released size, stage by stage, without the weights: a developer
tool (``tests/benchmarks/bench_memory.py`` prints it, ``tests/pipelines/test_memory_plan.py`` checks it).

Each transformer stage is traced, not estimated: a model with one block of every kind the config has (dense
multimodal, MoE) is built at the released width on fake tensors (``FakeTensorMode``), and its own
``forward_packed`` runs on inputs of the stage's token count under
:class:`~helpers.memory_tracking.LiveStorageTracker`, which records the bytes of live tensor storages and their
peak. A stage's device peak is then::

    peak = weights on the device + max over the step of (inputs + activations live + kernel workspace)

where the weights are summed over all layers from the traced blocks (the routed experts divided among the
expert-parallel ranks). Weights and activations are fake; the index metadata the forward reads on the host (modality
ids, segment bounds, rope coordinates, and the integer tensors made from them) stay real, so its checks, its
modality dispatch and its per-modality index sets run as on a GPU (:class:`_IndexTensorsStayReal`, a dispatch mode
that lives for one trace). Nothing outside the traced model instance is changed. Two GPU kernels are modelled by
their allocations (``kernels="cuda"``): attention as a flash-style varlen kernel (a processor set on the traced
model: output in the compute dtype, an fp32 log-sum-exp per query and head, the sink correction
``out * sigmoid(lse - sink)`` one more output), and the routed experts as the fused Triton kernel on an H100
(its own ``launch_specs`` and ``launch_result`` without the launches: the output, fp32 route weights, per-route
rows in the deterministic mode; int4 experts one head's banks dequantized in the activation dtype). The expert
op's backward runs its own body op by op on either device (:class:`_ExpertKernels`; a custom op hides its
temporaries from a dispatch mode), with CUDA's GEMM dtype and Triton's in-place int4 dequantization on
``"cuda"``. ``kernels="cpu"`` traces the CPU code instead: the CPU attention, and the ``torch_grouped`` expert
backend op by op. That is the checked mode: on a reduced config the plan equals a CPU run's allocator peak within
10 % (``tests/pipelines/test_memory_plan.py``).

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

import argparse
import contextlib
import copy
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from diffusers_magi2.models.attention_magi2 import Magi2AttnProcessor
from diffusers_magi2.models.modality import Modality
from diffusers_magi2.models.transformer_magi2 import DEFAULT_FORWARD_CHUNK_SIZE, Magi2Transformer3DModel
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from diffusers_magi2.moe import experts as moe_experts
from diffusers_magi2.moe.experts_backward import device_kernels, experts_backward
from diffusers_magi2.moe.quantize import FP8_SCALE_NAMES
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES
from diffusers_magi2.parallel.expert_parallel import ep_head_layout
from diffusers_magi2.pipelines.decoding_magi2 import WAN22_VAE_CONFIG

from .memory_tracking import LiveStorageTracker


__all__ = [
    "GB",
    "PLAN_RESOLUTIONS",
    "Magi2StageMemory",
    "check_plan_resolution",
    "plan_audio_decode",
    "plan_image_encode",
    "plan_lora_training_step",
    "plan_preview_step",
    "plan_refiner_step",
    "plan_text_encode",
    "plan_video_decode",
    "plan_wan_decode",
    "preview_token_counts",
    "trace_lora_training_step",
    "trace_preview_forward",
    "trace_refiner_forward",
    "triton_expert_allocations",
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


# ------------------------------------------------------------------------------------------- the tracing


def _written_tensors(func, args, kwargs) -> list:
    """The tensors ``func`` writes into (the mutable arguments of its schema)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _grouped_mm_result(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output of ``torch._grouped_mm`` (2D x 3D: ``[M, N]``; 2D x 2D, a jagged contraction: ``[G, M, N]``;
    3D x 3D: ``[G, M, N]``; 3D x 2D: ``[M, N]``)."""
    dtype = out_dtype or mat_a.dtype
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return mat_a.new_empty(offs.shape[0], mat_a.shape[0], mat_b.shape[1], dtype=dtype)
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        return mat_a.new_empty(mat_a.shape[0], mat_a.shape[1], mat_b.shape[2], dtype=dtype)
    return mat_a.new_empty(mat_a.shape[-2], mat_b.shape[-1], dtype=dtype)


class _IndexTensorsStayReal(TorchDispatchMode):
    """For one trace: an op whose tensor inputs are all real runs for real (the host-side index metadata), an op with
    a fake input runs on fake tensors, and a factory makes a fake tensor if it is floating point (an activation or a
    workspace) and a real one otherwise (an index table), ``arange`` always a real one (coordinates, index ranges).
    An op that would write fake results into a real tensor raises: those values would stay unset, and the forward
    may read them on the host. ``torch._grouped_mm`` on fake tensors allocates its output
    (:func:`_grouped_mm_result`: its fake kernel takes bf16 only, the CPU kernel any float)."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            if func is torch.ops.aten._grouped_mm.default:  # its fake kernel takes bf16 only
                return _grouped_mm_result(*args, **kwargs)
            if any(not isinstance(t, FakeTensor) for t in _written_tensors(func, args, kwargs)):
                raise RuntimeError(f"the memory-plan trace would write fake values into a real index tensor ({func})")
            return func(*args, **kwargs)
        if tensors or func.overloadpacket is torch.ops.aten.arange:  # (coordinates and index ranges)
            return func(*args, **kwargs)
        with self.fake_mode:
            out = func(*args, **kwargs)
        if all(t.is_floating_point() for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            return out
        return func(*args, **kwargs)


#: The GPU the ``kernels="cuda"`` trace models the expert kernels for (an H100 / H200; on sm_80 the atomic mode's
#: bf16 output is summed in an fp32 buffer instead, one more ``[S, H, Dh]`` fp32 tensor per call).
PLAN_CAPABILITY = (9, 0)


def triton_expert_allocations(x, routes, weights, scales, backend, deterministic, top_k_routes):
    """The fused Triton kernel's call (``triton_mh_moe_forward``, arguments as the expert op's) without its
    launches: the buffers its own ``launch_specs`` allocates for :data:`PLAN_CAPABILITY` (the output, fp32 route
    weights; int4 experts: one head's three banks in the activation dtype, which the dequantization kernel fills in
    place) and its ``launch_result``."""
    from diffusers_magi2.moe import experts_triton

    specs = experts_triton.launch_specs(
        x,
        routes,
        weights,
        scales=scales or None,
        deterministic=deterministic,
        capability=PLAN_CAPABILITY,
        top_k_routes=top_k_routes,
    )
    return experts_triton.launch_result(specs, x, routes, weights, deterministic, top_k_routes)


def _written_by_the_kernel(packed, scale, out):
    """The Triton int4 dequantization into ``out``: it allocates nothing."""
    return out


class _ExpertKernels(TorchDispatchMode):
    """The expert op and its backward as they run on the traced device, op by op (a custom op hides its
    temporaries from a dispatch mode). The backward always runs its own body (grouped GEMMs in route blocks); on
    ``"cuda"`` with CUDA's choices (``device_kernels("cuda", ...)``'s GEMM dtype, int4 banks written by the Triton
    kernel straight into the reused buffers). The forward: on ``"cpu"`` its torch body (with the backend it
    was called with); on ``"cuda"`` the fused Triton kernel by its allocations (:func:`triton_expert_allocations`),
    for every expert storage."""

    def __init__(self, kernels: str) -> None:
        super().__init__()
        self.kernels = kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.diffusers_magi2.mh_moe_experts.default:  # (torch keeps the op's function as _init_fn)
            if self.kernels == "cuda":
                return triton_expert_allocations(*args, **kwargs)
            return moe_experts.mh_moe_experts._init_fn(*args, **kwargs)
        if func is torch.ops.diffusers_magi2.mh_moe_experts_backward.default:
            if self.kernels == "cuda":
                gemm_dtype, _ = device_kernels("cuda", args[1].dtype)
                *op_args, top_k = args
                kernels = (gemm_dtype, _written_by_the_kernel)
                return tuple(experts_backward(*op_args, top_k_routes=top_k, kernels=kernels))
            return moe_experts.mh_moe_experts_backward._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


class _FlashAttentionKernel(torch.autograd.Function):
    """A flash-style varlen kernel's allocations. Forward: the output and an fp32 LSE per (head, query), saving
    q, k, v, the output and the LSE; backward: dq, dk, dv, with an fp32 ``dq`` accumulator and an fp32 row sum of
    ``dO * O`` per (head, query) as workspace (FlashAttention's backward)."""

    @staticmethod
    def forward(ctx, query, key, value):
        n, hq, _ = query.shape
        out = torch.empty_like(query)
        lse = torch.empty(hq, n, dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, _, lse = ctx.saved_tensors
        workspace = torch.empty(query.shape, dtype=torch.float32), torch.empty_like(lse)
        grads = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        del workspace
        return grads


class _FlashAttentionAllocations(Magi2AttnProcessor):
    """``kernels="cuda"``: attention as :class:`_FlashAttentionKernel`, then the sink correction
    ``out * sigmoid(lse - sink)`` (set on the traced model with ``set_attn_processor``)."""

    def attend(self, attn, query, key, value, attention_mask, heads=None) -> torch.Tensor:
        out, lse = _FlashAttentionKernel.apply(query, key, value)
        sinks = getattr(attn, "sinks", None)
        if sinks is not None:
            factor = torch.sigmoid(lse - sinks.float()[0, : query.shape[1], None]).t().unsqueeze(-1)
            out = out * factor.to(out.dtype)
        return out


class _WeightsCounted(LiveStorageTracker):
    """A tracker that counts the traced model's own tensors from the start, so that a layer whose weights change
    storage during its call (layerwise casting: the stored dtype cast to the compute dtype and back) is seen as it is
    on a GPU; :attr:`activations` is the peak above the bytes the model held at the start."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.count(list(model.parameters()) + list(model.buffers()))
        self.base = self.live
        self.reset_peak()

    @property
    def activations(self) -> int:
        return self.peak - self.base


@contextlib.contextmanager
def _traced(model: torch.nn.Module, fake_mode: FakeTensorMode, kernels: str, grad: bool = False):
    """The trace's modes around a call of ``model``; yields its :class:`_WeightsCounted` tracker (which sees what
    :class:`_ExpertKernels` runs)."""
    tracker = _WeightsCounted(model)
    with torch.set_grad_enabled(grad), _IndexTensorsStayReal(fake_mode), tracker, _ExpertKernels(kernels):
        yield tracker


def _set_kernels(model: torch.nn.Module, kernels: str) -> None:
    """The kernels the trace models, chosen on the traced instance with the models' own switches: on the GPU flash
    attention (the experts: :class:`_ExpertKernels`); on the CPU the CPU attention and the ``torch_grouped``
    experts (the path without host reads, which the measured checks run)."""
    if kernels == "cuda":
        model.set_attn_processor(_FlashAttentionAllocations())
    elif hasattr(model, "set_moe_backend"):
        model.set_moe_backend("torch_grouped")


def _add_exchange_buffers(model: torch.nn.Module, tracker: LiveStorageTracker, tokens: int) -> list:
    """Before each block, the send and receive buffers of its all-to-all exchanges (context parallelism)."""

    def before(block, args):
        width = block.attention.q_size
        tracker.add_transient(_exchange_bytes(tokens, width, args[0].element_size()), "all_to_all buffers")

    return [block.register_forward_pre_hook(before) for block in model.transformer_blocks]


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
    FP8_SCALE_NAMES + INT4_SCALE_NAMES
)


def _expert_bytes(moe) -> int:
    names = dict(moe.named_parameters())
    names.update(moe.named_buffers())
    return _nbytes([names[n] for n in _EXPERT_TENSORS if n in names])


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


@dataclass
class _Trace:
    weights: int
    activations: int
    peak_at: Optional[str]


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


def _on_fake_tensors(model: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """``model`` (built on the meta device) with every parameter and buffer a fake CPU tensor of its shape and
    dtype (``to_empty``; a module move cannot swap fake parameters, so whatever moves them, PEFT's adapters
    included, happens on meta first)."""
    with fake_mode:
        return model.to_empty(device="cpu")


def _preview_kinds(transformer_config: Optional[dict]) -> tuple:
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
    kinds, per_layer = _preview_kinds(transformer_config)
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
    return _on_fake_tensors(model, fake_mode), kinds, per_layer


def _preview_weights(model, kinds, per_layer, ep_degree: int) -> int:
    """Weight bytes of every layer (from its kind's block), the routed experts split among ``ep_degree`` ranks."""
    block_bytes = {}
    for kind, block in zip(kinds, model.transformer_blocks):
        nbytes = _module_bytes(block)
        if kind[1] and ep_degree > 1:
            moe_core = block.mlp.moe_mlp
            layout = ep_head_layout(moe_core.num_heads, ep_degree, 0)
            experts = _expert_bytes(moe_core)
            nbytes += experts * layout.local_num_heads // moe_core.num_heads - experts
        block_bytes[kind] = nbytes
    return (
        _module_bytes(model.pre_adapter) + _module_bytes(model.post_adapter) + sum(block_bytes[k] for k in per_layer)
    )


@dataclass
class _StoredWeights:
    """The model's bytes with its dense weights stored in a narrower dtype (layerwise casting), and the bytes of the
    compute-dtype copies a call makes: of the largest cast layer, and of all cast layers of the largest block (a
    checkpointed block's backward keeps its layers' copies until it is done)."""

    weights: int
    layer_copy: int
    block_copy: int


def _layerwise_casting(model, kinds, per_layer, storage_dtype, compute_dtype, ep_degree: int = 1) -> _StoredWeights:
    """:class:`_StoredWeights` of ``model`` (on meta) under ``enable_layerwise_casting(storage_dtype,
    compute_dtype)``, read from a cast copy. The trace itself runs the layers in the compute dtype (diffusers' hook
    moves the module, which fake parameters refuse), so the copies are added to its peak: an upper bound."""
    stored = copy.deepcopy(model)
    stored.enable_layerwise_casting(storage_dtype=storage_dtype, compute_dtype=compute_dtype)

    def copies(module) -> int:  # a module the casting hooks: its own tensors are cast to the compute dtype
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None or registry.get_hook(_LAYERWISE_CASTING_HOOK) is None:
            return 0
        return sum(t.numel() for t in module.parameters(recurse=False)) * compute_dtype.itemsize

    blocks = [sum(copies(m) for m in block.modules()) for block in stored.transformer_blocks]
    return _StoredWeights(
        _preview_weights(stored, kinds, per_layer, ep_degree), max(copies(m) for m in stored.modules()), max(blocks)
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
        count_inputs: count the packed inputs, handed over as ``forward`` does (``forward_packed`` frees
            ``hidden_states`` once embedded); ``False``: the caller holds them and they are not counted
            (``forward_packed`` called directly).
        storage_dtype: ``enable_layerwise_casting(storage_dtype, compute_dtype)`` on the dense weights (``None``:
            off): the weights in that dtype, and the largest layer's compute-dtype copy added to the peak.

    Raises:
        ValueError: unknown ``kernels``, bad degrees, or segments not summing to the tokens.
    """
    _check_kernels(kernels)
    _check_degree("cp_degree", cp_degree)
    _check_degree("ep_degree", ep_degree)
    n_total = sum(counts.values())
    if sum(segments) != n_total:
        raise ValueError(f"segments {list(segments)} must sum to the {n_total} tokens")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    stored = []

    def cast(meta_model):
        stored.append(_layerwise_casting(meta_model, kinds, per_layer, storage_dtype, compute_dtype, ep_degree))

    kinds, per_layer = _preview_kinds(transformer_config)
    model, kinds, per_layer = build_traced_preview(
        transformer_config, expert_dtype, compute_dtype, fake_mode=fake, prepare=cast if storage_dtype else None
    )
    _set_kernels(model, kernels)
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
    weights = stored[0].weights if stored else _preview_weights(model, kinds, per_layer, ep_degree)

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
    with _traced(model, fake, kernels) as tracker:
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
    return _Trace(weights, tracker.activations + (stored[0].layer_copy if stored else 0), tracker.peak_op)


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
) -> _Trace:
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

    Raises:
        ValueError: unknown ``kernels`` or a bad degree.
    """
    _check_kernels(kernels)
    _check_degree("cp_degree", cp_degree)
    cfg = dict(refiner_config or {})
    num_layers = cfg.pop("num_layers", 30)
    kinds, per_layer = _layer_kinds(num_layers, mm=cfg.pop("multimodal_layers", (0, 1, 28, 29)))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"), _default_dtype(compute_dtype):  # its linears take the default dtype (islands: fp32)
        model = Magi2RefinerTransformer3DModel(
            num_layers=len(kinds), multimodal_layers=[k for k, (m,) in enumerate(kinds) if m], **cfg
        )
    model = _on_fake_tensors(model, fake)
    _set_kernels(model, kernels)
    if forward_chunk_size is not None:
        model.enable_forward_chunking(forward_chunk_size)
    block_bytes = {k: _module_bytes(b) for k, b in zip(kinds, model.transformer_blocks)}
    weights = _module_bytes(model.pre_adapter) + _module_bytes(model.post_adapter)
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
    with _traced(model, fake, kernels) as tracker:
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
    return _Trace(weights, tracker.activations, tracker.peak_op)


# ------------------------------------------------------------------------------------------- a LoRA training step

#: ``examples/train_lora.py``'s default ``--targets``: LoRA on the attention's ``linear_qkv`` and ``linear_proj``.
LORA_TARGETS = ("linear_qkv", "linear_proj")


def _lora_bytes(module: torch.nn.Module) -> int:
    return _nbytes([p for n, p in module.named_parameters() if ".lora_" in n])


@functools.lru_cache(maxsize=None)
def _train_script():
    from .train_workers import load_train_script

    return load_train_script()


def trace_lora_training_step(
    video_shape: Sequence[int],
    expert_dtype: Optional[str] = None,
    *,
    transformer_config: Optional[dict] = None,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    audio_tokens: int = AUDIO_LATENTS,
    rank: int = 16,
    targets: Sequence[str] = LORA_TARGETS,
    storage_dtype: Optional[torch.dtype] = None,
    gradient_checkpointing: bool = True,
    offload_block_inputs: bool = False,
    kernels: str = "cuda",
    forward_chunk_size: Optional[int] = DEFAULT_FORWARD_CHUNK_SIZE,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> _Trace:
    """Weights and peak activations of one LoRA training step of ``examples/train_lora.py``: its ``add_lora``
    (the transformer frozen in ``compute_dtype``, routed experts in ``expert_dtype``; an fp32 LoRA of ``rank`` on
    ``targets``), its ``training_loss`` on one cached sample (fp32 video latent ``(T, H, W)``, ``audio_tokens``,
    ``text_tokens``; at sigma 0.5) and the loss's ``backward``. The weights include the LoRA's AdamW moments (two
    fp32 copies); the activations the LoRA gradients. Only one block of each kind is traced: with gradient
    checkpointing every other layer adds its saved block input ``[N, n*C]``, counted as live at the peak. An upper
    bound: the backward of layer ``L`` sees the ``L`` saved inputs of the layers before it, and with the traced
    blocks in the order of their kinds' last layers, the ``j``-th traced block's kind has its last layer at
    ``L <= j + (layers - kinds)`` (each kind after it has a later last layer of its own).

    Args:
        video_shape: latent ``(T, H, W)``; expert_dtype: as :func:`trace_preview_forward`.
        transformer_config: ``Magi2Transformer3DModel`` arguments (default: released).
        rank, targets: the script's ``--rank`` and ``--targets``.
        storage_dtype: FP8 storage of the frozen dense weights (``enable_layerwise_casting``), or ``None``: the
            weights in that dtype, and the compute-dtype copies of the largest block's layers added to the peak.
        gradient_checkpointing: the script's ``--gradient_checkpointing``.
        offload_block_inputs: the script's ``--offload_block_inputs`` (``enable_gradient_checkpointing(
            offload_block_inputs=True)``): the saved inputs of the layers not traced are in host memory (not
            counted); the traced layers' are counted (an upper bound by one layer's input: the trace runs on one
            device, where the host copies cannot be told apart).
        kernels, forward_chunk_size, compute_dtype: as :func:`trace_preview_forward`.

    Raises:
        ValueError: unknown ``kernels``.
    """
    _check_kernels(kernels)
    script = _train_script()
    args = argparse.Namespace(
        targets=list(targets),
        rank=rank,
        alpha=None,
        gradient_checkpointing=gradient_checkpointing,
        offload_block_inputs=offload_block_inputs,
    )
    kinds, per_layer = _preview_kinds(transformer_config)
    stored = []

    def add_lora(model):
        script.add_lora(model, args)
        if storage_dtype is not None:
            stored.append(_layerwise_casting(model, kinds, per_layer, storage_dtype, compute_dtype))

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, kinds, per_layer = build_traced_preview(
        transformer_config, expert_dtype, compute_dtype, fake_mode=fake, prepare=add_lora
    )
    _set_kernels(model, kernels)
    if forward_chunk_size is None:
        model.disable_forward_chunking()
    else:
        model.enable_forward_chunking(forward_chunk_size)
    lora = {kind: _lora_bytes(block) for kind, block in zip(kinds, model.transformer_blocks)}
    weights = stored[0].weights if stored else _preview_weights(model, kinds, per_layer, 1)
    weights += 2 * sum(lora[k] for k in per_layer)  # the AdamW moments

    config = model.config
    with fake:
        sample = {
            "latents": torch.empty(config.in_channels, *video_shape),
            "audio_latents": torch.empty(audio_tokens, config.audio_in_channels),
            "text_states": torch.empty(text_tokens, config.text_in_channels),
        }
        noise = {
            "eps": torch.empty(1, config.in_channels, *video_shape),
            "eps_a": torch.empty(1, audio_tokens, config.audio_in_channels),
        }
    with _traced(model, fake, kernels, grad=True) as tracker:
        tracker.count(list(sample.values()) + list(noise.values()))
        loss = script.training_loss(model, sample, None, torch.device("cpu"), {"sigma": 0.5, **noise})
        loss.backward()
        del loss
    saved = 0
    if gradient_checkpointing and not offload_block_inputs:  # the saved inputs of the layers not traced
        tokens = math.prod(video_shape) + audio_tokens + text_tokens
        saved = (
            (len(per_layer) - len(kinds)) * tokens * config.num_streams * model.hidden_size * compute_dtype.itemsize
        )
    copies = stored[0].block_copy if stored else 0
    return _Trace(weights, tracker.activations + saved + copies, tracker.peak_op)


# ------------------------------------------------------------------------------------------- stage rows


def _row(
    stage: str, name: str, trace: _Trace, capacity: int, margin: int, notes=(), layout: str = "1 GPU"
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
        storage_dtype: FP8 storage of the dense weights (``enable_layerwise_casting``), or ``None``.
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
    res = "540p" if resolution == "1080p" else resolution
    what = EXPERT_NAMES[expert_dtype] + ("" if storage_dtype is None else ", FP8-stored dense weights")
    return _row(f"preview step {res}, {what}", f"preview_{res}", trace, capacity, margin, notes, layout)


def plan_refiner_step(
    *,
    cp_degree: int = 1,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    forward_chunk_size: Optional[int] = None,
    capacity: Optional[int] = None,
    margin: int = SPARE_BYTES,
) -> Magi2StageMemory:
    """Peak device memory of one 1080p refiner forward (CFG runs two of them one after the other).

    Raises:
        ValueError: a bad degree.
    """
    video_shape = _refiner_video_shape()
    trace = trace_refiner_forward(video_shape, text_tokens, cp_degree=cp_degree, forward_chunk_size=forward_chunk_size)
    layout = "1 GPU" if cp_degree == 1 else f"CP{cp_degree}, per rank"
    if capacity is None:
        capacity = H200_BYTES if cp_degree == 1 else H100_BYTES
    notes = [f"{math.prod(video_shape) + text_tokens} tokens per CFG branch"]
    return _row("refiner step 1080p", "refiner_1080p", trace, capacity, margin, notes, layout)


def plan_lora_training_step(
    resolution: str = "272p",
    expert_dtype: Optional[str] = None,
    *,
    storage_dtype: Optional[torch.dtype] = None,
    offload_block_inputs: bool = False,
    capacity: int = H100_BYTES,
    margin: int = SPARE_BYTES,
) -> Magi2StageMemory:
    """Peak device memory of one ``examples/train_lora.py`` step on one 10 s clip (:func:`trace_lora_training_step`
    with its defaults: rank 16 on ``linear_qkv`` and ``linear_proj``, gradient checkpointing, 512 text tokens).

    Raises:
        ValueError: an unknown resolution.
    """
    height, width = check_plan_resolution(resolution)
    video = (LATENT_FRAMES, height // 16, width // 16)
    trace = trace_lora_training_step(
        video,
        expert_dtype,
        storage_dtype=storage_dtype,
        offload_block_inputs=offload_block_inputs,
    )
    what = EXPERT_NAMES[expert_dtype] + ("" if storage_dtype is None else ", FP8-stored dense weights")
    notes = [
        f"{math.prod(video) + AUDIO_LATENTS + DEFAULT_TEXT_TOKENS} tokens, LoRA rank 16 on linear_qkv + linear_proj "
        "(fp32, with AdamW moments), gradient checkpointing",
        "block inputs in host memory" if offload_block_inputs else "block inputs on the device",
    ]
    name = f"lora_train_{resolution}" + ("" if offload_block_inputs else "_inputs_on_device")
    return _row(f"LoRA training step {resolution}, {what}", name, trace, capacity, margin, notes)


# --------------------------------------------------------------------------------------- encoders, decoders

#: Qwen3.5-27B: its parameter count (the full config is not in this repository), hidden size and depth.
TEXT_ENCODER_PARAMETERS = 27 * 10**9
TEXT_ENCODER_HIDDEN, TEXT_ENCODER_LAYERS = 5120, 64


def _trace_call(build, call) -> _Trace:
    """Weights of ``build()`` and the peak bytes of ``call(module)``, both on fake tensors."""
    with FakeTensorMode():
        module = build().eval()
        tracker = LiveStorageTracker()
        tracker.ignore(list(module.parameters()) + list(module.buffers()))
        with torch.no_grad(), tracker:
            result = call(module)
            del result
        return _Trace(_module_bytes(module), tracker.peak, tracker.peak_op)


def _clip_frames(resolution: str) -> int:
    """Latent frames of the clip a decoder sees: 540p the preview's 32, 1080p the refined 63."""
    return REFINER_LATENT_FRAMES if resolution == "1080p" else LATENT_FRAMES


def plan_video_decode(
    resolution: str, *, capacity: int = H200_BYTES, margin: int = SPARE_BYTES, dtype=torch.bfloat16
) -> Magi2StageMemory:
    """Peak device memory of the TurboVAE decode of one clip (540p: 32 latents -> 125 frames; 1080p: the refined
    63 latents -> 249 frames), the decoded frames kept on the device as ``decode_video_latents`` returns them.

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder
    from diffusers_magi2.pipelines.decoding_magi2 import decode_video_latents

    height, width = check_plan_resolution(resolution)
    frames = _clip_frames(resolution)

    def build():
        with _default_dtype(dtype):  # (a module move cannot swap fake parameters)
            return Magi2TurboVAEDecoder()

    def call(decoder):
        latents = torch.empty(1, decoder.config.latent_channels, frames, height // 16, width // 16, dtype=dtype)
        return decode_video_latents(decoder, None, latents)

    notes = [f"{4 * (frames - 1) + 1} frames; the class's default widths (SandAI's TurboVAE JSON is not public)"]
    trace = _trace_call(build, call)
    return _row(f"TurboVAE decode {resolution}", f"turbovae_decode_{resolution}", trace, capacity, margin, notes)


def plan_wan_decode(
    resolution: str, *, tiled: bool = False, capacity: int = H200_BYTES, margin: int = SPARE_BYTES
) -> Magi2StageMemory:
    """Peak device memory of the Wan2.2 VAE decoding one clip (fp32; the pipeline's decoder without a TurboVAE),
    frames as :func:`plan_video_decode`; ``tiled``: with diffusers' ``enable_tiling()`` (its default tiles).

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers import AutoencoderKLWan

    from diffusers_magi2.pipelines.decoding_magi2 import decode_video_latents

    height, width = check_plan_resolution(resolution)
    frames = _clip_frames(resolution)

    def build():
        vae = AutoencoderKLWan(**WAN22_VAE_CONFIG, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)  # (48 channels)
        if tiled:
            vae.enable_tiling()
        return vae

    def call(vae):
        return decode_video_latents(None, vae, torch.empty(1, 48, frames, height // 16, width // 16))

    notes = [f"{4 * (frames - 1) + 1} frames" + (", tiled (enable_tiling)" if tiled else "")]
    trace = _trace_call(build, call)
    return _row(f"Wan2.2 VAE decode {resolution}", f"wan_decode_{resolution}", trace, capacity, margin, notes)


def plan_image_encode(
    resolution: str = "540p", *, capacity: int = H200_BYTES, margin: int = SPARE_BYTES
) -> Magi2StageMemory:
    """Peak device memory of the Wan2.2 VAE encoding the I2V reference image (fp32, one frame).

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers import AutoencoderKLWan

    height, width = check_plan_resolution(resolution)

    def call(vae):
        return vae.encode(torch.empty(1, 3, 1, height, width)).latent_dist.mean

    trace = _trace_call(lambda: AutoencoderKLWan(**WAN22_VAE_CONFIG), call)
    return _row(f"Wan2.2 VAE image encode {resolution}", f"image_encode_{resolution}", trace, capacity, margin)


def plan_audio_decode(*, capacity: int = H200_BYTES, margin: int = SPARE_BYTES) -> Magi2StageMemory:
    """Peak device memory of the Stable Audio Open VAE (``AutoencoderOobleck``, fp32) decoding 250 latents."""
    from diffusers import AutoencoderOobleck

    def call(vae):
        return vae.decode(torch.empty(1, vae.config.decoder_input_channels, AUDIO_LATENTS)).sample

    trace = _trace_call(AutoencoderOobleck, call)
    return _row("audio decode (Oobleck)", "audio_decode", trace, capacity, margin, ["10 s stereo"])


def plan_text_encode(
    text_tokens: int = 7000, *, capacity: int = H200_BYTES, margin: int = SPARE_BYTES
) -> Magi2StageMemory:
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
    trace = _Trace(TEXT_ENCODER_PARAMETERS * 2, hidden_states + mlp, None)
    return _row("text encoding (Qwen3.5-27B)", "text_encode", trace, capacity, margin, notes)
