"""Routing (`compute_topk_probs_and_indices`) and CSR layout (`global_sort_routes`) against plain-Python oracles."""

from __future__ import annotations

import pytest
import torch

from diffusers_magi2.moe.routing import check_finite_router_logits, compute_topk_probs_and_indices, global_sort_routes


def oracle_route(logits, top_k, bias=None, score_func="sigmoid", route_norm=True, eps=1e-12):
    """Per (head, token) Python loop; selection by biased score, weights from the unbiased score."""
    num_heads, num_tokens, num_experts = logits.shape
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    bias = torch.zeros(num_heads, num_experts) if bias is None else bias.reshape(num_heads, num_experts)
    probs = torch.empty(num_heads, num_tokens, top_k)
    idx = torch.empty(num_heads, num_tokens, top_k, dtype=torch.int64)
    for h in range(num_heads):
        for s in range(num_tokens):
            sel = [(float(scores[h, s, e] + bias[h, e]), -e) for e in range(num_experts)]
            chosen = [-neg for _, neg in sorted(sel, reverse=True)[:top_k]]  # ties: lower id first
            p = torch.stack([scores[h, s, e] for e in chosen])
            if route_norm:
                p = p / max(float(p.abs().sum()), eps)
            probs[h, s] = p
            idx[h, s] = torch.tensor(chosen)
    return probs, idx


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("route_norm", [True, False])
def test_routing_matches_loop_oracle(score_func: str, route_norm: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 7, generator=gen)
    bias = torch.randn(3, 7, generator=gen) * 0.3
    probs, idx = compute_topk_probs_and_indices(
        logits, 3, score_func=score_func, expert_bias=bias, route_norm=route_norm
    )
    ref_p, ref_i = oracle_route(logits, 3, bias, score_func, route_norm)
    assert idx.dtype == torch.int64 and probs.dtype == torch.float32
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(probs, ref_p, atol=1e-7, rtol=0)
    if route_norm:
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, 11), atol=1e-6, rtol=0)


def test_bias_steers_selection_only() -> None:
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]])  # 1 head, 1 token, 4 experts
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])  # flat [H*E] form
    probs, idx = compute_topk_probs_and_indices(logits, 2, expert_bias=bias, route_norm=False)
    assert idx.tolist() == [[[0, 3]]]  # expert 0 chosen only because of the bias
    expected = torch.sigmoid(torch.tensor([0.0, 3.0]))  # weights are the unbiased scores
    torch.testing.assert_close(probs[0, 0], expected, atol=0, rtol=0)
    # [H, E] and [H*E] bias forms agree.
    p2, i2 = compute_topk_probs_and_indices(logits, 2, expert_bias=bias.view(1, 4), route_norm=False)
    assert torch.equal(i2, idx) and torch.equal(p2, probs)


def test_ties_follow_torch_topk_and_are_a_valid_topk_set() -> None:
    logits = torch.zeros(2, 5, 6)  # every score ties
    logits[1, :, 4] = 1.0
    probs, idx = compute_topk_probs_and_indices(logits, 3)
    ref = torch.topk(torch.sigmoid(logits), 3, dim=-1, sorted=True).indices
    assert torch.equal(idx, ref)
    for h in range(2):
        for s in range(5):
            assert len(set(idx[h, s].tolist())) == 3  # no expert twice
    assert (idx[1, :, 0] == 4).all()
    torch.testing.assert_close(probs[0], torch.full((5, 3), 1 / 3), atol=1e-7, rtol=0)


def test_route_norm_eps_guards_zero_sum() -> None:
    logits = torch.full((1, 2, 3), -1e4)  # sigmoid -> 0 exactly
    probs, _ = compute_topk_probs_and_indices(logits, 2)
    assert torch.isfinite(probs).all() and (probs == 0).all()


