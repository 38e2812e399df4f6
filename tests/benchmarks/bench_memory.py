"""Memory plan at the released size: the peak device memory of every stage of a generation, weights +
activations + kernel workspace, for one GPU (an H200, 141 GB, ``enable_model_cpu_offload``: one model on the
device at a time) and per rank under CP8 x EP4 x 2 (80 GB GPUs, each stage's model alone on the device).

Traced without the memory (``tests/helpers/memory_plan.py``: the model code on fake tensors, GPU
attention and the fused MoE kernel modelled by their allocations); the method is checked against a CPU run's
allocator peak in ``tests/pipelines/test_memory_plan.py`` (within 10 %). Prints a markdown table and, with
``--out``, writes the rows as JSON. The baseline column of each row is its device's capacity: ``spare`` must be
at least 8 GB for ``fits``.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_memory [--out memory_plan.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tests.helpers.memory_plan import (
    GB,
    H100_BYTES,
    plan_audio_decode,
    plan_image_encode,
    plan_preview_step,
    plan_refiner_step,
    plan_text_encode,
    plan_video_decode,
)


FP8 = "float8_e4m3fn"


def plan_rows(quick: bool = False) -> list:
    """Every stage's :class:`Magi2StageMemory` (``quick``: 540p preview rows only)."""
    rows = []
    resolutions = ("540p",) if quick else ("272p", "540p")
    if not quick:
        rows += [plan_text_encode(), plan_image_encode()]
    for res in resolutions:
        for experts in (None, FP8):
            rows.append(plan_preview_step(res, experts))
    rows.append(plan_preview_step("540p", FP8, forward_chunk_size=None))  # what the default chunking buys
    if not quick:
        rows += [plan_refiner_step(), plan_video_decode("540p"), plan_video_decode("1080p"), plan_audio_decode()]
    for res in resolutions:
        for experts in (None, FP8):
            rows.append(plan_preview_step(res, experts, cp_degree=8, ep_degree=4))
    if not quick:
        rows.append(plan_refiner_step(cp_degree=8))
        for row in (plan_text_encode(capacity=H100_BYTES), plan_video_decode("1080p", capacity=H100_BYTES)):
            row.layout = "CP8 x EP4 x 2, rank 0"
            rows.append(row)
    return rows


def markdown(rows) -> str:
    """The README's table."""
    lines = [
        "| stage | device | weights | activations | peak | spare | fits (>= 8 GB spare) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = f" ({'; '.join(r.notes)})" if r.notes else ""
        lines.append(
            f"| {r.stage}{note} | {r.layout}, {r.capacity / GB:.0f} GB | {r.weights / GB:.2f} GB | "
            f"{r.activations / GB:.2f} GB | {r.total / GB:.2f} GB | {r.spare / GB:.2f} GB | "
            f"{'yes' if r.fits else 'no'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="540p preview rows only")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = plan_rows(args.quick)
    print(markdown(rows))
    result = {"rows": [r.as_dict() for r in rows], "seconds": round(time.perf_counter() - t0, 1)}
    print(f"planned {len(rows)} stages in {result['seconds']} s")
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
            json.dump(result, f, indent=2)
        os.replace(f.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
