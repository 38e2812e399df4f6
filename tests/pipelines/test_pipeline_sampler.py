"""Preview sampler semantics: schedule (shift applied once), noise order, CFG and Flow-UniPC steps vs the ``sampler/`` fixture."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.pipeline_stubs import StandInTransformer, preview_scheduler, tiny_oobleck, tiny_wan22_vae
from safetensors.torch import load_file

from diffusers_magi2.pipelines.pipeline_magi2 import Magi2Pipeline  # noqa: E402


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def cases(fixtures_dir):
    return load_file(str(fixtures_dir / "magi2_tiny_components" / "sampler" / "sampler_cases.safetensors"))


#: The fixture's clip, 3 video and 10 audio latent frames (the pipeline refuses noise of another length).
FIXTURE_CLIP = {"duration_s": 0.72, "audio_latent_fps": 10 / 0.72}


def make_pipe(scheduler=None):
    return Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=StandInTransformer(),
        audio_vae=tiny_oobleck(),
        scheduler=scheduler or preview_scheduler(),
    )


def embeds():
    g = torch.Generator().manual_seed(3)
    return {
        "prompt_embeds": torch.randn(1, 5, 8, generator=g),
        "prompt_attention_mask": torch.ones(1, 5, dtype=torch.bool),
        "negative_prompt_embeds": torch.randn(1, 3, 8, generator=g),
        "negative_prompt_attention_mask": torch.ones(1, 3, dtype=torch.bool),
    }


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_schedule_shift_applied_once_for_video_and_audio(task):
    """Both task paths, and both the video and audio schedulers, give the reference schedule
    (SandAI ``Magi2PreviewSampler``): the shift is applied once, by the scheduler. The I2V path runs ``__call__`` with an
    image (tiny Wan2.2 VAE, stand-in DiT) and records the timesteps the model received."""
    pipe = make_pipe()
    if task == "i2v":
        pipe.register_modules(vae=tiny_wan22_vae())
        e = embeds()
        image = PIL.Image.fromarray(np.full((20, 30, 3), 128, dtype=np.uint8))
        pipe(
            **e,
            image=image,
            image_embeds=torch.zeros(1, 8),
            height=32,
            width=48,
            num_inference_steps=100,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
        seen = [int(c["timestep"][0]) for c in pipe.transformer.calls]
        # 30x20 -> 48x32 (long side 48) -> floored to multiples of 32: 32x32 -> latent 2x2
        assert pipe.transformer.calls[0]["image_latents"].shape == (2, 48, 1, 2, 2)
    video, audio, timesteps = pipe.prepare_timesteps(100, "cpu")
    if task == "i2v":
        assert seen == timesteps.tolist()
    for sched in (video, audio):
        ts = sched.timesteps.tolist()
        assert ts[:5] == [999, 998, 996, 995, 993]
        assert ts[-3:] == [177, 124, 65]
        assert abs(float(sched.sigmas[0]) - 0.999857) <= 1e-6
        assert float(sched.sigmas[-1]) == 0.0
        assert len(ts) == 100
    assert video is pipe.scheduler and audio is not pipe.scheduler
    assert pipe.config.sigma_start == 0.999


def test_schedule_matches_fixture_tables(cases):
    pipe = make_pipe()
    for n, name in ((100, "preview100_shift7"), (6, "preview6_shift7")):
        video, audio, timesteps = pipe.prepare_timesteps(n, "cpu")
        assert torch.equal(timesteps.cpu(), cases[f"schedule.{name}.timesteps"])
        assert torch.allclose(video.sigmas.float(), cases[f"schedule.{name}.sigmas"], atol=1e-7, rtol=0)
        assert torch.equal(audio.timesteps, timesteps)


def test_scheduler_without_flow_sigmas_is_rejected():
    """A scheduler that would not apply the shift (or would use another schedule) raises."""
    from diffusers import UniPCMultistepScheduler

    bad = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=False)
    pipe = make_pipe(scheduler=bad)
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        pipe.prepare_timesteps(10, "cpu")


def test_noise_draw_order_video_then_audio(cases):
    pipe = make_pipe()
    video, audio = pipe.prepare_latents(
        1, 32, 48, "cpu", torch.Generator().manual_seed(42), num_latent_frames=3, num_audio_latents=10
    )
    assert torch.equal(video, cases["preview.init.video_noise"])
    assert torch.equal(audio, cases["preview.init.audio_noise"])
    # default sizes: a 10 s clip
    video, audio = pipe.prepare_latents(1, 256, 448, "cpu", torch.Generator().manual_seed(0))
    assert video.shape == (1, 48, 32, 16, 28) and audio.shape == (1, 250, 64)


def test_sampler_closed_loop_matches_fixture(cases):
    """6 steps with the documented stand-in velocity, CFG 5.0 / 7.0, through ``__call__``."""
    pipe = make_pipe()
    pipe.register_to_config(**FIXTURE_CLIP)
    seen = []

    def record(p, i, t, tensors):
        seen.append((int(t), {k: v.clone() for k, v in tensors.items()}))
        return {}

    out = pipe(
        **embeds(),
        height=32,
        width=48,
        num_inference_steps=6,
        latents=cases["preview.init.video_noise"],
        audio_latents=cases["preview.init.audio_noise"],
        output_type="latent",
        callback_on_step_end=record,
    )
    assert [t for t, _ in seen] == cases["preview.timesteps"].tolist()
    for k, (_, tensors) in enumerate(seen):
        for name, key in (("latents", "video"), ("audio_latents", "audio")):
            ref = cases[f"preview.step{k}.{key}_latent_out"]
            assert (tensors[name] - ref).abs().max().item() <= 1e-4
            assert rel_l2(tensors[name], ref) <= 1e-5
    for got, key in ((out.frames, "video"), (out.audio, "audio")):
        ref = cases[f"preview.final.{key}"]
        assert (got - ref).abs().max().item() <= 1e-4, key
        assert rel_l2(got, ref) <= 1e-5, key

    # what the model saw: batch [cond, uncond], shared latents, integer timesteps as floats,
    # each text half with its own true length
    calls = pipe.transformer.calls
    assert len(calls) == 6
    for k, call in enumerate(calls):
        assert call["hidden_states"].shape[0] == 2
        assert torch.equal(call["hidden_states"][0], call["hidden_states"][1])
        assert call["timestep"].dtype == torch.float32
        assert call["timestep"].tolist() == [float(cases["preview.timesteps"][k])] * 2
        assert torch.allclose(call["timestep"] / 1000.0, cases["preview.t_normalized"][k].expand(2))
        assert call["encoder_attention_mask"].sum(1).tolist() == [5, 3]
        assert torch.allclose(call["hidden_states"][:1], cases[f"preview.step{k}.video_latent_in"], atol=1e-5, rtol=0)
        assert torch.allclose(
            call["audio_hidden_states"][:1], cases[f"preview.step{k}.audio_latent_in"], atol=1e-5, rtol=0
        )


def test_sampler_teacher_forced_steps_match(cases):
    """Each scheduler step fed the fixture's guided velocity and input reproduces its output."""
    pipe = make_pipe()
    video, audio, timesteps = pipe.prepare_timesteps(6, "cpu")
    for k, t in enumerate(timesteps):
        cond, uncond = cases[f"preview.step{k}.video_cond"], cases[f"preview.step{k}.video_uncond"]
        guided = uncond + 5.0 * (cond - uncond)
        assert torch.allclose(guided, cases[f"preview.step{k}.video_guided"], atol=1e-6, rtol=0)
        out = video.step(guided, t, cases[f"preview.step{k}.video_latent_in"], return_dict=False)[0]
        assert (out - cases[f"preview.step{k}.video_latent_out"]).abs().max().item() <= 1e-6
        a_guided = cases[f"preview.step{k}.audio_uncond"] + 7.0 * (
            cases[f"preview.step{k}.audio_cond"] - cases[f"preview.step{k}.audio_uncond"]
        )
        out = audio.step(a_guided, t, cases[f"preview.step{k}.audio_latent_in"], return_dict=False)[0]
        assert (out - cases[f"preview.step{k}.audio_latent_out"]).abs().max().item() <= 1e-6