def oracle_sort(probs, idx, num_experts):
    num_heads, num_tokens, top_k = idx.shape
    routes = []
    for h in range(num_heads):
        for s in range(num_tokens):
            for j in range(top_k):
                routes.append((h * num_experts + int(idx[h, s, j]), s, float(probs[h, s, j])))
    routes.sort(key=lambda r: r[0])  # Python's sort is stable: (h, s, k) order inside an expert
    offsets = [0] * (num_heads * num_experts + 1)
    for g, _, _ in routes:
        offsets[g + 1] += 1
    for i in range(1, len(offsets)):
        offsets[i] += offsets[i - 1]
    return [r[1] for r in routes], [r[2] for r in routes], offsets


@pytest.mark.parametrize("shape", [(3, 9, 2, 5), (1, 1, 1, 1), (2, 0, 2, 4), (4, 6, 4, 4)])
def test_global_sort_matches_oracle(shape) -> None:
    num_heads, num_tokens, top_k, num_experts = shape
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(num_heads, num_tokens, num_experts, generator=gen)
    probs, idx = compute_topk_probs_and_indices(logits, top_k)
    gather_ids, probs_sorted, offsets = global_sort_routes(probs, idx, num_experts)
    ref_g, ref_p, ref_o = oracle_sort(probs, idx, num_experts)
    assert gather_ids.dtype == torch.int32 and probs_sorted.dtype == torch.float32 and offsets.dtype == torch.int64
    assert gather_ids.tolist() == ref_g
    assert probs_sorted.tolist() == ref_p
    assert offsets.tolist() == ref_o
    assert offsets.numel() == num_heads * num_experts + 1


def test_global_sort_empty_experts() -> None:
    idx = torch.tensor([[[3], [3], [0]]])  # experts 1 and 2 get nothing
    probs = torch.tensor([[[0.5], [0.25], [1.0]]])
    gather_ids, probs_sorted, offsets = global_sort_routes(probs, idx, 4)
    assert offsets.tolist() == [0, 1, 1, 1, 3]
    assert gather_ids.tolist() == [2, 0, 1]
    assert probs_sorted.tolist() == [1.0, 0.5, 0.25]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"router_logits": torch.zeros(2, 3), "top_k": 1}, "router_logits must be a 3-D"),
        ({"router_logits": torch.zeros(1, 2, 3, dtype=torch.int32), "top_k": 1}, "router_logits must be one of"),
        ({"router_logits": torch.zeros(1, 2, 3), "top_k": 0}, r"top_k must be an int in \[1, 3\]"),
        ({"router_logits": torch.zeros(1, 2, 3), "top_k": 4}, r"top_k must be an int in \[1, 3\]"),
        ({"router_logits": torch.zeros(1, 2, 3), "top_k": 1, "score_func": "relu"}, "score_func"),
        ({"router_logits": torch.zeros(2, 2, 3), "top_k": 1, "expert_bias": torch.zeros(5)}, "expert_bias"),
    ],
)
def test_routing_bad_input(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        compute_topk_probs_and_indices(**kwargs)


def test_global_sort_bad_input() -> None:
    idx = torch.zeros(1, 2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="same shape"):
        global_sort_routes(torch.zeros(1, 2, 2), idx, 4)
    with pytest.raises(ValueError, match="integer"):
        global_sort_routes(torch.zeros(1, 2, 1), idx.float(), 4)
    with pytest.raises(ValueError, match="num_experts"):
        global_sort_routes(torch.zeros(1, 2, 1), idx, 0)
    with pytest.raises(ValueError, match="3-D"):
        global_sort_routes(torch.zeros(2, 1), idx.view(2, 1), 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_router_logits_are_refused_naming_head_and_token(bad) -> None:
    """The check a caller may run before routing (the seed function itself routes them, as the seed does)."""
    logits = torch.randn(3, 5, 4)
    logits[2, 1] = bad
    with pytest.raises(ValueError, match=r"router logits are not finite.*head 2, token 1"):
        check_finite_router_logits(logits)
