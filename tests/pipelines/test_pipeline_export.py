"""mp4 export: rational 12.5 fps, 44.1 kHz stereo, durations, no double scaling of uint8, duration check, atomic writes."""

from __future__ import annotations

import re
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from helpers.pipeline_stubs import StandInTransformer, preview_scheduler, tiny_oobleck

from diffusers_magi2 import Magi2Pipeline, export_to_video_with_audio  # noqa: E402
from diffusers_magi2.utils.export import frames_to_uint8, probe_streams  # noqa: E402


def mean_decoded_pixel(path) -> float:
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24").astype(np.float64) for f in container.decode(video=0)]
    return float(np.mean(frames))


@pytest.mark.parametrize("kind", ["uint8", "float32", "torch_uint8", "pil"])
def test_uint8_frames_are_not_scaled_twice(tmp_path, kind):
    """12 constant frames of value 10 -> the decoded mean is 10 ± 3 whatever the frame dtype."""
    import PIL.Image

    frames = {
        "uint8": np.full((12, 64, 64, 3), 10, dtype=np.uint8),
        "float32": np.full((12, 64, 64, 3), 10 / 255, dtype=np.float32),
        "torch_uint8": torch.full((12, 64, 64, 3), 10, dtype=torch.uint8),
        "pil": [PIL.Image.fromarray(np.full((64, 64, 3), 10, dtype=np.uint8))] * 12,
    }[kind]
    path = export_to_video_with_audio(frames, tmp_path / f"{kind}.mp4", fps=12.5)
    assert abs(mean_decoded_pixel(path) - 10) <= 3


def test_pipeline_np_output_is_float_in_unit_range_and_exports(tmp_path):
    """The default output_type="np" returns float32 frames in [0, 1]; the documented export takes them as is."""

    pipe = Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=StandInTransformer(),
        audio_vae=tiny_oobleck(),
        scheduler=preview_scheduler(),
        duration_s=0.72,  # the clip of the latents below: 3 video and 18 audio latent frames
    )
    # stub decoder: constant pixel value 10/255 after (x + 1) / 2
    target = 10 / 255
    pipe.decode_video = lambda latents: torch.full(
        (latents.shape[0], 3, 4 * (latents.shape[2] - 1) + 1, 16 * latents.shape[3], 16 * latents.shape[4]),
        2 * target - 1,
    )
    from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder

    # a real (tiny) decoder object so the pipeline can decode; its output is replaced by the stub above
    pipe.register_modules(
        video_decoder=Magi2TurboVAEDecoder(
            decoder_block_out_channels=[2, 2, 2, 2], decoder_layers_per_block=[1, 1, 1, 1, 1]
        )
    )
    out = pipe(
        prompt_embeds=torch.randn(1, 4, 8),
        prompt_attention_mask=torch.ones(1, 4, dtype=torch.bool),
        negative_prompt_embeds=torch.randn(1, 2, 8),
        negative_prompt_attention_mask=torch.ones(1, 2, dtype=torch.bool),
        height=32,
        width=32,
        num_inference_steps=1,
        latents=torch.randn(1, 48, 3, 2, 2),
        audio_latents=torch.randn(1, 18, 64),
        output_type="np",
    )
    assert out.frames.dtype == np.float32 and out.frames.shape == (1, 9, 32, 32, 3)
    assert 0.0 <= out.frames.min() and out.frames.max() <= 1.0
    np.testing.assert_allclose(out.frames, target, atol=1e-6)
    # 18 audio latents last 0.72 s, as long as the 9 frames at 12.5 fps (the export checks the durations)
    assert out.audio.shape == (1, 2, int(18 * 2048 * 441 / 512)) and out.audio.dtype == np.float32
    path = export_to_video_with_audio(
        out.frames[0], tmp_path / "pipe.mp4", audio=out.audio[0], fps=out.fps, audio_sample_rate=out.audio_sample_rate
    )
    assert abs(mean_decoded_pixel(path) - 10) <= 3
    pt = pipe(
        prompt_embeds=torch.randn(1, 4, 8),
        prompt_attention_mask=torch.ones(1, 4, dtype=torch.bool),
        negative_prompt_embeds=torch.randn(1, 2, 8),
        negative_prompt_attention_mask=torch.ones(1, 2, dtype=torch.bool),
        height=32,
        width=32,
        num_inference_steps=1,
        latents=torch.randn(1, 48, 3, 2, 2),
        audio_latents=torch.randn(1, 18, 64),
        output_type="pt",
    )
    assert pt.frames.shape == (1, 9, 3, 32, 32) and isinstance(pt.audio, torch.Tensor)
    path = export_to_video_with_audio(pt.frames[0], tmp_path / "pipe_pt.mp4", fps=pt.fps)
    assert abs(mean_decoded_pixel(path) - 10) <= 3


