"""The seed API: vLLM-Omni's ``vllm_omni.diffusion.models.magi2.mh_moe`` page (``../shared/docs/seed_mh_moe_api.txt``)
at the package top level. Every form is called as the page writes it and checked against a loop written here; the
signatures are pinned with ``inspect`` (names, order, kinds, defaults; additions only keyword-only, with defaults),
and the README's "From vLLM-Omni" block runs verbatim."""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing

import pytest
import torch
from helpers.fixtures import REPO_ROOT

import diffusers_magi2
from diffusers_magi2 import (
    Magi2MultiHeadMoE,
    Magi2MultiHeadMoEConfig,
    RoutingScore,
    compute_topk_probs_and_indices,
    global_sort_routes,
    swiglu7_pair,
    torch_mh_moe_forward,
)
from diffusers_magi2.moe import experts_triton


P, K, E = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty
EXPERT_ARGS = [(n, P, E) for n in ("x", "gather_ids", "probs", "expert_offsets", "w_gate", "w_up", "w_down")]
#: (object, [(name, kind, default)]) as on the seed page
SEED_SIGNATURES = {
    "compute_topk_probs_and_indices": [
        ("router_logits", P, E),
        ("top_k", P, E),
        ("score_func", K, "sigmoid"),
        ("expert_bias", K, None),
        ("route_norm", K, True),
        ("norm_eps", K, 1e-12),
    ],
    "global_sort_routes": [("topk_probs", P, E), ("topk_indices", P, E), ("num_experts", P, E)],
    "swiglu7_pair": [("gate", P, E), ("up", P, E)],
    "torch_mh_moe_forward": EXPERT_ARGS,
    "triton_mh_moe_forward": EXPERT_ARGS + [("deterministic", K, False)],
    "Magi2MultiHeadMoE.ep_slice": [("self", P, E), ("checkpoint_tensor", P, E)],
    "Magi2MultiHeadMoE.forward": [("self", P, E), ("x", P, E)],
}
#: the config's fields, in vLLM-Omni's order (``params_dtype`` has no default there)
SEED_CONFIG_FIELDS = [
    ("hidden_size", E),
    ("num_heads", E),
    ("num_experts", E),
    ("top_k", E),
    ("expert_intermediate_size", E),
    ("params_dtype", E),
    ("score_func", "sigmoid"),
    ("route_norm", True),
    ("route_scale", 1.0),
]


def _resolve(dotted: str):
    obj = diffusers_magi2
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", sorted(SEED_SIGNATURES))
def test_seed_signatures_are_kept_and_additions_are_keyword_only(name) -> None:
    params = list(inspect.signature(_resolve(name)).parameters.values())
    seed = SEED_SIGNATURES[name]
    seed_positional = [s for s in seed if s[1] is P]
    assert [(p.name, p.kind, p.default) for p in params[: len(seed_positional)]] == seed_positional
    ours = {p.name: p for p in params}
    for pname, kind, default in seed:
        assert (ours[pname].kind, ours[pname].default) == (kind, default), pname
    for added in (p for p in params if p.name not in {s[0] for s in seed}):
        assert added.kind is K and added.default is not E, f"{name}: {added.name} must be keyword-only with a default"


def test_seed_config_fields_order_defaults_and_keyword_only_additions() -> None:
    fields = dataclasses.fields(Magi2MultiHeadMoEConfig)
    head = [(f.name, E if f.default is dataclasses.MISSING else f.default) for f in fields[: len(SEED_CONFIG_FIELDS)]]
    assert head == SEED_CONFIG_FIELDS
    assert all(not f.kw_only for f in fields[: len(SEED_CONFIG_FIELDS)])
    assert all(f.kw_only and f.default is not dataclasses.MISSING for f in fields[len(SEED_CONFIG_FIELDS) :])
    assert dataclasses.is_dataclass(Magi2MultiHeadMoEConfig) and Magi2MultiHeadMoEConfig.__dataclass_params__.frozen
    assert typing.get_origin(RoutingScore) is typing.Literal
    assert typing.get_args(RoutingScore) == ("softmax", "sigmoid")


