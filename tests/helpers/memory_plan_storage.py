"""What a narrower-stored dense weight adds to a traced forward, for :mod:`helpers.memory_plan`.

Dense weights stored narrower (FP8 storage, layerwise casting) are traced in the compute dtype, and each call of a
stored layer with ``numel`` weights adds, from its start, what the storing hook holds beside the layer's own work::

    held      = numel * compute itemsize    the compute-dtype weight, until the call returns
    transient = 2 * numel * 4               FP8 on the CPU, once, as it starts: ``copy.mul_(fp32 scale)`` runs through
                                            TensorIterator's CPU temporaries (the copy promoted to fp32, an fp32
                                            output); CUDA casts inside the kernel (0)

Measured by the CPU allocator at bf16: an FP8-stored projection's dequantization peaks at ``10 numel`` bytes,
``2 numel`` of them held through the call.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Dict

import torch
from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK

from diffusers_magi2.models.fp8_storage_magi2 import FP8_STORAGE_HOOK

from .memory_trace import check_kernels
from .memory_tracking import LiveStorageTracker


__all__ = ["cast_copy_bytes", "layer_calls", "stored_calls_traced", "stored_copy", "stored_layer_calls"]


def stored_copy(model, storage_dtype, compute_dtype):
    """A copy of ``model`` with its dense weights stored: ``enable_fp8_storage`` for e4m3, else layerwise casting."""
    stored = copy.deepcopy(model)
    if storage_dtype == torch.float8_e4m3fn:
        stored.enable_fp8_storage(compute_dtype=compute_dtype)
    else:
        stored.enable_layerwise_casting(storage_dtype=storage_dtype, compute_dtype=compute_dtype)
    return stored


def cast_copy_bytes(module, compute_dtype) -> int:
    """Bytes of the compute-dtype copy a storing hook makes of ``module``'s own weights for its call (0 unstored)."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None or not any(registry.get_hook(h) for h in (_LAYERWISE_CASTING_HOOK, FP8_STORAGE_HOOK)):
        return 0
    return sum(t.numel() for t in module.parameters(recurse=False)) * compute_dtype.itemsize


def layer_calls(stored, compute_dtype, kernels: str) -> Dict[str, tuple]:
    """``{name: (held, transient)}`` bytes of each stored layer's call in ``stored`` (module docstring)."""
    calls = {}
    for name, module in stored.named_modules():
        held = cast_copy_bytes(module, compute_dtype)
        if not held:
            continue
        scaled = module._diffusers_hook.get_hook(FP8_STORAGE_HOOK) is not None and compute_dtype != torch.float32
        calls[name] = (held, 2 * module.weight.numel() * torch.float32.itemsize if scaled and kernels == "cpu" else 0)
    return calls


def stored_layer_calls(
    model, storage_dtype: torch.dtype, kernels: str, compute_dtype: torch.dtype = torch.bfloat16
) -> Dict[str, tuple]:
    """What each call of a stored layer adds to the trace: ``{name: (held, transient)}`` bytes, the compute-dtype
    weight held through the call and the storing hook's temporaries as it starts (module docstring).

    Args:
        model: a transformer (on meta or real) with its dense weights not yet stored.
        storage_dtype: ``torch.float8_e4m3fn`` (``enable_fp8_storage``) or a layerwise-casting storage dtype.
        kernels: ``"cuda"`` or ``"cpu"``.
        compute_dtype: the dtype the layers compute in.

    Raises:
        ValueError: unknown ``kernels``.
    """
    check_kernels(kernels)
    return layer_calls(stored_copy(model, storage_dtype, compute_dtype), compute_dtype, kernels)


@contextlib.contextmanager
def stored_calls_traced(model, calls: Dict[str, tuple], tracker: LiveStorageTracker, compute_dtype):
    """Around each call of a stored layer of ``model`` (named in ``calls``), its held copy live (a fake tensor) and
    its transient a peak candidate."""
    held = []

    def before(name):
        def hook(module, args):
            nbytes, transient = calls[name]
            held.append(torch.empty(nbytes // compute_dtype.itemsize, dtype=compute_dtype))
            if transient:
                tracker.add_transient(transient, f"{name}: the stored weight's dequantization")

        return hook

    def after(module, args, out):
        held.pop()

    handles = []
    for name in calls:
        module = model.get_submodule(name)
        handles += [module.register_forward_pre_hook(before(name)), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
