"""Output dataclass of :class:`~diffusers_magi2.Magi2Pipeline`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffusers.utils import BaseOutput


__all__ = ["Magi2PipelineOutput"]


@dataclass
class Magi2PipelineOutput(BaseOutput):
    """What :class:`~diffusers_magi2.Magi2Pipeline` returns.

    Args:
        frames: ``"np"``: float32 ``[B, F, H, W, 3]`` in [0, 1]; ``"pt"``: ``[B, F, 3, H, W]``; ``"pil"``: lists of
            images; ``"latent"``: the final video latents ``[B, 48, T, H/16, W/16]``.
        audio: ``"np"``/``"pil"``: float32 ``[B, 2, S]`` numpy; ``"pt"``: a tensor; ``"latent"``: ``[B, L, 64]``.
        audio_sample_rate: samples per second of ``audio``, ``None`` for ``"latent"``.
        fps: frames per second of ``frames``, ``None`` for ``"latent"``.

    Save with ``export_to_video_with_audio(out.frames[0], path, audio=out.audio[0], fps=out.fps,
    audio_sample_rate=out.audio_sample_rate)``.
    """

    frames: Any
    audio: Any
    audio_sample_rate: int | None = None
    fps: float | None = None
