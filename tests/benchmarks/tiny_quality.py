"""What the tiny model's quality benchmarks share (not collected by pytest): loading the trained tiny pipeline (or
the random control at its shapes), one judged clip, PSNR, mean judge scores, the markdown table and the JSON file.

PSNR of frames ``x`` against a reference ``y`` (both ``[F, H, W, 3]`` in [0, 1])::

    PSNR = 10 log10(1 / mean((x - y)^2))   dB, over every pixel of every frame (inf when equal)

A clip is 2 s at the trained size (``TINY_TRAINED_CONFIG["call"]``); each figure is the mean over the clips of a
prompt set (:data:`SEEN_PROMPTS`, :data:`HELD_OUT_PROMPTS` of ``bench_tiny_prompt_following``) x noise seeds.
Times are the process's CPU seconds (``time.process_time``; run with ``OMP_NUM_THREADS=1``), which a busy shared
machine does not inflate as it does wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from diffusers_magi2.pipelines.tiny_default import TINY_TRAINED_CONFIG, build_tiny_random_pipeline
from diffusers_magi2.pipelines.tiny_judge import judge_clip
from tests.benchmarks.bench_tiny_prompt_following import HELD_OUT_PROMPTS, SEEN_PROMPTS


__all__ = [
    "HELD_OUT_PROMPTS",
    "JUDGED",
    "SEEN_PROMPTS",
    "Clip",
    "common_parser",
    "generate",
    "load_pipeline",
    "mean_scores",
    "pipeline_folder",
    "prompt_set",
    "print_table",
    "psnr",
    "write_json",
]

#: The judge's accuracies a table reports, in order.
JUDGED = ("colour", "shape", "motion", "sound")


@dataclass
class Clip:
    """One generated clip: frames ``[F, H, W, 3]`` and audio ``[C, S]`` (float32 numpy), its judge scores, and the
    CPU seconds of the whole call and of the transformer's forwards in it."""

    prompt: str
    frames: np.ndarray
    audio: np.ndarray
    scores: dict
    seconds: float
    transformer_seconds: float
    extra: dict = field(default_factory=dict)


def common_parser(doc: str, seen: int = len(SEEN_PROMPTS), held_out: int = len(HELD_OUT_PROMPTS)):
    """``--model`` (a trained tiny pipeline folder; default the random control), ``--out`` (JSON), and the prompt
    set's ``--seen`` / ``--held_out`` counts (the first of each list; defaults ``seen``, ``held_out``)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--model", default=None, help="trained tiny pipeline folder (default: the random control)")
    p.add_argument("--out", default=None, help="also write the results as JSON")
    p.add_argument("--seen", type=int, default=seen, help=f"seen prompts in the set (of {len(SEEN_PROMPTS)})")
    p.add_argument(
        "--held_out", type=int, default=held_out, help=f"held-out prompts in the set (of {len(HELD_OUT_PROMPTS)})"
    )
    return p


def prompt_set(p: argparse.ArgumentParser, args) -> tuple[list[str], list[str]]:
    """The set's seen and held-out prompts (``--seen``, ``--held_out``); ``p.error`` for counts out of range."""
    if not (0 <= args.seen <= len(SEEN_PROMPTS) and 0 <= args.held_out <= len(HELD_OUT_PROMPTS)):
        p.error(f"--seen must be in 0..{len(SEEN_PROMPTS)} and --held_out in 0..{len(HELD_OUT_PROMPTS)}")
    if args.seen + args.held_out == 0:
        p.error("the prompt set is empty (--seen 0 --held_out 0)")
    return SEEN_PROMPTS[: args.seen], HELD_OUT_PROMPTS[: args.held_out]


@contextlib.contextmanager
def pipeline_folder(model: str | None):
    """``model``, or without it the random control (``build_tiny_random_pipeline(TINY_TRAINED_CONFIG)``) saved to a
    temporary folder, removed on exit."""
    if model:
        yield model
        return
    with tempfile.TemporaryDirectory(prefix="tiny-random-") as folder:
        build_tiny_random_pipeline(TINY_TRAINED_CONFIG).save_pretrained(folder)
        yield folder


def load_pipeline(model: str | None, **kwargs):
    """``Magi2Pipeline.from_pretrained(model, **kwargs)``, or without ``model`` the random control
    (``build_tiny_random_pipeline(TINY_TRAINED_CONFIG)``); progress bars off."""
    if model:
        from diffusers_magi2 import Magi2Pipeline

        pipe = Magi2Pipeline.from_pretrained(model, **kwargs)
    else:
        pipe = build_tiny_random_pipeline(TINY_TRAINED_CONFIG)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class _ForwardTimer:
    """CPU seconds spent in ``model``'s forwards (a pre- and a post-hook) while entered."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.seconds, self._start = model, 0.0, 0.0

    def __enter__(self):
        def pre(*_):
            self._start = time.process_time()

        def post(*_):
            self.seconds += time.process_time() - self._start

        self._handles = [self.model.register_forward_pre_hook(pre), self.model.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()


def generate(pipe, prompt: str, seed: int, steps: int, guidance: float, **call_kwargs) -> Clip:
    """One 2 s clip of ``prompt`` at the trained size and noise seed ``seed``, judged (``tiny_judge.judge_clip``).

    ``guidance`` sets both the video and the audio CFG scale unless ``call_kwargs`` sets ``audio_guidance_scale``.
    """
    size = TINY_TRAINED_CONFIG["call"]
    call_kwargs.setdefault("audio_guidance_scale", guidance)
    start = time.process_time()
    with _ForwardTimer(pipe.transformer) as timer:
        out = pipe(
            prompt,
            height=size["height"],
            width=size["width"],
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=torch.Generator().manual_seed(seed),
            **call_kwargs,
        )
    seconds = time.process_time() - start
    frames = np.asarray(out.frames[0], dtype=np.float32)
    audio = np.asarray(out.audio[0], dtype=np.float32)
    scores = judge_clip(frames, audio, pipe.audio_sample_rate, prompt)
    return Clip(prompt, frames, audio, scores, seconds, timer.seconds)


def psnr(frames: np.ndarray, reference: np.ndarray) -> float:
    """PSNR in dB of ``frames`` against ``reference`` (module docstring); ``inf`` when they are equal."""
    mse = float(np.mean((np.asarray(frames, np.float64) - np.asarray(reference, np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def mean_scores(clips: list[Clip]) -> dict:
    """Mean judge accuracy per :data:`JUDGED` detector and mean flicker over ``clips``."""
    means = {k: sum(float(c.scores[k]) for c in clips) / len(clips) for k in JUDGED}
    means["flicker"] = sum(c.scores["flicker"] for c in clips) / len(clips)
    return means


def _cell(value) -> str:
    if isinstance(value, float):
        return "∞" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def print_table(columns: list[str], rows: list[list]) -> str:
    """Print (and return) a markdown table; floats with two decimals."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str | None, results: dict) -> None:
    """Write ``results`` to ``path`` (a temporary name first, then renamed); nothing without a path."""
    if not path:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=float)
    os.replace(tmp, path)
