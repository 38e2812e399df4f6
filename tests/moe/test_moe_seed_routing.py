"""The seed's routing behaviours (vLLM-Omni's ``magi2.mh_moe``), each against the seed's reference routing written
here: scores = sigmoid (or softmax) of the logits in their dtype, selection = scores + ``expert_bias.view(H, 1,
-1)``, ``torch.topk`` (sorted), the scores gathered and L1-normalised with eps. Non-finite logits route (a NaN row
gives NaN weights), any float dtype routes in its dtype, a per-head bias broadcasts, the layer routes with
``router.expert_bias_ema``, and both router biases are frozen parameters."""

from __future__ import annotations

import pytest
import torch

from diffusers_magi2 import (
    Magi2MultiHeadMoE,
    Magi2MultiHeadMoEConfig,
    compute_topk_probs_and_indices,
    global_sort_routes,
    torch_mh_moe_forward,
)


def seed_routing(logits, top_k, bias=None, score_func="sigmoid", eps=1e-12):
    """The seed's reference routing, as its page and SandAI's code write it."""
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    selection = scores if bias is None else scores + bias.view(logits.shape[0], 1, -1)
    indices = torch.topk(selection, top_k, dim=-1, sorted=True).indices
    probs = torch.gather(scores, -1, indices)
    return probs / probs.abs().sum(-1, keepdim=True).clamp_min(eps), indices


def _logits(dtype=torch.float32, heads=3, tokens=6, experts=8, seed=0):
    return (torch.randn(heads, tokens, experts, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_a_nan_logit_gives_its_row_nan_weights_and_no_error(score_func) -> None:
    logits = _logits()
    logits[1, 4, 5] = float("nan")
    logits[2, 0, 3] = float("inf")
    probs, indices = compute_topk_probs_and_indices(logits, 2, score_func=score_func)
    assert probs[1, 4].isnan().all()
    if score_func == "sigmoid":  # (softmax makes the whole row NaN)
        assert indices[1, 4, 0] == 5  # the NaN ranks first, as in torch.topk
    want_probs, want_indices = seed_routing(logits, 2, score_func=score_func)
    assert torch.equal(indices, want_indices)
    fine = torch.ones(3, 6, dtype=torch.bool)
    fine[1, 4] = False
    if score_func == "softmax":
        fine[2, 0] = False  # softmax of an inf row is NaN too, in the seed as here
    assert torch.isfinite(probs[fine]).all()
    torch.testing.assert_close(probs[fine], want_probs[fine], atol=1e-6, rtol=0)
    torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
def test_every_float_dtype_routes_in_that_dtype_with_the_reference_indices(dtype) -> None:
    logits = _logits(dtype, seed=1)
    bias = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)) * 0.1  # fp32, as the layer holds it
    for b in (None, bias):
        probs, indices = compute_topk_probs_and_indices(logits, 3, expert_bias=b)
        want_probs, want_indices = seed_routing(logits, 3, b)
        assert probs.dtype == dtype and indices.dtype == torch.int64
        assert torch.equal(indices, want_indices)
        tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 0.0)  # bf16/fp16: the same ops, the same bits
        torch.testing.assert_close(probs, want_probs, atol=tol, rtol=0)


@pytest.mark.parametrize("shape", [(3,), (3, 1), (3, 1, 1)])
def test_a_per_head_bias_broadcasts_over_the_experts(shape) -> None:
    """A head-wide shift: the same bias on every expert of a head, so the choice and the weights are those of no
    bias (an invariant), and equal to the reference's broadcast."""
    logits = _logits(seed=3)
    bias = torch.tensor([0.5, -2.0, 7.0]).view(shape)
    probs, indices = compute_topk_probs_and_indices(logits, 2, expert_bias=bias)
    plain_probs, plain_indices = compute_topk_probs_and_indices(logits, 2)
    assert torch.equal(indices, plain_indices) and torch.equal(probs, plain_probs)
    assert torch.equal(indices, seed_routing(logits, 2, bias)[1])
    expanded = bias.reshape(3, 1).expand(3, 8)
    assert torch.equal(compute_topk_probs_and_indices(logits, 2, expert_bias=expanded)[1], indices)


