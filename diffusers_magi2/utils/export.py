"""Write MAGI-2 output (frames + stereo audio) to an mp4 with PyAV: diffusers' ``export_to_video`` takes an
integer fps and rescales uint8 frames, MAGI-2 needs 12.5 fps (25/2)."""

from __future__ import annotations

import os
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np


__all__ = ["export_to_video_with_audio", "frames_to_uint8", "probe_streams"]

_AUDIO_CHUNK = 1024  # AAC frame size


def _as_numpy(value: Any) -> np.ndarray:
    try:
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu")
            if value.dtype in (torch.bfloat16, torch.float16):
                value = value.float()
            return value.numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return np.asarray(value)


def _refuse_non_finite(what: str, values: np.ndarray) -> None:
    """``ValueError`` naming the first NaN/inf of ``values`` (a black or silent clip would be written otherwise)."""
    bad = np.argwhere(~np.isfinite(values))
    if bad.size:
        index = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{what} holds NaN/inf ({len(bad)} values, the first {values[index]} at index {list(index)}); nothing "
            "was written: an mp4 of it would be black or silent there"
        )


def frames_to_uint8(video: Any) -> np.ndarray:
    """Frames as ``[F, H, W, 3]`` uint8: uint8 as is, float ``[0, 1]`` as ``uint8(clip(x) * 255)`` (the reference's
    rounding); ``[1, F, ...]`` and ``[F, 3, H, W]`` layouts and lists of PIL images are accepted.

    Raises:
        ValueError: wrong rank/channel count, an empty clip, an unsupported dtype, or a NaN/inf value.
    """
    if isinstance(video, (list, tuple)):
        if len(video) == 0:
            raise ValueError("video has no frames")
        frames = [
            np.asarray(frame.convert("RGB")) if hasattr(frame, "convert") else _as_numpy(frame) for frame in video
        ]
        video = np.stack(frames, axis=0)
    else:
        video = _as_numpy(video)
    if video.ndim == 5:
        if video.shape[0] != 1:
            raise ValueError(f"video must hold one clip; got a batch of {video.shape[0]} (shape {video.shape})")
        video = video[0]
    if video.ndim == 4 and video.shape[-1] != 3 and video.shape[1] == 3:
        video = np.transpose(video, (0, 2, 3, 1))  # [F, 3, H, W] (output_type="pt") -> [F, H, W, 3]
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video must be [frames, height, width, 3] (RGB); got shape {tuple(video.shape)}")
    if video.shape[0] == 0:
        raise ValueError("video has no frames")
    if video.dtype == np.uint8:
        return np.ascontiguousarray(video)
    if np.issubdtype(video.dtype, np.floating):
        _refuse_non_finite("video", video)
        return np.ascontiguousarray((np.clip(video.astype(np.float32), 0.0, 1.0) * 255.0).astype(np.uint8))
    raise ValueError(f"video dtype must be uint8 (0-255) or float (0-1); got {video.dtype}")


def _audio_planar(audio: Any) -> np.ndarray:
    """``[channels, samples]`` float32 from ``[samples, C]``, ``[C, samples]`` or ``[1, C, samples]``."""
    audio = _as_numpy(audio)
    if audio.ndim == 3:
        if audio.shape[0] != 1:
            raise ValueError(f"audio must hold one clip; got shape {tuple(audio.shape)}")
        audio = audio[0]
    if audio.ndim == 1:
        audio = audio[None, :]
    if audio.ndim != 2:
        raise ValueError(f"audio must be [samples, channels] or [channels, samples]; got shape {tuple(audio.shape)}")
    if audio.shape[0] not in (1, 2) and audio.shape[1] in (1, 2):
        audio = audio.T
    if audio.shape[0] not in (1, 2):
        raise ValueError(f"audio must have 1 or 2 channels; got shape {tuple(audio.shape)}")
    if audio.shape[0] == 1:
        audio = np.repeat(audio, 2, axis=0)
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"audio must be float samples in [-1, 1]; got dtype {audio.dtype}")
    _refuse_non_finite("audio", audio)
    return np.ascontiguousarray(audio.astype(np.float32))


def _fit_audio_duration(
    samples: np.ndarray, num_frames: int, rate: Fraction, sample_rate: int, trim_or_pad: bool
) -> np.ndarray:
    """Check (or, with ``trim_or_pad``, enforce) that ``samples`` lasts as long as the video, within one frame."""
    video_s = Fraction(num_frames) / rate
    audio_s = Fraction(samples.shape[1], sample_rate)
    if trim_or_pad:
        target = round(video_s * sample_rate)
        if samples.shape[1] >= target:
            return np.ascontiguousarray(samples[:, :target])
        return np.pad(samples, ((0, 0), (0, target - samples.shape[1])))
    if abs(video_s - audio_s) > 1 / rate:
        raise ValueError(
            f"video lasts {float(video_s):g} s ({num_frames} frames at {float(rate):g} fps) but audio lasts "
            f"{float(audio_s):g} s ({samples.shape[1]} samples at {sample_rate} Hz); they may differ by at most "
            f"one frame period ({float(1 / rate):g} s). Pass trim_or_pad_audio=True to cut or pad the audio "
            "to the video's duration."
        )
    return samples


