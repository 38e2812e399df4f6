"""Expert weights in fp32 from any storage: the dequantization of one bank's rows, by the storage its dtype names
(:func:`~diffusers_magi2.moe.expert_formats.storage_of`).

bf16/fp16/fp32 banks are upcast (exact); FP8 banks are ``q * scale[n]`` (:mod:`.expert_storage_fp8`); int4 banks are
``NF4[c] * scale[k // G, n]`` (:mod:`.expert_storage_int4`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .expert_formats import storage_of


__all__ = ["dequantize_bank", "dequantize_expert"]


def dequantize_expert(weight: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """One expert's matrix ``[K, N]`` in fp32 (int4: ``weight [K, N/2]``, ``scale [K/G, N]``; FP8: ``scale [N]``)."""
    return dequantize_bank(weight, scale)


def dequantize_bank(
    weight: torch.Tensor, scale: Optional[torch.Tensor], *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Stored rows ``[..., K, N']`` (e.g. one head's experts ``[E, K, N']``) in fp32 ``[..., K, N]``; int4 is
    written into ``out`` when given (a reused fp32 buffer of the result's shape)."""
    return storage_of((weight,), None if scale is None else (scale,)).dequantize(weight, scale, out=out)
