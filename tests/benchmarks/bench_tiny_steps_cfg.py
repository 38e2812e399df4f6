"""Prompt following of the trained tiny MAGI-2 against the step count and the CFG scale (not collected by pytest).

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_tiny_steps_cfg --model FOLDER \\
        [--steps 4 8 16 32 64] [--guidance 1 2 3 5 7 10] [--out steps_cfg.json]

Prompt set ("prompt-following set"): the benchmark's 8 seen and 4 held-out prompts (``bench_tiny_prompt_following``)
at noise seed 0. Two sweeps: the step counts at CFG 5, and the CFG scales at 16 steps (the trained model's call
default); the scale is the video's and the audio's alike (``guidance_scale`` = ``audio_guidance_scale``; 1 is no
guidance). Each row gives the judge's accuracies on the seen and the held-out prompts and the mean CPU seconds of a
clip.
"""

from __future__ import annotations

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


DEFAULT_STEPS, DEFAULT_GUIDANCE = 16, 5.0


def score(pipe, prompts: tuple[list[str], list[str]], steps: int, guidance: float) -> dict:
    """Mean judge scores on the seen and the held-out prompts, and CPU seconds per clip."""
    seen = [generate(pipe, prompt, 0, steps, guidance) for prompt in prompts[0]]
    held_out = [generate(pipe, prompt, 0, steps, guidance) for prompt in prompts[1]]
    clips = seen + held_out
    nothing = dict.fromkeys((*JUDGED, "flicker"), float("nan"))
    return {
        "seen": mean_scores(seen) if seen else nothing,
        "held_out": mean_scores(held_out) if held_out else nothing,
        "seconds_per_clip": sum(c.seconds for c in clips) / len(clips),
    }


def main(argv=None) -> int:
    p = common_parser(__doc__)
    p.add_argument("--steps", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--guidance", type=float, nargs="+", default=[1.0, 2.0, 3.0, 5.0, 7.0, 10.0])
    args = p.parse_args(argv)
    prompts = prompt_set(p, args)
    if any(s < 1 for s in args.steps) or any(g < 1.0 for g in args.guidance):
        p.error(f"--steps must be >= 1 and --guidance >= 1; got {args.steps} and {args.guidance}")
    pipe = load_pipeline(args.model)
    settings = [(s, DEFAULT_GUIDANCE) for s in args.steps]
    settings += [(DEFAULT_STEPS, g) for g in args.guidance if (DEFAULT_STEPS, g) not in settings]
    results = {"model": args.model or "random control", "prompts": prompts[0] + prompts[1], "seed": 0}
    measured = {setting: score(pipe, prompts, *setting) for setting in settings}
    results["runs"] = [{"steps": s, "guidance": g, **measured[(s, g)]} for s, g in settings]
    print(f"model: {results['model']}; {args.seen} seen + {args.held_out} held-out prompts, seed 0")
    columns = ["steps", "CFG", *(f"{k} (seen)" for k in JUDGED), "colour (held-out)", "motion (held-out)"]
    columns.append("CPU s / clip")
    for label, rows in (
        ("steps at CFG 5", [(s, DEFAULT_GUIDANCE) for s in args.steps]),
        (f"CFG at {DEFAULT_STEPS} steps", [(DEFAULT_STEPS, g) for g in args.guidance]),
    ):
        print(label)
        table = []
        for s, g in rows:
            r = measured[(s, g)]
            table.append(
                [s, g, *(r["seen"][k] for k in JUDGED), r["held_out"]["colour"], r["held_out"]["motion"]]
                + [r["seconds_per_clip"]]
            )
        print_table(columns, table)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
