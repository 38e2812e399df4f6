"""The expert op's backward (``diffusers_magi2.moe.experts_backward``): only the asked-for gradients, no weight-sized
buffer for frozen experts, no host read for top-k routes, grouped GEMMs in route blocks, against autograd of the
loop-over-experts reference."""

from __future__ import annotations

import pytest
import torch
from helpers.int4_models import BANKS, int4_copy
from helpers.moe_cases import AllocationRecorder, count_host_reads, random_case, tiny_config

from diffusers_magi2.moe.dequantize import dequantize_bank
from diffusers_magi2.moe.experts import mh_moe_experts_backward, torch_mh_moe_forward
from diffusers_magi2.moe.experts_backward import experts_backward
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.moe.quantize import FP8_SCALE_NAMES, quantize_fp8
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES
from diffusers_magi2.moe.reference import reference_mh_moe_forward
from diffusers_magi2.moe.routing import global_sort_routes


BACKWARD_OP = torch.ops.diffusers_magi2.mh_moe_experts_backward.default
GRAD_TOL = 1e-5  # fp32: grouped GEMMs sum in another order than the per-expert loop of the reference


def _layer(storage: str) -> Magi2MultiHeadMoE:
    """TINY layer (2 heads x 4 experts, Dh 32, De 32) with frozen experts stored as ``storage``."""
    torch.manual_seed(0)
    module = Magi2MultiHeadMoE(tiny_config(num_experts=4, head_dim=32, expert_dim=32))
    if storage == "int4":
        return int4_copy(module, 16)
    if storage == "float8_e4m3fn":
        fp8 = Magi2MultiHeadMoE(tiny_config(num_experts=4, head_dim=32, expert_dim=32, expert_dtype=storage))
        state = module.state_dict()
        for bank, scale in zip(BANKS, FP8_SCALE_NAMES):
            state[bank], state[scale] = quantize_fp8(state[bank])
        fp8.load_state_dict(state)
        return fp8
    for bank in BANKS:
        module.get_parameter(bank).requires_grad_(False)
    return module


@pytest.mark.parametrize("storage", ["float32", "float8_e4m3fn", "int4"])
def test_frozen_experts_backward_allocates_no_tensor_of_an_expert_weights_shape(storage) -> None:
    """Every allocation of the backward, inside the expert op too, is recorded: none has a bank's shape (stored or
    dequantized) or its size; the input and router still get their gradients."""
    module = _layer(storage)
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = module(hidden)
    recorder = AllocationRecorder({BACKWARD_OP: lambda *a: tuple(experts_backward(*a[:-1], top_k_routes=a[-1]))})
    with recorder:
        out.square().sum().backward()
    banks = [module.get_parameter(name) for name in BANKS]
    forbidden = {tuple(b.shape) for b in banks} | {(8, 32, 32)}  # stored, and dequantized [H*E, K, N]
    assert recorder.shapes and not [s for s in recorder.shapes if s[1] in forbidden]
    assert max(n for _, n in recorder.allocations) < 8 * 32 * 32  # no buffer as large as one bank
    assert bool(hidden.grad.abs().sum() > 0) and bool(module.gate.grad.abs().sum() > 0)
    assert all(b.grad is None for b in banks)


def _case(seed: int = 3, num_tokens: int = 7):
    x, probs, idx, w_gate, w_up, w_down = random_case(num_tokens, 2, 4, 2, 16, 32, torch.float32, seed=seed)
    return x, list(global_sort_routes(probs, idx, 4)), [w_gate, w_up, w_down]


def _autograd(x, routes, weights, grad):
    """Gradients ``[x, probs, w_gate, w_up, w_down]`` by autograd of the loop-over-experts reference."""
    leaves = [x.clone().requires_grad_(True), routes[1].clone().requires_grad_(True)]
    leaves += [w.clone().requires_grad_(True) for w in weights]
    out = reference_mh_moe_forward(leaves[0], routes[0], leaves[1], routes[2], *leaves[2:])
    return torch.autograd.grad(out, leaves, grad)


def test_backward_computes_only_the_asked_for_gradients() -> None:
    """Each gradient asked for alone equals autograd of the reference; the others are empty ``(0,)`` tensors."""
    x, routes, weights = _case()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    want = _autograd(x, routes, weights, grad)
    for i in range(5):
        needs = [j == i for j in range(5)]
        got = mh_moe_experts_backward(grad, x, routes, weights, [], needs, True)
        torch.testing.assert_close(got[i], want[i], atol=GRAD_TOL, rtol=GRAD_TOL)
        assert all(g.shape == (0,) for j, g in enumerate(got) if j != i)
    everything = mh_moe_experts_backward(grad, x, routes, weights, [], [True] * 5, True)
    for got, expected in zip(everything, want):
        torch.testing.assert_close(got, expected, atol=GRAD_TOL, rtol=GRAD_TOL)


