"""Device memory of a call, traced on fake tensors: the method of the memory plan (:mod:`helpers.memory_plan`).

A model is built on the meta device, its parameters and buffers made fake CPU tensors (:func:`on_fake_tensors`),
and one call runs under :func:`traced`, whose :class:`~helpers.memory_tracking.LiveStorageTracker` records the bytes
of live tensor storages and their peak. Weights and activations are fake; the index metadata the forward reads on
the host (modality ids, segment bounds, rope coordinates, and the integer tensors made from them) stay real, so its
checks, its modality dispatch and its per-modality index sets run as on a GPU (:class:`_IndexTensorsStayReal`, a
dispatch mode that lives for one trace). Nothing outside the traced model instance is changed.

Two GPU kernels are modelled by their allocations (``kernels="cuda"``, :func:`set_kernels`): attention as a
flash-style varlen kernel (a processor set on the traced model: output in the compute dtype, an fp32 log-sum-exp
per query and head, the sink correction ``out * sigmoid(lse - sink)`` one more output), and the routed experts as
the fused Triton kernel on an H100 (:func:`triton_expert_allocations`: its own ``launch_specs`` and
``launch_result`` without the launches). The expert op's backward runs its own body op by op on either device
(:class:`_ExpertKernels`; a custom op hides its temporaries from a dispatch mode), with CUDA's GEMM dtype and
Triton's in-place int4 dequantization on ``"cuda"``. ``kernels="cpu"`` traces the CPU code instead: the CPU
attention, and the ``torch_grouped`` expert backend op by op.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from diffusers_magi2.models.attention_magi2 import Magi2AttnProcessor
from diffusers_magi2.moe import experts as moe_experts
from diffusers_magi2.moe.experts_backward import device_kernels, experts_backward

from .memory_tracking import LiveStorageTracker


__all__ = [
    "KERNELS",
    "PLAN_CAPABILITY",
    "Trace",
    "check_kernels",
    "default_dtype",
    "module_bytes",
    "on_fake_tensors",
    "set_kernels",
    "tensor_bytes",
    "trace_call",
    "traced",
    "triton_expert_allocations",
]


KERNELS = ("cuda", "cpu")


def check_kernels(kernels: str) -> None:
    """Refuse a ``kernels`` not in :data:`KERNELS` (``ValueError``)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}; got {kernels!r}")


@dataclass
class Trace:
    """One traced call: weight bytes, peak bytes above them, and the op at the peak."""

    weights: int
    activations: int
    peak_at: Optional[str]
    #: the activations' peak while a module of each named part runs (:func:`part_peaks`)
    parts: Dict[str, int] = field(default_factory=dict)


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

    def attend(self, attn, query, key, value, attention_mask, heads=None, query_start=0) -> torch.Tensor:
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
def traced(model: torch.nn.Module, fake_mode: FakeTensorMode, kernels: str, grad: bool = False):
    """The trace's modes around a call of ``model``; yields its :class:`_WeightsCounted` tracker (which sees what
    :class:`_ExpertKernels` runs)."""
    tracker = _WeightsCounted(model)
    with torch.set_grad_enabled(grad), _IndexTensorsStayReal(fake_mode), tracker, _ExpertKernels(kernels):
        yield tracker


@contextlib.contextmanager
def part_peaks(tracker: "_WeightsCounted", parts: Dict[str, Sequence[torch.nn.Module]]):
    """Yields ``{part: bytes}``: the activations' peak (above the model's own tensors) while a module of each part
    runs, everything live then included; the tracker's own peak is left as it would be without."""
    peaks = dict.fromkeys(parts, 0)
    outer = []

    def enter(module, args):
        outer.append((tracker.peak, tracker.peak_op))
        tracker.reset_peak()

    def leave(name):
        def hook(module, args, out):
            peaks[name] = max(peaks[name], tracker.peak - tracker.base)
            peak, op = outer.pop()
            if peak > tracker.peak:
                tracker.peak, tracker.peak_op = peak, op

        return hook

    handles = []
    for name, modules in parts.items():
        for module in modules:
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave(name))]
    try:
        yield peaks
    finally:
        for handle in handles:
            handle.remove()


def set_kernels(model: torch.nn.Module, kernels: str) -> None:
    """The kernels the trace models, chosen on the traced instance with the models' own switches: on the GPU flash
    attention (the experts: :class:`_ExpertKernels`); on the CPU the CPU attention and the ``torch_grouped``
    experts (the path without host reads, which the measured checks run)."""
    if kernels == "cuda":
        model.set_attn_processor(_FlashAttentionAllocations())
    elif hasattr(model, "set_moe_backend"):
        model.set_moe_backend("torch_grouped")


def on_fake_tensors(model: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """``model`` (built on the meta device) with every parameter and buffer a fake CPU tensor of its shape and
    dtype (``to_empty``; a module move cannot swap fake parameters, so whatever moves them, PEFT's adapters
    included, happens on meta first)."""
    with fake_mode:
        return model.to_empty(device="cpu")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """``torch``'s default dtype set to ``dtype`` for the block."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def tensor_bytes(tensors) -> int:
    """Bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers."""
    return tensor_bytes(list(module.parameters()) + list(module.buffers()))


def trace_call(build, call) -> Trace:
    """Weights of ``build()`` and the peak bytes of ``call(module)``, both on fake tensors."""
    with FakeTensorMode():
        module = build().eval()
        tracker = LiveStorageTracker()
        tracker.ignore(list(module.parameters()) + list(module.buffers()))
        with torch.no_grad(), tracker:
            result = call(module)
            del result
        return Trace(module_bytes(module), tracker.peak, tracker.peak_op)
