"""The whole chain on real-format input: SandAI checkpoint -> converter -> Magi2Pipeline -> mp4.

The transformer is ``magi2_tiny/preview_h4`` converted with ``magi2-convert``'s library entry; the
text encoder, VAEs and tokenizer are tiny random ones built in code with matching channel counts
(video 12, audio 16, text 48). Also: one denoising-step forward of the real transformer through the
pipeline's batching reproduces the transformer-level fixture (t2v and i2v).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler  # noqa: E402
from helpers.pipeline_stubs import tiny_real_format_components
from safetensors.torch import load_file

from diffusers_magi2 import Magi2Pipeline, Magi2Transformer3DModel, export_to_video_with_audio  # noqa: E402
from diffusers_magi2.utils.export import probe_streams  # noqa: E402


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def converted_repo(fixtures_dir, tmp_path_factory):
    from diffusers_magi2.conversion.repo import ConversionRequest, convert_checkpoint

    out = tmp_path_factory.mktemp("magi2_h4") / "repo"
    src = fixtures_dir / "magi2_tiny" / "preview_h4" / "sandai_checkpoint"
    convert_checkpoint(
        ConversionRequest(
            output_path=out,
            components=["transformer", "scheduler"],
            inputs={"transformer": src},
            config=src / "magi2_preview.json",
        ),
        log=lambda *_: None,
    )
    return out


@pytest.fixture(scope="module")
def pipe(converted_repo):
    components = tiny_real_format_components(with_vae=True)
    components["scheduler"] = UniPCMultistepScheduler.from_pretrained(converted_repo / "scheduler")
    transformer = Magi2Transformer3DModel.from_pretrained(converted_repo / "transformer", dtype=torch.float32)
    return Magi2Pipeline(transformer=transformer, **components)


def test_converted_scheduler_is_the_preview_schedule(pipe):
    _, _, timesteps = pipe.prepare_timesteps(100, "cpu")
    assert timesteps[:5].tolist() == [999, 998, 996, 995, 993] and timesteps[-3:].tolist() == [177, 124, 65]


def test_t2v_call_and_mp4_streams(pipe, tmp_path):
    out = pipe(
        "A red fox trots through fresh snow at dawn, wind howling",
        height=32,
        width=48,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.frames.shape == (1, 125, 32, 48, 3) and out.frames.dtype == np.float32
    assert 0.0 <= out.frames.min() and out.frames.max() <= 1.0
    assert out.audio.shape == (1, 2, 441_000) and out.audio.dtype == np.float32
    assert np.isfinite(out.audio).all() and out.fps == 12.5 and out.audio_sample_rate == 44_100
    # the model really ran on the [cond, uncond] batch with the real 10 s lengths
    path = export_to_video_with_audio(
        out.frames[0], tmp_path / "clip.mp4", audio=out.audio[0], fps=out.fps, audio_sample_rate=out.audio_sample_rate
    )
    info = probe_streams(path)
    frame = 1 / 12.5
    assert info["video_frames"] == 125
    assert info["fps"] == Fraction(25, 2)
    assert info["audio_sample_rate"] == 44_100 and info["audio_channels"] == 2
    assert abs(info["video_stream_duration_s"] - 10.0) <= frame
    assert abs(info["audio_stream_duration_s"] - 10.0) <= frame
    assert abs(info["video_stream_duration_s"] - info["audio_stream_duration_s"]) <= frame
    assert abs(info["audio_duration_s"] - 10.0) <= frame
    assert [p.name for p in tmp_path.iterdir()] == ["clip.mp4"]  # no temporary left behind


@pytest.fixture(scope="module")
def saved_pipeline(pipe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved_pipeline") / "saved"
    pipe.save_pretrained(folder)
    return folder


ONE_STEP = {"prompt": "a cat on a sofa", "height": 32, "width": 48, "num_inference_steps": 1, "output_type": "latent"}


def test_save_load_round_trip_and_latent_output(pipe, saved_pipeline):
    loaded = Magi2Pipeline.from_pretrained(saved_pipeline)
    assert loaded.config.negative_prompt == pipe.config.negative_prompt
    assert loaded.config.sigma_start == 0.999
    a = pipe(**ONE_STEP, generator=torch.Generator().manual_seed(7))
    b = loaded(**ONE_STEP, generator=torch.Generator().manual_seed(7))
    assert a.frames.shape == (1, 12, 32, 2, 3) and a.audio.shape == (1, 250, 16)
    assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio)


def test_a_transformer_quantized_to_int4_at_load_goes_into_from_pretrained(pipe, saved_pipeline):
    """``from_pretrained(..., transformer=...)`` with int4 experts quantized while the transformer is read: the
    pipeline keeps them as they are and computes what the in-memory int4 twin of its transformer does."""
    from helpers.int4_models import int4_transformer

    transformer = Magi2Transformer3DModel.from_pretrained(
        saved_pipeline, subfolder="transformer", expert_dtype="int4", expert_int4_group_size=32
    )
    codes = {k: v.clone() for k, v in transformer.state_dict().items() if v.dtype == torch.uint8}
    loaded = Magi2Pipeline.from_pretrained(saved_pipeline, transformer=transformer, dtype=torch.float32)
    assert loaded.transformer is transformer and loaded.transformer.config.expert_dtype == "int4"
    twin = Magi2Pipeline(**{**pipe.components, "transformer": int4_transformer(pipe.transformer, 32)})
    a = loaded(**ONE_STEP, generator=torch.Generator().manual_seed(7))
    b = twin(**ONE_STEP, generator=torch.Generator().manual_seed(7))
    assert torch.isfinite(a.frames).all() and torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio)
    assert len(codes) == 6 and all(torch.equal(transformer.get_parameter(k), v) for k, v in codes.items())


@pytest.mark.parametrize("case", ["t2v", "i2v"])
def test_one_step_forward_matches_transformer_fixture(pipe, fixtures_dir, case):
    """Pipeline batching ([cond, uncond], each text with its own length, image kept in both halves)
    with the converted transformer reproduces the reference's outputs; CFG applied on top."""
    T = load_file(str(fixtures_dir / "magi2_tiny" / "preview_h4" / "fp32" / "transformer_case.safetensors"))
    p = "i2v.pipeline." if case == "i2v" else "pipeline."
    txt, null = T[p + "txt_feat"], T[p + "null_txt_feat"]
    image_latents = image_embeds = None
    if case == "i2v":
        image_latents = T[p + "ref_image_feat"][:, 0]
        image_embeds = T[p + "ref_image_special_token_embedding"][:, 0]
    pipe._guidance_scale, pipe._audio_guidance_scale, pipe._attention_kwargs = 5.0, 7.0, None
    video, audio = pipe.predict_velocity(
        T[p + "latent"],
        T[p + "audio_latent"],
        T[p + "timestep"],
        txt,
        torch.ones(1, txt.shape[1], dtype=torch.bool),
        null,
        torch.ones(1, null.shape[1], dtype=torch.bool),
        image_latents,
        image_embeds,
    )
    ref_v, ref_a = T[p + "video_out"], T[p + "audio_out"]
    want_v = ref_v[1:] + 5.0 * (ref_v[:1] - ref_v[1:])
    want_a = ref_a[1:] + 7.0 * (ref_a[:1] - ref_a[1:])
    assert (video - want_v).abs().max().item() <= 1e-4 * 5 and rel_l2(video, want_v) <= 1e-5 * 5
    assert (audio - want_a).abs().max().item() <= 1e-4 * 7 and rel_l2(audio, want_a) <= 1e-5 * 7
    # and the raw [cond, uncond] outputs themselves
    with torch.no_grad():
        raw = pipe.transformer(
            hidden_states=T[p + "latent"].expand(2, -1, -1, -1, -1),
            timestep=T[p + "timestep"].expand(2),
            encoder_hidden_states=torch.cat([txt, torch.cat([null, null.new_zeros(1, 2, 48)], 1)]),
            audio_hidden_states=T[p + "audio_latent"].expand(2, -1, -1),
            encoder_attention_mask=torch.tensor([[True] * 5, [True] * 3 + [False] * 2]),
            image_latents=None if image_latents is None else image_latents.expand(2, -1, -1, -1, -1),
            image_embeds=None if image_embeds is None else image_embeds.expand(2, -1),
        )
    assert (raw.sample - ref_v).abs().max().item() <= 1e-4 and rel_l2(raw.sample, ref_v) <= 1e-5
    assert (raw.audio_sample - ref_a).abs().max().item() <= 1e-4 and rel_l2(raw.audio_sample, ref_a) <= 1e-5