@pytest.mark.parametrize("shape", [(4,), (3, 2), (8,), (3, 8, 1), (24, 1)])
def test_a_bias_of_another_shape_is_refused_naming_the_shapes_allowed(shape) -> None:
    with pytest.raises(ValueError, match=r"expert_bias must be a floating-point tensor of shape \[3, 8\] or \[24\]"):
        compute_topk_probs_and_indices(_logits(), 2, expert_bias=torch.zeros(shape))


def _layer(seed=0) -> Magi2MultiHeadMoE:
    torch.manual_seed(seed)
    return Magi2MultiHeadMoE(Magi2MultiHeadMoEConfig(64, 2, 8, 2, 16, torch.float32, route_scale=2.5))


def _routed_by_hand(moe, x, bias):
    """The layer's forward by the seed functions with ``bias``."""
    heads = x.view(-1, moe.num_heads, moe.d_head)
    logits = torch.einsum("shd,hed->hse", heads, moe.gate.view(moe.num_heads, moe.num_experts, moe.d_head))
    probs, indices = compute_topk_probs_and_indices(logits, moe.top_k, expert_bias=bias)
    routes = global_sort_routes(probs * 2.5, indices, moe.num_experts)
    return torch_mh_moe_forward(heads, *routes, moe.W_gate, moe.W_up, moe.W_down).reshape(x.shape)


def test_the_layer_routes_with_the_ema_bias() -> None:
    moe = _layer()
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(5)))
        moe.router.expert_bias_ema.copy_(torch.randn(16, generator=torch.Generator().manual_seed(6)))
    out = moe(x)
    assert torch.equal(out, _routed_by_hand(moe, x, moe.router.expert_bias_ema))
    assert not torch.allclose(out, _routed_by_hand(moe, x, moe.router.expert_bias), atol=1e-3)  # the two differ
    with torch.no_grad():
        moe.router.expert_bias.zero_()  # the raw bias is kept, never read
    assert torch.equal(moe(x), out)


def test_both_router_biases_are_frozen_parameters_under_the_same_keys() -> None:
    moe = _layer()
    params = dict(moe.named_parameters())
    for key in ("router.expert_bias", "router.expert_bias_ema"):
        assert isinstance(params[key], torch.nn.Parameter) and not params[key].requires_grad
        assert params[key].dtype == torch.float32 and params[key].shape == (16,)
    assert set(moe.state_dict()) == set(params)
    assert not dict(moe.named_buffers())
    moe.to(torch.bfloat16)  # a layer alone has no fp32 islands (the models keep "router" in fp32)
    x = torch.randn(5, 64).bfloat16().requires_grad_(True)
    moe(x).float().sum().backward()
    assert moe.router.expert_bias.grad is None and moe.router.expert_bias_ema.grad is None


def test_router_biases_stay_fp32_parameters_in_a_model_and_build_on_meta() -> None:
    """In a transformer the router is an fp32 island: a bf16 move keeps both biases fp32 frozen parameters; under
    ``moe_tensors_on_meta`` they are built on the meta device like the rest of the layer."""
    from helpers.tiny_transformer import tiny_model

    from diffusers_magi2.moe.layer import moe_tensors_on_meta

    model = tiny_model().to(torch.bfloat16)
    biases = {n: p for n, p in model.named_parameters() if ".router.expert_bias" in n}
    assert len(biases) == 2 and all(p.dtype == torch.float32 and not p.requires_grad for p in biases.values())
    ema = next(p for n, p in biases.items() if n.endswith("_ema"))
    assert torch.equal(ema, next(p for n, p in biases.items() if not n.endswith("_ema")))  # as a converter writes
    with moe_tensors_on_meta():
        moe = _layer()
    assert moe.router.expert_bias_ema.is_meta and isinstance(moe.router.expert_bias_ema, torch.nn.Parameter)
