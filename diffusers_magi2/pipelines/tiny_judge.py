"""Small detectors that judge a clip of the tiny world (:mod:`.tiny_world`) against its caption.

* **Shape mask**: pixels with HSV saturation ≥ 0.45 and value ≥ 0.35 (the background is grey and dark).
* **Colour**: over the frames whose mask holds 0.5 %–40 % of the pixels, the circular mean hue of the mask pixels;
  it names the colour of :data:`~.tiny_world.COLOURS` with the nearest hue, if the hues agree (mean resultant length
  ``R ≥ 0.7``) and are within 35° of it, else the colour of :data:`~.tiny_world.NEW_COLOURS` within 35° of it (so
  the new colours change no verdict on the trained ones), else ``None``. Random noise has hues spread over the
  circle (``R ≈ 0``).
* **Motion**: the mask's centroid per frame, fitted by a line in time; the net displacement over the clip
  ``(Δx, Δy)`` (fractions of the width / height) names the motion of the dominant axis if it is at least 0.15 and
  at least twice the other axis, else "stays still" (:data:`~.tiny_world.NEW_MOTIONS`) if both are below 0.05,
  else ``None``.
* **Shape**: the mask's area over its bounding box's, median over frames: a disc fills π/4 ≈ 0.79, a square 1;
  the threshold is 0.89.
* **Sound**: the mono mix's magnitude spectrum between 100 Hz and 2 kHz; its peak names the colour whose tone
  (:data:`~.tiny_world.TONES_HZ`, :data:`~.tiny_world.NEW_TONES_HZ`; any two at least 7 semitones apart) is within a
  semitone and a half of it, if the peak stands at least 20 times above the band's median magnitude, else ``None``.
* **Flicker**: the mean absolute change of the background (pixels outside the mask in two consecutive frames) from
  one frame to the next, on the [0, 1] scale (0 for the world, whose background is still).
"""

from __future__ import annotations

import numpy as np

from .tiny_world import COLOURS, MOTIONS, NEW_COLOURS, NEW_MOTIONS, NEW_TONES_HZ, TONES_HZ, parse_caption


__all__ = ["judge_clip", "judge_colour", "judge_motion", "judge_shape", "judge_tone", "flicker", "shape_mask"]


