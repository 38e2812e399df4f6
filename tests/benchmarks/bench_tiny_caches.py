"""diffusers' caches on the trained tiny MAGI-2 (not collected by pytest): judge accuracy, PSNR against the uncached
run and speed-up of FirstBlockCache, MagCache and TaylorSeer at 25, 50 and 100 steps.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_tiny_caches --model FOLDER [--steps 25 50 100] \\
        [--seen 4] [--held_out 2] [--out caches.json]

Prompt set ("cache set"): the first ``--seen`` of the benchmark's seen prompts and the first ``--held_out`` held-out
ones (``bench_tiny_prompt_following``), noise seed 0, CFG 5 (video and audio). The caches, as a diffusers user sets
them (``pipe.transformer.enable_cache(config)``):

- ``FirstBlockCacheConfig(threshold=0.05)`` (diffusers' default);
- ``MagCacheConfig(mag_ratios=r, num_inference_steps=N)`` with diffusers' defaults (threshold 0.06, at most 3 steps
  skipped in a row, the first 20 % of steps always computed), ``r`` calibrated on this model at ``N`` steps:
  ``MagCacheConfig(calibrate=True)`` on one run of a calibration prompt (the first seen prompt at noise seed 100,
  not in the set), ``r_t = mean over tokens of |res_t| / |res_{t-1}|`` with ``res`` the blocks' residual;
- ``TaylorSeerCacheConfig()`` (diffusers' defaults: the blocks' attention computed for the first 3 steps, then every
  5th, first-order Taylor predictions between), with fp32 Taylor factors (the model computes in fp32).

Each prompt runs uncached and with each cache in turn (interleaved, so that a busy machine slows all alike).
PSNR is over the decoded frames against the uncached clip of the same prompt and seed; the speed-up is the
uncached seconds over the cached ones, of the transformer's forwards and of the whole call (text encoding and
decoding included), summed over the set.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging

import torch
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from tests.benchmarks.tiny_quality import (
    JUDGED,
    SEEN_PROMPTS,
    common_parser,
    generate,
    load_pipeline,
    mean_scores,
    print_table,
    prompt_set,
    psnr,
    write_json,
)


GUIDANCE = 5.0
CALIBRATION_SEED = 100


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def calibrate_mag_cache(pipe, prompt: str, steps: int) -> list[float]:
    """MagCache's magnitude ratios for ``pipe.transformer`` at ``steps`` steps, from one calibration run of
    ``prompt`` (diffusers' ``MagCacheConfig(calibrate=True)``, which logs them at the run's end)."""
    logger = logging.getLogger("diffusers.hooks.mag_cache")
    records, level, propagate = _Records(), logger.level, logger.propagate
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the hook also prints them
            generate(pipe, prompt, CALIBRATION_SEED, steps, GUIDANCE)
    finally:
        pipe.transformer.disable_cache()
        logger.removeHandler(records)
        logger.setLevel(level)
        logger.propagate = propagate
    prefix = "MagCache Calibration Results: "
    found = [m[len(prefix) :] for m in records.messages if m.startswith(prefix)]
    if len(found) != 1:
        raise RuntimeError(f"MagCache calibration logged {len(found)} results at {steps} steps, expected one")
    ratios = [float(r) for r in ast.literal_eval(found[0])]
    if len(ratios) != steps:
        raise RuntimeError(f"MagCache calibration gave {len(ratios)} ratios for {steps} steps")
    return ratios


def cache_configs(ratios: list[float], steps: int) -> dict:
    """The caches compared (module docstring), by name."""
    return {
        "FirstBlockCache": FirstBlockCacheConfig(threshold=0.05),
        "MagCache": MagCacheConfig(mag_ratios=ratios, num_inference_steps=steps),
        "TaylorSeer": TaylorSeerCacheConfig(taylor_factors_dtype=torch.float32),
    }


def run(pipe, prompts: list[str], steps: int) -> dict:
    """Every cache at ``steps`` steps on ``prompts``: ``{name: {accuracies, psnr_db, speed-ups, seconds}}``."""
    ratios = calibrate_mag_cache(pipe, SEEN_PROMPTS[0], steps)
    configs = cache_configs(ratios, steps)
    clips = {name: [] for name in ("uncached", *configs)}
    for prompt in prompts:
        clips["uncached"].append(generate(pipe, prompt, 0, steps, GUIDANCE))
        for name, config in configs.items():
            pipe.transformer.enable_cache(config)
            try:
                clips[name].append(generate(pipe, prompt, 0, steps, GUIDANCE))
            finally:
                pipe.transformer.disable_cache()
    base = clips["uncached"]
    base_t, base_s = sum(c.transformer_seconds for c in base), sum(c.seconds for c in base)
    results = {"mag_ratios": ratios}
    for name, got in clips.items():
        results[name] = {
            **mean_scores(got),
            "psnr_db": sum(psnr(c.frames, b.frames) for c, b in zip(got, base)) / len(got),
            "transformer_speedup": base_t / sum(c.transformer_seconds for c in got),
            "call_speedup": base_s / sum(c.seconds for c in got),
            "transformer_seconds": sum(c.transformer_seconds for c in got),
            "seconds": sum(c.seconds for c in got),
        }
    return results


def main(argv=None) -> int:
    p = common_parser(__doc__, seen=4, held_out=2)
    p.add_argument("--steps", type=int, nargs="+", default=[25, 50, 100])
    args = p.parse_args(argv)
    seen, held_out = prompt_set(p, args)
    if any(s < 2 for s in args.steps):
        p.error(f"--steps must all be >= 2, got {args.steps}")
    pipe = load_pipeline(args.model)
    prompts = seen + held_out
    results = {"model": args.model or "random control", "prompts": prompts, "seed": 0, "guidance": GUIDANCE}
    rows = []
    for steps in args.steps:
        results[str(steps)] = table = run(pipe, prompts, steps)
        for name, r in table.items():
            if name != "mag_ratios":
                rows.append(
                    [steps, name, *(r[k] for k in JUDGED), r["psnr_db"], r["transformer_speedup"], r["call_speedup"]]
                )
    print(f"model: {results['model']}; cache set: {args.seen} seen + {args.held_out} held-out prompts, seed 0")
    columns = ["steps", "cache", *JUDGED, "PSNR vs uncached (dB)", "speed-up (transformer)", "speed-up (call)"]
    print_table(columns, rows)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
