"""The synthetic audio-video world the trained tiny MAGI-2 learned: one shape moving over a plain dark background,
with a tone whose pitch names the shape's colour.

A clip of caption ``"a {colour} {shape} {motion}"`` (e.g. ``"a red circle moves right"``) has ``F`` frames
``[F, H, W, 3]`` in [0, 1]: background :data:`BACKGROUND`, the shape (a disc of radius ``r`` or a square of half-side
``r``, ``r ≈ 0.17 min(H, W)``) filled with :data:`COLOURS` ``[colour]``, its centre moving linearly through
``c(t) = c0 + d · t/(F-1) · 0.5 (H or W)`` along the motion's direction ``d`` (:data:`MOTIONS`, image axes: +x right,
+y down), starting a quarter of the way in. The stereo audio is ``0.3 sin(2π f t)`` on both channels with
``f = TONES_HZ[colour]``, ``t`` from the clip's start: every pitch is a multiple of the audio latent rate and the
phase is locked to the start, so each 40 ms latent window holds the same waveform (why:
``examples/tiny/train_tiny_autoencoders.py``). A seed jitters the start (±0.06 of the frame across the
motion, ±0.04 along it), the radius (±10 %) and the amplitude (±10 %); everything else is fixed, so the caption
determines what a judge (:mod:`.tiny_judge`) must see and hear.

:data:`HELD_OUT` holds four colour × shape × motion triples no training clip shows (each colour, shape and motion
still appears in training); :data:`SEEN` is the other 28. :data:`NEW_COLOURS` (purple, hue 292.5°, halfway between
the hue windows the judge gives red and blue; its tone :data:`NEW_TONES_HZ` about a fifth above yellow's) and
:data:`NEW_MOTIONS` ("stays still": the shape rests at the centre, jittered ±0.06 on both axes) render and parse
like the others but are in no training triple: concepts for a LoRA to teach.
"""

from __future__ import annotations

import itertools
import re

import numpy as np


__all__ = [
    "BACKGROUND",
    "COLOURS",
    "HELD_OUT",
    "MOTIONS",
    "NEW_COLOURS",
    "NEW_MOTIONS",
    "NEW_TONES_HZ",
    "SEEN",
    "SHAPES",
    "TONES_HZ",
    "caption",
    "parse_caption",
    "render_audio",
    "render_frames",
]

#: RGB in [0, 1] of each colour (saturated; hues 0°, 130°, 225°, 55°).
COLOURS = {
    "red": (0.90, 0.12, 0.12),
    "green": (0.15, 0.80, 0.25),
    "blue": (0.20, 0.35, 0.95),
    "yellow": (0.92, 0.85, 0.15),
}
SHAPES = ("circle", "square")
#: Direction ``(dx, dy)`` of each motion phrase in image axes (+x right, +y down).
MOTIONS = {"moves left": (-1, 0), "moves right": (1, 0), "moves up": (0, -1), "moves down": (0, 1)}
#: Pitch of the tone of each colour, Hz (a fifth apart: the nearest other tone is 1.5x away).
TONES_HZ = {"red": 200.0, "green": 300.0, "blue": 450.0, "yellow": 675.0}
BACKGROUND = (0.08, 0.08, 0.10)
#: Colours outside the training triples (module docstring), RGB in [0, 1], and their tones in Hz.
NEW_COLOURS = {"purple": (0.83, 0.18, 0.92)}
NEW_TONES_HZ = {"purple": 1025.0}
#: Motions outside the training triples, with their ``(dx, dy)``.
NEW_MOTIONS = {"stays still": (0, 0)}
_RGB = {**COLOURS, **NEW_COLOURS}
_DIRECTIONS = {**MOTIONS, **NEW_MOTIONS}
_HZ = {**TONES_HZ, **NEW_TONES_HZ}

_ALL = tuple(itertools.product(COLOURS, SHAPES, MOTIONS))
HELD_OUT = (
    ("red", "square", "moves up"),
    ("green", "circle", "moves left"),
    ("blue", "square", "moves down"),
    ("yellow", "circle", "moves right"),
)
SEEN = tuple(t for t in _ALL if t not in HELD_OUT)


def caption(colour: str, shape: str, motion: str) -> str:
    """The world's caption ``"a {colour} {shape} {motion}"`` of a triple."""
    return f"a {colour} {shape} {motion}"


