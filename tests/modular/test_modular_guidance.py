"""The modular denoise loops guide through diffusers guiders: swapping the video ``guider`` for diffusers'
adaptive projected guidance (APG) gives, at every step, that guider's own formula applied to the transformer's
conditional and unconditional predictions (computed here independently), while the audio keeps its CFG; a
guider that runs only the conditional pass leaves the negative prompt unencoded; a guider that hooks the model
for one pass, and a guidance scale passed to the call (it is the guider's), are refused before any work."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler
from diffusers.guiders import AdaptiveProjectedGuidance, ClassifierFreeGuidance, SkipLayerGuidance
from helpers.modular_testing_utils import PROMPT, T2V, tiny_pipelines


@pytest.fixture(scope="module")
def modular():
    return tiny_pipelines()[1]


@pytest.fixture
def guiders(modular):
    """Restores the default guiders after the test."""
    saved = {"guider": modular.guider, "audio_guider": modular.audio_guider}
    yield modular
    modular.update_components(**saved)


def apg_reference(cond, uncond, scale: float, eta: float, threshold: float) -> torch.Tensor:
    """APG (Sadat et al. 2024, arXiv:2410.02416) per sample: the CFG update ``cond - uncond`` clipped to norm
    ``threshold``, split into its part along ``cond`` and the rest, the parallel part weighted by ``eta``."""
    dims = tuple(range(1, cond.ndim))
    update = cond - uncond
    norm = torch.linalg.vector_norm(update, dim=dims, keepdim=True)
    update = (update * torch.clamp(threshold / norm, max=1.0)).double()
    direction = cond.double() / torch.linalg.vector_norm(cond.double(), dim=dims, keepdim=True)
    parallel = (update * direction).sum(dim=dims, keepdim=True) * direction
    return uncond + scale * (update - parallel + eta * parallel).float()


def test_an_apg_video_guider_gives_the_apg_formula_and_the_audio_keeps_cfg(guiders, monkeypatch):
    modular = guiders
    scale, eta, threshold = 4.0, 0.5, 20.0
    modular.update_components(
        guider=AdaptiveProjectedGuidance(guidance_scale=scale, eta=eta, adaptive_projected_guidance_rescale=threshold)
    )
    forwards, velocities = [], []
    hook = modular.transformer.register_forward_hook(
        lambda module, args, out: forwards.append((out.sample.float().clone(), out.audio_sample.float().clone()))
    )
    step = UniPCMultistepScheduler.step

    def recording_step(self, model_output, *args, **kwargs):
        velocities.append(model_output.clone())
        return step(self, model_output, *args, **kwargs)

    monkeypatch.setattr(UniPCMultistepScheduler, "step", recording_step)
    try:
        modular(prompt=PROMPT, generator=torch.Generator().manual_seed(3), output_type="latent", **T2V)
    finally:
        hook.remove()
    assert len(forwards) == T2V["num_inference_steps"] and len(velocities) == 2 * len(forwards)
    clipped = []
    for (video, audio), video_velocity, audio_velocity in zip(forwards, velocities[::2], velocities[1::2]):
        (v_c, v_u), (a_c, a_u) = video.chunk(2), audio.chunk(2)  # one forward on [cond; uncond]
        clipped.append(torch.linalg.vector_norm(v_c - v_u).item() > threshold)
        torch.testing.assert_close(video_velocity, apg_reference(v_c, v_u, scale, eta, threshold))
        assert not torch.allclose(video_velocity, v_u + scale * (v_c - v_u), atol=1e-3)  # not plain CFG
        assert torch.equal(audio_velocity, a_u + 7.0 * (a_c - a_u))  # the audio guider's CFG, bit for bit
    assert all(clipped)  # the norm clip of APG is exercised


def test_a_guider_without_an_unconditional_pass_leaves_the_negative_prompt_unencoded(guiders):
    modular = guiders
    modular.update_components(
        guider=ClassifierFreeGuidance(guidance_scale=1.0), audio_guider=ClassifierFreeGuidance(guidance_scale=1.0)
    )
    calls = []
    hook = modular.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        state = modular(prompt=PROMPT, generator=torch.Generator().manual_seed(3), output_type="latent", **T2V)
    finally:
        hook.remove()
    assert state.get("negative_prompt_embeds") is None
    assert calls == [1] * T2V["num_inference_steps"]  # the conditional pass alone


def test_a_guider_that_hooks_the_model_for_one_pass_is_refused_before_any_work(guiders):
    modular = guiders
    modular.update_components(guider=SkipLayerGuidance(skip_layer_guidance_layers=[0]))
    calls = []
    hook = modular.text_encoder.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="guider is a SkipLayerGuidance, which changes the model for one pass"):
            modular(prompt=PROMPT, **T2V)
        with pytest.raises(ValueError, match=r"audio_guider=pipe.audio_guider.new\(guidance_scale=3.0\)"):
            modular(prompt=PROMPT, audio_guidance_scale=3.0, **T2V)
    finally:
        hook.remove()
    assert calls == []
