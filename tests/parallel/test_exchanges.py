"""The exchange interface in one process: ``dispatch -> local compute -> combine`` moves nothing where every token
and head is here, refuses token counts that do not fit before any collective, and hands expert parallelism the
exchange of the same setting. (The collectives behind the parallel exchanges run on gloo ranks:
``test_ep_collectives.py``, ``test_cp_collectives.py``, ``test_cp_models.py``.)"""

from __future__ import annotations

import pytest
import torch

from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.parallel.context_parallel import Magi2ContextParallelGroup, plan_sequence_shards
from diffusers_magi2.parallel.exchanges import (
    Magi2ContextParallelExpertExchange,
    Magi2ExpertParallelExchange,
    Magi2LocalAttentionExchange,
    Magi2LocalExpertExchange,
    expert_exchange,
)
from diffusers_magi2.parallel.expert_parallel import ep_head_layout


CONFIG = Magi2MultiHeadMoEConfig(32, 4, 4, 2, 16, torch.float32)


def _cp(size: int) -> Magi2ContextParallelGroup:
    """A CP group record (no collective runs in these tests)."""
    return Magi2ContextParallelGroup(group=None, rank=0, size=size, device=torch.device("cpu"))


def test_local_exchanges_hand_over_every_token_and_head_unchanged():
    x = torch.randn(5, 4, 8)
    local, handle = Magi2LocalExpertExchange().dispatch(x, ep_token_counts=[5])
    assert local is x
    assert Magi2LocalExpertExchange().combine(local * 2, handle).equal(x * 2)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    shard, handle = Magi2LocalAttentionExchange().dispatch(q, k, v)
    assert shard.query is q and shard.key is k and shard.value is v and shard.heads is None
    assert Magi2LocalAttentionExchange().combine(q + 1, handle).equal(q + 1)


@pytest.mark.parametrize("counts", [[4], [5, 0], [True]])
def test_the_local_expert_exchange_refuses_token_counts_of_other_ranks(counts):
    with pytest.raises(ValueError, match=r"ep_token_counts must be None or \[5\]"):
        Magi2LocalExpertExchange().dispatch(torch.randn(5, 4, 8), ep_token_counts=counts)


def test_a_context_parallel_layer_without_expert_parallelism_keeps_its_tokens():
    """EP degree 1 under CP: no exchange, the same output as the layer alone (same backend), in chunks too."""
    torch.manual_seed(0)
    moe = Magi2MultiHeadMoE(CONFIG)
    moe.set_backend("torch_grouped")
    x = torch.randn(7, 32)
    alone = moe(x)
    moe.exchange = Magi2ContextParallelExpertExchange(_cp(2), moe.ep_layout, None)
    plan = plan_sequence_shards(14, 2, 0)
    assert moe.exchange.sync_free and moe.exchange.token_chunk(3) == 3
    assert torch.equal(moe(x, shard_plan=plan), alone)
    with pytest.raises(ValueError, match="ep_token_counts must be None under context parallelism"):
        moe(x, ep_token_counts=[7, 7], shard_plan=plan)


def test_expert_parallelism_gets_the_exchange_of_the_same_setting():
    layout = ep_head_layout(4, 2, 1)
    one_process = Magi2LocalExpertExchange().for_expert_parallel(layout, None)
    assert type(one_process) is Magi2ExpertParallelExchange and one_process.layout == layout
    assert type(expert_exchange(ep_head_layout(4, 1, 0), None)) is Magi2LocalExpertExchange
    cp = Magi2ContextParallelExpertExchange(_cp(1), ep_head_layout(4, 1, 0), None)
    assert type(cp.for_expert_parallel(ep_head_layout(4, 1, 0), None)) is Magi2ContextParallelExpertExchange
    # EP groups must tile the CP ranks: a degree that does not divide the CP degree is refused at once
    with pytest.raises(
        ValueError, match=r"expert-parallel degree \(2\) divides neither the context-parallel degree \(3\)"
    ):
        Magi2ContextParallelExpertExchange(_cp(3), ep_head_layout(4, 1, 0), None).for_expert_parallel(layout, None)


def test_an_expert_parallel_exchange_refuses_bad_counts_before_any_collective():
    exchange = Magi2ExpertParallelExchange(ep_head_layout(4, 2, 0), group=object())  # never reached
    with pytest.raises(ValueError, match="ep_token_counts must be 2 non-negative host ints"):
        exchange.dispatch(torch.randn(3, 4, 8), ep_token_counts=[3])
    with pytest.raises(ValueError, match=r"ep_token_counts\[0\] = 2 but this rank holds 3 tokens"):
        exchange.dispatch(torch.randn(3, 4, 8), ep_token_counts=[2, 1])
