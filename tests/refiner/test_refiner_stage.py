"""Refiner stage (SandAI ``evaluate_magi2_refiner_with_latent``) against the `sampler/` component fixture (stand-in refiner velocity)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler
from helpers.pipeline_stubs import refiner_velocity
from safetensors.torch import load_file

from diffusers_magi2.pipelines.refiner_stage import (
    Magi2RefinerStageConfig,
    make_refiner_scheduler,
    prepare_refiner_latents,
    refiner_latent_size,
    refiner_renoise_scale,
    renoise_latents,
    upsample_preview_latents,
    zero_snr_refiner_sigmas,
)
from diffusers_magi2.pipelines.sampling_magi2 import unshifted_sigmas


B48 = torch.linspace(-0.05, 0.05, 48).view(1, 48, 1, 1, 1)
COND = torch.ones(1, 2, 8)
UNCOND = torch.zeros(1, 3, 8)


class _Out:
    def __init__(self, sample):
        self.sample = sample


class StandIn:
    """The fixture's deterministic refiner stand-in (no timestep input), recording its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, hidden_states, encoder_hidden_states, encoder_attention_mask=None, attention_kwargs=None):
        x = hidden_states
        cond = encoder_hidden_states is COND
        self.calls.append(("cond" if cond else "uncond", x.shape[0], x.clone()))
        if cond:
            return _Out(1.02 * x - 0.2 * torch.sin(x) + B48)
        return _Out(0.98 * x + 0.1 * torch.cos(x))


#: SandAI ``magi2_refiner.json`` ``evaluation_config``: 5 steps, shift 5, CFG 2, re-noise at 220.
RELEASED = Magi2RefinerStageConfig(
    num_inference_steps=5, shift=5.0, guidance_scale=2.0, noise_value=220, sigma_start=0.999, vae_stride_spatial=16
)


def run_stage(model, latents, cond, uncond, scheduler, height, width, config=RELEASED, on_step=None, **noise):
    """The stage from ``prepare_refiner_latents`` and refiner forwards with a loop of its own (batch 1)."""
    x, stage_scheduler = prepare_refiner_latents(latents, scheduler, config, height, width, **noise)
    g = config.guidance_scale
    for i, t in enumerate(stage_scheduler.timesteps):
        v = refiner_velocity(model, x, cond)
        if g != 1.0:
            u = refiner_velocity(model, x, uncond)
            v = u + torch.tensor(g) * (v - u)
        x = stage_scheduler.step(v, t, x, return_dict=False)[0]
        if on_step is not None:
            on_step(i, t, x)
    return x


def _base_scheduler():
    return UniPCMultistepScheduler(
        use_flow_sigmas=True,
        flow_shift=7.0,
        prediction_type="flow_prediction",
        solver_order=2,
        solver_type="bh2",
        predict_x0=True,
        lower_order_final=True,
        final_sigmas_type="zero",
    )


@pytest.fixture(scope="module")
def case(fixtures_dir):
    return load_file(str(fixtures_dir / "magi2_tiny_components/sampler/sampler_cases.safetensors"))


def test_zero_snr_table_and_renoise_scale(case):
    table = zero_snr_refiner_sigmas()
    assert table.shape == (1000,) and table.dtype == torch.float32
    assert (table - case["refiner.zero_snr_sigmas"]).abs().max().item() <= 2e-7
    s = refiner_renoise_scale(220)
    assert s.item() == case["refiner.sigma_220"].item()
    assert abs(s.item() - 0.838910) < 1e-6
    assert ((1 - s**2) ** 0.5).item() == pytest.approx(case["refiner.noise_coef"].item(), abs=1e-7)
    assert table[999].item() == 0.0 and abs(table[0].item() - 0.99957) < 1e-5
    with pytest.raises(ValueError, match="noise_value"):
        refiner_renoise_scale(1000)


def test_upsample_and_renoise(case):
    up = upsample_preview_latents(case["refiner.input_latent"], *refiner_latent_size(48, 80))
    assert up.shape == (1, 48, 5, 3, 5)
    assert (up - case["refiner.upsampled"]).abs().max().item() <= 1e-6
    rn = renoise_latents(up, case["refiner.noise_eps"], 220)
    assert (rn - case["refiner.renoised"]).abs().max().item() <= 1e-6
    assert refiner_latent_size(1088, 1920) == (68, 120)
    assert upsample_preview_latents(torch.zeros(1, 2, 32, 2, 2), 3, 3).shape[2] == 63


