"""Weight formats on the trained tiny MAGI-2 (not collected by pytest): judge accuracy and PSNR against the fp32
transformer of a bf16 transformer, FP8 and int4 routed experts, FP8-stored dense weights, and int4 experts with
FP8-stored dense weights (the 80 GB recipe).

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_tiny_quantization --model FOLDER [--seeds 1] \\
        [--int4_group_size 32] [--out quantization.json]

Prompt set ("prompt-following set"): the benchmark's 8 seen and 4 held-out prompts (``bench_tiny_prompt_following``)
at noise seeds ``0 .. --seeds - 1``, 16 steps, CFG 5 (video and audio). Only the transformer changes between
columns; it is read from ``FOLDER/transformer`` as a user reads it:

- fp32: as saved (the reference);
- bf16: ``from_pretrained(dtype=torch.bfloat16)`` (fp32 islands stay fp32);
- FP8 experts: the same with ``expert_dtype="float8_e4m3fn"`` (weight-only e4m3, one fp32 scale per expert and
  output channel);
- int4 experts: ``expert_dtype="int4"`` at ``expert_int4_group_size=--int4_group_size`` (the tiny MoE heads are 64
  wide, so the released size's 128 cannot divide them; 32 keeps two groups per column, as the fixtures' test does);
- FP8 dense: bf16 with ``enable_fp8_storage()`` (e4m3, one fp32 scale per output channel);
- int4 + FP8 dense: both.

The text encoder and the VAEs stay fp32 in every column. PSNR is over the decoded frames against the fp32 clip of
the same prompt and seed.
"""

from __future__ import annotations

import torch

from diffusers_magi2 import Magi2Transformer3DModel
from tests.benchmarks.tiny_quality import (
    JUDGED,
    common_parser,
    generate,
    load_pipeline,
    mean_scores,
    pipeline_folder,
    print_table,
    prompt_set,
    psnr,
    write_json,
)


STEPS, GUIDANCE = 16, 5.0
#: Column name -> (``from_pretrained`` keywords, FP8-stored dense weights).
FORMATS = {
    "fp32": ({}, False),
    "bf16": ({"dtype": torch.bfloat16}, False),
    "FP8 experts": ({"dtype": torch.bfloat16, "expert_dtype": "float8_e4m3fn"}, False),
    "int4 experts": ({"dtype": torch.bfloat16, "expert_dtype": "int4"}, False),
    "FP8 dense": ({"dtype": torch.bfloat16}, True),
    "int4 + FP8 dense": ({"dtype": torch.bfloat16, "expert_dtype": "int4"}, True),
}


def load_transformer(folder: str, name: str, int4_group_size: int):
    """The transformer of ``folder`` in format ``name`` (:data:`FORMATS`)."""
    kwargs, fp8_dense = FORMATS[name]
    if kwargs.get("expert_dtype") == "int4":
        kwargs = {**kwargs, "expert_int4_group_size": int4_group_size}
    transformer = Magi2Transformer3DModel.from_pretrained(folder, subfolder="transformer", **kwargs)
    if fp8_dense:
        transformer.enable_fp8_storage(compute_dtype=torch.bfloat16)
    return transformer.eval()


def main(argv=None) -> int:
    p = common_parser(__doc__)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--int4_group_size", type=int, default=32)
    args = p.parse_args(argv)
    seen, held_out = prompt_set(p, args)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    prompts = [(prompt, seed) for prompt in seen + held_out for seed in range(args.seeds)]
    with pipeline_folder(args.model) as folder:
        pipe = load_pipeline(folder)
        transformers = {name: load_transformer(folder, name, args.int4_group_size) for name in FORMATS}
    clips = {name: [] for name in FORMATS}
    for prompt, seed in prompts:
        for name, transformer in transformers.items():
            pipe.register_modules(transformer=transformer)
            clips[name].append(generate(pipe, prompt, seed, STEPS, GUIDANCE))
    reference = clips["fp32"]
    results = {"model": args.model or "random control", "prompts": prompts, "steps": STEPS, "guidance": GUIDANCE}
    rows = []
    for name, got in clips.items():
        results[name] = {
            **mean_scores(got),
            "psnr_db": sum(psnr(c.frames, r.frames) for c, r in zip(got, reference)) / len(got),
            "transformer_seconds": sum(c.transformer_seconds for c in got),
        }
        r = results[name]
        rows.append([name, *(r[k] for k in JUDGED), r["psnr_db"]])
    print(f"model: {results['model']}; {len(seen)} seen + {len(held_out)} held-out prompts x {args.seeds} seed(s)")
    print_table(["transformer", *JUDGED, "PSNR vs fp32 (dB)"], rows)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
