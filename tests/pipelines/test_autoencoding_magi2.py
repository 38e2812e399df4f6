"""``Magi2Pipeline.encode_audio``: the Oobleck posterior mean, time first, the layout ``decode_audio`` takes back
(the video encode is checked against the Wan2.2 fixture in ``test_pipeline_image.py``)."""

from __future__ import annotations

import torch
from helpers.pipeline_stubs import StandInTransformer, preview_scheduler, tiny_oobleck

from diffusers_magi2 import Magi2Pipeline  # noqa: E402


def _audio_pipe():
    """A pipeline with a tiny Oobleck of 64 latent channels (the encoder's 128 halved), as decode_audio takes them."""
    audio_vae = tiny_oobleck(encoder_hidden_size=128, channel_multiples=[1, 1, 1, 1, 1])
    pipe = Magi2Pipeline(
        tokenizer=None, text_encoder=None, transformer=StandInTransformer(), audio_vae=audio_vae,
        scheduler=preview_scheduler(),
    )  # fmt: skip
    return pipe, audio_vae


def test_encode_audio_is_the_time_first_posterior_mean_that_decode_audio_takes():
    pipe, audio_vae = _audio_pipe()
    waveform = torch.randn(2, 2, 3 * 2048, generator=torch.Generator().manual_seed(0)).to(torch.float64)
    latents = pipe.encode_audio(waveform)
    assert latents.shape == (2, 3, 64) and latents.dtype == torch.float32
    with torch.no_grad():
        mean = audio_vae.encode(waveform.float()).latent_dist.mean  # [B, 64, L]
    assert torch.equal(latents, mean.permute(0, 2, 1))
    audio = pipe.decode_audio(latents)  # 3 latents -> 6144 samples -> the 441/512 resample
    assert audio.shape == (2, 2, 6144 * 441 // 512)


def test_encode_audio_refuses_a_waveform_of_another_layout_before_encoding():
    import pytest

    pipe, audio_vae = _audio_pipe()
    encoded = []
    audio_vae.encoder.register_forward_pre_hook(lambda *_: encoded.append(1))
    cases = [
        (torch.zeros(2, 2048), r"waveform must be a floating-point tensor \[B, C, S\]; got a torch.float32"),
        (torch.zeros(1, 2, 2048, dtype=torch.int16), r"waveform must be a floating-point tensor"),
        ([0.0] * 2048, r"got <class 'list'>"),
        (torch.zeros(1, 1, 2048), r"its C must be 2 \(the audio VAE's audio_channels\)"),
        (torch.zeros(1, 2, 3000), r"its S must be a positive multiple of 2048 samples"),
        (torch.zeros(1, 2, 0), r"its S must be a positive multiple of 2048 samples"),
    ]
    for waveform, match in cases:
        with pytest.raises(ValueError, match=match):
            pipe.encode_audio(waveform)
    assert encoded == []
    pipe.audio_vae = None
    with pytest.raises(ValueError, match="encode_audio needs the pipeline's audio_vae"):
        pipe.encode_audio(torch.zeros(1, 2, 2048))
