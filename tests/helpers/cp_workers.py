"""Per-rank bodies of the context-parallel collective tests (run on gloo ranks by ``test_cp_collectives.py``).

Every rank builds the same full inputs from fixed seeds, keeps its shard, runs the exchange and returns plain
tensors; the parent compares them with single-process references computed from the same seeds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from diffusers_magi2.models.attention_magi2 import magi2_attention_with_sinks
from diffusers_magi2.parallel.context_parallel import (
    gather_sequence_shards,
    plan_sequence_shards,
    ulysses_combine,
    ulysses_dispatch,
    ulysses_head_layout,
)
from diffusers_magi2.parallel.exchanges import Magi2UlyssesAttentionExchange
from diffusers_magi2.parallel.expert_parallel import (
    ep_combine,
    ep_dispatch,
    ep_head_layout,
    ep_replica_combine,
    ep_replica_dispatch,
    ep_replica_layout,
)


#: (query heads, kv heads) of the tiny fixtures: h4, h3 (GQA 6/3) and the refiner (GQA 6/2)
HEAD_CONFIGS = [(4, 4), (6, 3), (6, 2)]
HEAD_DIM = 8
SEGMENTS = (5, 0, 8, 3)  # packed samples; one empty
NUM_TOKENS = sum(SEGMENTS)
#: per N: the balanced split and an uneven one with a zero-token rank
TOKEN_SPLITS = {
    1: [None],
    2: [None, (0, 16)],
    3: [None, (9, 0, 7)],
    4: [None, (3, 6, 0, 7)],
}
#: per N, the EP degrees that divide it (replicas = N / E)
EP_DEGREES = {1: [1], 2: [1, 2], 3: [1, 3], 4: [1, 2, 4]}
MOE_DH = 8


def attention_inputs(hq: int, hkv: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(10 * hq + hkv)
    q = torch.randn(NUM_TOKENS, hq, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(NUM_TOKENS, hkv, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(NUM_TOKENS, hkv, HEAD_DIM, generator=g).to(dtype)
    sinks = torch.randn(1, hq, generator=g)
    return q, k, v, sinks


def attention_reference(hq: int, hkv: int, dtype=torch.float32):
    q, k, v, sinks = attention_inputs(hq, hkv, dtype)
    return magi2_attention_with_sinks(q, k, v, sinks, SEGMENTS, HEAD_DIM**-0.5)


def loss_weights(hq: int) -> torch.Tensor:
    """Fixed per-element weights of the attention output, so the gradient check sees every element."""
    return torch.arange(NUM_TOKENS * hq * HEAD_DIM, dtype=torch.float32).view(NUM_TOKENS, hq, HEAD_DIM).cos()


def standin_weights(num_heads: int) -> torch.Tensor:
    return torch.randn(num_heads, MOE_DH, MOE_DH, generator=torch.Generator().manual_seed(200 + num_heads))


def standin_inputs(num_heads: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, num_heads, MOE_DH, generator=torch.Generator().manual_seed(300 + num_heads))


def standin_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.einsum("shd,hde->she", x, w))


class _CountAllToAll:
    """Counts ``dist.all_to_all_single`` calls while installed (the functions under test call it at run time)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = dist.all_to_all_single

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def ulysses_attention(q, k, v, sinks: torch.Tensor, plan, group, world: int, rank: int) -> torch.Tensor:
    """This rank's shard of q/k/v through the Ulysses exchange: dispatch -> attention with sinks -> combine (a
    rank without query heads attends to nothing, as the attention processors do)."""
    exchange = Magi2UlyssesAttentionExchange(group, rank, world)
    shard, handle = exchange.dispatch(q, k, v, plan)
    heads = shard.heads
    out = shard.query
    if len(heads):
        out = magi2_attention_with_sinks(
            shard.query, shard.key, shard.value, sinks[:, heads.start : heads.stop], SEGMENTS, HEAD_DIM**-0.5
        )
    return exchange.combine(out, handle)


def ulysses_checks(rank: int, world: int) -> dict:
    res = {}
    group = dist.group.WORLD
    for hq, hkv in HEAD_CONFIGS:
        layout = ulysses_head_layout(hq, hkv, world, rank)
        for split in TOKEN_SPLITS[world]:
            plan = plan_sequence_shards(NUM_TOKENS, world, rank, SEGMENTS, split)
            q, k, v, sinks = attention_inputs(hq, hkv)
            with _CountAllToAll() as counter:
                out = ulysses_attention(plan.shard(q), plan.shard(k), plan.shard(v), sinks, plan, group, world, rank)
            res[("attn", hq, hkv, split)] = out
            res[("calls", hq, hkv, split)] = counter.calls
            res[("full", hq, hkv, split)] = gather_sequence_shards(out, plan, group)
        # bf16 on the wire, async handles, and gradients, on the uneven split
        split = TOKEN_SPLITS[world][-1]
        plan = plan_sequence_shards(NUM_TOKENS, world, rank, SEGMENTS, split)
        q, k, v, sinks = attention_inputs(hq, hkv, torch.bfloat16)
        pending = ulysses_dispatch(plan.shard(q), plan.shard(k), plan.shard(v), layout, plan, group, async_op=True)
        q_l, k_l, v_l = pending.wait()
        res[("scatter_bf16", hq, hkv)] = (q_l.clone(), k_l.clone(), v_l.clone(), layout.local_query_heads)
        back = ulysses_combine(q_l.contiguous(), layout, plan, group, async_op=True).wait()
        res[("roundtrip_bf16", hq, hkv)] = back  # query heads sent there and back == the local query shard
        q, k, v, sinks = attention_inputs(hq, hkv)
        leaves = [plan.shard(t).clone().requires_grad_(True) for t in (q, k, v)]
        out = ulysses_attention(*leaves, sinks, plan, group, world, rank)
        (out * plan.shard(loss_weights(hq))).sum().backward()
        res[("grad", hq, hkv)] = [t.grad for t in leaves]
    return res


def replica_checks(rank: int, world: int) -> dict:
    res = {}
    group = dist.group.WORLD
    for num_heads in (4, 3):
        w = standin_weights(num_heads)
        x = standin_inputs(num_heads)
        for split in TOKEN_SPLITS[world]:
            plan = plan_sequence_shards(NUM_TOKENS, world, rank, None, split)
            for ep in EP_DEGREES[world]:
                layout = ep_replica_layout(num_heads, world, ep, rank)
                heads = layout.heads

                def compute(local_x, heads=heads):
                    out = torch.zeros_like(local_x)
                    n = heads.num_real_local_heads
                    if n and local_x.shape[0]:
                        ws = w[heads.local_head_start : heads.local_head_start + n]
                        out[:, :n] = standin_reference(local_x[:, :n], ws)
                    return out

                with _CountAllToAll() as counter:
                    a = ep_replica_dispatch(plan.shard(x), plan.token_counts, layout, group, async_op=True).wait()
                    out = ep_replica_combine(compute(a), plan.token_counts, layout, group, async_op=True).wait()
                res[("moe", num_heads, split, ep)] = out
                res[("moe_calls", num_heads, split, ep)] = counter.calls
                if ep == world:  # no replicas: the same bytes as the existing sharded-token EP exchange
                    ref = ep_head_layout(num_heads, world, rank)
                    a = ep_dispatch(plan.shard(x), plan.token_counts, ref, group)
                    res[("moe_ep_path", num_heads, split)] = ep_combine(compute(a), plan.token_counts, ref, group)
    return res


def cp_worker(rank: int, world: int) -> dict:
    return {"ulysses": ulysses_checks(rank, world), "replicas": replica_checks(rank, world)}
