"""Storage dtypes of the routed experts (``expert_dtype``), and FP8 (``float8_e4m3fn``) weight-only storage.

``expert_dtype`` is ``None`` (the experts keep the load dtype), ``"float8_e4m3fn"`` (below) or ``"int4"`` (4-bit
NF4 codes with group scales, :mod:`.quantize_int4`).

FP8: every expert matrix ``W [K, N]`` (``W_gate``/``W_up``: ``[Dh, De]``, ``W_down``: ``[De, Dh]``, used as
``x @ W``) is stored as ``q = round_e4m3(W / s)`` with one fp32 scale per (expert, output channel):

    s[g, n] = max_k |W[g, k, n]| / 448,        W ~= q * s,

448 being the largest finite e4m3 value (a column of zeros keeps ``s = 0`` and ``q = 0``). The scales sit beside
the weights as ``W_gate_scale [H*E, De]``, ``W_up_scale [H*E, De]``, ``W_down_scale [H*E, Dh]``. Activations,
accumulation and the other rounding points are unchanged; the hidden activation (rounded to the ``W_down`` dtype
with bf16/fp32 experts) is rounded to the activation dtype instead (so too with int4 experts).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch._subclasses.fake_tensor import is_fake


__all__ = [
    "EXPERT_DTYPES",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_SCALE_NAMES",
    "INT4",
    "parse_expert_dtype",
    "quantize_fp8",
    "raise_non_finite_weight",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: the ``expert_dtype`` of 4-bit routed experts (:mod:`.quantize_int4`)
INT4 = "int4"
#: Allowed values of ``expert_dtype``: ``None`` (the experts keep the load dtype), FP8 e4m3, or 4-bit.
EXPERT_DTYPES = (None, "float8_e4m3fn", INT4)
#: names of the scale buffers beside ``W_gate``/``W_up``/``W_down`` (fp32 islands of the models).
FP8_SCALE_NAMES = ("W_gate_scale", "W_up_scale", "W_down_scale")


def parse_expert_dtype(expert_dtype: Union[None, str, torch.dtype]) -> Union[None, torch.dtype, str]:
    """``None``, ``torch.float8_e4m3fn`` or ``"int4"`` for an ``expert_dtype`` setting.

    Raises:
        ValueError: any other value (the message lists the allowed ones).
    """
    if expert_dtype is None or expert_dtype is FP8_DTYPE or expert_dtype == INT4:
        return expert_dtype
    if isinstance(expert_dtype, str) and expert_dtype.removeprefix("torch.") == "float8_e4m3fn":
        return FP8_DTYPE
    raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}; got {expert_dtype!r}")


@torch.no_grad()
def quantize_fp8(
    weight: torch.Tensor,
    chunk_rows: int = 64,
    *,
    name: str = "expert bank",
    first_row: int = 0,
    num_experts: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an expert bank ``[R, K, N]`` to ``(q [R, K, N] float8_e4m3fn, scale [R, N] float32)``.

    ``chunk_rows`` experts at a time (small fp32 temporaries).

    Args:
        name: the tensor's name, for the error message.
        first_row: the bank row of ``weight[0]`` (e.g. an expert-parallel rank's first row), for the message.
        num_experts: experts per head ``E``; the message then names row ``g`` as head ``g // E``, expert ``g % E``.

    Raises:
        ValueError: ``weight`` is not a 3-D floating-point tensor, or holds a NaN or inf (naming the tensor, the
            expert and the output column: its scale, and so the whole column, would be NaN/inf).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not weight.is_floating_point():
        shape = getattr(weight, "shape", weight)
        raise ValueError(f"quantize_fp8 expects a 3-D float expert bank [R, K, N]; got {shape}")
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], weight.shape[2], dtype=torch.float32, device=weight.device)
    has_values = not is_fake(weight)  # a fake tensor (memory planning) holds no values to check
    for start in range(0, weight.shape[0], chunk_rows):
        w = weight[start : start + chunk_rows].to(torch.float32)
        s = w.abs().amax(dim=1) / FP8_MAX
        if has_values and not torch.isfinite(s).all():
            raise_non_finite_weight(
                w, name, first_row + start, num_experts, "its FP8 scale, and so that whole output column"
            )
        divisor = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)
        q[start : start + chunk_rows] = (w / divisor).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[start : start + chunk_rows] = s
    return q, scale


def raise_non_finite_weight(
    w: torch.Tensor, name: str, first_row: int, num_experts: Optional[int], consequence: str
) -> None:
    """ValueError naming the first non-finite element of the chunk ``w [r, K, N]`` (bank row ``first_row``) and
    what it would poison (``consequence``, e.g. ``"its FP8 scale, and so that whole output column"``)."""
    r, k, n = (int(i) for i in (~torch.isfinite(w)).nonzero()[0])
    row = first_row + r
    value = w[r, k, n].item()
    where = f"expert row {row}" if not num_experts else f"expert {row % num_experts} of head {row // num_experts}"
    raise ValueError(
        f"{name} holds a non-finite weight ({value}) in {where} (row {row} of [H*E, K, N]), input row {k}, "
        f"column {n}: {consequence}, would be {value}; repair or re-export the checkpoint (only finite weights "
        "can be quantized)"
    )
