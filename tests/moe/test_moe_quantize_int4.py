"""The int4 expert format (``diffusers_magi2/moe/quantize_int4.py``): the NF4 levels, quantize/dequantize against a
computation written here, the packing layout, bad input, and the ``expert_dtype`` setting."""

from __future__ import annotations

import pytest
import torch
from helpers.int4_reference import plain_quantize_int4

from diffusers_magi2.moe.dequantize import dequantize_bank, dequantize_expert
from diffusers_magi2.moe.quantize import EXPERT_DTYPES, parse_expert_dtype
from diffusers_magi2.moe.quantize_int4 import (
    INT4_PACKED_DTYPE,
    INT4_SCALE_DTYPE,
    NF4_LEVELS,
    SCALE_RATIOS,
    SCALE_REFITS,
    dequantize_int4,
    quantize_int4,
)


def test_nf4_levels_are_normal_quantiles_normalised_to_one() -> None:
    """QLoRA's construction, evaluated here: Phi^-1 of 8 (positive) and 7 (negative) steps from 0.9677083 to 0.5."""
    p = 0.9677083
    positive = torch.special.ndtri(torch.linspace(p, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(p, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.sort(torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive])).values
    levels = levels / levels.max()
    assert len(NF4_LEVELS) == 16 and list(NF4_LEVELS) == sorted(NF4_LEVELS) and NF4_LEVELS[7] == 0.0
    assert torch.equal(torch.tensor(NF4_LEVELS, dtype=torch.float32), levels.float())


def _encode_group(values: list[float], scale: torch.Tensor) -> tuple[list[int], float, float]:
    """Codes (nearest level, the lower at a midpoint), bf16-rounded scale and squared error of one group."""
    s = float(scale.bfloat16())
    divisor = s if s > 0 else 1.0
    levels = [float(v) for v in torch.tensor(NF4_LEVELS)]  # as fp32
    codes = [min(range(16), key=lambda q: (abs(v / divisor - levels[q]), q)) for v in values]
    error = sum((levels[c] * s - v) ** 2 for c, v in zip(codes, values))
    return codes, s, error


def _expected(w: torch.Tensor, group: int):
    """Per (row, group, column), as loops: the scale of least squared error among amax * r and two least-squares
    refits of the chosen codes (the module docstring's rule)."""
    rows, k, n = w.shape
    levels = [float(v) for v in torch.tensor(NF4_LEVELS)]
    codes = torch.empty(rows, k, n, dtype=torch.int64)
    scales = torch.empty(rows, k // group, n, dtype=torch.bfloat16)
    for r in range(rows):
        for j in range(k // group):
            for c in range(n):
                values = w[r, j * group : (j + 1) * group, c].tolist()
                amax = torch.tensor(max(abs(v) for v in values))
                best = None
                for ratio in SCALE_RATIOS:
                    candidate = _encode_group(values, amax * ratio)
                    best = candidate if best is None or candidate[2] < best[2] else best
                for _ in range(SCALE_REFITS):
                    chosen = [levels[q] for q in best[0]]
                    norm = sum(v * v for v in chosen)
                    fit = sum(a * b for a, b in zip(chosen, values)) / norm if norm else 0.0
                    candidate = _encode_group(values, torch.tensor(fit) if fit > 0 else amax)
                    best = candidate if candidate[2] < best[2] else best
                codes[r, j * group : (j + 1) * group, c] = torch.tensor(best[0])
                scales[r, j, c] = best[1]
    return codes, scales


def test_quantize_and_dequantize_match_a_loop_and_the_packing_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 6, generator=gen) * torch.tensor([0.02, 1.0, 30.0]).view(3, 1, 1)
    w[1, :4, 2] = 0.0  # a zero group: scale 0, code of 0.0
    packed, scale = quantize_int4(w, group_size=4)
    assert (packed.dtype, packed.shape, scale.dtype, scale.shape) == (
        INT4_PACKED_DTYPE,
        (3, 8, 3),
        INT4_SCALE_DTYPE,
        (3, 2, 6),
    )
    codes, want_scale = _expected(w, 4)
    assert torch.equal(scale, want_scale) and scale[1, 0, 2] == 0
    for r, k, j in [(0, 0, 0), (1, 3, 1), (2, 7, 2), (1, 2, 1)]:  # byte (k, j) = c[k, 2j] | c[k, 2j+1] << 4
        byte = int(packed[r, k, j])
        assert (byte & 15, byte >> 4) == (int(codes[r, k, 2 * j]), int(codes[r, k, 2 * j + 1]))
    unpacked = torch.stack([packed & 15, packed >> 4], dim=-1).view(3, 8, 6).long()
    assert torch.equal(unpacked, codes)
    levels = torch.tensor(NF4_LEVELS)
    want = levels[codes] * want_scale.float().repeat_interleave(4, dim=1)
    got = dequantize_int4(packed, scale)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(dequantize_bank(packed, scale), want)
    assert torch.equal(dequantize_expert(packed[2], scale[2]), want[2])
    buffer = torch.full_like(want, float("nan"))
    assert dequantize_int4(packed, scale, out=buffer, chunk_rows=2) is buffer and torch.equal(buffer, want)
    # the scale search never does worse than the plain absmax scale (its first candidate), group by group
    plain_scale = w.abs().view(3, 2, 4, 6).amax(2).bfloat16().float().repeat_interleave(4, dim=1)
    divisor = torch.where(plain_scale > 0, plain_scale, torch.ones_like(plain_scale))
    plain = levels[(w / divisor).unsqueeze(-1).sub(levels).abs().argmin(-1)] * plain_scale
    group_error = lambda d: (d - w).square().view(3, 2, 4, 6).sum(2)  # noqa: E731
    assert (group_error(got) <= group_error(plain) * (1 + 1e-6)).all()


def test_quantize_equals_the_plain_bucketize_form_bit_for_bit_whatever_the_chunk_and_threads() -> None:
    """Against ``torch.bucketize`` over the midpoints and ``torch.where`` per candidate, on weights that sit exactly on
    midpoints and levels, repeat (ties between candidates), span 1e-30 to 1e30, or are zero groups."""
    gen = torch.Generator().manual_seed(1)
    levels = torch.tensor(NF4_LEVELS)
    midpoints = (levels[1:] + levels[:-1]) / 2
    w = torch.randn(6, 32, 40, generator=gen) * 0.02
    w[0, :, :8] = levels[torch.randint(0, 16, (32, 8), generator=gen)] * 0.5
    w[0, ::16, :8] = 0.5  # amax = 0.5 = s, kept (levels fit): W / s lands exactly on the levels and the midpoints
    w[0, 5::16, :8] = midpoints[torch.randint(0, 15, (2, 8), generator=gen)] * 0.5
    w[1, :, :8] = torch.randint(-2, 3, (32, 8), generator=gen).float()  # few values: equal errors across candidates
    w[2] *= torch.logspace(-30, 30, 40).view(1, 40)
    w[3, :16] = 0.0
    want = plain_quantize_int4(w, 16)
    threads = torch.get_num_threads()
    try:
        for num_threads, chunk_size in [(1, None), (1, 16 * 40), (1, 7 * 16 * 40), (2, 3 * 16 * 40)]:
            torch.set_num_threads(num_threads)
            got = quantize_int4(w, 16, chunk_size)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (num_threads, chunk_size)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(quantize_int4(w.bfloat16(), 8)[0], plain_quantize_int4(w.bfloat16(), 8)[0])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_naming_tensor_expert_row_and_column(value) -> None:
    w = torch.randn(8, 8, 4)
    w[5, 3, 1] = value
    match = (
        r"W_down holds a non-finite weight \(.+\) in expert 1 of head 1 \(row 5 of \[H\*E, K, N\]\), input row 3, "
        r"column 1: its int4 group scale"
    )
    with pytest.raises(ValueError, match=match):
        quantize_int4(w, 4, 8, name="W_down", num_experts=4)


@pytest.mark.parametrize(
    ("shape", "group", "match"),
    [
        ((2, 12, 4), 8, r"W_gate \[R, K=12, N=4\]: the int4 group size group_size=8 does not divide K=12"),
        ((2, 8, 5), 4, r"W_gate \[R, K=8, N=5\]: int4 codes are packed two per byte along N, which must be even"),
        ((2, 8, 4), 0, r"group_size \(the int4 group size\) must be a positive int"),
    ],
)
def test_a_shape_the_group_size_does_not_fit_is_refused_naming_the_tensor(shape, group, match) -> None:
    with pytest.raises(ValueError, match=match):
        quantize_int4(torch.zeros(shape), group, name="W_gate")


def test_quantize_refuses_what_is_not_a_float_bank() -> None:
    with pytest.raises(ValueError, match="3-D float expert bank"):
        quantize_int4(torch.zeros(4, 4), 2)
    with pytest.raises(ValueError, match="3-D float expert bank"):
        quantize_int4(torch.zeros(2, 4, 4, dtype=torch.int32), 2)


@pytest.mark.parametrize("bad", ["int8", "nf4", "uint4", torch.uint8, 4])
def test_expert_dtype_values_outside_the_allowed_set_get_one_error_listing_them(bad) -> None:
    assert EXPERT_DTYPES == (None, "float8_e4m3fn", "int4")
    assert parse_expert_dtype("int4") == "int4"
    with pytest.raises(ValueError, match=r"expert_dtype must be one of \(None, 'float8_e4m3fn', 'int4'\); got"):
        parse_expert_dtype(bad)