def test_guidance_one_skips_uncond_and_callback_can_replace_latents(cases):
    pipe = make_pipe()
    pipe.register_to_config(**FIXTURE_CLIP)
    e = embeds()
    replaced = {}

    def zero_audio(p, i, t, tensors):
        replaced[i] = True
        return {"audio_latents": torch.zeros_like(tensors["audio_latents"])}

    out = pipe(
        prompt_embeds=e["prompt_embeds"],
        prompt_attention_mask=e["prompt_attention_mask"],
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        height=32,
        width=48,
        num_inference_steps=2,
        latents=cases["preview.init.video_noise"],
        audio_latents=cases["preview.init.audio_noise"],
        output_type="latent",
        callback_on_step_end=zero_audio,
    )
    assert all(c["hidden_states"].shape[0] == 1 for c in pipe.transformer.calls)
    assert torch.count_nonzero(out.audio) == 0 and len(replaced) == 2
    assert out.fps is None and out.audio_sample_rate is None


def test_callback_receives_every_allowed_tensor_by_name(cases):
    """Each name in ``_callback_tensor_inputs`` reaches the callback with the loop's current tensor."""
    pipe = make_pipe()
    pipe.register_to_config(**FIXTURE_CLIP)
    e = embeds()
    seen = []

    def record_all(p, i, t, tensors):
        seen.append({k: v.clone() for k, v in tensors.items()})
        return {}

    out = pipe(
        prompt_embeds=e["prompt_embeds"],
        prompt_attention_mask=e["prompt_attention_mask"],
        negative_prompt_embeds=e["negative_prompt_embeds"],
        negative_prompt_attention_mask=e["negative_prompt_attention_mask"],
        height=32,
        width=48,
        num_inference_steps=2,
        latents=cases["preview.init.video_noise"],
        audio_latents=cases["preview.init.audio_noise"],
        output_type="latent",
        callback_on_step_end=record_all,
        callback_on_step_end_tensor_inputs=list(pipe._callback_tensor_inputs),
    )
    assert len(seen) == 2 and set(seen[-1]) == set(pipe._callback_tensor_inputs)
    assert torch.equal(seen[-1]["latents"], out.frames) and torch.equal(seen[-1]["audio_latents"], out.audio)
    assert torch.equal(seen[0]["prompt_embeds"], e["prompt_embeds"])
    assert torch.equal(seen[0]["negative_prompt_embeds"], e["negative_prompt_embeds"])