def test_streams_rate_and_durations(tmp_path):
    frames = (np.random.default_rng(0).random((125, 32, 48, 3)) * 255).astype(np.uint8)
    t = np.arange(441_000) / 44_100
    audio = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)], 1).astype(np.float32)
    path = export_to_video_with_audio(frames, tmp_path / "clip.mp4", audio=audio, fps=12.5, audio_sample_rate=44_100)
    info = probe_streams(path)
    assert info["video_frames"] == 125 and info["fps"] == Fraction(25, 2)
    assert info["video_stream_duration_s"] == pytest.approx(10.0, abs=1e-9)
    assert info["audio_sample_rate"] == 44_100 and info["audio_channels"] == 2
    assert abs(info["audio_stream_duration_s"] - info["video_stream_duration_s"]) <= 1 / 12.5
    assert abs(info["audio_duration_s"] - 10.0) <= 1 / 12.5
    # channels-first audio and mono audio are accepted too
    export_to_video_with_audio(frames[:5], tmp_path / "cf.mp4", audio=audio.T[:, :20_000], fps=12.5)
    mono = probe_streams(
        export_to_video_with_audio(frames[:5], tmp_path / "mono.mp4", audio=audio[:20_000, 0], fps=12.5)
    )
    assert mono["audio_channels"] == 2