def _loop_topk(logits, top_k, bias, route_norm):
    """Per (head, token): sigmoid scores, top-k of the biased scores (ties to the lower id), unbiased weights."""
    heads, tokens, experts = logits.shape
    probs = torch.empty(heads, tokens, top_k, dtype=torch.float64)
    indices = torch.empty(heads, tokens, top_k, dtype=torch.int64)
    for h in range(heads):
        for s in range(tokens):
            scores = [1.0 / (1.0 + math.exp(-float(v))) for v in logits[h, s]]
            chosen = sorted(range(experts), key=lambda e: (-(scores[e] + float(bias[h, e])), e))[:top_k]
            weights = [scores[e] for e in chosen]
            total = sum(weights) if route_norm else 1.0
            probs[h, s] = torch.tensor([w / total for w in weights], dtype=torch.float64)
            indices[h, s] = torch.tensor(chosen)
    return probs, indices


def _loop_experts(x, topk_probs, topk_indices, w_gate, w_up, w_down):
    """``y[s, h] = sum_k p * W_down[g] swiglu7(x W_gate[g], x W_up[g])``, ``g = h E + e``, in float64."""
    x, w_gate, w_up, w_down = (t.double() for t in (x, w_gate, w_up, w_down))
    tokens, heads, _ = x.shape
    experts = w_gate.shape[0] // heads
    y = torch.zeros_like(x)
    for s in range(tokens):
        for h in range(heads):
            for p, e in zip(topk_probs[h, s].tolist(), topk_indices[h, s].tolist()):
                g = h * experts + e
                gate, up = (x[s, h] @ w_gate[g]).clamp(max=7.0), (x[s, h] @ w_up[g]).clamp(-7.0, 7.0)
                y[s, h] += p * ((gate * torch.sigmoid(1.702 * gate) * (up + 1.0)) @ w_down[g])
    return y


def _case(tokens=5, heads=2, experts=4, top_k=2, d_head=16, d_expert=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, d_head, generator=gen)
    w_gate = torch.randn(heads * experts, d_head, d_expert, generator=gen) * d_head**-0.5
    w_up = torch.randn(heads * experts, d_head, d_expert, generator=gen) * d_head**-0.5
    w_down = torch.randn(heads * experts, d_expert, d_head, generator=gen) * d_expert**-0.5
    logits = torch.randn(heads, tokens, experts, generator=gen)
    bias = torch.randn(heads, experts, generator=gen) * 0.3
    return x, logits, bias, w_gate, w_up, w_down, top_k


def test_seed_routing_sort_and_expert_forms_match_the_loop_oracle() -> None:
    x, router_logits, expert_bias, w_gate, w_up, w_down, top_k = _case()
    topk_probs, topk_indices = compute_topk_probs_and_indices(
        router_logits, top_k, score_func="sigmoid", expert_bias=expert_bias, route_norm=True, norm_eps=1e-12
    )
    want_probs, want_indices = _loop_topk(router_logits, top_k, expert_bias, route_norm=True)
    assert torch.equal(topk_indices, want_indices)
    torch.testing.assert_close(topk_probs.double(), want_probs, atol=1e-6, rtol=0)

    gather_ids, probs, expert_offsets = global_sort_routes(topk_probs, topk_indices, 4)
    heads, tokens, _ = topk_indices.shape
    flat = [(h * 4 + int(e), s, float(p)) for h in range(heads) for s in range(tokens)
            for e, p in zip(topk_indices[h, s], topk_probs[h, s])]  # fmt: skip
    ordered = sorted(flat, key=lambda r: r[0])  # stable: (head, token, k) order within an expert
    assert gather_ids.tolist() == [s for _, s, _ in ordered]
    assert probs.tolist() == [p for _, _, p in ordered]
    assert expert_offsets.tolist() == [sum(1 for g, _, _ in flat if g < b) for b in range(heads * 4 + 1)]

    y = torch_mh_moe_forward(x, gather_ids, probs, expert_offsets, w_gate, w_up, w_down)
    want = _loop_experts(x, topk_probs, topk_indices, w_gate, w_up, w_down)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)  # fp32 GEMMs against float64


