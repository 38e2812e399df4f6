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
        frames: the videos. ``output_type="np"``: float32 ``np.ndarray`` ``[B, F, H, W, 3]`` in [0, 1];
            ``"pt"``: ``torch.Tensor`` ``[B, F, 3, H, W]`` in [0, 1]; ``"pil"``: ``list`` (batch) of
            ``list`` of ``PIL.Image``; ``"latent"``: the final video latents ``[B, 48, T, H/16, W/16]``
            (fp32, normalised). F = 4·(T − 1) + 1 (125 for the 10 s preview).
        audio: the soundtracks. ``"np"``/``"pil"``: float32 ``np.ndarray`` ``[B, 2, S]`` (stereo,
            channels first) at ``audio_sample_rate``; ``"pt"``: ``torch.Tensor`` ``[B, 2, S]``;
            ``"latent"``: the final audio latents ``[B, L, 64]``. S = ⌊L·2048·441/512⌋ (441,000 for
            L = 250, i.e. 10 s).
        audio_sample_rate: samples per second of ``audio`` (44,100), ``None`` for ``"latent"``.
        fps: frames per second of ``frames`` (12.5 for the preview), ``None`` for ``"latent"``.

    Save with ``export_to_video_with_audio(out.frames[0], path, audio=out.audio[0], fps=out.fps,
    audio_sample_rate=out.audio_sample_rate)``; it accepts every non-latent ``output_type`` unchanged.
    """

    frames: Any
    audio: Any
    audio_sample_rate: int | None = None
    fps: float | None = None
