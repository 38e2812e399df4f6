"""``examples/train_lora.py``'s data: the videos and captions of ``--data_dir`` checked, encoded once into
``<stem>.magi2.safetensors`` caches (normalised Wan latents, audio latents and text states, written to a temp path
then renamed), and read back checked against the transformer's widths.

A clip of ``F`` kept frames (``F = 4k + 1``) at ``fps`` lasts ``d = F / fps`` seconds (the pipeline's own clip: 25
frames at 12.5 fps, 2 s) and has ``L = round(d * audio_latent_fps)`` audio latents (the pipeline's geometry). Its
audio track is resampled (FFmpeg's resampler, through PyAV) to the audio VAE's own rate ``hop * audio_latent_fps``
(``hop = prod(downsampling_ratios)`` samples per latent: 2048 x 25 = 51.2 kHz, the rate the pipeline's decode
resamples from by ``audio_resample_ratio``) and its channel layout, cut or padded with silence to ``L * hop``
samples, and encoded to the posterior mean of the pipeline's audio VAE (``AutoencoderOobleck.encode``), stored as
``audio_latents [L, A]``. A video without an audio track is a silent clip: its latents are the encoding of silence.

With ``--vram_gb`` the encoders follow generation's memory rules (:func:`encode_streamed`): a pipeline of the
encoders alone (no transformer), its text encoder streamed by ``Magi2Pipeline.enable_weight_streaming`` (pinned or
disk host memory), each VAE on the device for its own encode only; the whole pipeline is released before the
training weights load, so host memory peaks at the larger of caching's and training's, not their sum.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path


__all__ = [
    "CACHE_SUFFIX",
    "VIDEO_SUFFIXES",
    "encode_audio",
    "encode_dataset",
    "encode_negative_prompt",
    "encode_streamed",
    "load_cache",
    "read_audio",
    "read_video",
    "scan_dataset",
]

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm")
CACHE_SUFFIX = ".magi2.safetensors"


def scan_dataset(data_dir: Path, want_videos: bool) -> list[Path]:
    """The caches (or, with ``want_videos``, the videos) of ``data_dir``, checked; raises ``ValueError`` naming the
    first bad file (a video without a caption, an empty folder)."""
    if not data_dir.is_dir():
        raise ValueError(f"--data_dir {str(data_dir)!r} is not a folder")
    videos = sorted(p for p in data_dir.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES)
    if want_videos:
        if not videos:
            raise ValueError(
                f"{data_dir}: --cache needs videos ({', '.join(VIDEO_SUFFIXES)}) with <stem>.txt captions"
            )
        for video in videos:
            caption = video.with_suffix(".txt")
            if not caption.is_file() or not caption.read_text(encoding="utf-8").strip():
                raise ValueError(f"{video}: missing or empty caption {caption.name}")
        return videos
    caches = sorted(p for p in data_dir.iterdir() if p.name.endswith(CACHE_SUFFIX))
    if not caches:
        hint = " (run with --cache to encode the videos)" if videos else ""
        raise ValueError(f"{data_dir}: no {CACHE_SUFFIX} caches{hint}")
    return caches


def read_video(path: Path, scale: int = 16):
    """``([3, F, H, W] float pixels in [-1, 1], fps)`` (``F`` cut to ``4k + 1``; ``fps`` the stream's average frame
    rate, a ``Fraction``); ``ValueError`` naming ``path`` for an unreadable file or a height/width that is not a
    multiple of ``scale``."""
    import av
    import numpy as np
    import torch

    try:
        with av.open(str(path)) as container:
            fps = container.streams.video[0].average_rate
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (av.error.FFmpegError, ValueError, IndexError) as error:
        raise ValueError(f"{path}: unreadable video ({error})") from None
    if not frames or not fps:
        raise ValueError(f"{path}: unreadable video (no frames or no frame rate)")
    h, w = frames[0].shape[:2]
    if h % scale or w % scale:
        raise ValueError(f"{path}: {w}x{h} frames; the VAE takes heights and widths that are multiples of {scale}")
    frames = frames[: (len(frames) - 1) // 4 * 4 + 1]
    x = torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2).float()
    return x / 127.5 - 1.0, fps


def read_audio(path: Path, sample_rate: int, channels: int, num_samples: int):
    """The audio track of ``path`` as float32 ``[channels, num_samples]`` at ``sample_rate`` (PyAV's
    ``AudioResampler``: FFmpeg's resampling and channel mixing), cut or padded with silence to ``num_samples``;
    ``None`` when the file has no audio track."""
    import av
    import numpy as np
    import torch

    layout = {1: "mono", 2: "stereo"}[channels]
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=sample_rate)
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        chunks = [f.to_ndarray() for frame in container.decode(audio=0) for f in resampler.resample(frame)]
    chunks += [f.to_ndarray() for f in resampler.resample(None)]
    wave = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), np.float32)
    out = np.zeros((channels, num_samples), np.float32)
    out[:, : min(num_samples, wave.shape[1])] = wave[:, :num_samples]
    return torch.from_numpy(out)


def encode_dataset(pipe, videos: list[Path], device, streamed: bool = False) -> None:
    """Write ``<stem>.magi2.safetensors`` for each video: its normalised Wan latent, its audio latents (module
    docstring) and its caption's text states (every video is read and checked before the first is encoded). The
    VAEs and the text encoder run on ``device`` and go back to host memory afterwards (the transformer trains alone
    on the device); ``streamed``: the pipeline streams (``enable_weight_streaming``), so only each VAE moves, for
    its own encode."""
    for name, what in (("vae", "Wan VAE"), ("audio_vae", "audio VAE"), ("text_encoder", "text encoder")):
        if getattr(pipe, name, None) is None:
            raise ValueError(f"--cache needs the pipeline's {what} (the repo has no {name} component)")
    scale = pipe.vae_scale_factor_spatial
    pixels = {v: read_video(v, scale) for v in videos}
    encoders = [] if streamed else [pipe.vae, pipe.audio_vae, pipe.text_encoder]
    for encoder in encoders:
        encoder.to(device)
    try:
        _encode_videos(pipe, pixels, device)
    finally:
        for encoder in encoders:
            encoder.to("cpu")


def encode_negative_prompt(pipe, device, streamed: bool = False):
    """``[Lt, C]`` fp32 text states of the pipeline's negative prompt (``config.negative_prompt``, what the
    sampler's unconditional branch feeds), the text encoder on ``device`` for it and back in host memory after
    (``streamed``: streamed by the pipeline instead)."""
    import torch

    if getattr(pipe, "text_encoder", None) is None or not pipe.config.get("negative_prompt"):
        raise ValueError("--cfg_dropout needs the pipeline's text encoder and its config.negative_prompt")
    if not streamed:
        pipe.text_encoder.to(device)
    try:
        with torch.no_grad():
            embeds, mask, _ = pipe.encode_text([pipe.config.negative_prompt], device)
    finally:
        if not streamed:
            pipe.text_encoder.to("cpu")
    return embeds[0][mask[0]].float().cpu()


def encode_streamed(load_encoders, videos: list[Path], vram_gb: float, host_memory: str, negative: bool):
    """The caches of ``videos`` (:func:`encode_dataset`) and, with ``negative``, the negative prompt's text states
    (else ``None``), from the pipeline of ``(pipe, device) = load_encoders()`` (its encoders, no transformer)
    streamed as generation streams it: ``enable_weight_streaming(vram_gb, host_memory)`` on ``device``. Every
    weight it held is released on return (``release_weight_streaming``: the text encoder's pinned buffers handed
    back to the OS; then the pipeline dropped, garbage collected, the CUDA cache emptied)."""
    import torch

    pipe, device = load_encoders()
    try:
        pipe.enable_weight_streaming(vram_gb=vram_gb, host_memory=host_memory, device=str(device))
        if videos:
            encode_dataset(pipe, videos, device, streamed=True)
        return encode_negative_prompt(pipe, device, streamed=True) if negative else None
    finally:
        pipe.release_weight_streaming()
        del pipe
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def encode_audio(pipe, video: Path, duration_s: float):
    """``[L, A]`` fp32 audio latents of ``video``'s audio track (module docstring; ``pipe.encode_audio``)."""
    import math

    import torch

    audio_vae = pipe.audio_vae
    hop = math.prod(audio_vae.config.downsampling_ratios)
    latent_fps = float(pipe.config.audio_latent_fps)
    num_latents = max(1, round(duration_s * latent_fps))
    channels = int(audio_vae.config.audio_channels)
    wave = read_audio(video, round(hop * latent_fps), channels, num_latents * hop)
    if wave is None:
        print(f"{video.name}: no audio track; its audio latents encode silence")
        wave = torch.zeros(channels, num_latents * hop)
    return pipe.encode_audio(wave[None])[0]


def _encode_videos(pipe, pixels: dict, device) -> None:
    """:func:`encode_dataset`'s caches of the read videos ``{path: (pixels, fps)}``, the encoders on ``device``."""
    import torch
    from safetensors.torch import save_file

    for video, (x, fps) in pixels.items():
        latents = pipe.encode_video(x[None])[0].cpu()
        with torch.no_grad():
            embeds, mask, _ = pipe.encode_text([video.with_suffix(".txt").read_text(encoding="utf-8").strip()], device)
        audio = encode_audio(pipe, video, x.shape[1] / fps).cpu()
        out = {
            "latents": latents.contiguous(),
            "audio_latents": audio.contiguous(),
            "text_states": embeds[0][mask[0]].float().cpu().contiguous(),
        }
        target = video.parent / (video.stem + CACHE_SUFFIX)
        tmp = target.with_name(target.name + ".tmp")
        save_file(out, str(tmp))
        os.replace(tmp, target)


def load_cache(path: Path, transformer) -> dict:
    """A cache's tensors, checked against the transformer's widths; ``ValueError`` naming ``path`` otherwise."""
    import torch
    from safetensors.torch import load_file

    try:
        d = load_file(str(path))
    except Exception as error:  # noqa: BLE001  (safetensors raises several types)
        raise ValueError(f"{path}: unreadable cache ({error})") from None
    cfg = transformer.config
    lat, text = d.get("latents"), d.get("text_states")
    if lat is None or lat.dim() != 4 or lat.shape[0] != cfg.in_channels:
        raise ValueError(f"{path}: latents must be [{cfg.in_channels}, T, H, W], got {getattr(lat, 'shape', None)}")
    if text is None or text.dim() != 2 or text.shape[1] != cfg.text_in_channels:
        raise ValueError(
            f"{path}: text_states must be [Lt, {cfg.text_in_channels}], got {getattr(text, 'shape', None)}"
        )
    audio = d.get("audio_latents")
    if audio is None:
        audio = torch.zeros(max(1, 2 * lat.shape[1]), cfg.audio_in_channels)
    if audio.dim() != 2 or audio.shape[1] != cfg.audio_in_channels:
        raise ValueError(f"{path}: audio_latents must be [La, {cfg.audio_in_channels}], got {tuple(audio.shape)}")
    return {"latents": lat.float(), "text_states": text.float(), "audio_latents": audio.float()}
