"""The shipped trained tiny pipeline follows its prompt: four prompts of the tiny world, one per colour and motion,
as 2 s clips at the main job's size and step count (``tiny_call_defaults``), judged by the world's detectors; the
random model at the same shapes is the control. Each clip is judged again under pixel noise of ±2/255 and audio
noise of ±1e-3 (far more than any CPU's rounding moves a decoded frame or sample), so no judgement sits on a
detector's threshold."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from diffusers_magi2.pipelines.tiny_default import (
    TINY_TRAINED_CONFIG,
    build_tiny_default_pipeline,
    build_tiny_random_pipeline,
)
from diffusers_magi2.pipelines.tiny_judge import judge_colour, judge_motion, judge_tone
from diffusers_magi2.pipelines.tiny_world import caption


#: One prompt per colour and per motion, both shapes (all seen in training).
PROMPTS = [
    caption(*t)
    for t in (
        ("red", "circle", "moves right"),
        ("green", "square", "moves up"),
        ("blue", "circle", "moves left"),
        ("yellow", "square", "moves down"),
    )
]
SEED = 0


def _generate(pipe, call: dict):
    """The four clips of :data:`PROMPTS` in one batched call: float frames ``[4, F, H, W, 3]`` in [0, 1], audio
    ``[4, 2, S]`` and its sample rate."""
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPTS, **call, generator=torch.Generator().manual_seed(SEED), output_type="np")
    return np.asarray(out.frames), np.asarray(out.audio), out.audio_sample_rate


def _judgements(frames: np.ndarray, audio: np.ndarray, rate: int) -> list[tuple[str | None, ...]]:
    """(colour, motion, tone) the detectors find in each clip, also under ±2/255 of seeded pixel noise and ±1e-3
    of audio noise (a judgement that changes under it is recorded as ``None``)."""
    rng = np.random.default_rng(SEED)
    pixel_noise = rng.uniform(-2 / 255, 2 / 255, frames.shape[1:]).astype(np.float32)
    audio_noise = rng.uniform(-1e-3, 1e-3, audio.shape[1:]).astype(np.float32)
    found = []
    for clip, sound in zip(frames, audio):
        noisy = (np.clip(clip + pixel_noise, 0, 1), sound + audio_noise)
        verdicts = {(judge_colour(f), judge_motion(f), judge_tone(a, rate)) for f, a in ((clip, sound), noisy)}
        found.append(tuple(v.pop() if len(v) == 1 else None for v in map(set, zip(*verdicts))))
    return found


def _accuracy(found) -> tuple[float, float, float]:
    colours = [p.split()[1] for p in PROMPTS]
    motions = [" ".join(p.split()[3:]) for p in PROMPTS]
    colour = np.mean([f[0] == c for f, c in zip(found, colours)])
    motion = np.mean([f[1] == m for f, m in zip(found, motions)])
    tone = np.mean([f[2] == c for f, c in zip(found, colours)])
    return float(colour), float(motion), float(tone)


@pytest.fixture(scope="module")
def trained():
    return build_tiny_default_pipeline()


def test_the_trained_tiny_draws_and_sounds_the_prompted_colour_and_motion(trained, caplog):
    from diffusers.utils import logging as dlogging

    assert trained.tiny_call_defaults == TINY_TRAINED_CONFIG["call"]
    assert trained.config.duration_s == 2.0 and trained.config.trained_resolutions == [[32, 32]]
    dlogging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            frames, audio, rate = _generate(trained, trained.tiny_call_defaults)
    finally:
        dlogging.disable_propagation()
    assert "outside the trained resolutions" not in caplog.text  # the model was trained at this size
    assert frames.shape == (4, 25, 32, 32, 3)
    found = _judgements(frames, audio, rate)
    colour, motion, tone = _accuracy(found)
    assert colour >= 0.9 and motion >= 0.9 and tone >= 0.9, found


def test_the_random_model_at_the_same_shapes_does_not(trained):
    """The control: the seeded random model at the trained shapes, same prompts, noise and call."""
    random = build_tiny_random_pipeline(TINY_TRAINED_CONFIG)
    found = _judgements(*_generate(random, trained.tiny_call_defaults))
    colour, motion, tone = _accuracy(found)
    assert colour < 0.5 and motion < 0.5 and tone < 0.5, found
