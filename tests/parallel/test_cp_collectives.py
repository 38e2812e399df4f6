"""Context-parallel exchanges on N = 1..4 gloo ranks equal the single-process computation.

One call on N gloo ranks per N (cached across the tests) runs ``cp_workers.cp_worker``. Head counts are
those of the tiny fixtures (4/4, 6/3 and 6/2 query/kv heads); token splits are balanced and uneven with a
zero-token rank; the packed sequence has four samples, one of them empty. Ulysses attention with sinks is fp32,
so the only difference to one process is the order of the softmax sums: ≤ 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from helpers.cp_workers import (
    EP_DEGREES,
    HEAD_CONFIGS,
    NUM_TOKENS,
    SEGMENTS,
    TOKEN_SPLITS,
    attention_inputs,
    attention_reference,
    cp_worker,
    loss_weights,
    standin_inputs,
    standin_reference,
    standin_weights,
)
from helpers.ep_spawn_utils import run_on_ranks

from diffusers_magi2.models.attention_magi2 import magi2_attention_with_sinks
from diffusers_magi2.parallel.context_parallel import plan_sequence_shards


pytestmark = pytest.mark.distributed


WORLDS = [1, 2, 3, 4]
ATOL = 1e-6

_RESULTS: dict = {}


def _results(world: int) -> list:
    if world not in _RESULTS:
        _RESULTS[world] = run_on_ranks(cp_worker, world, deadline_s=240.0)
    return _RESULTS[world]


def _plans(world, split, segments=SEGMENTS):
    return [plan_sequence_shards(NUM_TOKENS, world, r, segments, split) for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_ulysses_attention_with_segments_and_sinks_equals_one_process(world):
    results = _results(world)
    for hq, hkv in HEAD_CONFIGS:
        ref = attention_reference(hq, hkv)
        for split in TOKEN_SPLITS[world]:
            for rank, plan in enumerate(_plans(world, split)):
                res = results[rank]["ulysses"]
                torch.testing.assert_close(res[("attn", hq, hkv, split)], plan.shard(ref), atol=ATOL, rtol=0)
                torch.testing.assert_close(res[("full", hq, hkv, split)], ref, atol=ATOL, rtol=0)
                # one fused q/k/v exchange in, one out (the final gather is an all-gather, not counted)
                assert res[("calls", hq, hkv, split)] == (0 if world == 1 else 2)


@pytest.mark.parametrize("world", WORLDS)
def test_ulysses_exchange_moves_bf16_heads_exactly(world):
    results = _results(world)
    split = TOKEN_SPLITS[world][-1]
    for hq, hkv in HEAD_CONFIGS:
        q, k, v, _ = attention_inputs(hq, hkv, torch.bfloat16)
        rep = hq // hkv
        for rank, plan in enumerate(_plans(world, split)):
            q_l, k_l, v_l, heads = results[rank]["ulysses"][("scatter_bf16", hq, hkv)]
            kv = range(heads.start // rep, (heads.stop - 1) // rep + 1) if len(heads) else range(0)
            assert q_l.dtype == torch.bfloat16
            assert torch.equal(q_l, q[:, heads.start : heads.stop])
            assert torch.equal(k_l, k[:, kv.start : kv.stop]) and torch.equal(v_l, v[:, kv.start : kv.stop])
            back = results[rank]["ulysses"][("roundtrip_bf16", hq, hkv)]
            assert torch.equal(back, plan.shard(q))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_attention_gradients_equal_one_process(world):
    results = _results(world)
    split = TOKEN_SPLITS[world][-1]
    for hq, hkv in HEAD_CONFIGS:
        q, k, v, sinks = (t.clone().requires_grad_(True) for t in attention_inputs(hq, hkv))
        out = magi2_attention_with_sinks(q, k, v, sinks.detach(), SEGMENTS, q.shape[-1] ** -0.5)
        (out * loss_weights(hq)).sum().backward()
        for rank, plan in enumerate(_plans(world, split)):
            grads = results[rank]["ulysses"][("grad", hq, hkv)]
            for got, full in zip(grads, (q.grad, k.grad, v.grad)):
                torch.testing.assert_close(got, plan.shard(full), atol=1e-5, rtol=0)


@pytest.mark.parametrize("world", WORLDS)
def test_routed_heads_with_ep_replicas_equal_one_process(world):
    results = _results(world)
    for num_heads in (4, 3):
        ref = standin_reference(standin_inputs(num_heads), standin_weights(num_heads))
        for split in TOKEN_SPLITS[world]:
            for rank, plan in enumerate(_plans(world, split, None)):
                res = results[rank]["replicas"]
                for ep in EP_DEGREES[world]:
                    torch.testing.assert_close(res[("moe", num_heads, split, ep)], plan.shard(ref), atol=1e-6, rtol=0)
                    assert res[("moe_calls", num_heads, split, ep)] == (0 if world == 1 else 2)
                if world > 1:  # EP degree = CP degree: bit-identical to the existing sharded-token layout
                    assert torch.equal(res[("moe", num_heads, split, world)], res[("moe_ep_path", num_heads, split)])
