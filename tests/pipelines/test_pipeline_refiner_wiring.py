"""``Magi2Pipeline``'s two-stage (1080p refiner) path, wired with fast stand-ins.

The preview DiT is the ``sampler/`` fixture's stand-in (``pipeline_stubs.StandInTransformer``) and the
refiner a small deterministic stand-in with the ``Magi2RefinerTransformer3DModel`` keyword API, so
these tests check the wiring (sizes, noise order, negative prompt, fps, resize, presets) against
independent computations in a few seconds. The real tiny models run in
``test_pipeline_refiner_two_stage.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.pipeline_stubs import (
    StandInRefiner,
    StandInTransformer,
    preview_scheduler,
    refine_directly,
    short_clip_noise,
    stub_embeds,
    tiny_oobleck,
    tiny_text_encoder,
    tiny_wan22_vae,
)

from diffusers_magi2.pipelines.pipeline_magi2 import Magi2Pipeline, resize_video_frames  # noqa: E402


S_220 = 0.838910  # SandAI ZeroSNRDDPMDiscretization: re-noise signal scale at noise_value 220


def make_pipe(with_vae=False, refiner=True):
    return Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=StandInTransformer(),
        audio_vae=tiny_oobleck(),
        scheduler=preview_scheduler(),
        vae=tiny_wan22_vae() if with_vae else None,
        refiner=StandInRefiner() if refiner else None,
    )


embeds = stub_embeds


SMALL = {"height": 64, "width": 96, "preview_height": 32, "preview_width": 48, "num_inference_steps": 2}


def test_pipeline_refiner_path_equals_direct_stage_call():
    """The pipeline's refined latent is exactly the refiner stage run directly on its preview latent with the
    generator continuing from the preview draws; the preview audio is returned untouched."""
    pipe = make_pipe()
    e = embeds()
    two = pipe(**e, **SMALL, generator=torch.Generator().manual_seed(0), output_type="latent")
    refiner_calls = pipe.refiner.calls[:]
    assert two.frames.shape == (1, 48, 63, 4, 6) and two.audio.shape == (1, 250, 64)

    pipe.refiner.calls.clear()
    g = torch.Generator().manual_seed(0)
    preview = pipe(**e, height=32, width=48, num_inference_steps=2, generator=g, output_type="latent")
    assert torch.equal(preview.audio, two.audio)  # audio is not refined
    direct = refine_directly(
        pipe.refiner,
        preview.frames,
        e["prompt_embeds"],
        e["negative_prompt_embeds"],
        pipe.scheduler,
        pipe.refiner_stage_config(),
        height=64,
        width=96,
        prompt_attention_mask=e["prompt_attention_mask"],
        negative_prompt_attention_mask=e["negative_prompt_attention_mask"],
        generator=g,
    )
    assert torch.equal(direct, two.frames)

    # independent check of the first refiner input: trilinear 2T-1 upsample, VP re-noise with the
    # noise drawn after the preview's video then audio noise from the same generator
    g = torch.Generator().manual_seed(0)
    torch.randn(1, 48, 32, 2, 3, generator=g)
    torch.randn(1, 250, 64, generator=g)
    eps = torch.randn(1, 48, 63, 4, 6, generator=g)
    up = F.interpolate(preview.frames, size=(63, 4, 6), mode="trilinear", align_corners=True)
    x0 = up * S_220 + eps * (1 - S_220**2) ** 0.5
    assert (refiner_calls[0]["hidden_states"] - x0).abs().max().item() <= 1e-5
    # 5 steps x (cond, uncond), batch 1, text only (no audio tokens)
    assert len(refiner_calls) == 10
    for i, call in enumerate(refiner_calls):
        want = e["prompt_embeds"] if i % 2 == 0 else e["negative_prompt_embeds"]
        assert torch.equal(call["encoder_hidden_states"], want) and call["audio_hidden_states"] is None


def test_preview_cfg_off_still_feeds_the_negative_prompt_to_the_refiner():
    pipe = make_pipe()
    e = embeds()
    pipe(
        **e,
        **SMALL,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        generator=torch.Generator().manual_seed(1),
        output_type="latent",
        **short_clip_noise(pipe),
    )
    assert all(c["hidden_states"].shape[0] == 1 for c in pipe.transformer.calls)  # preview: no uncond half
    texts = [c["encoder_hidden_states"] for c in pipe.refiner.calls]
    assert len(texts) == 10 and all(torch.equal(t, e["negative_prompt_embeds"]) for t in texts[1::2])


def test_refiner_settings_reach_the_stage():
    pipe = make_pipe()
    e = embeds()
    common = dict(**e, **SMALL, **short_clip_noise(pipe), output_type="latent")
    pipe(
        **common,
        refiner_num_inference_steps=3,
        refiner_guidance_scale=1.0,
        generator=torch.Generator().manual_seed(2),
        attention_kwargs={"window_backend": "sdpa"},
    )
    calls = pipe.refiner.calls
    assert len(calls) == 3 and all(torch.equal(c["encoder_hidden_states"], e["prompt_embeds"]) for c in calls)
    assert calls[0]["attention_kwargs"] == {"window_backend": "sdpa"}


def test_attention_kwargs_reach_the_model_that_declares_them():
    """Each key goes to the model listing it in ``supported_attention_kwargs``; a key no model of the
    call takes raises before any model runs. Both real MAGI-2 models declare only the LoRA ``scale``, and an old refiner
    kernel key names the processor that chooses the kernel now."""
    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel

    assert Magi2Transformer3DModel.supported_attention_kwargs == ("scale",)
    assert Magi2RefinerTransformer3DModel.supported_attention_kwargs == ("scale",)
    pipe = make_pipe()
    pipe.transformer.supported_attention_kwargs = ()
    pipe.refiner.supported_attention_kwargs = ("refiner_only",)
    seen = []
    forward = pipe.transformer.forward

    def recording_forward(*args, attention_kwargs=None, **kwargs):
        seen.append(attention_kwargs)
        return forward(*args, attention_kwargs=attention_kwargs, **kwargs)

    pipe.transformer.forward = recording_forward
    e = embeds()
    common = dict(**e, **short_clip_noise(pipe), output_type="latent")
    pipe(
        **common,
        **SMALL,
        refiner_num_inference_steps=1,
        generator=torch.Generator().manual_seed(2),
        attention_kwargs={"refiner_only": 7},
    )
    assert seen and all(a is None for a in seen)  # the preview DiT takes none of them
    assert pipe.refiner.calls and all(c["attention_kwargs"] == {"refiner_only": 7} for c in pipe.refiner.calls)

    seen.clear()
    pipe.refiner.calls.clear()
    with pytest.raises(ValueError, match=r"does not support attention_kwargs \['lora_rank'\]; allowed keys"):
        pipe(**common, **SMALL, attention_kwargs={"lora_rank": 1})
    with pytest.raises(ValueError, match=r"allowed keys: \[\]"):  # the refiner's key on a single-stage call
        pipe(**common, height=32, width=48, num_inference_steps=1, attention_kwargs={"refiner_only": 7})
    with pytest.raises(ValueError, match="attention_kwargs must be a dict"):
        pipe(**common, **SMALL, attention_kwargs=[("window_backend", "sdpa")])
    assert seen == [] and pipe.refiner.calls == []


def test_decoded_two_stage_output_is_25fps_and_resizable():
    """Refined latents (2T - 1 = 3) decode to 4 * (3 - 1) + 1 = 9 frames at 25 fps; output_height/width
    resize each decoded frame bilinearly (checked against the reference's formula on [0, 1] frames)."""
    pipe = make_pipe(with_vae=True)
    e = embeds()
    kwargs = dict(**e, **SMALL, **short_clip_noise(pipe))
    plain = pipe(**kwargs, generator=torch.Generator().manual_seed(4))
    assert plain.frames.shape == (1, 9, 64, 96, 3) and plain.fps == 25.0 and plain.audio_sample_rate == 44_100
    assert plain.audio.shape == (1, 2, int(10 * 2048 * 441 / 512))
    resized = pipe(**kwargs, generator=torch.Generator().manual_seed(4), output_height=40, output_width=70)
    assert resized.frames.shape == (1, 9, 40, 70, 3) and resized.fps == 25.0
    frames = torch.from_numpy(plain.frames[0]).permute(3, 0, 1, 2)  # reference: [C, F, H, W] per-frame 2-D
    want = F.interpolate(frames, size=(40, 70), mode="bilinear", align_corners=False).permute(1, 2, 3, 0).clamp(0, 1)
    assert np.abs(resized.frames[0] - want.numpy()).max() <= 1e-5
    # one stage keeps 12.5 fps
    one = pipe(
        **e,
        height=32,
        width=48,
        num_inference_steps=1,
        **short_clip_noise(pipe),
    )
    assert one.frames.shape == (1, 5, 32, 48, 3) and one.fps == 12.5


def test_resize_video_frames_chunks_match_one_shot():
    video = torch.randn(2, 3, 7, 8, 10)
    out = resize_video_frames(video, 5, 13, frames_per_chunk=3)
    flat = video.transpose(1, 2).reshape(14, 3, 8, 10)
    want = (
        F.interpolate(flat, size=(5, 13), mode="bilinear", align_corners=False).reshape(2, 7, 3, 5, 13).transpose(1, 2)
    )
    assert torch.allclose(out, want, atol=0, rtol=0)


def test_1080p_preset_uses_the_config_preview_size(monkeypatch):
    """``resolution="1080p"`` (= 1088x1920) denoises the preview at ``config.preview_height/width`` and
    hands the refiner stage the 1088x1920 target (its latents are replaced here, with no steps: 1080p is too big)."""
    pipe = make_pipe()
    pipe.register_to_config(preview_height=32, preview_width=48)
    seen = {}

    def fake_prepare(latents, scheduler, config, height, width, generator=None):
        seen.update(config=config, height=height, width=width, preview_shape=tuple(latents.shape))
        no_steps = SimpleNamespace(timesteps=torch.zeros(0))
        return latents.new_zeros(1, 48, 2 * latents.shape[2] - 1, height // 16, width // 16), no_steps

    monkeypatch.setattr("diffusers_magi2.pipelines.pipeline_magi2.prepare_refiner_latents", fake_prepare)
    out = pipe(
        **embeds(),
        resolution="1080p",
        num_inference_steps=1,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        audio_latents=torch.randn(1, 250, 64),
    )
    assert seen["preview_shape"] == (1, 48, 32, 2, 3)
    assert (seen["height"], seen["width"]) == (1088, 1920)
    cfg = seen["config"]
    assert (cfg.num_inference_steps, cfg.shift, cfg.guidance_scale, cfg.noise_value) == (5, 5.0, 2.0, 220)
    assert out.frames.shape == (1, 48, 63, 68, 120)
    assert Magi2Pipeline.apply_resolution_preset("540p", 512, 896) == (512, 896)
    assert make_pipe().stage_sizes(1088, 1920) == (True, 512, 896)  # released default preview size
    assert make_pipe().stage_sizes(512, 896) == (False, 512, 896)


def test_i2v_reference_image_is_prepared_at_the_preview_size():
    """I2V on the two-stage path encodes the reference image for the preview stage (the refiner
    gets no image tokens), as the reference sizes it from the preview width/height."""
    import PIL.Image

    pipe = make_pipe(with_vae=True)
    image = PIL.Image.fromarray(np.full((30, 40, 3), 100, dtype=np.uint8))
    pipe(
        **embeds(),
        **SMALL,
        image=image,
        image_embeds=torch.zeros(1, 8),
        output_type="latent",
        **short_clip_noise(pipe),
        generator=torch.Generator().manual_seed(0),
    )
    at_preview = pipe.preprocess_reference_image(image, 32, 48).shape[-2:]
    at_output = pipe.preprocess_reference_image(image, 64, 96).shape[-2:]
    assert at_preview != at_output
    got = pipe.transformer.calls[0]["image_latents"].shape[-2:]
    assert tuple(got) == (at_preview[0] // 16, at_preview[1] // 16)
    assert len(pipe.refiner.calls) == 10 and pipe.refiner.calls[0]["hidden_states"].shape == (1, 48, 3, 4, 6)


def test_preview_cfg_off_encodes_the_default_negative_prompt_for_the_refiner():
    """From prompt text with preview CFG off, the pipeline still encodes the (built-in) negative
    prompt, and the refiner's uncond forwards receive exactly its embeddings."""
    from diffusers_magi2.pipelines.tiny_default import build_tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(vocab_size=512)
    text_encoder = tiny_text_encoder(tokenizer, hidden_size=16, intermediate_size=16, head_dim=8, linear_num_heads=1)
    pipe = make_pipe()
    pipe.register_modules(tokenizer=tokenizer, text_encoder=text_encoder)
    pipe(
        prompt="a fox in snow",
        **SMALL,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        refiner_num_inference_steps=1,
        output_type="latent",
        **short_clip_noise(pipe),
        generator=torch.Generator().manual_seed(0),
    )
    neg, _, _ = pipe.encode_text([pipe.config.negative_prompt], "cpu")
    cond, _, _ = pipe.encode_text(["a fox in snow"], "cpu")
    assert all(c["hidden_states"].shape[0] == 1 for c in pipe.transformer.calls)
    calls = pipe.refiner.calls
    assert len(calls) == 2 and cond.shape[1] != neg.shape[1]
    assert torch.equal(calls[0]["encoder_hidden_states"], cond) and torch.equal(calls[1]["encoder_hidden_states"], neg)
