"""FP8 storage of dense projections with one scale per output channel, dequantized for each call (a diffusers hook).

A projection ``y = x W^T`` with ``W [O, I]`` (a modality-grouped one: ``[M O, I]``, a row per modality and output
channel) is stored as ``weight = round_e4m3(W / s)`` (``float8_e4m3fn``) beside the fp32 buffer ``weight_scale``::

    s[o] = max_i |W[o, i]| / 448,        W ~= weight * s,

as the FP8 routed experts are (:func:`~diffusers_magi2.moe.quantize.quantize_fp8`; a row of zeros keeps ``s = 0``).
For each call the hook (:class:`Magi2FP8StorageHook`, a diffusers ``ModelHook``) puts ``weight * s`` in the
compute dtype in the weight's place (the module's ``compute_dtype`` attribute, which PEFT also reads, so a LoRA on
it is made in that dtype; the product is taken in fp32 and rounded once, into one compute-dtype copy, the memory
layerwise casting's cast takes) and the FP8 tensor back after the call (also when it raises). Nothing is held
between calls, so ``.to()``, model CPU offload and group offload move the stored tensors; PEFT's LoRA layers wrap
the projection and call it.

Why a scale: e4m3 has 3 mantissa bits and its smallest normal is ``2^-6``; unscaled (``enable_layerwise_casting``),
weights below that lose relative precision (subnormal steps of ``2^-9``), which the released model's weights
(``N(0, ~1/sqrt(5120))``) mostly are. Scaled, every row spans the normal range and each weight errs by at most
``2^-4`` relative. That mantissa bound stays: a weight errs up to 16 times more than in bf16 (``2^-8``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from diffusers.hooks import HookRegistry, ModelHook

from ..moe.quantize import FP8_DTYPE, quantize_fp8


__all__ = [
    "DENSE_STORAGE_DTYPES",
    "FP8_STORAGE_HOOK",
    "Magi2FP8StorageHook",
    "apply_fp8_storage",
    "check_dense_storage_dtype",
    "fp8_storage_compute_dtype",
    "quantize_rows_fp8",
]

#: the hook's name in a module's ``HookRegistry``
FP8_STORAGE_HOOK = "magi2_fp8_storage"
#: values of the transformers' ``dense_storage_dtype`` config: ``None`` (the load dtype) or per-channel FP8
DENSE_STORAGE_DTYPES = (None, "float8_e4m3fn")


def check_dense_storage_dtype(value) -> None:
    """Raise ``ValueError`` unless ``value`` is one of :data:`DENSE_STORAGE_DTYPES` (naming the config key)."""
    if value not in DENSE_STORAGE_DTYPES:
        raise ValueError(f"dense_storage_dtype must be one of {DENSE_STORAGE_DTYPES}; got {value!r}")


def quantize_rows_fp8(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [O, I] float8_e4m3fn, scale [O] float32)`` of a projection weight ``[O, I]``, one scale per row (meta
    in, meta out).

    Raises:
        ValueError: ``weight`` holds a NaN or inf (naming ``name``, the row and the column).
    """
    if weight.is_meta or not weight.numel():  # (no values, or none to scale: an empty row is 0)
        q = torch.zeros(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        return q, torch.zeros(weight.shape[0], device=weight.device)
    q, scale = quantize_fp8(weight.detach().t().unsqueeze(0), name=name)  # [1, I, O]: a scale per column o
    return q[0].t().contiguous(), scale[0]


class Magi2FP8StorageHook(ModelHook):
    """Puts ``weight * weight_scale`` in the module's ``compute_dtype`` in its ``weight`` for its call and the FP8
    tensor back after it (module docstring)."""

    def new_forward(self, module: nn.Module, *args, **kwargs):
        stored = module.weight.data
        weight = stored.to(module.compute_dtype)  # exact: every e4m3 value is a bf16/fp16/fp32 value
        module.weight.data = weight.mul_(module.weight_scale.unsqueeze(1))  # in fp32, rounded once, in place
        try:
            return self.fn_ref.original_forward(*args, **kwargs)
        finally:  # also when the call raises
            module.weight.data = stored


def apply_fp8_storage(module: nn.Module, compute_dtype: torch.dtype, name: str = "weight") -> None:
    """Store ``module.weight`` as per-channel FP8 with a ``weight_scale`` buffer and register
    :class:`Magi2FP8StorageHook`; a module already stored so (an FP8 ``weight`` beside its ``weight_scale``, e.g.
    loaded from a converted repo) keeps its values and takes ``compute_dtype``.

    Raises:
        ValueError: the weight holds a NaN or inf (naming ``name``).
    """
    if "weight_scale" not in module._buffers:
        q, scale = quantize_rows_fp8(module.weight, name)
        module.weight.data = q
        module.register_buffer("weight_scale", scale)
    elif module.weight.dtype != FP8_DTYPE:  # FP8 values a load cast to the load dtype: exact back
        module.weight.data = module.weight.data.to(FP8_DTYPE)
    module.weight.requires_grad_(False)
    module.compute_dtype = compute_dtype  # (PEFT also creates adapters in a base layer's compute_dtype)
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if registry.get_hook(FP8_STORAGE_HOOK) is None:
        registry.register_hook(Magi2FP8StorageHook(), FP8_STORAGE_HOOK)


def fp8_storage_compute_dtype(module: nn.Module) -> Optional[torch.dtype]:
    """The compute dtype of ``module``'s :class:`Magi2FP8StorageHook`, or ``None`` without one."""
    registry = getattr(module, "_diffusers_hook", None)
    return module.compute_dtype if registry is not None and registry.get_hook(FP8_STORAGE_HOOK) else None
