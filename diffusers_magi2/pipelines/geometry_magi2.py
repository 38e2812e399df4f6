"""The latent geometry of a MAGI-2 call, read from the component configs (SandAI ``_resolve_lengths``).

A ``d``-second clip at ``fps`` has video latents ``[B, C, T, H/s, W/s]`` with

    T = (round(2 d fps) - 1) // (2 r) + 1        (32 for 10 s at 12.5 fps)

and audio latents ``[B, L, A]`` with ``L = round(d audio_latent_fps)`` (250). ``C``, ``s`` (pixels per latent
cell) and ``r`` (frames per latent frame after the first) come from the Wan2.2 VAE's config, else TurboVAED's,
else 48 / 16 / 4; ``A`` from the Oobleck decoder's ``decoder_input_channels``, else 64. The scales and channels
need no clip (:func:`video_latent_sizes`), so a pipeline built without ``duration_s`` (diffusers' text-only
construction passes ``None`` for it) still has its ``vae_scale_factor_spatial``.
"""

from __future__ import annotations

from dataclasses import dataclass


__all__ = ["Magi2LatentGeometry", "Magi2LatentGeometryMixin", "latent_geometry", "video_latent_sizes"]

#: ``(vae config key, video_decoder config key, default)`` of each video latent size.
_VIDEO_KEYS = {
    "spatial_scale": ("scale_factor_spatial", "spatial_compression_ratio", 16),
    "temporal_scale": ("scale_factor_temporal", "temporal_compression_ratio", 4),
    "channels": ("z_dim", "latent_channels", 48),
}


@dataclass(frozen=True)
class Magi2LatentGeometry:
    """The latent sizes of one call (module docstring).

    Attributes:
        spatial_scale: pixels per latent cell along H and W (16).
        temporal_scale: frames per latent frame after the first (4).
        channels: video latent channels (48).
        audio_channels: audio latent channels (64).
        num_frames: video latent frames ``T`` of the clip.
        num_audio_latents: audio latent length ``L`` of the clip.
    """

    spatial_scale: int
    temporal_scale: int
    channels: int
    audio_channels: int
    num_frames: int
    num_audio_latents: int


def video_latent_sizes(vae=None, video_decoder=None) -> dict[str, int]:
    """``{"spatial_scale", "temporal_scale", "channels"}`` of the video latents, from ``vae``'s config (read first),
    else ``video_decoder``'s, else 16 / 4 / 48 (module docstring); either may be ``None``."""
    sizes = {}
    for name, (vae_key, decoder_key, default) in _VIDEO_KEYS.items():
        if vae is not None:
            sizes[name] = int(getattr(vae.config, vae_key))
        elif video_decoder is not None and decoder_key in video_decoder.config:
            sizes[name] = int(getattr(video_decoder.config, decoder_key))
        else:
            sizes[name] = default
    return sizes


def latent_geometry(
    vae=None,
    video_decoder=None,
    audio_vae=None,
    *,
    duration_s: float = 10.0,
    fps: float = 12.5,
    audio_latent_fps: float = 25.0,
) -> Magi2LatentGeometry:
    """The latent sizes of a ``duration_s`` clip with these components (each may be ``None``).

    Args:
        vae: ``AutoencoderKLWan`` (read first), video_decoder: ``Magi2TurboVAEDecoder``, audio_vae:
            ``AutoencoderOobleck``; their configs give the sizes of the module docstring.
        duration_s, fps, audio_latent_fps: the pipeline config values of the clip.

    Returns:
        :class:`Magi2LatentGeometry`.

    Raises:
        ValueError: ``duration_s``, ``fps`` or ``audio_latent_fps`` is not a positive number (e.g. ``None``), naming it.
    """
    clip = {"duration_s": duration_s, "fps": fps, "audio_latent_fps": audio_latent_fps}
    for name, value in clip.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(
                f"the pipeline config's {name} must be a number > 0 to size the clip's latents; got {value!r} (set it "
                f"with Magi2Pipeline(..., {name}=...) or pipe.register_to_config({name}=...))"
            )
    sizes = video_latent_sizes(vae, video_decoder)
    audio_channels = 64 if audio_vae is None else int(audio_vae.config.decoder_input_channels)
    frames = int(round(float(duration_s) * float(fps) * 2))
    return Magi2LatentGeometry(
        **sizes,
        audio_channels=audio_channels,
        num_frames=(frames - 1) // (2 * sizes["temporal_scale"]) + 1,
        num_audio_latents=int(round(float(duration_s) * float(audio_latent_fps))),
    )


class Magi2LatentGeometryMixin:
    """The geometry properties of a MAGI-2 pipeline (``Magi2Pipeline``, ``Magi2ModularPipeline``), read from its
    ``vae`` / ``video_decoder`` / ``audio_vae`` (each optional) and its ``duration_s`` / ``fps`` /
    ``audio_latent_fps`` config (:func:`latent_geometry`)."""

    def latent_geometry(self) -> Magi2LatentGeometry:
        """The latent sizes of a ``config.duration_s`` clip with this pipeline's components."""
        cfg = self.config
        return latent_geometry(
            getattr(self, "vae", None),
            getattr(self, "video_decoder", None),
            getattr(self, "audio_vae", None),
            duration_s=cfg["duration_s"],
            fps=cfg["fps"],
            audio_latent_fps=cfg["audio_latent_fps"],
        )

    def _video_latent_sizes(self) -> dict[str, int]:
        return video_latent_sizes(getattr(self, "vae", None), getattr(self, "video_decoder", None))

    @property
    def vae_scale_factor_spatial(self) -> int:
        """Pixels per latent cell along H and W (16 for Wan2.2 / TurboVAED); needs no ``duration_s``."""
        return self._video_latent_sizes()["spatial_scale"]

    @property
    def vae_scale_factor_temporal(self) -> int:
        """Frames per latent frame after the first (4)."""
        return self._video_latent_sizes()["temporal_scale"]

    @property
    def num_channels_latents(self) -> int:
        """Video latent channels (48), from the VAE / video decoder config."""
        return self._video_latent_sizes()["channels"]

    @property
    def num_channels_audio_latents(self) -> int:
        """Audio latent channels (64), from ``audio_vae.config.decoder_input_channels``."""
        return self.latent_geometry().audio_channels

    @property
    def audio_sample_rate(self) -> int:
        """Sample rate of the returned audio (``audio_vae.config.sampling_rate``, 44,100)."""
        return int(self.audio_vae.config.sampling_rate)

    def num_latent_frames(self) -> int:
        """Video latent length ``T`` of a ``duration_s`` clip (32 for 10 s)."""
        return self.latent_geometry().num_frames

    def num_audio_latents(self) -> int:
        """Audio latent length ``L`` of a ``duration_s`` clip (250 for 10 s)."""
        return self.latent_geometry().num_audio_latents