def test_refiner_schedule_values(case):
    sched = make_refiner_scheduler(_base_scheduler(), 5.0)
    assert sched.config.flow_shift == 5.0 and sched.config.solver_order == 2
    sched.set_timesteps(sigmas=unshifted_sigmas(0.999, 5))
    assert sched.timesteps.tolist() == [999, 952, 882, 768, 555]
    assert torch.equal(sched.timesteps.cpu(), case["refiner.timesteps"])
    assert np.allclose(np.asarray(sched.sigmas, dtype=np.float32), case["refiner.sigmas"].numpy(), atol=1e-7)
    assert np.allclose(np.asarray(sched.sigmas)[:5], [0.9998, 0.9522, 0.8821, 0.7689, 0.5552], atol=1e-4)
    with pytest.raises(ValueError, match="flow"):
        make_refiner_scheduler(UniPCMultistepScheduler(), 5.0)


def test_refiner_stage_closed_loop(case):
    model = StandIn()
    steps = []
    out = run_stage(
        model,
        case["refiner.input_latent"],
        COND,
        UNCOND,
        _base_scheduler(),
        height=48,
        width=80,
        noise=case["refiner.noise_eps"],
        on_step=lambda i, t, x: steps.append((int(t), x.clone())),
    )
    assert [t for t, _ in steps] == [999, 952, 882, 768, 555]
    # two batch-1 forwards per step, cond then uncond
    assert [c[0] for c in model.calls] == ["cond", "uncond"] * 5
    assert all(c[1] == 1 for c in model.calls)
    for k in range(5):
        assert (model.calls[2 * k][2] - case[f"refiner.step{k}.latent_in"]).abs().max().item() <= 1e-6
        assert (steps[k][1] - case[f"refiner.step{k}.latent_out"]).abs().max().item() <= 1e-6
    assert (out - case["refiner.final.video"]).abs().max().item() <= 1e-6


def test_refiner_stage_teacher_forced_guidance(case):
    """Stored cond/uncond velocities -> guided velocity and scheduler step, per step."""
    sched = make_refiner_scheduler(_base_scheduler(), 5.0)
    sched.set_timesteps(sigmas=unshifted_sigmas(0.999, 5))
    for k, t in enumerate(sched.timesteps):
        c, u = case[f"refiner.step{k}.video_cond"], case[f"refiner.step{k}.video_uncond"]
        v = u + torch.tensor(2.0) * (c - u)
        assert torch.equal(v, case[f"refiner.step{k}.video_guided"])
        x = sched.step(v, t, case[f"refiner.step{k}.latent_in"], return_dict=False)[0]
        assert (x - case[f"refiner.step{k}.latent_out"]).abs().max().item() <= 1e-6


def test_refiner_stage_with_generator_and_errors(case):
    model = StandIn()
    gen = torch.Generator().manual_seed(4243)
    out = run_stage(
        model, case["refiner.input_latent"], COND, UNCOND, _base_scheduler(), height=48, width=80, generator=gen
    )
    # the fixture drew eps with torch.manual_seed(4243); randn_like on the default CPU generator
    assert (out - case["refiner.final.video"]).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="noise shape"):
        prepare_refiner_latents(
            case["refiner.input_latent"], _base_scheduler(), RELEASED, 48, 80, noise=torch.zeros(1, 48, 5, 3, 4)
        )
    no_cfg = StandIn()
    run_stage(
        no_cfg,
        case["refiner.input_latent"],
        COND,
        None,
        _base_scheduler(),
        height=48,
        width=80,
        config=dataclasses.replace(RELEASED, guidance_scale=1.0),
        generator=torch.Generator().manual_seed(0),
    )
    assert [c[0] for c in no_cfg.calls] == ["cond"] * 5


def test_refiner_stage_with_tiny_refiner_model(fixtures_dir):
    """The stage drives the real (tiny) refiner model: 2T-1 frames, cond/uncond texts of different lengths."""
    from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel

    model = Magi2RefinerTransformer3DModel.from_original_checkpoint(
        fixtures_dir / "magi2_tiny/refiner/sandai_checkpoint", torch_dtype=torch.float32
    )
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, 12, 3, 2, 4, generator=g)
    cond, uncond = torch.randn(1, 5, 48, generator=g), torch.randn(1, 3, 48, generator=g)
    with torch.no_grad():
        out = run_stage(model, lat, cond, uncond, _base_scheduler(), height=64, width=128, generator=g)
    assert out.shape == (1, 12, 5, 4, 8) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert out.std().item() > 0.1
