"""``Magi2ModularPipeline`` (``Magi2AutoBlocks``) against ``Magi2Pipeline`` on the tiny default's components,
same seed: every step's latents (seen by a step callback), the frames, the audio and the frame rate are equal bit
for bit on the text-to-video, image-to-video and two-stage paths, and with other CFG scales set on the guiders;
callbacks that replace a tensor or interrupt behave the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.guiders import ClassifierFreeGuidance
from helpers.modular_testing_utils import IMAGE, PROMPT, T2V, TWO_STAGE, tiny_pipelines

from diffusers_magi2.modular_pipelines import Magi2ModularPipeline


@pytest.fixture(scope="module")
def pipes():
    return tiny_pipelines(with_refiner=True)


def _recorder(log):
    def callback(pipe, i, t, tensors):
        log.append((type(pipe).__name__, i, int(t), {k: v.clone() for k, v in tensors.items()}))
        return {}

    return callback


def _run_both(pipes, **call):
    pipe, modular = pipes
    names = ["latents", "audio_latents", "prompt_embeds"]
    classic_log, modular_log = [], []
    ref = pipe(
        PROMPT,
        generator=torch.Generator().manual_seed(11),
        callback_on_step_end=_recorder(classic_log),
        callback_on_step_end_tensor_inputs=names,
        **call,
    )
    state = modular(
        prompt=PROMPT,
        generator=torch.Generator().manual_seed(11),
        callback_on_step_end=_recorder(modular_log),
        callback_on_step_end_tensor_inputs=names,
        **call,
    )
    return ref, state, classic_log, modular_log


def _assert_same_steps(classic_log, modular_log):
    assert len(classic_log) == len(modular_log) > 0
    for (cls_a, i_a, t_a, a), (cls_b, i_b, t_b, b) in zip(classic_log, modular_log):
        assert (cls_a, cls_b) == ("Magi2Pipeline", "Magi2ModularPipeline")
        assert (i_a, t_a) == (i_b, t_b) and a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (i_a, name)


@pytest.mark.parametrize(
    "mode, call",
    [("t2v", T2V), ("i2v", {**T2V, "height": 64, "width": 64, "image": IMAGE}), ("two_stage", TWO_STAGE)],
)
def test_modular_equals_classic_bit_for_bit(pipes, mode, call):
    ref, state, classic_log, modular_log = _run_both(pipes, **call)
    _assert_same_steps(classic_log, modular_log)
    steps = call["num_inference_steps"] + (call.get("refiner_num_inference_steps", 0))
    assert len(modular_log) == steps
    assert np.array_equal(ref.frames, state.get("videos"))
    assert np.array_equal(ref.audio, state.get("audio"))
    assert (ref.fps, ref.audio_sample_rate) == (state.get("fps"), state.get("audio_sample_rate"))
    assert ref.fps == (25.0 if mode == "two_stage" else 12.5)
    # the final latents in the state are the last step's
    assert torch.equal(state.get("latents"), modular_log[-1][3]["latents"])
    if mode == "i2v":
        assert state.get("image_latents") is not None and state.get("image_embeds") is not None
    else:
        assert state.get("image_latents") is None


def test_cfg_scales_on_the_guiders_equal_the_classic_scales(pipes):
    """``guider`` / ``audio_guider`` at ``(3, 4)`` give ``Magi2Pipeline(guidance_scale=3, audio_guidance_scale=4)``
    bit for bit (same arithmetic, ``v_u + g (v_c - v_u)``). At video scale 1 the arithmetic differs: the video
    guider returns the conditional prediction ``v_c``, where ``Magi2Pipeline`` (whose forward still has the uncond
    half, for the audio) computes ``v_u + 1 (v_c - v_u)``; after one step the video latent is equal within fp32
    rounding and the audio latent bit for bit."""
    pipe, modular = pipes
    saved = {"guider": modular.guider, "audio_guider": modular.audio_guider}

    def both(video: float, audio: float, **call):
        modular.update_components(
            guider=ClassifierFreeGuidance(guidance_scale=video),
            audio_guider=ClassifierFreeGuidance(guidance_scale=audio),
        )
        ref = pipe(PROMPT, guidance_scale=video, audio_guidance_scale=audio, generator=_seed(6), **call)
        return ref, modular(prompt=PROMPT, generator=_seed(6), **call)

    try:
        ref, state = both(3.0, 4.0, **T2V)
        assert np.array_equal(ref.frames, state.get("videos")) and np.array_equal(ref.audio, state.get("audio"))
        ref, state = both(1.0, 4.0, **{**T2V, "num_inference_steps": 1, "output_type": "latent"})
        torch.testing.assert_close(state.get("latents"), ref.frames, rtol=1.3e-6, atol=1e-5)
        assert torch.equal(ref.audio, state.get("audio_latents"))
    finally:
        modular.update_components(**saved)


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_callbacks_replace_tensors_and_interrupt_the_same(pipes):
    """Step 0 halves the latents through the returned dict; step 1 sets ``pipe._interrupt``: the remaining steps
    are skipped and the (preview) latents returned, in both pipelines alike."""

    def make(log):
        def callback(pipe, i, t, tensors):
            log.append(i)
            if i == 0:
                return {"latents": tensors["latents"] * 0.5}
            pipe._interrupt = True
            return {}

        return callback

    pipe, modular = pipes
    call = {**T2V, "num_inference_steps": 4, "output_type": "latent"}
    classic_calls, modular_calls = [], []
    ref = pipe(PROMPT, generator=torch.Generator().manual_seed(2), callback_on_step_end=make(classic_calls), **call)
    state = modular(
        prompt=PROMPT, generator=torch.Generator().manual_seed(2), callback_on_step_end=make(modular_calls), **call
    )
    assert classic_calls == modular_calls == [0, 1]
    assert pipe.interrupt and modular.interrupt
    assert torch.equal(ref.frames, state.get("videos")) and torch.equal(ref.audio, state.get("audio"))
    # the interrupt is reset by the next call
    again = modular(prompt=PROMPT, generator=torch.Generator().manual_seed(2), output=["videos"], **call)
    assert not modular.interrupt and not torch.equal(again["videos"], state.get("videos"))


def test_text_embeddings_reused_across_two_seeds(pipes):
    """The composed use: run the text encoder once, keep the embeddings, denoise twice with two seeds."""
    pipe, modular = pipes
    blocks = modular.blocks
    text = blocks.sub_blocks.pop("text_encoder")
    encoder = Magi2ModularPipeline.from_classic(pipe, blocks=_sequential(input=blocks.sub_blocks["input"], text=text))
    embeds = encoder(
        prompt=PROMPT,
        **T2V,
        output=["prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask"],
    )
    generator = Magi2ModularPipeline.from_classic(pipe, blocks=blocks)  # input, image, denoise, refiner, decode
    generator.set_progress_bar_config(disable=True)
    first, second = (
        generator(**embeds, **T2V, generator=torch.Generator().manual_seed(seed), output="videos") for seed in (4, 5)
    )
    assert np.array_equal(first, pipe(PROMPT, generator=torch.Generator().manual_seed(4), **T2V).frames)
    assert not np.array_equal(first, second)


def _sequential(**blocks):
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    return SequentialPipelineBlocks.from_blocks_dict(blocks)


def test_a_nan_latent_is_refused_at_the_same_step_by_both_pipelines(pipes):
    """A callback that poisons the latents after step 0: the next step's routers see NaN and both loops raise the
    step check's error for step 1, before that step is taken (the modular denoiser calls the same check)."""

    def poison(pipe, i, t, tensors):
        return {"latents": torch.full_like(tensors["latents"], float("nan"))} if i == 0 else {}

    pipe, modular = pipes
    call = {**T2V, "output_type": "latent", "callback_on_step_end": poison}
    match = r"MoE router inputs are not finite at step index 1: first in transformer_blocks\.\d+\.mlp\.moe_mlp"
    with pytest.raises(ValueError, match=match):
        pipe(PROMPT, generator=torch.Generator().manual_seed(3), **call)
    with pytest.raises(ValueError, match=match):
        modular(prompt=PROMPT, generator=torch.Generator().manual_seed(3), **call)
    # the flags were cleared: both serve again
    assert torch.isfinite(
        pipe(PROMPT, generator=torch.Generator().manual_seed(3), **T2V, output_type="latent").frames
    ).all()


def test_a_nan_seen_outside_a_step_does_not_fail_the_next_request(pipes):
    """A MoE layer called directly with NaN records it, and no step check follows (as after a direct model call, or a
    forward cut short by an exception): each pipeline's next request still runs, as its steps clear the flags
    before their forwards, and gives the latents of a clean run."""
    pipe, modular = pipes
    moe = next(m for m in pipe.transformer.modules() if hasattr(m, "non_finite_router_logits"))
    call = {**T2V, "output_type": "latent"}
    clean = pipe(PROMPT, generator=torch.Generator().manual_seed(5), **call).frames
    for run in (
        lambda: pipe(PROMPT, generator=torch.Generator().manual_seed(5), **call).frames,
        lambda: modular(prompt=PROMPT, generator=torch.Generator().manual_seed(5), **call).get("videos"),
    ):
        with torch.no_grad():
            moe(torch.full((4, moe.hidden_size), float("nan")))
        assert bool(moe.non_finite_router_logits.value)
        assert torch.equal(run(), clean)
