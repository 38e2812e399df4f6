"""Context-parallel plans and head layouts in one process (host arithmetic, no process group), and CPU FLOP counting.

The multi-rank exchanges are checked in ``test_cp_collectives.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.flop_counter import count_flops, register_cpu_sdpa_flop_formula
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from diffusers_magi2.parallel.context_parallel import balanced_token_counts, plan_sequence_shards, ulysses_head_layout
from diffusers_magi2.parallel.expert_parallel import ep_replica_layout, replica_token_parts


def test_sequence_plan_slices_tokens_and_segments():
    plan = plan_sequence_shards(16, 4, 2, segment_lengths=(5, 0, 8, 3), token_counts=(3, 6, 0, 7))
    assert plan.offsets == (0, 3, 9, 9, 16) and plan.start == 9 and plan.num_local_tokens == 0
    assert [plan.local_segment_lengths(r) for r in range(4)] == [(3, 0, 0, 0), (2, 0, 4, 0), (0,) * 4, (0, 0, 4, 3)]
    x = torch.arange(16.0).view(16, 1).expand(16, 9)
    assert plan.shard(x).shape == (0, 9)
    assert torch.equal(plan_sequence_shards(16, 4, 3, token_counts=(3, 6, 0, 7)).shard(x), x[9:])
    # balanced split: remainders go to the first ranks; more ranks than tokens leaves ranks empty
    assert balanced_token_counts(10, 4) == (3, 3, 2, 2)
    assert balanced_token_counts(2, 4) == (1, 1, 0, 0)
    assert plan_sequence_shards(10, 4, 1).token_counts == (3, 3, 2, 2)


def test_sequence_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"token_counts must be 2 non-negative ints summing to num_tokens=5"):
        plan_sequence_shards(5, 2, 0, token_counts=(2, 2))
    with pytest.raises(ValueError, match=r"token_counts\[1\] must be >= 0"):
        plan_sequence_shards(5, 2, 0, token_counts=(6, -1))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        plan_sequence_shards(5, 2, 2)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        plan_sequence_shards(5.0, 2, 0)
    with pytest.raises(ValueError, match=r"segment_lengths \[2, 2\] sum to 4, expected 5"):
        plan_sequence_shards(5, 2, 0, segment_lengths=(2, 2))
    with pytest.raises(ValueError, match="cannot shard a tensor with 4 rows"):
        plan_sequence_shards(5, 2, 0).shard(torch.zeros(4))


def test_ulysses_layout_pads_query_heads_and_replicates_kv_heads():
    # released preview: 24 q = 24 kv heads on 8 ranks, 3 each, no padding
    lay = ulysses_head_layout(24, 24, 8, 5)
    assert lay.local_query_heads == range(15, 18) and lay.local_kv_heads == range(15, 18)
    assert lay.widths() == (9,) * 8
    # h4 on 3 ranks: padded to 6; rank 2 owns only padding and receives nothing
    lay = ulysses_head_layout(4, 4, 3, 2)
    assert lay.padded_num_heads == 6 and lay.query_ranges == ((0, 2), (2, 4), (4, 4)) and lay.widths() == (6, 6, 0)
    # refiner 6 q / 2 kv on 4 ranks: kv head 0 goes to ranks 0 and 1, kv head 1 to ranks 1 and 2
    lay = ulysses_head_layout(6, 2, 4, 1)
    assert lay.kv_ranges == ((0, 1), (0, 2), (1, 2), (0, 0))
    assert lay.local_query_heads == range(2, 4) and lay.local_kv_index() == (0, 1)
    # h3's 6 q / 3 kv on 2 ranks: q 0-2 read kv 0, 0, 1 (not a plain GQA group, the caller expands)
    assert ulysses_head_layout(6, 3, 2, 0).local_kv_index() == (0, 0, 1)
    plan = plan_sequence_shards(10, 4, 1)
    assert lay.send_elements(plan, 8) == (3 * 8 * (4 + 6 + 4 + 0), 10 * 8 * 2)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        ulysses_head_layout(6, 4, 2, 0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        ulysses_head_layout(4, 4, 2, 2)


def test_ep_replica_layout_leaves_no_rank_idle():
    # 12 MoE heads on 8 ranks: EP 4 x 2 replicas gives every rank 3 real heads; EP 8 pads to 16 and idles two
    layouts = [ep_replica_layout(12, 8, 4, r) for r in range(8)]
    assert [lay.heads.local_head_start for lay in layouts] == [0, 3, 6, 9] * 2
    assert all(lay.heads.num_real_local_heads == 3 for lay in layouts)
    assert [lay.replica for lay in layouts] == [0] * 4 + [1] * 4
    assert [ep_replica_layout(12, 8, 8, r).heads.num_real_local_heads for r in range(8)] == [2] * 6 + [0] * 2
    with pytest.raises(
        ValueError, match=r"expert-parallel degree \(3\) must divide the context-parallel degree \(8\)"
    ):
        ep_replica_layout(12, 8, 3, 0)


def test_replica_token_parts_split_every_rank_evenly():
    parts = replica_token_parts((7, 0, 5, 3), 2)
    assert parts == ((4, 3), (0, 0), (2, 3), (2, 1))
    assert [sum(p[g] for p in parts) for g in range(2)] == [8, 7]  # remainders spread over the replicas
    parts = replica_token_parts((5, 5, 5, 1, 0, 2, 7, 3), 4)
    totals = [sum(p[g] for p in parts) for g in range(4)]
    assert sum(totals) == 28 and max(totals) - min(totals) <= 1
    assert replica_token_parts((4,), 1) == ((4,),)


def test_cpu_sdpa_flops_are_counted(monkeypatch):
    monkeypatch.delitem(flop_registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, raising=False)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v)
    assert plain.get_total_flops() == 0  # torch alone does not count the CPU kernel
    register_cpu_sdpa_flop_formula()
    register_cpu_sdpa_flop_formula()  # idempotent
    out, flops = count_flops(F.scaled_dot_product_attention, q, k, v)
    assert out.shape == (2, 3, 5, 8)
    assert flops == 2 * (2 * 2 * 3 * 5 * 7 * 8)  # q k^T and p v: 2·B·H·Lq·Lk·D each
    # grouped-query attention (3 key/value heads shared by 6 query heads): counted per query head
    q6 = torch.randn(2, 6, 5, 8)
    _, flops = count_flops(F.scaled_dot_product_attention, q6, k, v, enable_gqa=True)
    assert flops == 2 * (2 * 2 * 6 * 5 * 7 * 8)