def export_to_video_with_audio(
    video: Any,
    output_path: str | os.PathLike,
    audio: Any = None,
    fps: float | Fraction = Fraction(25, 2),
    audio_sample_rate: int = 44100,
    video_codec: str = "libx264",
    crf: int = 18,
    audio_bitrate: int = 192_000,
    trim_or_pad_audio: bool = False,
) -> str:
    """Write an mp4 (H.264 yuv420p at an exact rational frame rate, stereo AAC) via a temporary file and a rename.

    The durations must agree, ``|F / fps - N / audio_sample_rate| <= 1 / fps`` in exact fractions, before
    anything is written.

    Args:
        video: ``[F, H, W, 3]`` frames (see :func:`frames_to_uint8`), e.g. ``Magi2PipelineOutput.frames[0]``;
            H and W even.
        output_path: destination ``.mp4``.
        audio: optional waveform ``[samples, channels]`` or ``[channels, samples]`` in [-1, 1] (mono duplicated).
        fps: frame rate (a float is made an exact ``Fraction``).
        audio_sample_rate: samples per second of ``audio``.
        video_codec: PyAV/FFmpeg encoder name.
        crf: x264 constant-rate factor.
        audio_bitrate: AAC bitrate in bit/s.
        trim_or_pad_audio: cut or silence-pad audio of another duration instead of raising.

    Returns:
        ``str(output_path)``.

    Raises:
        ValueError: bad frames/audio shapes or dtypes, NaN/inf frames or audio samples, odd frame size,
            non-positive fps or sample rate, or video and audio durations that differ by more than one frame period (unless
            ``trim_or_pad_audio``).
        TypeError: ``trim_or_pad_audio`` is not a bool.
    """
    import av

    if not isinstance(trim_or_pad_audio, bool):
        raise TypeError(f"trim_or_pad_audio must be a bool; got {type(trim_or_pad_audio).__name__}")
    frames = frames_to_uint8(video)
    num_frames, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"frame height and width must be even for yuv420p; got {height}x{width}")
    rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"fps must be positive; got {fps}")
    samples = None
    if audio is not None:
        if int(audio_sample_rate) <= 0:
            raise ValueError(f"audio_sample_rate must be positive; got {audio_sample_rate}")
        samples = _audio_planar(audio)
        samples = _fit_audio_duration(samples, num_frames, rate, int(audio_sample_rate), trim_or_pad_audio)

    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{output_path.stem}.", suffix=".mp4", dir=output_path.parent)
    os.close(handle)
    try:
        with av.open(tmp_name, mode="w", format="mp4") as container:
            vstream = container.add_stream(video_codec, rate=rate)
            vstream.width, vstream.height = width, height
            vstream.pix_fmt = "yuv420p"
            vstream.time_base = Fraction(1, 1) / rate
            if video_codec == "libx264":
                vstream.options = {"crf": str(crf)}
            astream = None
            if samples is not None:
                astream = container.add_stream("aac", rate=int(audio_sample_rate))
                astream.layout = "stereo"
                astream.bit_rate = int(audio_bitrate)
                astream.time_base = Fraction(1, int(audio_sample_rate))

            for index in range(num_frames):
                frame = av.VideoFrame.from_ndarray(frames[index], format="rgb24")
                frame.pts = index
                container.mux(vstream.encode(frame))
            container.mux(vstream.encode(None))

            if astream is not None:
                for start in range(0, samples.shape[1], _AUDIO_CHUNK):
                    chunk = samples[:, start : start + _AUDIO_CHUNK]
                    aframe = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
                    aframe.sample_rate = int(audio_sample_rate)
                    aframe.pts = start
                    aframe.time_base = Fraction(1, int(audio_sample_rate))
                    container.mux(astream.encode(aframe))
                container.mux(astream.encode(None))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp creates 0600; give the final file the usual permissions
        os.replace(tmp_name, output_path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)
        raise
    return str(output_path)


def probe_streams(path: str | os.PathLike) -> dict[str, Any]:
    """Read back what an mp4 holds (used by tests and ``examples/generate.py``).

    Returns:
        dict with ``video_frames`` (decoded count), ``fps`` (``Fraction`` average rate),
        ``video_duration_s`` (frames / fps), ``video_stream_duration_s`` (container metadata) and, if
        an audio track exists, ``audio_sample_rate``, ``audio_channels``, ``audio_stream_duration_s``
        (container metadata), ``audio_samples`` (decoded count; the AAC decoder returns whole
        1024-sample frames, so up to 1023 samples of padding) and ``audio_duration_s``.
    """
    import av

    info: dict[str, Any] = {}
    with av.open(str(path)) as container:
        vstream = container.streams.video[0]
        info["fps"] = Fraction(vstream.average_rate)
        if vstream.duration is not None:
            info["video_stream_duration_s"] = float(vstream.duration * vstream.time_base)
        count = 0
        for _ in container.decode(vstream):
            count += 1
        info["video_frames"] = count
        info["video_duration_s"] = float(count / info["fps"])
    with av.open(str(path)) as container:
        if container.streams.audio:
            astream = container.streams.audio[0]
            info["audio_sample_rate"] = astream.rate
            info["audio_channels"] = astream.channels
            if astream.duration is not None:
                info["audio_stream_duration_s"] = float(astream.duration * astream.time_base)
            total = 0
            for frame in container.decode(astream):
                total += frame.samples
            info["audio_samples"] = total
            info["audio_duration_s"] = total / astream.rate
    return info
