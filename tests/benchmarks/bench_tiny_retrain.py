"""Retrain the tiny MAGI-2 from its seed and compare its judge scores with the shipped weights' (not collected by
pytest): the training is reproducible when every accuracy is within ±0.05 of the shipped model's.

    .venv/bin/python -m tests.benchmarks.bench_tiny_retrain [--shipped FOLDER] [--threads 1] [--seeds 3] \\
        [--workdir DIR] [--out retrain.json]

It runs the recipe the shipped weights were trained with (:data:`RECIPE`: ``examples/tiny/``'s scripts, seed 0),
each script in a subprocess with ``--threads`` threads (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``), into ``--workdir``
(default: a temporary folder, removed afterwards), then scores the retrained pipeline and the shipped one (``--shipped``,
default ``build_tiny_default_pipeline()``) on the prompt-following set (the 8 seen and 4 held-out prompts of
``bench_tiny_prompt_following`` x noise seeds ``0 .. --seeds - 1``, 16 steps, CFG 5) and prints both with their
differences, and each stage's CPU minutes against the budgets on 2 cores (:data:`BUDGETS_MIN`: the autoencoders
together 30, the transformer 50). The exit status is 1 when a difference exceeds the tolerance.

The full recipe takes as long as the README's tiny training commands. ``--video_decoder_steps``,
``--audio_vae_steps`` and ``--transformer_steps`` override its step counts, to check the benchmark itself in minutes (the scores are then
those of an untrained model).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.benchmarks.tiny_quality import (
    JUDGED,
    common_parser,
    generate,
    load_pipeline,
    mean_scores,
    print_table,
    prompt_set,
    write_json,
)


STEPS, GUIDANCE, TOLERANCE = 16, 5.0, 0.05
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny"
#: The shipped weights' recipe: (script, flags); ``{ae}``, ``{tr}``, ``{pipeline}`` are folders of the work dir and
#: ``{video_decoder_steps}`` ... the step counts.
RECIPE = (
    (
        "train_tiny_autoencoders.py",
        "--component video_decoder --output_dir {ae} --max_train_steps {video_decoder_steps} "
        "--checkpointing_steps 500 --seed 0",
    ),
    (
        "train_tiny_autoencoders.py",
        "--component audio_vae --output_dir {ae} --max_train_steps {audio_vae_steps} --checkpointing_steps 100 --seed 0",
    ),
    (
        "train_tiny_transformer.py",
        "--output_dir {tr} --autoencoders_dir {ae} --pipeline_output_dir {pipeline} "
        "--max_train_steps {transformer_steps} --train_batch_size 16 --learning_rate 1e-3 --lr_scheduler cosine "
        "--lr_warmup_steps 200 --checkpointing_steps 1000 --seed 0",
    ),
)
DEFAULT_STEPS = {"video_decoder_steps": 3000, "audio_vae_steps": 300, "transformer_steps": 4000}
#: CPU-minute budgets of the recipe on 2 CPU cores: the autoencoders together, the transformer.
BUDGETS_MIN = {"autoencoders": 30.0, "transformer": 50.0}


def retrain(workdir: Path, threads: int, steps: dict) -> tuple[Path, list[dict]]:
    """Run :data:`RECIPE` into ``workdir``; the trained pipeline folder and each script's command, wall and CPU
    seconds (the child's user + system time)."""
    folders = {"ae": workdir / "autoencoders", "tr": workdir / "transformer", "pipeline": workdir / "pipeline"}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    runs = []
    for script, flags in RECIPE:
        command = [sys.executable, str(TINY / script), *flags.format(**folders, **steps).split()]
        print("+", " ".join(command[1:]), flush=True)
        start, cpu = time.perf_counter(), _children_cpu_s()
        subprocess.run(command, check=True, env=env)
        runs.append(
            {"command": command[1:], "seconds": time.perf_counter() - start, "cpu_seconds": _children_cpu_s() - cpu}
        )
    return folders["pipeline"], runs


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def budgets(runs: list[dict]) -> dict:
    """Wall and CPU minutes of the autoencoders' and the transformer's scripts against :data:`BUDGETS_MIN` (judged
    on CPU minutes: one thread on a 2-core machine that other jobs may share)."""
    part = {"autoencoders": "train_tiny_autoencoders.py", "transformer": "train_tiny_transformer.py"}
    spent = {}
    for name, budget in BUDGETS_MIN.items():
        mine = [r for r in runs if Path(r["command"][0]).name == part[name]]
        cpu, wall = (sum(r[k] for r in mine) / 60 for k in ("cpu_seconds", "seconds"))
        spent[name] = {"cpu_min": cpu, "wall_min": wall, "budget_min": budget, "within": cpu <= budget}
    return spent


def score(pipe, prompts: tuple[list[str], list[str]], seeds: int) -> dict:
    """Judge scores of the seen and the held-out prompts over noise seeds ``0 .. seeds - 1``."""
    return {
        split: mean_scores([generate(pipe, p, seed, STEPS, GUIDANCE) for p in group for seed in range(seeds)])
        for split, group in zip(("seen", "held_out"), prompts)
        if group
    }


def main(argv=None) -> int:
    p = common_parser(__doc__)
    p.add_argument(
        "--shipped", default=None, help="the shipped pipeline folder (default: build_tiny_default_pipeline)"
    )
    p.add_argument("--threads", type=int, default=1, help="threads of each training script (the recipe's: 1)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workdir", default=None, help="keep the retrained run here (default: a temporary folder)")
    for name, value in DEFAULT_STEPS.items():
        p.add_argument(f"--{name}", type=int, default=value)
    args = p.parse_args(argv)
    prompts = prompt_set(p, args)
    if args.threads < 1 or args.seeds < 1 or any(getattr(args, n) < 1 for n in DEFAULT_STEPS):
        p.error("--threads, --seeds and the step counts must be >= 1")
    if args.model:
        p.error("--model is not used here: the retrained model is compared with --shipped")
    steps = {n: getattr(args, n) for n in DEFAULT_STEPS}
    with tempfile.TemporaryDirectory(prefix="tiny-retrain-") as tmp:
        workdir = Path(args.workdir or tmp)
        folder, runs = retrain(workdir, args.threads, steps)
        retrained = score(load_pipeline(str(folder)), prompts, args.seeds)
    if args.shipped:
        shipped_pipe = load_pipeline(args.shipped)
    else:
        from diffusers_magi2 import build_tiny_default_pipeline

        shipped_pipe = build_tiny_default_pipeline()
        shipped_pipe.set_progress_bar_config(disable=True)
    shipped = score(shipped_pipe, prompts, args.seeds)
    rows, worst = [], 0.0
    for split in retrained:
        for k in JUDGED:
            diff = retrained[split][k] - shipped[split][k]
            worst = max(worst, abs(diff))
            rows.append([split, k, shipped[split][k], retrained[split][k], f"{diff:+.2f}"])
    ok = worst <= TOLERANCE
    spent = budgets(runs)
    results = {"steps": steps, "threads": args.threads, "runs": runs, "budgets": spent}
    results.update(shipped=shipped, retrained=retrained)
    results.update(worst_difference=worst, within_tolerance=ok)
    print(f"recipe steps {steps}, {args.threads} threads; {args.seeds} seed(s) per prompt")
    for k, v in spent.items():
        verdict = "within" if v["within"] else "OVER"
        print(
            f"{k}: {v['cpu_min']:.1f} CPU min ({v['wall_min']:.1f} wall), budget {v['budget_min']:.0f} CPU min: {verdict}"
        )
    print_table(["prompts", "judge", "shipped", "retrained", "difference"], rows)
    print(f"largest difference {worst:.3f}: {'within' if ok else 'OUTSIDE'} ±{TOLERANCE}")
    write_json(args.out, results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
