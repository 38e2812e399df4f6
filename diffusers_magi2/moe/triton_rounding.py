"""Rounding points shared by the package's Triton kernels, and whether they run in Triton's CPU interpreter.

A kernel rounds an fp32 value to the dtype of a pointer in one of four modes (``constexpr``): keep fp32; cast
natively (round to nearest even on the GPU); emulate round-to-nearest-even bf16 in fp32 (the interpreter's
fp32->bf16 casts truncate, so the value is made exact first); or round-trip through fp16 (the interpreter with fp16
tensors).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


__all__ = ["EMU_BF16", "EMU_FP16", "INTERPRET", "KEEP", "NATIVE", "round_to", "rounding_mode"]

#: Whether kernels run in Triton's CPU interpreter (fixed at import, as ``@triton.jit`` reads it then).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: rounding modes of :func:`round_to`
KEEP, NATIVE, EMU_BF16, EMU_FP16 = 0, 1, 2, 3


@triton.jit
def _round_bf16_rne(x):
    """fp32 -> nearest-even bf16 value, kept in fp32 (bit-exact with torch's ``.bfloat16()``)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, ptr_dtype_src, MODE: tl.constexpr):
    """``x`` (fp32) rounded to the element dtype of the pointer ``ptr_dtype_src`` in mode ``MODE``."""
    if MODE == 1:
        return x.to(ptr_dtype_src.dtype.element_ty)
    elif MODE == 2:
        return _round_bf16_rne(x)
    elif MODE == 3:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def rounding_mode(dtype: torch.dtype, native_ok: bool) -> int:
    """The :func:`round_to` mode for rounding to ``dtype``: keep fp32, a native cast where ``native_ok``, else the
    interpreter's emulation."""
    if dtype == torch.float32:
        return KEEP
    if native_ok:
        return NATIVE
    return EMU_BF16 if dtype == torch.bfloat16 else EMU_FP16
