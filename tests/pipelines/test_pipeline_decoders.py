"""The pipeline's decoding paths with converted reference components: TurboVAED video decode (sliding
windows, de-normalisation, final uint8 frames) and Stable Audio decode + the 441/512 resample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.pipeline_stubs import StandInTransformer, preview_scheduler
from safetensors.torch import load_file

from diffusers_magi2 import Magi2Pipeline  # noqa: E402
from diffusers_magi2.utils.export import frames_to_uint8  # noqa: E402


@pytest.fixture(scope="module")
def components(fixtures_dir, tmp_path_factory):
    from diffusers import AutoencoderOobleck

    from diffusers_magi2.conversion.components import convert_stable_audio_vae, convert_turbo_vae
    from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder

    root = fixtures_dir / "magi2_tiny_components"
    tmp = tmp_path_factory.mktemp("decoders")
    turbo = Magi2TurboVAEDecoder.from_pretrained(convert_turbo_vae(root / "turbo_vae", tmp / "turbo")).eval()
    audio = AutoencoderOobleck.from_pretrained(
        convert_stable_audio_vae(
            root / "stable_audio_vae" / "stable-audio-open-tiny", tmp / "sao", audio_encoder="zeros"
        )
    ).eval()
    pipe = Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=StandInTransformer(),
        audio_vae=audio,
        scheduler=preview_scheduler(),
        video_decoder=turbo,
    )
    return (
        pipe,
        load_file(str(root / "turbo_vae" / "decode_cases.safetensors")),
        load_file(str(root / "stable_audio_vae" / "cases.safetensors")),
    )


@pytest.mark.parametrize("case", ["A", "B", "C"])
def test_turbo_video_decode_and_frames(components, case):
    pipe, video_cases, _ = components
    decoded = pipe.decode_video(video_cases[f"latent.{case}"])
    torch.testing.assert_close(decoded, video_cases[f"fp32.{case}.decoded"], atol=1e-5, rtol=1e-5)
    frames = pipe.video_processor.postprocess_video(decoded, output_type="np")[0]
    got = frames_to_uint8(frames).astype(np.int16)
    want = video_cases[f"fp32.{case}.frames_uint8"].numpy().astype(np.int16)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1


def test_audio_decode_and_resample(components):
    pipe, _, audio_cases = components
    audio = pipe.decode_audio(audio_cases["decode.latent"])
    assert audio.shape == (1, 2, 8820) and audio.dtype == np.float32
    np.testing.assert_allclose(audio[0].T, audio_cases["decode.resampled"].numpy(), atol=1e-5, rtol=1e-5)
    assert pipe.audio_sample_rate == 44_100 and pipe.num_channels_audio_latents == 64


def test_turbo_video_decode_tiled_still_matches_the_reference(components):
    pipe, video_cases, _ = components
    latents = video_cases["latent.A"]
    assert latents.shape[-1] > 1  # several one-latent tiles across the width
    pipe.video_decoder.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16)
    try:
        decoded = pipe.decode_video(latents)
    finally:
        pipe.video_decoder.disable_tiling()
    torch.testing.assert_close(decoded, video_cases["fp32.A.decoded"], atol=1e-5, rtol=1e-5)