def test_backward_in_route_blocks_cut_mid_expert_equals_one_block() -> None:
    """Blocks of 5 routes split experts' groups; the weight gradients add up over the blocks."""
    x, routes, weights = _case(num_tokens=9)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    whole = experts_backward(grad, x, routes, weights, None, [True] * 5)
    blocks = experts_backward(grad, x, routes, weights, None, [True] * 5, chunk_rows=5)
    for a, b in zip(whole, blocks):
        torch.testing.assert_close(a, b, atol=GRAD_TOL, rtol=GRAD_TOL)  # sums split across blocks


def test_backward_of_top_k_routes_reads_nothing_on_the_host_and_a_bad_layout_gives_nan() -> None:
    """Routes declared top-k (as the MoE layer declares its own) take their head bounds from the layout, with no host
    read; offsets that break that layout make the gradients NaN, never silently wrong."""
    x, routes, weights = _case()
    grad = torch.randn(x.shape)
    with count_host_reads() as counts:
        grads = experts_backward(grad, x, routes, weights, None, [True] * 5, top_k_routes=True)
    assert counts == {} and all(torch.isfinite(g).all() for g in grads)
    # T = S*H*k, but head 0 holds one route more than S*k: not the top-k layout the backward relies on
    offsets = routes[2].clone()
    offsets[4] += 1
    csr = [routes[0], routes[1], offsets]
    bad = experts_backward(grad, x, csr, weights, None, [True, True, False, False, False], top_k_routes=True)
    assert all(torch.isnan(g).all() for g in bad[:2])


def test_backward_of_a_csr_with_top_k_many_routes_but_another_layout_matches_autograd() -> None:
    """The seed functions take any CSR: ``T = S*H*k`` routes whose heads do not hold ``S*k`` each (head 0 takes
    one route of head 1) get the gradients of autograd through ``torch_mh_moe_forward``, not NaN."""
    x, routes, weights = _case()
    offsets = routes[2].clone()
    moved = int(offsets[4])  # head 1's first route becomes head 0's (its last expert's) ...
    offsets[4] += 1
    gather_ids = routes[0].clone()
    taken = set(gather_ids[offsets[3] : moved].tolist())
    gather_ids[moved] = next(t for t in range(x.shape[0]) if t not in taken)  # ... for a token that expert lacks
    csr = [gather_ids, routes[1], offsets]
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    leaves = [x.clone().requires_grad_(True), routes[1].clone().requires_grad_(True)]
    out = torch_mh_moe_forward(leaves[0], gather_ids, leaves[1], offsets, *weights)
    got = torch.autograd.grad(out, leaves, grad)
    for a, b in zip(got, _autograd(x, csr, weights, grad)[:2]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=GRAD_TOL, rtol=GRAD_TOL)


def test_backward_of_a_hand_made_csr_matches_autograd() -> None:
    """Routes that are not top-k (the seed functions take any CSR): the head bounds are read on the host once."""
    x, routes, weights = _case()
    keep = torch.ones(routes[0].numel(), dtype=torch.bool)
    keep[[0, 5, 17]] = False  # drop three routes: T is no multiple of S*H any more
    counts = torch.diff(routes[2])
    for r in (0, 5, 17):
        counts[torch.searchsorted(routes[2], torch.tensor(r), right=True) - 1] -= 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    csr = [routes[0][keep], routes[1][keep], offsets]
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    got = experts_backward(grad, x, csr, weights, None, [True] * 5)
    for a, b in zip(got, _autograd(x, csr, weights, grad)):
        torch.testing.assert_close(a, b, atol=GRAD_TOL, rtol=GRAD_TOL)


@pytest.mark.parametrize("storage", ["float8_e4m3fn", "int4"])
def test_quantized_experts_backward_is_autograd_of_the_dequantized_weights(storage) -> None:
    """Through the torch path with frozen FP8 / int4 banks: the input and route-weight gradients are fp32 autograd
    of the reference on the dequantized banks."""
    module = _layer(storage)
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(7))
    routes = list(global_sort_routes(*module.route(x), 4))
    names = FP8_SCALE_NAMES if storage != "int4" else INT4_SCALE_NAMES
    banks = [module.get_parameter(n) for n in BANKS]
    scales = [module.get_buffer(n) for n in names]
    dense = [dequantize_bank(b, s) for b, s in zip(banks, scales)]
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    leaves = [x.clone().requires_grad_(True), routes[1].detach().clone().requires_grad_(True)]
    out = torch_mh_moe_forward(leaves[0], routes[0], leaves[1], routes[2], *banks, scales=scales)
    got = torch.autograd.grad(out, leaves, grad)
    want = _autograd(x, [routes[0], routes[1].detach(), routes[2]], dense, grad)[:2]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=GRAD_TOL, rtol=GRAD_TOL)