@pytest.mark.skipif(
    not experts_triton.INTERPRET and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1"
)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_seed_triton_form_matches_the_loop_oracle() -> None:
    x, router_logits, expert_bias, w_gate, w_up, w_down, top_k = _case(tokens=3, seed=1)
    topk_probs, topk_indices = compute_topk_probs_and_indices(router_logits, top_k, expert_bias=expert_bias)
    gather_ids, probs, expert_offsets = global_sort_routes(topk_probs, topk_indices, 4)
    want = _loop_experts(x, topk_probs, topk_indices, w_gate, w_up, w_down)
    for deterministic in (False, True):
        y = diffusers_magi2.triton_mh_moe_forward(
            x, gather_ids, probs, expert_offsets, w_gate, w_up, w_down, deterministic=deterministic
        )
        torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


def test_seed_swiglu7_pair_is_fp32_math_in_the_gate_dtype() -> None:
    gate = torch.tensor([-9.0, -1.0, 0.5, 3.0, 7.5, 12.0]).bfloat16()
    up = torch.tensor([-8.0, 0.25, -0.5, 2.0, 6.0, 9.0]).bfloat16()
    out = swiglu7_pair(gate, up)
    want = []
    for g, u in zip(gate.float().tolist(), up.float().tolist()):
        g, u = min(g, 7.0), min(max(u, -7.0), 7.0)
        want.append(g / (1.0 + math.exp(-1.702 * g)) * (u + 1.0))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor(want, dtype=torch.float64).bfloat16())


def test_seed_layer_attributes_shapes_and_ep_slice() -> None:
    config = Magi2MultiHeadMoEConfig(96, 3, 4, 2, 8, torch.bfloat16)
    assert (config.score_func, config.route_norm, config.route_scale) == ("sigmoid", True, 1.0)
    one = Magi2MultiHeadMoE(config)
    assert (one.d_head, one.d_expert, one.num_heads, one.num_experts, one.top_k) == (32, 8, 3, 4, 2)
    assert one.config is config and one.ep_group is None
    # heads 3 over 2 expert-parallel ranks: padded to 4, two per rank, rank 1 holds head 2 and the padding head
    rank1 = Magi2MultiHeadMoE(config, ep_rank=1, ep_size=2)
    got = [getattr(rank1, n) for n in ("padded_num_heads", "local_num_heads", "ep_pad_heads", "local_head_start")]
    assert got == [4, 2, 1, 2] and rank1.has_real_moe_heads and rank1.local_flatten_num_experts == 8
    assert not Magi2MultiHeadMoE(config, ep_rank=3, ep_size=4).has_real_moe_heads
    assert (rank1.gate.shape, rank1.gate.dtype) == ((8, 32), torch.float32)
    for name, shape in (("W_gate", (8, 32, 8)), ("W_up", (8, 32, 8)), ("W_down", (8, 8, 32))):
        bank = getattr(rank1, name)
        assert isinstance(bank, torch.nn.Parameter) and (bank.shape, bank.dtype) == (shape, torch.bfloat16)
    assert isinstance(rank1.router, torch.nn.Module) and rank1.router.expert_bias.shape == (8,)
    checkpoint_tensor = torch.arange(12.0).view(12, 1)  # rows g = h E + e of all 3 heads
    assert rank1.ep_slice(checkpoint_tensor).flatten().tolist() == [8, 9, 10, 11, 0, 0, 0, 0]
    assert one.forward(torch.randn(5, 96).bfloat16()).shape == (5, 96)


def test_readme_from_vllm_omni_block_runs_verbatim() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    code = readme.split("<!-- from-vllm-omni -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md:from-vllm-omni", "exec"), namespace)
    moe, x, y = namespace["moe"], namespace["x"], namespace["y"]
    assert torch.equal(moe(x), y.reshape(x.shape))  # the same bits as the layer
