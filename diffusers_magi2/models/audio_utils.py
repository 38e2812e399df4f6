"""Audio post-processing of MAGI-2: the 441/512 resample after the Stable Audio (Oobleck) decoder.

MAGI-2's audio latents run on a 25 Hz grid (250 latents per 10 s clip); the Oobleck decoder turns
each latent into 2048 samples, i.e. 512,000 samples per clip, which SandAI then resamples by
441/512 to 441,000 samples = 10.0 s at 44.1 kHz (``inference/pipeline/audio_decoder.py``,
``decode_audio``). Spec section 5.5.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

__all__ = [
    "AUDIO_SAMPLE_RATE",
    "RESAMPLE_NUMERATOR",
    "RESAMPLE_DENOMINATOR",
    "resampled_length",
    "resample_audio",
    "resample_audio_441_512",
    "waveform_to_output_audio",
]

#: Sample rate of MAGI-2's output audio track (Hz).
AUDIO_SAMPLE_RATE = 44100
RESAMPLE_NUMERATOR = 441
RESAMPLE_DENOMINATOR = 512


def resampled_length(num_samples: int) -> int:
    """``int(num_samples * 441 / 512)`` (truncation, as the reference): 512,000 -> 441,000, 1000 -> 861."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return int(num_samples * RESAMPLE_NUMERATOR / RESAMPLE_DENOMINATOR)


def resample_audio(audio: Union[np.ndarray, torch.Tensor], ratio: float, axis: int = 0) -> np.ndarray:
    """Resample ``audio`` along ``axis`` to ``int(N * ratio)`` samples with ``scipy.signal.resample`` (FFT).

    Matches SandAI ``decode_audio`` / ``resample_audio_sinc``: ``scipy.signal.resample(x, int(N * ratio))``
    on the time axis, result cast to float32. MAGI-2 uses ``ratio = 441/512`` (exact in binary, so
    ``int(N * ratio) == int(N * 441 / 512)``); the pipeline reads it from its config.

    Args:
        audio: samples, e.g. ``[N, channels]`` (time on ``axis``), any float dtype; a torch tensor is
            moved to CPU and converted to float32 numpy first.
        ratio: output/input sample-count ratio, > 0.
        axis: time axis.

    Returns:
        ``np.ndarray`` float32 with ``int(N * ratio)`` samples on ``axis``.

    Raises:
        ValueError: empty time axis, an axis out of range, or a ratio that is not positive.
    """
    from scipy.signal import resample  # local: scipy is only needed for audio output

    if not ratio > 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().to("cpu", torch.float32).numpy()
    audio = np.asarray(audio)
    if not -audio.ndim <= axis < audio.ndim:
        raise ValueError(f"axis {axis} out of range for an array of shape {audio.shape}")
    num_samples = audio.shape[axis]
    if num_samples == 0:
        raise ValueError("cannot resample an empty signal (0 samples on the time axis)")
    return resample(audio, int(num_samples * ratio), axis=axis).astype(np.float32)


def resample_audio_441_512(audio: Union[np.ndarray, torch.Tensor], axis: int = 0) -> np.ndarray:
    """:func:`resample_audio` by MAGI-2's fixed 441/512 (``resampled_length(N)`` samples on ``axis``)."""
    return resample_audio(audio, RESAMPLE_NUMERATOR / RESAMPLE_DENOMINATOR, axis=axis)


def waveform_to_output_audio(waveform: torch.Tensor) -> np.ndarray:
    """Oobleck decoder output ``[1, channels, N]`` -> output track ``[int(N*441/512), channels]`` float32.

    The exact chain of SandAI ``decode_audio``: ``waveform.squeeze(0).T`` as float32 numpy, then
    :func:`resample_audio_441_512` along time. For a batch, call it per sample.

    Raises:
        ValueError: ``waveform`` is not ``[1, channels, N]``.
    """
    if waveform.ndim != 3 or waveform.shape[0] != 1:
        raise ValueError(f"waveform must be [1, channels, N], got {tuple(waveform.shape)}")
    samples = waveform[0].detach().to("cpu", torch.float32).T.numpy()
    return resample_audio_441_512(samples, axis=0)
