"""The non-finite checks of ``models/finite_checks_magi2.py`` on the model itself: the routers only record, the
router check's hook refuses each forward's NaN/inf router inputs (naming the loop's step), and a stage's result is
checked once, naming the first non-finite weight of the whole model. Through the pipelines:
``tests/pipelines/test_pipeline_non_finite.py``; under context parallelism: ``tests/parallel/test_cp_non_finite.py``."""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry
from helpers.tiny_transformer import tiny_inputs, tiny_model

from diffusers_magi2.models import finite_checks_magi2
from diffusers_magi2.models.finite_checks_magi2 import (
    apply_router_input_check,
    check_router_inputs_finite,
    check_stage_result_finite,
)


def _with_nan_video(inputs: dict) -> dict:
    bad = {**inputs, "hidden_states": inputs["hidden_states"].clone()}
    bad["hidden_states"][0, :, 1, 2, 3] = float("nan")
    return bad


def test_a_nan_input_is_recorded_by_the_routers_and_refused_by_the_step_check_naming_the_first_router(monkeypatch):
    """The forward itself neither raises nor issues a device assert (on CUDA one would leave the context unusable);
    the check names the first MoE layer and no weight, clears the flags, and the model serves again."""

    def no_device_assert(*args, **kwargs):
        raise AssertionError("a device-side assert was issued")

    monkeypatch.setattr(torch, "_assert_async", no_device_assert)
    model, inputs = tiny_model(), tiny_inputs()
    first_moe = f"transformer_blocks.{min(model.config.moe_layers)}.mlp.moe_mlp"
    with torch.no_grad():
        reference = model(**inputs).sample
        check_router_inputs_finite(model, 0)  # finite inputs route
        assert torch.isnan(model(**_with_nan_video(inputs)).sample).any()
        match = rf"router inputs are not finite at step index 3: first in {first_moe}\b.*no weight of the model is"
        with pytest.raises(ValueError, match=match):
            check_router_inputs_finite(model, 3)
        check_router_inputs_finite(model, 4)  # cleared
        assert torch.equal(model(**inputs).sample, reference)
        check_router_inputs_finite(model, 5)


def test_a_non_finite_bf16_expert_weight_is_named_by_layer_parameter_expert_and_head():
    """A NaN in one routed expert poisons the tokens it serves, which the next MoE layer's router sees: the step
    check names the weight, not the input."""
    model = tiny_model(num_layers=3, moe_layers=[1, 2]).to(torch.bfloat16)
    moe = model.transformer_blocks[1].mlp.moe_mlp
    routed, route = [], moe.route

    def recording_route(x):
        probs, indices = route(x)
        routed.append(indices)
        return probs, indices

    moe.route = recording_route
    with torch.no_grad():
        model(**tiny_inputs())
        check_router_inputs_finite(model)
        head, expert = 1, int(routed[0][1, 0, 0])  # head 1's first choice for the first token
        moe.W_up[head * moe.num_experts + expert, 3, 5] = float("nan")
        model(**tiny_inputs())
        match = (
            r"first in transformer_blocks\.2\.mlp\.moe_mlp; the weight transformer_blocks\.1\.mlp\.moe_mlp\.W_up "
            rf"holds nan at expert {expert} of head 1 \(element \[{head * moe.num_experts + expert}, 3, 5\]\)"
        )
        with pytest.raises(ValueError, match=match):
            check_router_inputs_finite(model)


