"""The pipeline's autoencoder methods: pixels and waveforms to the latents the transformer takes, and back.

Video latents are the Wan2.2 VAE's posterior mean normalised per channel, ``(mu - mean) * (1 / std)`` with its
``latents_mean`` / ``latents_std`` tables (:func:`~.decoding_magi2.wan_latent_stats`); audio latents are the Oobleck
VAE's posterior mean, one latent per ``prod(downsampling_ratios)`` samples (2048), time first. Under weight
streaming each autoencoder is on the device for its own encode or decode only (``_autoencoder_stage``).
"""

from __future__ import annotations

import numpy as np
import torch

from .decoding_magi2 import decode_audio_latents, decode_video_latents, wan_latent_stats


__all__ = ["Magi2AutoencoderMixin", "encode_video_pixels"]


def encode_video_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised fp32 mean latents of ``pixels`` ``[B, 3, F, H, W]`` through the Wan2.2 ``vae`` where it is."""
    mu = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().float()
    mean, inv_std = wan_latent_stats(vae, mu.device)
    return (mu - mean) * inv_std


def _check_encode_input(name: str, tensor, shape: tuple, dims: dict) -> None:
    """Refuse an encode input that is not a floating tensor of the layout ``shape`` whose ``dims`` checks hold."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.ndim != len(shape):
        got = f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else None
        raise ValueError(f"{name} must be a floating-point tensor [{', '.join(shape)}]; got {got or type(tensor)}")
    for dim, (what, ok) in dims.items():
        if not ok(tensor.shape[dim]):
            raise ValueError(f"{name} of shape {tuple(tensor.shape)}: its {shape[dim]} must be {what}")


class Magi2AutoencoderMixin:
    """``encode_video`` / ``encode_audio`` / ``decode_video`` / ``decode_audio`` of
    :class:`~diffusers_magi2.pipelines.pipeline_magi2.Magi2Pipeline`."""

    @torch.no_grad()
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode pixels into the normalised video latents the transformer denoises (the inverse of
        :meth:`decode_video`; an I2V reference image is the one-frame case).

        Args:
            pixels: ``[B, 3, F, H, W]`` in [-1, 1], any float dtype, any device; ``F = 4k + 1`` frames, ``H`` and
                ``W`` multiples of 16.

        Returns:
            ``torch.Tensor`` fp32 ``[B, 48, (F - 1) / 4 + 1, H / 16, W / 16]`` on the VAE's device (the streaming
            device while weights are streamed).

        Raises:
            ValueError: the pipeline has no ``vae``, or ``pixels`` is not a floating-point tensor of that layout
                (naming the dimension that is wrong and what it may be).
        """
        if getattr(self, "vae", None) is None:
            raise ValueError("encode_video needs the pipeline's vae (the Wan2.2 VAE); this pipeline has none")
        step, space = self.vae.config.scale_factor_temporal, self.vae.config.scale_factor_spatial
        _check_encode_input(
            "pixels",
            pixels,
            ("B", "C", "F", "H", "W"),
            {
                1: ("3 (RGB)", lambda c: c == 3),
                2: (f"{step}k + 1 frames", lambda f: f % step == 1 % step),
                3: (f"a positive multiple of {space}", lambda h: h > 0 and h % space == 0),
                4: (f"a positive multiple of {space}", lambda w: w > 0 and w % space == 0),
            },
        )
        with self._autoencoder_stage("vae"):
            return encode_video_pixels(self.vae, pixels)

    @torch.no_grad()
    def encode_audio(self, waveform: torch.Tensor) -> torch.Tensor:
        """Encode a waveform into the audio latents the transformer denoises (the posterior mean; the inverse of
        :meth:`decode_audio` but for its output resample).

        Args:
            waveform: ``[B, C, S]`` with ``C = audio_vae.config.audio_channels`` (2), any float dtype, any device,
                at the audio VAE's own rate: ``prod(audio_vae.config.downsampling_ratios) * config.audio_latent_fps``
                samples per second (2048 * 25 = 51,200), ``S`` a multiple of the product.

        Returns:
            ``torch.Tensor`` fp32 ``[B, S / 2048, 64]`` (time first, as ``audio_latents``) on the audio VAE's device.

        Raises:
            ValueError: the pipeline has no ``audio_vae``, or ``waveform`` is not a floating-point tensor of that
                layout (naming the dimension that is wrong and what it may be).
        """
        audio_vae = getattr(self, "audio_vae", None)
        if audio_vae is None:
            raise ValueError("encode_audio needs the pipeline's audio_vae (the Oobleck VAE); this pipeline has none")
        channels, hop = audio_vae.config.audio_channels, int(np.prod(audio_vae.config.downsampling_ratios))
        _check_encode_input(
            "waveform",
            waveform,
            ("B", "C", "S"),
            {
                1: (f"{channels} (the audio VAE's audio_channels)", lambda c: c == channels),
                2: (f"a positive multiple of {hop} samples (one latent each)", lambda n: n > 0 and n % hop == 0),
            },
        )
        with self._autoencoder_stage("audio_vae"):
            audio_vae = self.audio_vae
            posterior = audio_vae.encode(waveform.to(device=audio_vae.device, dtype=audio_vae.dtype)).latent_dist
            return posterior.mean.transpose(1, 2).float()

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised video latents ``[B, 48, T, h, w]`` -> pixels ``[B, 3, 4(T-1)+1, 16h, 16w]`` in [-1, 1]."""
        video_decoder = getattr(self, "video_decoder", None)
        with self._autoencoder_stage("vae" if video_decoder is None else "video_decoder"):
            return decode_video_latents(video_decoder, getattr(self, "vae", None), latents)

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> np.ndarray:
        """Audio latents ``[B, L, 64]`` -> stereo ``[B, 2, S]`` float32 numpy at ``audio_sample_rate``."""
        with self._autoencoder_stage("audio_vae"):
            return decode_audio_latents(self.audio_vae, audio_latents, float(self.config.audio_resample_ratio))