_MOTION_WORDS = "|".join(r"\s+".join(m.split()) for m in _DIRECTIONS)
_CAPTION = re.compile(
    rf"\ba\s+({'|'.join(_RGB)})\s+({'|'.join(SHAPES)})\s+({_MOTION_WORDS})",
    re.IGNORECASE,
)


def parse_caption(text: str) -> tuple[str, str, str] | None:
    """``(colour, shape, motion)`` of the first ``"a {colour} {shape} moves {dir}"`` in ``text`` (any case, extra
    words such as "to the" before the direction not allowed), else ``None``."""
    match = _CAPTION.search(text)
    if match is None:
        return None
    colour, shape, motion = (g.lower() for g in match.groups())
    return colour, shape, " ".join(motion.split())


def _jitter(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 0x7179]))


def render_frames(
    colour: str, shape: str, motion: str, *, height: int, width: int, num_frames: int, seed: int = 0
) -> np.ndarray:
    """The clip's frames (module docstring).

    Args:
        colour, shape, motion: keys of :data:`COLOURS` (or :data:`NEW_COLOURS`), :data:`SHAPES`, :data:`MOTIONS` (or
            :data:`NEW_MOTIONS`).
        height, width: pixels (>= 16 each); num_frames: ``F >= 2``.
        seed: the jitter's seed.

    Returns:
        float32 ``[F, H, W, 3]`` in [0, 1].

    Raises:
        ValueError: an unknown word, or a size below the minimum.
    """
    if colour not in _RGB or shape not in SHAPES or motion not in _DIRECTIONS:
        raise ValueError(
            f"unknown triple {(colour, shape, motion)!r}; colours {list(_RGB)}, shapes {list(SHAPES)}, "
            f"motions {list(_DIRECTIONS)}"
        )
    if height < 16 or width < 16 or num_frames < 2:
        raise ValueError(f"need height, width >= 16 and num_frames >= 2; got {height}, {width}, {num_frames}")
    rng = _jitter(seed)
    dx, dy = _DIRECTIONS[motion]
    side = min(height, width)
    radius = 0.17 * side * rng.uniform(0.9, 1.1)
    along, across = rng.uniform(-0.04, 0.04), rng.uniform(-0.06, 0.06)
    # start a quarter of the way in along the motion, centred (jittered) across it; travel half the frame.
    start = np.array([0.5 - 0.25 * dx + (along if dx else across), 0.5 - 0.25 * dy + (along if dy else across)])
    t = np.linspace(0.0, 1.0, num_frames)
    cx = (start[0] + 0.5 * dx * t) * width
    cy = (start[1] + 0.5 * dy * t) * height
    ys = np.arange(height, dtype=np.float32)[:, None] + 0.5
    xs = np.arange(width, dtype=np.float32)[None, :] + 0.5
    frames = np.empty((num_frames, height, width, 3), dtype=np.float32)
    frames[:] = np.asarray(BACKGROUND, dtype=np.float32)
    fill = np.asarray(_RGB[colour], dtype=np.float32)
    for f in range(num_frames):
        if shape == "circle":
            inside = (xs - cx[f]) ** 2 + (ys - cy[f]) ** 2 <= radius**2
        else:
            inside = (np.abs(xs - cx[f]) <= radius) & (np.abs(ys - cy[f]) <= radius)
        frames[f][inside] = fill
    return frames


def render_audio(colour: str, *, num_samples: int, sample_rate: int, seed: int = 0) -> np.ndarray:
    """The clip's stereo tone (module docstring): float32 ``[2, num_samples]`` in [-0.33, 0.33].

    Raises:
        ValueError: an unknown colour, or a sample rate below twice the tone's pitch.
    """
    if colour not in _RGB:
        raise ValueError(f"unknown colour {colour!r}; colours {list(_RGB)}")
    if sample_rate < 2 * _HZ[colour]:
        raise ValueError(f"sample_rate {sample_rate} is below the Nyquist rate of a {_HZ[colour]} Hz tone")
    rng = _jitter(seed)
    rng.uniform(size=3)  # the frames' draws, so that the audio's do not repeat them
    gain = 0.3 * rng.uniform(0.9, 1.1)
    t = np.arange(num_samples, dtype=np.float64) / sample_rate
    wave = (gain * np.sin(2 * np.pi * _HZ[colour] * t)).astype(np.float32)
    return np.stack([wave, wave])
