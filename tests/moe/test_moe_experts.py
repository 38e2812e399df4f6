"""Torch expert path (`torch_mh_moe_forward`), `swiglu7` and the loop-over-experts reference (the oracle)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.moe_cases import random_case, unit_swiglu_layer

from diffusers_magi2.moe.activation import swiglu7, swiglu7_backward, swiglu7_interleaved
from diffusers_magi2.moe.expert_checks import check_expert_inputs
from diffusers_magi2.moe.experts import torch_mh_moe_forward
from diffusers_magi2.moe.reference import reference_mh_moe_forward
from diffusers_magi2.moe.routing import global_sort_routes


def swiglu7_scalar(g: float, u: float) -> float:
    """Closed form of SandAI's ``swiglu7``: min(g,7) * sigmoid(1.702*min(g,7)) * (clamp(u,-7,7) + 1)."""
    g = min(g, 7.0)
    u = max(-7.0, min(u, 7.0))
    return g / (1.0 + math.exp(-1.702 * g)) * (u + 1.0)


def loop_oracle(x, top_probs, top_idx, w_gate, w_up, w_down):
    """The package's reference on the CSR layout of the given top-k routes."""
    routes = global_sort_routes(top_probs, top_idx, w_gate.shape[0] // x.shape[1])
    return reference_mh_moe_forward(x, *routes, w_gate, w_up, w_down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_loop_oracle(dtype: torch.dtype) -> None:
    x, probs, idx, w_gate, w_up, w_down = random_case(9, 3, 5, 3, 16, 24, dtype)
    out = torch_mh_moe_forward(x, *global_sort_routes(probs, idx, 5), w_gate, w_up, w_down)
    ref = loop_oracle(x, probs, idx, w_gate, w_up, w_down)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    else:  # fp32 accumulation order differs from the fp64 oracle: at most one bf16 ulp per contribution sum
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
        assert (out != ref).float().mean() < 0.02


def test_torch_path_empty_experts_zero_tokens_and_untouched_heads() -> None:
    x, probs, idx, w_gate, w_up, w_down = random_case(4, 2, 6, 1, 16, 16, torch.float32)
    idx.zero_()  # every route to expert 0 of its head: experts 1..5 empty
    gather_ids, probs_sorted, offsets = global_sort_routes(probs, idx, 6)
    out = torch_mh_moe_forward(x, gather_ids, probs_sorted, offsets, w_gate, w_up, w_down)
    torch.testing.assert_close(out, loop_oracle(x, probs, idx, w_gate, w_up, w_down), atol=2e-5, rtol=1e-5)
    # S = 0
    empty_routes = (gather_ids[:0], probs_sorted[:0], torch.zeros_like(offsets))
    empty = torch_mh_moe_forward(x[:0], *empty_routes, w_gate, w_up, w_down)
    assert empty.shape == (0, 2, 16)


def test_swiglu7_known_values() -> None:
    """The "+1" on the linear half, the one-sided gate clamp and the ±7 linear clamp."""
    gate = torch.tensor([1.0, 10.0, -10.0])
    up = torch.tensor([0.0, 10.0, -10.0])
    out = swiglu7(gate, up)
    torch.testing.assert_close(out[:2], torch.tensor([0.845796, 55.99963]), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[2], torch.tensor(2.43e-6), atol=0, rtol=5e-3)
    ref = torch.tensor([swiglu7_scalar(float(g), float(u)) for g, u in zip(gate, up)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
    # A "standard SwiGLU" (no +1) would give 0 for (1, 0): guard against the "correction".
    assert out[0] > 0.8
    # dtype rules: input dtype by default, fp32 math, one rounding.
    assert swiglu7(gate.bfloat16(), up.bfloat16()).dtype == torch.bfloat16
    assert swiglu7(gate, up, out_dtype=torch.bfloat16).equal(out.bfloat16())


def test_expert_path_applies_swiglu7_with_plus_one() -> None:
    args = unit_swiglu_layer([1.0, 10.0, -10.0], [0.0, 10.0, -10.0])
    out = torch_mh_moe_forward(*args)[0, 0]
    torch.testing.assert_close(out[:2], torch.tensor([0.845796, 55.99963]), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[2], torch.tensor(2.43e-6), atol=0, rtol=5e-3)
    assert (out[3:] == 0).all()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(x=a["x"][0]), "x must be a 3-D"),
        (lambda a: a.update(x=a["x"].double()), "x dtype"),
        (lambda a: a.update(w_up=a["w_up"][:, :, :8]), "w_up must match w_gate"),
        (lambda a: a.update(w_down=a["w_down"][:, :8]), "w_down must be"),
        (lambda a: a.update(w_gate=a["w_gate"][:, :8], w_up=a["w_up"][:, :8]), "Dh="),
        (
            lambda a: a.update(w_gate=a["w_gate"][:5], w_up=a["w_up"][:5], w_down=a["w_down"][:5]),
            "positive multiple of the number of heads",
        ),
        (lambda a: a.update(gather_ids=a["gather_ids"].float()), "gather_ids"),
        (lambda a: a.update(probs=a["probs"][:-1]), "probs must be"),
        (lambda a: a.update(expert_offsets=a["expert_offsets"][:-1]), "expert_offsets must be"),
    ],
)
def test_expert_bad_input(mutate, match) -> None:
    x, probs, idx, w_gate, w_up, w_down = random_case(4, 2, 3, 2, 16, 16, torch.float32)
    gather_ids, probs_sorted, offsets = global_sort_routes(probs, idx, 3)
    args = {
        "x": x,
        "gather_ids": gather_ids,
        "probs": probs_sorted,
        "expert_offsets": offsets,
        "w_gate": w_gate,
        "w_up": w_up,
        "w_down": w_down,
    }
    mutate(args)
    with pytest.raises(ValueError, match=match):
        torch_mh_moe_forward(**args)


@pytest.mark.parametrize(
    ("position", "scales", "match"),
    [
        (0, None, "x must be a tensor"),
        (2, None, "probs must be a tensor"),
        (6, None, "w_down must be a tensor"),
        (None, (None, None, None), "w_gate_scale must be a tensor"),
        (None, (), "scales must be None or three tensors"),
    ],
)
def test_expert_arguments_that_are_not_tensors_are_refused_by_name(position, scales, match) -> None:
    """A non-tensor argument gets a ValueError naming it (not the custom op's schema error), and the internal
    grouped check names it the same way."""
    x, probs, idx, *banks = random_case(4, 2, 3, 2, 16, 16, torch.float32)
    args = [x, *global_sort_routes(probs, idx, 3), *banks]
    if position is not None:
        args[position] = args[position].tolist()
    with pytest.raises(ValueError, match=match):
        torch_mh_moe_forward(*args, scales=scales)
    with pytest.raises(ValueError, match=match):
        check_expert_inputs(args[0], args[1:4], args[4:], scales)


def test_expert_offsets_inconsistent_with_routes() -> None:
    x, probs, idx, w_gate, w_up, w_down = random_case(4, 2, 3, 2, 16, 16, torch.float32)
    gather_ids, probs_sorted, offsets = global_sort_routes(probs, idx, 3)
    bad = offsets.clone()
    bad[-1] += 1
    with pytest.raises(ValueError, match="non-decreasing from 0"):
        torch_mh_moe_forward(x, gather_ids, probs_sorted, bad, w_gate, w_up, w_down)


def test_torch_path_is_differentiable() -> None:
    """Gradients through the torch path equal those through the loop oracle (fp32)."""
    x, probs, idx, w_gate, w_up, w_down = random_case(5, 2, 3, 2, 16, 16, torch.float32, seed=7)
    weight = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(8))
    grads = []
    for fn in ("torch", "oracle"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w_gate, w_up, w_down)]
        if fn == "torch":
            out = torch_mh_moe_forward(leaves[0], *global_sort_routes(probs, idx, 3), *leaves[1:])
        else:
            out = loop_oracle(leaves[0], probs, idx, *leaves[1:])
        (out * weight).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, ref in zip(*grads):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_torch_path_under_non_reentrant_checkpointing_gives_the_plain_gradients() -> None:
    """The expert op recomputed by ``torch.utils.checkpoint`` (``use_reentrant=False``, as diffusers' gradient
    checkpointing runs it) gives the gradients of a plain backward, bit for bit."""
    x, probs, idx, w_gate, w_up, w_down = random_case(5, 2, 3, 2, 16, 16, torch.float32, seed=11)
    routes = global_sort_routes(probs, idx, 3)
    weight = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(12))
    grads = []
    for checkpointed in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, w_gate, w_up, w_down)]

        def run(x, *weights):
            return torch_mh_moe_forward(x, *routes, *weights)

        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(run, *leaves, use_reentrant=False)
        else:
            out = run(*leaves)
        (out * weight).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, ref in zip(*grads):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu7_forms_agree_bit_for_bit(dtype: torch.dtype) -> None:
    """In-place (``out=``) and interleaved forms compute the out-of-place form's bits; the backward is autograd's."""
    gen = torch.Generator().manual_seed(4)
    gate = (torch.randn(64, 40, generator=gen) * 6).to(dtype)
    up = (torch.randn(64, 40, generator=gen) * 6).to(dtype)
    ref = swiglu7(gate, up, out_dtype=torch.float32)
    inplace = swiglu7(gate.float().clone(), up.float().clone(), out=torch.empty(64, 40))
    assert torch.equal(inplace, ref)
    fused = torch.stack([gate, up], dim=-1).flatten(-2)  # even columns gate, odd columns linear
    assert torch.equal(swiglu7_interleaved(fused, out_dtype=torch.float32), ref)
    assert swiglu7_interleaved(fused).dtype == dtype
    leaves = [gate.float().requires_grad_(True), up.float().requires_grad_(True)]
    grad = torch.randn(64, 40, generator=gen)
    expected = torch.autograd.grad(swiglu7(*leaves), leaves, grad)
    for got, want in zip(swiglu7_backward(gate, up, grad), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_swiglu7_bad_input() -> None:
    with pytest.raises(ValueError, match="same shape"):
        swiglu7(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="in place on fp32"):
        swiglu7(
            torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16), out=torch.empty(2, 3)
        )
    with pytest.raises(ValueError, match="even last dim"):
        swiglu7_interleaved(torch.zeros(2, 3))
