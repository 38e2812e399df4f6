"""Prompt following of a tiny MAGI-2 on the tiny world (not collected by pytest): the judge's colour, shape, motion
and sound accuracy and the background flicker, on seen and held-out triples, over several noise seeds.

    OMP_NUM_THREADS=2 .venv/bin/python -m tests.benchmarks.bench_tiny_prompt_following [--model FOLDER] \\
        [--seeds 3] [--num_inference_steps 16] [--guidance_scale 5] [--out follow.json]

Prompts: the eight seen triples :data:`SEEN_PROMPTS` (each colour, shape and motion at least twice) and the four
held-out ones (``tiny_world.HELD_OUT``), each at noise seeds ``0 .. --seeds - 1``, as 2 s clips at the trained size
(``TINY_TRAINED_CONFIG["call"]``). ``--model``: a trained tiny pipeline folder (``Magi2Pipeline.from_pretrained``);
without it, the random model at the trained shapes (``build_tiny_random_pipeline(TINY_TRAINED_CONFIG)``), the control.
Targets for a trained model (the issue's): colour >= 0.9, motion >= 0.8, sound >= 0.8 on the seen prompts.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from diffusers_magi2 import Magi2Pipeline
from diffusers_magi2.pipelines.tiny_default import TINY_TRAINED_CONFIG, build_tiny_random_pipeline
from diffusers_magi2.pipelines.tiny_judge import judge_clip
from diffusers_magi2.pipelines.tiny_world import HELD_OUT, caption


SEEN_PROMPTS = [
    caption(*t)
    for t in (
        ("red", "circle", "moves right"),
        ("green", "square", "moves up"),
        ("blue", "circle", "moves left"),
        ("yellow", "square", "moves down"),
        ("red", "circle", "moves down"),
        ("green", "square", "moves right"),
        ("blue", "circle", "moves up"),
        ("yellow", "square", "moves left"),
    )
]
HELD_OUT_PROMPTS = [caption(*t) for t in HELD_OUT]


def score(pipe, prompts, seeds, steps: int, guidance: float) -> dict:
    """Mean judge scores of ``prompts`` x ``seeds`` (one clip per pair)."""
    call = TINY_TRAINED_CONFIG["call"]
    rows = []
    for prompt in prompts:
        for seed in seeds:
            out = pipe(
                prompt,
                height=call["height"],
                width=call["width"],
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=torch.Generator().manual_seed(seed),
            )
            rows.append(judge_clip(out.frames[0], out.audio[0], pipe.audio_sample_rate, prompt))
    keys = ("colour", "shape", "motion", "sound", "flicker")
    return {"clips": len(rows), **{k: sum(float(r[k]) for r in rows) / len(rows) for k in keys}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="trained tiny pipeline folder (default: the random control)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--num_inference_steps", type=int, default=TINY_TRAINED_CONFIG["call"]["num_inference_steps"])
    p.add_argument("--guidance_scale", type=float, default=5.0)
    p.add_argument("--out", default=None, help="also write the table as JSON")
    args = p.parse_args(argv)
    if args.model:
        pipe = Magi2Pipeline.from_pretrained(args.model)
    else:
        pipe = build_tiny_random_pipeline(TINY_TRAINED_CONFIG)
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    seeds = range(args.seeds)
    table = {
        "seen": score(pipe, SEEN_PROMPTS, seeds, args.num_inference_steps, args.guidance_scale),
        "held_out": score(pipe, HELD_OUT_PROMPTS, seeds, args.num_inference_steps, args.guidance_scale),
    }
    print(f"model: {args.model or 'random control (TINY_TRAINED_CONFIG shapes)'}; {time.perf_counter() - start:.0f} s")
    print("| prompts | clips | colour | shape | motion | sound | flicker |")
    print("|---|---|---|---|---|---|---|")
    for split, row in table.items():
        print(
            f"| {split} | {row['clips']} | {row['colour']:.2f} | {row['shape']:.2f} | {row['motion']:.2f} | "
            f"{row['sound']:.2f} | {row['flicker']:.3f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
