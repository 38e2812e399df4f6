"""Packing a block into one flat buffer (offsets aligned, a self-overlapping tensor refused) and the pinned arenas'
rounding at the released sizes."""

from __future__ import annotations

import pytest
import torch

from diffusers_magi2.models.weight_streaming_layout import (
    ALIGNMENT,
    block_layout,
    next_pow2,
    pinned_bytes,
    plan_pinned_arenas,
)


def test_each_tensor_sits_at_an_aligned_offset_and_views_its_own_bytes():
    block = torch.nn.Module()
    block.weight = torch.nn.Parameter(torch.arange(15, dtype=torch.bfloat16).view(3, 5).t())  # strides (1, 5)
    block.register_buffer("codes", torch.arange(7, dtype=torch.uint8))
    block.tied = block.weight  # one storage, packed once
    layout = block_layout(block, 0)
    assert [(e.offset, e.nbytes) for e in layout.entries] == [(0, 30), (ALIGNMENT, 7)]
    assert layout.nbytes == 2 * ALIGNMENT
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for e in layout.entries:
        e.view(flat).copy_(e.tensor.data)
    assert torch.equal(layout.entries[0].view(flat), block.weight) and layout.entries[0].view(flat).stride() == (1, 5)
    assert torch.equal(flat[ALIGNMENT : ALIGNMENT + 7], block.codes)
    block.register_buffer("broadcast", torch.zeros(1).expand(4))
    with pytest.raises(ValueError, match=r"block 3: a tensor of shape \(4,\) overlaps itself; it cannot be packed"):
        block_layout(block, 3)


def test_pinned_arenas_keep_the_power_of_two_rounding_small_at_the_released_sizes():
    # the released preview's blocks with int4 experts (GB): 2 dense multimodal, 36 MoE, 2 dense multimodal
    sizes = [int(0.26e9)] * 2 + [int(1.69e9)] * 36 + [int(0.26e9)] * 2
    groups = plan_pinned_arenas(sizes)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    per_block = sum(next_pow2(n) for n in sizes)
    assert per_block > 1.15 * sum(sizes)  # pinning block by block: > 15 % rounding
    assert pinned_bytes(sizes) == sum(next_pow2(sum(sizes[i] for i in g)) for g in groups) <= 1.1 * sum(sizes)
