"""4-bit routed experts (``expert_dtype="int4"``): NF4 codes in groups along the contraction dim, two per byte.

Every expert matrix ``W [K, N]`` (``W_gate``/``W_up``: ``[Dh, De]``, ``W_down``: ``[De, Dh]``, used as ``x @ W``) is
cut into groups of ``G`` consecutive rows along ``K``; per (expert ``g``, group ``j``, output channel ``n``) one bf16
scale ``s`` and per weight a 4-bit code ``c``::

    W[g, k, n] ~= NF4[c[g, k, n]] * s[g, k // G, n],      c = the NF4 level nearest to W / s,

``s`` being, of the candidates ``bf16(a r)`` (``a`` the group's ``max |W|``, ``r`` in :data:`SCALE_RATIOS`) and then
:data:`SCALE_REFITS` least-squares refits ``bf16(<W, L> / <L, L>)`` of the codes chosen (``L = NF4[c]``), the one
with the least ``sum_k (L s - W)^2`` over the group (ties: the earlier candidate; a zero group keeps ``s = 0`` and
the code of 0.0; at a midpoint the lower level). NF4 (QLoRA, Dettmers et al. 2023) has 16 levels in ``[-1, 1]``, ascending,
placed at quantiles of the standard normal: ``Phi^-1`` of 8 equal steps from ``p = 0.9677083`` to 0.5 for the
positive half and 7 for the negative half, 0.0 exact, normalised to ``max = 1`` (:data:`NF4_LEVELS`). The
dequantised weight is ``NF4[c] * s`` computed in fp32 (both factors upcast exactly), which is what the torch paths
and the reference use.

Stored tensors (``R = H*E`` rows of flattened (head, expert), first in every tensor, so expert parallelism slices
them as it slices the bf16 banks)::

    W_gate, W_up        uint8 [R, Dh, De/2]       codes, two per byte along N:
    W_down              uint8 [R, De, Dh/2]           byte (k, j) = c[k, 2j] | c[k, 2j+1] << 4
    W_gate_group_scale  bf16  [R, Dh/G, De]
    W_up_group_scale    bf16  [R, Dh/G, De]
    W_down_group_scale  bf16  [R, De/G, Dh]

Rows stay contiguous along ``N`` (coalesced loads, and a dequantised tile is a plain reshape of the unpacked
nibbles). The scales are not fp32 islands (they are bf16 by format and are named apart from the FP8 ones); the
model config records ``expert_int4_group_size`` and ``expert_int4_packing`` (:data:`INT4_PACKING`).
Bytes per weight: ``4 + 16 / G`` bits (4.125 at the default ``G = 128``: 0.258 of bf16).

Why NF4 at ``G = 128`` with the scale search (``tests/benchmarks/bench_int4_format.py``: ``x @ W`` rel-L2 at the
released ``K``, normal | Student-t(5) weights): at the same bytes NF4 levels err less than uniform int4 levels
(g128: 0.090 | 0.112 against 0.105-0.118 | 0.152-0.170), NF4 at g128 errs less than uniform int4 at g64
(0.099-0.108 | 0.134-0.145) with 1.7 GB less at full size, g64 (0.086 | 0.099) would leave no slack in the 80 GB
plan (README "One GPU"), and the search lowers the error of the plain ``amax`` scale (0.095 | 0.118) for free at
inference (it only changes which scale is stored).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from .quantize import raise_non_finite_weight


__all__ = [
    "INT4_GROUP_SIZE",
    "INT4_PACKED_DTYPE",
    "INT4_PACKING",
    "INT4_SCALE_DTYPE",
    "INT4_SCALE_NAMES",
    "NF4_LEVELS",
    "SCALE_RATIOS",
    "SCALE_REFITS",
    "check_int4_bank_shape",
    "check_int4_banks",
    "dequantize_int4",
    "int4_shapes",
    "quantize_int4",
]

#: default group length along the contraction dim
INT4_GROUP_SIZE = 128
INT4_PACKED_DTYPE = torch.uint8
INT4_SCALE_DTYPE = torch.bfloat16
#: the code and packing of this format (NF4 levels, two codes per byte along N, the even column low), as the model
#: config records it
INT4_PACKING = "nf4_pairs_along_n"
#: names of the group-scale buffers beside ``W_gate``/``W_up``/``W_down``
INT4_SCALE_NAMES = ("W_gate_group_scale", "W_up_group_scale", "W_down_group_scale")
#: the 16 NF4 levels, ascending (the module docstring's construction, evaluated in float64 and rounded to fp32)
NF4_LEVELS = (
    -1.0,
    -0.6961929202079773,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444135189056396,
    -0.18477343022823334,
    -0.09104999154806137,
    0.0,
    0.07958032935857773,
    0.16093017160892487,
    0.24611228704452515,
    0.33791518211364746,
    0.44070979952812195,
    0.5626169443130493,
    0.7229567170143127,
    1.0,
)
#: candidate scales ``amax * r`` per group (the first wins ties), then least-squares refits of the chosen codes
SCALE_RATIOS = (1.0, 0.9, 0.8)
SCALE_REFITS = 2
# the two levels of every byte value (low nibble first), for the byte-wise lookup of dequantize_int4
_BYTE_LEVELS = [(NF4_LEVELS[b & 15], NF4_LEVELS[b >> 4]) for b in range(256)]


def int4_shapes(shape: tuple[int, int, int], group_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(packed, scale)`` shapes of a bank ``[R, K, N]``: ``[R, K, N/2]`` and ``[R, K/G, N]``."""
    rows, k, n = shape
    return (rows, k, n // 2), (rows, k // group_size, n)


def check_int4_bank_shape(shape, group_size: int, name: str, key: str = "group_size") -> None:
    """Raise unless a bank ``[R, K, N]`` can be stored at ``group_size``: ``G`` divides ``K`` and ``N`` is even.

    Args:
        shape: the bank's ``[R, K, N]``.
        group_size: ``G``.
        name: the tensor's name, for the message.
        key: the setting that holds ``G`` (e.g. the model config's ``expert_int4_group_size``), for the message.

    Raises:
        ValueError: naming the tensor, its ``K`` or ``N`` and the group size setting.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{key} (the int4 group size) must be a positive int; got {group_size!r}")
    _, k, n = shape
    if k % group_size:
        raise ValueError(
            f"{name} [R, K={k}, N={n}]: the int4 group size {key}={group_size} does not divide K={k} (groups run "
            f"along the contraction dim); pick a group size that divides {k}"
        )
    if n % 2:
        raise ValueError(f"{name} [R, K={k}, N={n}]: int4 codes are packed two per byte along N, which must be even")


def check_int4_banks(head_dim: int, expert_dim: int, group_size: int, key: str = "group_size") -> None:
    """:func:`check_int4_bank_shape` for the three banks of a MoE core (``W_gate``/``W_up [R, Dh, De]``,
    ``W_down [R, De, Dh]``).

    Raises:
        ValueError: as :func:`check_int4_bank_shape`.
    """
    check_int4_bank_shape((0, head_dim, expert_dim), group_size, "W_gate/W_up", key)
    check_int4_bank_shape((0, expert_dim, head_dim), group_size, "W_down", key)


def _encode(groups: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, midpoints: torch.Tensor):
    """Codes of ``groups [r, K/G, G, N]`` at ``scale [r, K/G, 1, N]`` (rounded to bf16 first), the rounded scale
    (fp32) and each group's squared error."""
    s = scale.to(INT4_SCALE_DTYPE).float()
    codes = torch.bucketize(groups / torch.where(s > 0, s, torch.ones_like(s)), midpoints, out_int32=True)
    error = levels[codes].mul_(s).sub_(groups).square_().sum(dim=2, keepdim=True)
    return codes, s, error


def _keep_better(best: list, candidate: tuple) -> None:
    """Per group, ``best`` (codes, scale, error) takes ``candidate`` where its error is strictly lower."""
    better = candidate[2] < best[2]
    for i, (old, new) in enumerate(zip(best, candidate)):
        best[i] = torch.where(better, new, old)


@torch.no_grad()
def quantize_int4(
    weight: torch.Tensor,
    group_size: int = INT4_GROUP_SIZE,
    chunk_rows: int = 16,
    *,
    name: str = "expert bank",
    first_row: int = 0,
    num_experts: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an expert bank ``[R, K, N]`` to ``(codes [R, K, N/2] uint8, scale [R, K/G, N] bf16)`` (module
    docstring), ``chunk_rows`` experts at a time (fp32 temporaries of that size).

    Args:
        weight: the bank, any float dtype.
        group_size: ``G``, rows of ``K`` per scale.
        chunk_rows: experts per step.
        name: the tensor's name, for the error message.
        first_row: the bank row of ``weight[0]`` (e.g. an expert-parallel rank's first row), for the message.
        num_experts: experts per head ``E``; the message then names row ``g`` as head ``g // E``, expert ``g % E``.

    Raises:
        ValueError: ``weight`` is not a 3-D floating-point tensor, ``G`` does not divide ``K`` or ``N`` is odd
            (naming the tensor), or it holds a NaN or inf (naming the tensor, the expert, the row and the column).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not weight.is_floating_point():
        shape = getattr(weight, "shape", weight)
        raise ValueError(f"quantize_int4 expects a 3-D float expert bank [R, K, N]; got {shape} for {name}")
    check_int4_bank_shape(weight.shape, group_size, name)
    rows, k, n = weight.shape
    packed_shape, scale_shape = int4_shapes(weight.shape, group_size)
    packed = torch.empty(packed_shape, dtype=INT4_PACKED_DTYPE, device=weight.device)
    scale = torch.empty(scale_shape, dtype=INT4_SCALE_DTYPE, device=weight.device)
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=weight.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    has_values = not is_fake(weight)  # a fake tensor (memory planning) holds no values to check
    for start in range(0, rows, chunk_rows):
        w = weight[start : start + chunk_rows].to(torch.float32)
        groups = w.view(w.shape[0], k // group_size, group_size, n)
        amax = groups.abs().amax(dim=2, keepdim=True)
        if has_values and not torch.isfinite(amax).all():
            consequence = "its int4 group scale, and so that group of the output column"
            raise_non_finite_weight(w, name, first_row + start, num_experts, consequence)
        best = list(_encode(groups, amax, levels, midpoints))
        for ratio in SCALE_RATIOS[1:]:
            _keep_better(best, _encode(groups, amax * ratio, levels, midpoints))
        for _ in range(SCALE_REFITS):  # least-squares scale of the chosen codes: <W, L> / <L, L>
            chosen = levels[best[0]]
            fit = (chosen * groups).sum(dim=2, keepdim=True) / (chosen * chosen).sum(dim=2, keepdim=True)
            _keep_better(best, _encode(groups, torch.where(fit > 0, fit, amax), levels, midpoints))
        codes = best[0].to(INT4_PACKED_DTYPE).view(w.shape[0], k, n // 2, 2)
        packed[start : start + chunk_rows] = codes[..., 0] | (codes[..., 1] << 4)
        scale[start : start + chunk_rows] = best[1].squeeze(2)
    return packed, scale


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, *, out: Optional[torch.Tensor] = None, chunk_rows: int = 16
) -> torch.Tensor:
    """``NF4[c] * s`` in fp32: codes ``[..., K, N/2]`` uint8 and scales ``[..., K/G, N]`` -> ``[..., K, N]``.

    Args:
        packed: the codes (module docstring), e.g. one expert ``[K, N/2]`` or a head's bank ``[E, K, N/2]``.
        scale: their group scales (bf16 or fp16).
        out: optional contiguous fp32 buffer of the result's shape, written in place (reused by the torch paths).
        chunk_rows: leading-dim rows per step (bounds the index temporary to ``chunk_rows`` matrices).

    Returns:
        ``out`` (or a new fp32 tensor).
    """
    *lead, k, half = packed.shape
    n, groups = 2 * half, scale.shape[-2]
    if out is None:
        out = torch.empty(*lead, k, n, dtype=torch.float32, device=packed.device)
    byte_levels = torch.tensor(_BYTE_LEVELS, dtype=torch.float32, device=packed.device)  # [256, 2]
    codes, scales, result = packed.reshape(-1, k, half), scale.reshape(-1, groups, n), out.view(-1, k, n)
    for start in range(0, codes.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        block = result[rows]
        torch.index_select(byte_levels, 0, codes[rows].reshape(-1).to(torch.int32), out=block.view(-1, 2))
        block.view(-1, groups, k // groups, n).mul_(scales[rows].unsqueeze(2))
    return out