def test_bad_inputs_raise_and_leave_nothing(tmp_path):
    good = np.zeros((3, 16, 16, 3), dtype=np.uint8)
    cases = [
        ({"video": np.zeros((3, 16, 16), dtype=np.uint8)}, "frames, height, width, 3"),
        ({"video": np.zeros((3, 15, 16, 3), dtype=np.uint8)}, "even"),
        ({"video": np.zeros((3, 16, 16, 3), dtype=np.int32)}, "dtype"),
        ({"video": np.zeros((0, 16, 16, 3), dtype=np.uint8)}, "no frames"),
        ({"video": good, "audio": np.zeros((100, 5), dtype=np.float32)}, "1 or 2 channels"),
        ({"video": good, "audio": np.zeros((100, 2), dtype=np.int16)}, "float"),
        ({"video": good, "fps": 0}, "fps"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            export_to_video_with_audio(output_path=tmp_path / "bad.mp4", **kwargs)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(Exception):
        export_to_video_with_audio(good, tmp_path / "bad.mp4", video_codec="no_such_codec")
    assert list(tmp_path.iterdir()) == []  # the temporary file is removed on failure


@pytest.mark.parametrize(
    "what, value, index, reported",
    [("video", "nan", (2, 3, 1, 0), "[2, 3, 1, 0]"), ("video", "inf", (2, 3, 1, 0), "[2, 3, 1, 0]"),
     ("audio", "nan", (100, 1), "[1, 100]")],  # audio is reported as [channel, sample]
)  # fmt: skip
def test_non_finite_frames_or_audio_are_refused_before_anything_is_written(tmp_path, what, value, index, reported):
    """A NaN frame would be written black (and a NaN sample silent): the exporter refuses it, naming the first."""
    frames, audio = np.full((25, 16, 16, 3), 0.5, dtype=np.float32), _tone(2.0)
    (frames if what == "video" else audio)[index] = float(value)
    expected = rf"^{what} holds NaN/inf \(1 values, the first {value} at index {re.escape(reported)}\)"
    with pytest.raises(ValueError, match=expected):
        export_to_video_with_audio(frames, tmp_path / "clip.mp4", audio=audio, fps=12.5)
    assert list(tmp_path.iterdir()) == []


def _tone(seconds, sample_rate=44_100):
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    return np.stack([0.3 * np.sin(2 * np.pi * 440 * t)] * 2, 1).astype(np.float32)


@pytest.mark.parametrize("audio_s", [0.5, 8.0])
def test_audio_of_another_duration_raises_before_encoding_and_leaves_nothing(tmp_path, monkeypatch, audio_s):
    """2 s of video (25 frames at 12.5 fps) with 0.5 s or 8 s of audio is refused before PyAV opens a file."""

    def no_encoding(*args, **kwargs):
        raise AssertionError("the duration check must come before encoding")

    monkeypatch.setattr(av, "open", no_encoding)
    frames = np.zeros((25, 16, 16, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"video lasts 2 s .* audio lasts .*trim_or_pad_audio=True"):
        export_to_video_with_audio(frames, tmp_path / "clip.mp4", audio=_tone(audio_s), fps=12.5)
    assert list(tmp_path.iterdir()) == []


def test_duration_check_is_exact_and_inclusive_at_one_frame_period(tmp_path):
    """249 frames at 25 fps (9.96 s) with 10.0 s of audio differ by exactly one frame period: allowed.
    One more audio sample, or one frame fewer, is over the bound (exact fractions, no float rounding)."""
    frames = np.zeros((251, 16, 16, 3), dtype=np.uint8)
    audio = np.zeros((441_001, 2), dtype=np.float32)
    for num_frames in (249, 251):  # 9.96 s and 10.04 s against 10.0 s
        path = export_to_video_with_audio(
            frames[:num_frames], tmp_path / f"{num_frames}.mp4", audio=audio[:441_000], fps=25
        )
        assert probe_streams(path)["video_frames"] == num_frames
    for num_frames, samples in ((249, 441_001), (248, 441_000)):
        with pytest.raises(ValueError, match="at most one frame period"):
            export_to_video_with_audio(frames[:num_frames], tmp_path / "over.mp4", audio=audio[:samples], fps=25)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["249.mp4", "251.mp4"]


def test_trim_or_pad_audio_fits_the_audio_to_the_video_duration(tmp_path):
    frames = np.zeros((25, 16, 16, 3), dtype=np.uint8)  # 2 s at 12.5 fps
    long = probe_streams(
        export_to_video_with_audio(frames, tmp_path / "trim.mp4", audio=_tone(8.0), fps=12.5, trim_or_pad_audio=True)
    )
    assert abs(long["audio_stream_duration_s"] - 2.0) <= 1 / 12.5
    short_path = export_to_video_with_audio(
        frames, tmp_path / "pad.mp4", audio=_tone(0.5), fps=12.5, trim_or_pad_audio=True
    )
    assert abs(probe_streams(short_path)["audio_stream_duration_s"] - 2.0) <= 1 / 12.5
    with av.open(str(short_path)) as container:
        decoded = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    # the tone, then silence (AAC priming delays the stream by a few ms; skip past the edge)
    assert np.abs(decoded[:, 4_410:17_640]).max() > 0.1
    assert np.abs(decoded[:, 30_000:88_000]).max() < 1e-3
    with pytest.raises(TypeError, match="trim_or_pad_audio must be a bool"):
        export_to_video_with_audio(frames, tmp_path / "bad.mp4", audio=_tone(2.0), fps=12.5, trim_or_pad_audio="yes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pad.mp4", "trim.mp4"]


def test_frames_to_uint8_truncates_like_the_reference():
    x = np.array([0.0, 0.5, 0.999, 1.0, 1.2, -0.1], dtype=np.float32).reshape(1, 1, 2, 3)
    assert frames_to_uint8(x).ravel().tolist() == [0, 127, 254, 255, 255, 0]


def test_written_mp4_gets_umask_permissions_not_mkstemp_0600(tmp_path):
    """The file is written under a private temporary name and renamed: the result must still carry the
    usual ``0666 & ~umask`` permissions (mkstemp's 0600 would hide it from other users)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = export_to_video_with_audio(np.zeros((3, 16, 16, 3), dtype=np.uint8), tmp_path / "perm.mp4")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
