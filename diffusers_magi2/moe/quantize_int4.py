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

How it runs (``tests/benchmarks/bench_int4_quantize.py`` times it against the plain vectorised form,
``tests/helpers/int4_reference.py``): whole ``[G, N]`` slabs of (expert, group) go through preallocated fp32/int32
buffers a cache-sized chunk at a time, with in-place ops, on the bank's device. The code of ``x = W / s`` needs no
search: ``key = round(x T + 2 T)`` (``T = 16``; ``x`` clamped to ``[-2, 2]``, where the codes are those of
``+-2``) is exact (``x T`` is, and adding ``2^23`` rounds to the integer, read back from the fp32 bits); a bin of
width ``1 / T`` holds at most one midpoint and none on its edge, so ``code = (midpoints below the bin) + (x > the
bin's midpoint)``, which is ``torch.bucketize(x, midpoints)``. The errors are summed by the plain form's ops over
rows of the same width ``N``, so the codes and scales are that form's bit for bit, whatever the chunk or thread
count, on one device type (a GPU's sums round differently).
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


# the key lookup of quantize_int4 (module docstring, "How it runs")
_KEY_SCALE = 16  # T: bins of 1/16 < the least gap between NF4 midpoints (0.080)
_MAGIC = float(2**23)  # fp32 x + 2^23, for 0 <= x < 2^22, holds round(x) in its low mantissa bits
_MAGIC_BITS = 0x4B000000  # the int32 bits of 2^23
_NO_MIDPOINT = 4.0  # above every clamped x


def _key_tables() -> tuple[torch.Tensor, ...]:
    """``(midpoint per bin, code per (bin, above), level per (bin, above))`` of the key lookup (CPU; checked)."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    midpoints = ((levels[1:] + levels[:-1]) / 2).tolist()
    bins = 4 * _KEY_SCALE + 1  # keys 0 .. 4T for x in [-2, 2]
    lower = [(key - 0.5) / _KEY_SCALE - 2 for key in range(bins)]  # bin key: [lower, lower + 1/T] (exact)
    threshold = [_NO_MIDPOINT] * bins
    for m in midpoints:
        key = round((m + 2) * _KEY_SCALE)
        if threshold[key] != _NO_MIDPOINT or not lower[key] < m < lower[key] + 1 / _KEY_SCALE:
            raise RuntimeError("NF4 key tables: a bin holds two midpoints or one on its edge")  # pragma: no cover
        threshold[key] = m
    codes = [min(15, sum(m < lo for m in midpoints) + above) for lo in lower for above in (0, 1)]
    return (
        torch.tensor(threshold, dtype=torch.float32),
        torch.tensor(codes, dtype=torch.int32),
        levels[torch.tensor(codes)],
    )


_KEY_TABLES = _key_tables()


def _default_chunk(device: torch.device) -> int:
    """Weights per step: cache-sized per CPU thread, large on an accelerator."""
    return 1 << 26 if device.type != "cpu" else (1 << 17) * max(1, torch.get_num_threads())


class _Int4Encoder:
    """The buffers of one :func:`quantize_int4` call (eight of ``numel``) and the steps on a chunk ``[S, G, N]``."""

    _FLOAT = ("w", "x", "key", "above", "level")  # the chunk, W / s (then products), keys, bins' tests, levels
    _INT = ("index", "best", "delta")  # (bin, above) index of each code, the best so far, scratch

    def __init__(self, numel: int, device: torch.device) -> None:
        self.buffers = {name: torch.empty(numel, dtype=torch.float32, device=device) for name in self._FLOAT}
        self.buffers.update({name: torch.empty(numel, dtype=torch.int32, device=device) for name in self._INT})
        self.threshold, self.codes, self.levels = (t.to(device) for t in _KEY_TABLES)
        self.shape = None

    def load(self, block: torch.Tensor) -> torch.Tensor:
        """Copy the chunk ``block [S, G, N]`` in (as fp32) and return its ``max |W|`` per group ``[S, 1, N]``."""
        if block.shape != self.shape:  # flat views ("name") and chunk-shaped ones ("name_"), once per shape
            self.shape, numel = block.shape, block.numel()
            for name, buffer in self.buffers.items():
                setattr(self, name, buffer[:numel])
                setattr(self, name + "_", buffer[:numel].view(block.shape))
        self.w_.copy_(block)
        return torch.abs(self.w_, out=self.x_).amax(dim=1, keepdim=True)

    def encode(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bf16-rounded scale, squared error)`` per group at ``scale [S, 1, N]``; leaves the (bin, above) index of
        every weight's code in ``self.index``."""
        s = scale.to(INT4_SCALE_DTYPE).float()
        torch.div(self.w_, torch.where(s > 0, s, torch.ones_like(s)), out=self.x_).clamp_(-2.0, 2.0)
        torch.mul(self.x, _KEY_SCALE, out=self.key).add_(_MAGIC + 2 * _KEY_SCALE)  # round(x T + 2T) + 2^23, exactly
        bins = torch.sub(self.key.view(torch.int32), _MAGIC_BITS, out=self.delta)
        torch.gt(self.x, torch.index_select(self.threshold, 0, bins, out=self.above), out=self.above)
        self.above.sub_(_MAGIC).add_(self.key, alpha=2)  # 2 key + above + 2^23, exactly
        torch.sub(self.above.view(torch.int32), _MAGIC_BITS, out=self.index)
        torch.index_select(self.levels, 0, self.index, out=self.level)
        return s, self.level_.mul_(s).sub_(self.w_).square_().sum(dim=1, keepdim=True)

    def keep_better(self, best: list, scale: torch.Tensor, error: torch.Tensor) -> None:
        """Per group, ``best`` (scale, error) and the codes in ``self.best`` take the last encoding's where its
        error is strictly lower (``best`` empty: take it)."""
        if not best:
            best += [scale, error]
            self.best.copy_(self.index)
            return
        better = error < best[1]
        best[0], best[1] = torch.where(better, scale, best[0]), torch.where(better, error, best[1])
        torch.sub(self.index, self.best, out=self.delta)
        self.delta_.mul_(better)
        self.best.add_(self.delta)

    def quantize(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [S, G, N] int32, scale [S, 1, N] bf16)`` of the loaded chunk (module docstring)."""
        best = []
        for ratio in SCALE_RATIOS:
            self.keep_better(best, *self.encode(amax * ratio))
        for _ in range(SCALE_REFITS):  # least-squares scale of the chosen codes: <W, L> / <L, L>
            chosen = torch.index_select(self.levels, 0, self.best, out=self.level).view(self.shape)
            fit = torch.mul(chosen, self.w_, out=self.x_).sum(dim=1, keepdim=True)
            fit = fit / torch.mul(chosen, chosen, out=self.x_).sum(dim=1, keepdim=True)
            self.keep_better(best, *self.encode(torch.where(fit > 0, fit, amax)))
        codes = torch.index_select(self.codes, 0, self.best, out=self.delta)
        return codes.view(self.shape), best[0].to(INT4_SCALE_DTYPE)


@torch.no_grad()
def quantize_int4(
    weight: torch.Tensor,
    group_size: int = INT4_GROUP_SIZE,
    chunk_size: Optional[int] = None,
    *,
    name: str = "expert bank",
    first_row: int = 0,
    num_experts: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an expert bank ``[R, K, N]`` to ``(codes [R, K, N/2] uint8, scale [R, K/G, N] bf16)`` (module
    docstring) on ``weight``'s device, about ``chunk_size`` weights at a time in whole groups (eight fp32/int32
    buffers of that size).

    The result does not depend on ``chunk_size`` or the thread count; it equals the plain vectorised form of the
    rule (``torch.bucketize`` over the NF4 midpoints, then the errors) bit for bit on the same device type (a GPU's
    sums may round differently, and a group at a near tie may then keep another scale).

    Args:
        weight: the bank, any float dtype.
        group_size: ``G``, rows of ``K`` per scale.
        chunk_size: weights per step (rounded to whole ``[G, N]`` slabs); default: ``2^17`` per
            CPU thread, ``2^26`` on an accelerator.
        name: the tensor's name, for the error message.
        first_row: the bank row of ``weight[0]`` (e.g. an expert-parallel rank's first row), for the message.
        num_experts: experts per head ``E``; the message then names row ``g`` as head ``g // E``, expert ``g % E``.

    Raises:
        ValueError: ``weight`` is not a 3-D floating-point tensor, ``G`` does not divide ``K`` or ``N`` is odd
            (naming the tensor), ``chunk_size`` is not a positive int, or it holds a NaN or inf (naming the tensor,
            the expert, the row and the column).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not weight.is_floating_point():
        shape = getattr(weight, "shape", weight)
        raise ValueError(f"quantize_int4 expects a 3-D float expert bank [R, K, N]; got {shape} for {name}")
    check_int4_bank_shape(weight.shape, group_size, name)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (weights per step); got {chunk_size!r}")
    rows, k, n = weight.shape
    packed_shape, scale_shape = int4_shapes(weight.shape, group_size)
    packed = torch.empty(packed_shape, dtype=INT4_PACKED_DTYPE, device=weight.device)
    scale = torch.empty(scale_shape, dtype=INT4_SCALE_DTYPE, device=weight.device)
    if is_fake(weight) or weight.numel() == 0:  # a fake tensor (memory planning) holds no values
        return packed, scale
    groups_per_row, slabs = k // group_size, rows * (k // group_size)
    chunk = chunk_size or _default_chunk(weight.device)
    per_step = max(1, chunk // (group_size * n))  # whole slabs: the sums' rounding depends on the row width
    source = weight.reshape(slabs, group_size, n)  # (expert, group) slabs: a view of a contiguous bank
    codes_out = packed.view(slabs, group_size, n // 2)
    scales_out = scale.view(slabs, n)
    encoder = _Int4Encoder(min(slabs, per_step) * group_size * n, weight.device)
    for first in range(0, slabs, per_step):
        amax = encoder.load(source[first : first + per_step])
        if not bool(torch.isfinite(amax).all()):
            rows_in = slice(first // groups_per_row, (first + amax.shape[0] - 1) // groups_per_row + 1)
            consequence = "its int4 group scale, and so that group of the output column"
            raise_non_finite_weight(weight[rows_in].float(), name, first_row + rows_in.start, num_experts, consequence)
        codes, best_scale = encoder.quantize(amax)
        pairs = codes.view(amax.shape[0], group_size, n // 2, 2)
        codes_out[first : first + per_step] = torch.add(pairs[..., 0], pairs[..., 1], alpha=16)
        scales_out[first : first + per_step] = best_scale.squeeze(1)
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
