"""Latent -> output helpers of the MAGI-2 pipeline (SandAI ``Magi2InferenceEngine.decode_video``,
``decode_audio`` / ``resample_audio_sinc``, ``Magi2Evaluator._resize_video``).

Normalised video latents are ``(mu - mean) * (1 / std)`` with the Wan2.2 tables; audio is the Oobleck decode
(2048 samples per latent) resampled by ``audio_resample_ratio`` (441/512: 250 latents -> 441,000 samples).
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch
from diffusers.video_processor import VideoProcessor


__all__ = [
    "WAN22_VAE_CONFIG",
    "decode_audio_latents",
    "decode_video_latents",
    "postprocess_audio",
    "postprocess_video_frames",
    "resample_audio",
    "resize_video_frames",
    "wan_latent_stats",
]


#: ``AutoencoderKLWan`` in SandAI's Wan2.2 form (``magi2_reference_spec`` §5.5: z 48, base 160, [1, 2, 4, 4]).
WAN22_VAE_CONFIG = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
}


def resize_video_frames(video: torch.Tensor, height: int, width: int, frames_per_chunk: int = 16) -> torch.Tensor:
    """Per-frame bilinear resize (``align_corners=False``) of ``video`` to ``height x width``, ``frames_per_chunk``
    frames at a time; the reference resizes after 8-bit quantisation, this the float frames.

    Args:
        video: ``[B, C, F, H, W]`` float tensor.
        height, width: output pixels (positive ints).

    Returns:
        ``[B, C, F, height, width]`` tensor, same dtype and device.

    Raises:
        ValueError: ``video`` is not 5-D or a size is not a positive int.
    """
    if video.dim() != 5:
        raise ValueError(f"video must be [B, C, F, H, W]; got shape {tuple(video.shape)}")
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"output {name} must be a positive int; got {value!r}")
    b, c, f = video.shape[:3]
    out = video.new_empty(b, c, f, height, width)
    for start in range(0, f, frames_per_chunk):
        stop = min(f, start + frames_per_chunk)
        chunk = video[:, :, start:stop].transpose(1, 2).reshape(b * (stop - start), c, *video.shape[3:])
        chunk = torch.nn.functional.interpolate(chunk, size=(height, width), mode="bilinear", align_corners=False)
        out[:, :, start:stop] = chunk.reshape(b, stop - start, c, height, width).transpose(1, 2)
    return out


def wan_latent_stats(vae, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, 1 / std)`` fp32 ``[1, C, 1, 1, 1]`` from ``vae.config.latents_mean/latents_std``."""
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)
    return mean, inv_std


def decode_video_latents(video_decoder, vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents ``[B, 48, T, h, w]`` -> fp32 pixels ``[B, 3, 4(T-1)+1, 16h, 16w]`` through
    ``video_decoder`` (it de-normalises itself), else the Wan ``vae`` (clamped to [-1, 1])."""
    if video_decoder is not None:
        out = video_decoder.decode(latents.to(device=video_decoder.device, dtype=video_decoder.dtype))
        video = out.sample if hasattr(out, "sample") else out[0]
        return video.float()
    z = latents.float()
    mean, inv_std = wan_latent_stats(vae, z.device)
    z = z / inv_std + mean
    video = vae.decode(z.to(device=vae.device, dtype=vae.dtype)).sample
    return video.float().clamp(-1.0, 1.0)


def resample_audio(audio: Union[np.ndarray, torch.Tensor], ratio: float, axis: int = 0) -> np.ndarray:
    """``scipy.signal.resample`` of ``audio`` along ``axis`` to ``int(N * ratio)`` samples (SandAI ``resample_audio_sinc``).

    Args:
        audio: samples with time on ``axis`` (numpy, or a torch tensor taken to fp32 CPU).
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


def decode_audio_latents(audio_vae, audio_latents: torch.Tensor, ratio: float) -> np.ndarray:
    """Audio latents ``[B, L, 64]`` -> stereo float32 numpy ``[B, 2, S]`` (module docstring)."""
    waveform = audio_vae.decode(
        audio_latents.transpose(1, 2).to(device=audio_vae.device, dtype=audio_vae.dtype)
    ).sample
    waveform = waveform.float().cpu().numpy()
    out = [resample_audio(row.T, ratio, axis=0).T for row in waveform]
    return np.stack(out, axis=0)


def postprocess_video_frames(
    video: torch.Tensor,
    output_type: str = "np",
    output_height: int | None = None,
    output_width: int | None = None,
    video_processor: VideoProcessor | None = None,
):
    """A call's frames from decoded pixels ``[B, 3, F, H, W]`` in [-1, 1] (:func:`decode_video_latents`): the optional
    bilinear resize (:func:`resize_video_frames`), then ``video_processor.postprocess_video`` to ``output_type``
    (``"np"``, ``"pil"`` or ``"pt"``; default processor: a plain ``VideoProcessor``)."""
    if output_height is not None:
        video = resize_video_frames(video, output_height, output_width)
    return (video_processor or VideoProcessor()).postprocess_video(video, output_type=output_type)


def postprocess_audio(audio: np.ndarray, output_type: str = "np"):
    """A call's audio from :func:`decode_audio_latents`: the numpy array, a torch tensor for ``"pt"``."""
    return torch.from_numpy(audio) if output_type == "pt" else audio
