"""The int4 dequantization kernel (interpreted on CPU via ``TRITON_INTERPRET=1`` from conftest) against the torch
dequantization it twins: the same values, rounded once to the output dtype."""

from __future__ import annotations

import pytest
import torch

from diffusers_magi2.moe import experts_triton
from diffusers_magi2.moe.dequantize_triton import dequantize_int4_triton
from diffusers_magi2.moe.quantize_int4 import dequantize_int4, quantize_int4


pytestmark = pytest.mark.skipif(
    not experts_triton.INTERPRET and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)",
)


@pytest.mark.parametrize(
    ("shape", "group"),
    [
        ((3, 64, 48), 16),  # N not a multiple of the 128-column tile: masked columns
        ((2, 96, 256), 32),  # two column tiles, three groups
        ((1, 24, 8), 8),  # a group of 8 rows, one step per group
    ],
)
def test_triton_dequantization_equals_the_torch_one_rounded_once(shape, group) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.05
    weight[0, :group, :2] = 0.0  # a zero group: scale 0, code of 0.0
    codes, scale = quantize_int4(weight, group)
    want = dequantize_int4(codes, scale)  # fp32, NF4[c] * s exactly
    assert torch.equal(dequantize_int4_triton(codes, scale), want)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.full(shape, float("nan"), dtype=dtype)
        assert dequantize_int4_triton(codes, scale, out=out) is out
        assert torch.equal(out, want.to(dtype))  # rounded once, to nearest even
    # views of a head's rows (as the expert launcher passes them)
    assert torch.equal(dequantize_int4_triton(codes[1:], scale[1:]), want[1:])


def test_triton_dequantization_bad_input() -> None:
    codes, scale = quantize_int4(torch.randn(2, 32, 16), 16)
    with pytest.raises(ValueError, match=r"must be \[R, K, N/2\], \[R, K/G, N\] and \[R, K, N\]"):
        dequantize_int4_triton(codes, scale[:, :, :8])
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        dequantize_int4_triton(codes, scale, out=torch.empty(2, 32, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="packed must be uint8"):
        dequantize_int4_triton(codes.float(), scale)
    with pytest.raises(ValueError, match="contiguous last dims"):
        dequantize_int4_triton(codes, scale, out=torch.empty(2, 16, 32).transpose(1, 2))
