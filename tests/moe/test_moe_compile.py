"""The expert call as a ``torch.library`` custom op: opcheck, and ``torch.compile(fullgraph=True)`` of a whole MoE
block (the Preview's routed + shared experts) on the CPU torch path, inference and training."""

from __future__ import annotations

import pytest
import torch
from helpers.moe_cases import random_case
from torch._dynamo.testing import CompileCounterWithBackend

from diffusers_magi2.models.feedforward_magi2 import Magi2MoEFeedForward
from diffusers_magi2.models.modality import Magi2ModalityDispatch
from diffusers_magi2.moe.experts import mh_moe_experts
from diffusers_magi2.moe.layer import Magi2MultiHeadMoEConfig
from diffusers_magi2.moe.routing import global_sort_routes


def test_expert_op_passes_opcheck() -> None:
    """Schema, fake (meta) implementation and autograd registration checked by torch.library.opcheck."""
    x, probs, idx, w_gate, w_up, w_down = random_case(6, 2, 3, 2, 16, 16, torch.float32, seed=11)
    gather_ids, probs_sorted, offsets = global_sort_routes(probs, idx, 3)
    leaves = [t.clone().requires_grad_(True) for t in (x, probs_sorted, w_gate, w_up, w_down)]
    args = (leaves[0], [gather_ids, leaves[1], offsets], leaves[2:], [], "torch", False, True)
    torch.library.opcheck(mh_moe_experts, args)


def moe_block() -> tuple[Magi2MoEFeedForward, torch.Tensor, Magi2ModalityDispatch]:
    torch.manual_seed(0)
    moe = Magi2MultiHeadMoEConfig(
        hidden_size=64,
        num_heads=2,
        num_experts=4,
        top_k=2,
        expert_intermediate_size=32,
        params_dtype=torch.float32,
        score_func="sigmoid",
        route_norm=True,
        route_scale=4.9,
    )
    block = Magi2MoEFeedForward(64, moe, shared_intermediate_size=32, modality_specific_intermediate_size=16)
    block.moe_mlp.set_backend("torch")
    dispatch = Magi2ModalityDispatch.from_modality_mapping(torch.tensor([0] * 6 + [1] * 3 + [2] * 3))
    return block, torch.randn(12, 64), dispatch


@pytest.mark.parametrize("training", [False, True])
def test_compile_fullgraph_whole_moe_block(training: bool) -> None:
    block, hidden, dispatch = moe_block()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # dynamo capture + AOTAutograd tracing through the fake
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    try:
        if training:
            results = []
            for fn in (block, compiled):
                block.zero_grad()
                x = hidden.clone().requires_grad_(True)
                out = fn(x, dispatch)
                out.square().sum().backward()
                results.append([out, x.grad, *(p.grad.clone() for p in block.parameters() if p.requires_grad)])
            for got, want in zip(results[1], results[0]):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            assert block.moe_mlp.W_gate.grad.abs().sum() > 0
        else:
            with torch.no_grad():
                torch.testing.assert_close(compiled(hidden, dispatch), block(hidden, dispatch), atol=1e-6, rtol=1e-6)
        assert counter.frame_count == 1  # one graph: no graph break anywhere in the block
        assert counter.op_count > 50
    finally:
        torch._dynamo.reset()
