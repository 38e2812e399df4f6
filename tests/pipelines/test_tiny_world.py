"""The tiny world: its vocabulary, held-out triples, captions and seeded clips."""

from __future__ import annotations

import numpy as np
import pytest

from diffusers_magi2.pipelines.tiny_world import (
    BACKGROUND,
    COLOURS,
    HELD_OUT,
    MOTIONS,
    NEW_COLOURS,
    NEW_MOTIONS,
    NEW_TONES_HZ,
    SEEN,
    SHAPES,
    caption,
    parse_caption,
    render_audio,
    render_frames,
)


def test_vocabulary_and_held_out_split():
    assert set(COLOURS) >= {"red", "green", "blue", "yellow"} and set(SHAPES) >= {"circle", "square"}
    assert set(MOTIONS) >= {"moves left", "moves right", "moves up", "moves down"}
    assert len(SEEN) + len(HELD_OUT) == len(COLOURS) * len(SHAPES) * len(MOTIONS) and not set(SEEN) & set(HELD_OUT)
    for position, vocabulary in enumerate((COLOURS, SHAPES, MOTIONS)):  # every word is still seen in training
        assert {t[position] for t in SEEN} == set(vocabulary)


def test_captions_round_trip_and_unknown_text_is_none():
    for triple in SEEN + HELD_OUT:
        assert parse_caption(caption(*triple)) == triple
    assert parse_caption("A Red  Circle moves RIGHT, fast") == ("red", "circle", "moves right")
    assert parse_caption("A red fox trots through fresh snow") is None


def test_clips_are_seeded_and_show_the_caption():
    a = render_frames("blue", "square", "moves down", height=32, width=48, num_frames=9, seed=4)
    assert a.shape == (9, 32, 48, 3) and a.dtype == np.float32
    np.testing.assert_array_equal(
        a, render_frames("blue", "square", "moves down", height=32, width=48, num_frames=9, seed=4)
    )
    assert not np.array_equal(
        a, render_frames("blue", "square", "moves down", height=32, width=48, num_frames=9, seed=5)
    )
    shape = np.all(a == np.asarray(COLOURS["blue"], np.float32), axis=-1)
    rest = a[~shape]
    np.testing.assert_array_equal(rest, np.broadcast_to(np.asarray(BACKGROUND, np.float32), rest.shape))
    rows = [np.flatnonzero(shape[f].any(1)).mean() for f in (0, 8)]
    assert rows[1] - rows[0] == pytest.approx(0.5 * 32, abs=1.0)  # half the frame height, downwards


def test_audio_is_the_colours_tone():
    audio = render_audio("green", num_samples=8000, sample_rate=8000, seed=1)
    assert audio.shape == (2, 8000) and np.array_equal(audio[0], audio[1])
    assert np.argmax(np.abs(np.fft.rfft(audio[0]))) == 300  # 1 s at 8 kHz: bin k is k Hz


@pytest.mark.parametrize("colour", [*COLOURS, *NEW_COLOURS])
def test_every_audio_latent_window_holds_the_same_waveform(colour):
    audio = render_audio(colour, num_samples=4 * 2048, sample_rate=51200, seed=3)  # 40 ms windows at 51.2 kHz
    windows = audio[0].reshape(4, 2048)
    assert audio[0, 0] == 0.0 and np.abs(windows - windows[0]).max() < 1e-5 < np.abs(windows[0]).max()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: render_frames("pink", "circle", "moves up", height=32, width=32, num_frames=3), "unknown triple"),
        (lambda: render_frames("red", "circle", "moves up", height=8, width=32, num_frames=3), "height, width >= 16"),
        (lambda: render_audio("red", num_samples=10, sample_rate=300), "Nyquist"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_new_colours_render_and_parse_but_are_in_no_training_triple():
    assert not set(NEW_COLOURS) & set(COLOURS) and set(NEW_TONES_HZ) == set(NEW_COLOURS)
    assert not {t[0] for t in SEEN + HELD_OUT} & set(NEW_COLOURS)
    assert parse_caption("a purple square moves left") == ("purple", "square", "moves left")
    assert parse_caption("A green circle stays  still") == ("green", "circle", "stays still")
    assert not {t[2] for t in SEEN + HELD_OUT} & set(NEW_MOTIONS)
    frames = render_frames("purple", "circle", "moves up", height=32, width=32, num_frames=5, seed=2)
    assert np.all(frames == np.asarray(NEW_COLOURS["purple"], np.float32), axis=-1).sum() > 50
    audio = render_audio("purple", num_samples=8000, sample_rate=8000, seed=1)
    assert abs(np.argmax(np.abs(np.fft.rfft(audio[0]))) - 1025.0) <= 1  # 1 s at 8 kHz: bin k is k Hz