def _hsv(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rgb = np.clip(np.asarray(frames, dtype=np.float32), 0.0, 1.0)
    value = rgb.max(-1)
    chroma = value - rgb.min(-1)
    saturation = np.where(value > 0, chroma / np.maximum(value, 1e-6), 0.0)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    safe = np.maximum(chroma, 1e-6)
    hue = np.where(value == r, (g - b) / safe, np.where(value == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    return (hue * 60.0) % 360.0, saturation, value


def shape_mask(frames: np.ndarray) -> np.ndarray:
    """Bool ``[F, H, W]``: the saturated, bright pixels of float frames ``[F, H, W, 3]`` in [0, 1]."""
    _, saturation, value = _hsv(frames)
    return (saturation >= 0.45) & (value >= 0.35)


def _usable(mask: np.ndarray) -> np.ndarray:
    share = mask.reshape(mask.shape[0], -1).mean(1)
    return (share >= 0.005) & (share <= 0.40)


def _hues(colours: dict) -> dict:
    return {name: _hsv(np.asarray(rgb, np.float32)[None, None, None])[0].item() for name, rgb in colours.items()}


_COLOUR_HUES, _NEW_COLOUR_HUES = _hues(COLOURS), _hues(NEW_COLOURS)


def _nearest_hue(hue_deg: float, hues: dict) -> str | None:
    """The name in ``hues`` whose hue is nearest ``hue_deg``, if within 35°, else ``None``."""
    distances = {name: abs((hue_deg - h + 180.0) % 360.0 - 180.0) for name, h in hues.items()}
    best = min(distances, key=distances.get)
    return best if distances[best] <= 35.0 else None


def judge_colour(frames: np.ndarray) -> str | None:
    """The colour the frames ``[F, H, W, 3]`` (float, [0, 1]) show (module docstring), or ``None``."""
    hue, _, _ = _hsv(frames)
    mask = shape_mask(frames)
    keep = _usable(mask)
    if not keep.any():
        return None
    angles = np.deg2rad(hue[keep][mask[keep]])
    mean = np.exp(1j * angles).mean()
    if abs(mean) < 0.7:
        return None
    mean_deg = np.rad2deg(np.angle(mean)) % 360.0
    return _nearest_hue(mean_deg, _COLOUR_HUES) or _nearest_hue(mean_deg, _NEW_COLOUR_HUES)


def judge_motion(frames: np.ndarray) -> str | None:
    """The motion the frames show (module docstring), or ``None``."""
    mask = shape_mask(frames)
    keep = np.flatnonzero(_usable(mask))
    if keep.size < max(2, mask.shape[0] // 2):
        return None
    height, width = mask.shape[1:]
    ys, xs = np.arange(height) + 0.5, np.arange(width) + 0.5
    cx = np.array([(mask[f].sum(0) * xs).sum() / mask[f].sum() / width for f in keep])
    cy = np.array([(mask[f].sum(1) * ys).sum() / mask[f].sum() / height for f in keep])
    span = (mask.shape[0] - 1) or 1
    dx = np.polyfit(keep, cx, 1)[0] * span
    dy = np.polyfit(keep, cy, 1)[0] * span
    big, small = (dx, dy) if abs(dx) >= abs(dy) else (dy, dx)
    if abs(big) < 0.05:
        return next(name for name, d in NEW_MOTIONS.items() if d == (0, 0))
    if abs(big) < 0.15 or abs(big) < 2 * abs(small):
        return None
    direction = (int(np.sign(dx)), 0) if abs(dx) >= abs(dy) else (0, int(np.sign(dy)))
    return next(name for name, d in MOTIONS.items() if d == direction)


def judge_shape(frames: np.ndarray) -> str | None:
    """``"circle"`` or ``"square"`` from the mask's fill of its bounding box (module docstring), or ``None``."""
    mask = shape_mask(frames)
    fills = []
    for f in np.flatnonzero(_usable(mask)):
        rows, cols = np.flatnonzero(mask[f].any(1)), np.flatnonzero(mask[f].any(0))
        box = (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1)
        fills.append(mask[f].sum() / box)
    if not fills:
        return None
    return "square" if np.median(fills) >= 0.89 else "circle"


def judge_tone(audio: np.ndarray, sample_rate: int) -> str | None:
    """The colour whose tone the audio ``[C, S]`` (or ``[S]``) at ``sample_rate`` Hz plays (module docstring), or
    ``None``."""
    mono = np.asarray(audio, dtype=np.float64)
    mono = mono.mean(0) if mono.ndim == 2 else mono
    if mono.size < sample_rate // 20:
        return None
    spectrum = np.abs(np.fft.rfft((mono - mono.mean()) * np.hanning(mono.size)))
    freqs = np.fft.rfftfreq(mono.size, 1.0 / sample_rate)
    band = (freqs >= 100.0) & (freqs <= 2000.0)
    if not band.any() or spectrum[band].max() < 20.0 * max(np.median(spectrum[band]), 1e-12):
        return None
    peak = freqs[band][np.argmax(spectrum[band])]
    semitones = {name: abs(12.0 * np.log2(peak / hz)) for name, hz in {**TONES_HZ, **NEW_TONES_HZ}.items()}
    best = min(semitones, key=semitones.get)
    return best if semitones[best] <= 1.5 else None


def flicker(frames: np.ndarray) -> float:
    """Mean absolute frame-to-frame change of the background (pixels outside the shape mask in both frames), on the
    [0, 1] scale; 0 when no frame pair shares a background pixel."""
    frames = np.asarray(frames, dtype=np.float32)
    background = ~shape_mask(frames)
    both = background[1:] & background[:-1]
    if frames.shape[0] < 2 or not both.any():
        return 0.0
    change = np.abs(np.diff(frames, axis=0)).mean(-1)
    return float(change[both].mean())


def judge_clip(frames: np.ndarray, audio: np.ndarray | None, sample_rate: int | None, prompt: str) -> dict:
    """Score one clip against the triple its prompt names (:func:`~.tiny_world.parse_caption`).

    Args:
        frames: float ``[F, H, W, 3]`` in [0, 1] (a pipeline's ``output.frames[0]``).
        audio: ``[C, S]`` samples, or ``None`` to skip the sound; sample_rate: its rate in Hz.
        prompt: a caption of the world.

    Returns:
        ``{"colour": bool, "shape": bool, "motion": bool, "sound": bool | None, "flicker": float, "seen": {...}}``
        where ``"seen"`` holds what each detector found.

    Raises:
        ValueError: the prompt names no triple of the world.
    """
    triple = parse_caption(prompt)
    if triple is None:
        raise ValueError(f"prompt {prompt!r} is not a caption of the tiny world ('a {{colour}} {{shape}} {{motion}}')")
    colour, shape, motion = triple
    seen = {"colour": judge_colour(frames), "shape": judge_shape(frames), "motion": judge_motion(frames)}
    seen["sound"] = None if audio is None else judge_tone(audio, int(sample_rate))
    return {
        "colour": seen["colour"] == colour,
        "shape": seen["shape"] == shape,
        "motion": seen["motion"] == motion,
        "sound": None if audio is None else seen["sound"] == colour,
        "flicker": flicker(frames),
        "seen": seen,
    }
