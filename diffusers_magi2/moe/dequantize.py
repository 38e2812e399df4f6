"""Expert weights in fp32 from any storage: the one dequantisation the torch paths and the reference share.

bf16/fp16/fp32 banks are upcast (exact); FP8 banks are ``q * scale[n]`` (:mod:`.quantize`); int4 banks are
``NF4[c] * scale[k // G, n]`` (:mod:`.quantize_int4`), told apart by their ``uint8`` codes.
"""

from __future__ import annotations

from typing import Optional

import torch

from .quantize_int4 import INT4_PACKED_DTYPE, dequantize_int4


__all__ = ["dequantize_bank", "dequantize_expert", "is_int4"]


def is_int4(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds packed int4 codes."""
    return weight.dtype == INT4_PACKED_DTYPE


def dequantize_expert(weight: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """One expert's matrix ``[K, N]`` in fp32 (int4: ``weight [K, N/2]``, ``scale [K/G, N]``; FP8: ``scale [N]``)."""
    if scale is None:
        return weight.float()
    if is_int4(weight):
        return dequantize_int4(weight, scale)
    return weight.float().mul_(scale)


def dequantize_bank(
    weight: torch.Tensor, scale: Optional[torch.Tensor], *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """A bank ``[E, K, N]`` (e.g. one head's experts) in fp32, as :func:`dequantize_expert` per expert; int4 is
    written into ``out`` when given (a reused fp32 buffer of the result's shape)."""
    if scale is None:
        return weight.float()
    if is_int4(weight):
        return dequantize_int4(weight, scale, out=out)
    return weight.float().mul_(scale.unsqueeze(1))