def test_the_hook_checks_each_forward_once_naming_the_loop_step_and_the_model_serves_on():
    """Installed twice, the hook is there once; a forward with a NaN router input raises at its end (with the step
    of the cache context it ran in, none outside one); a NaN recorded outside a forward (a MoE layer called
    directly) does not fail the next forward, whose output is the clean one bit for bit."""
    model, inputs = tiny_model(), tiny_inputs()
    with torch.no_grad():
        reference = model(**inputs).sample
        assert apply_router_input_check(apply_router_input_check(model)) is model
        assert list(HookRegistry.check_if_exists_or_initialize(model).hooks) == ["magi2_router_input_check"]
        assert torch.equal(model(**inputs).sample, reference)
        first_moe = rf"transformer_blocks\.{min(model.config.moe_layers)}\.mlp\.moe_mlp"
        at_step = rf"^MoE router inputs are not finite at step index 4: first in {first_moe};"
        with model.cache_context("cond_uncond", step_index=4), pytest.raises(ValueError, match=at_step):
            model(**_with_nan_video(inputs))
        with pytest.raises(ValueError, match=rf"^MoE router inputs are not finite: first in {first_moe};"):
            model(**_with_nan_video(inputs))
        moe = model.transformer_blocks[min(model.config.moe_layers)].mlp.moe_mlp
        moe(torch.full((4, moe.hidden_size), float("nan")))
        assert bool(moe.non_finite_router_logits.value)
        assert torch.equal(model(**inputs).sample, reference)


def test_a_checkpointed_blocks_recompute_runs_no_check(monkeypatch):
    """With gradient checkpointing the backward recomputes each block (its MoE layer routes again), but the check
    runs once per forward of the model, not in the recompute."""
    checks, real = [], finite_checks_magi2.check_router_inputs_finite

    def counted(model, step_index=None):
        checks.append(step_index)
        return real(model, step_index)

    monkeypatch.setattr(finite_checks_magi2, "check_router_inputs_finite", counted)
    model = apply_router_input_check(tiny_model()).train()
    model.enable_gradient_checkpointing()
    moe = model.transformer_blocks[min(model.config.moe_layers)].mlp.moe_mlp
    routes = []
    moe.register_forward_pre_hook(lambda *_: routes.append(1))
    out = model(**tiny_inputs()).sample
    assert (len(checks), len(routes)) == (1, 1)
    out.square().mean().backward()
    assert (len(checks), len(routes)) == (1, 2)


def test_a_stage_result_check_names_the_first_non_finite_weight_of_the_whole_model():
    """Finite results pass; a non-finite one names the first NaN/inf weight in ``named_parameters()`` order, even
    one after every MoE layer (the final projection), and with none blames the input."""
    model = tiny_model()
    latents = {"latents": torch.zeros(2, 3), "audio_latents": torch.zeros(4)}
    check_stage_result_finite(model, latents, "preview")
    bad = {**latents, "audio_latents": torch.tensor([0.0, 1.0, float("inf"), 0.0])}
    with pytest.raises(
        ValueError,
        match=r"^the preview stage's result is not finite \(NaN/inf in audio_latents\); no weight of the model is NaN/inf",
    ):
        check_stage_result_finite(model, bad, "preview")
    moe = model.transformer_blocks[1].mlp.moe_mlp
    with torch.no_grad():
        model.post_adapter.final_linear_video.weight[1, 2] = float("inf")
        moe.W_down[5, 3, 1] = float("nan")  # row 5 = head 1, expert 1 (4 experts per head)
    order = [name for name, _ in model.named_parameters()]
    assert order.index("post_adapter.final_linear_video.weight") < order.index(
        "transformer_blocks.1.mlp.moe_mlp.W_down"
    )
    projection = r"the weight post_adapter\.final_linear_video\.weight holds inf at element \[1, 2\]"
    with pytest.raises(ValueError, match=projection):
        check_stage_result_finite(model, bad, "preview")
    with torch.no_grad():
        model.post_adapter.final_linear_video.weight[1, 2] = 0.0
    expert = r"the weight transformer_blocks\.1\.mlp\.moe_mlp\.W_down holds nan at expert 1 of head 1 \(element \[5, 3, 1\]\)"
    with pytest.raises(
        ValueError, match=r"^the refiner stage's result is not finite \(NaN/inf in latents\); " + expert
    ):
        check_stage_result_finite(model, {"latents": torch.full((2,), float("nan"))}, "refiner")
