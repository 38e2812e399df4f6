"""Memory plan at the released size: the peak device memory of every stage of a generation, weights +
activations + kernel workspace.

Default: one 141 GB H200 (``enable_model_cpu_offload``: one model on the device at a time; FP8 or bf16 experts)
and per rank under CP8 x EP4 x 2 (80 GB GPUs, each stage's model alone on the device); a row fits with 8 GB spare.
``--gpu_gb 80``: the 1080p pipeline on one 80 GB H100/A100 (``--expert_dtype``, int4 by default, with FP8 storage
for the dense weights), every stage with 4 GB spare (<= 76 GB), the LoRA training step at 272p, and the host RAM
the offloaded components take. ``--gpu_gb 24`` / ``32``: the streamed recipes of an RTX 4090 / 5090
(``tests/helpers/memory_plan_consumer.py``: per stage the device peak, host memory, host->device copies and a time
model per step; with 24, per-rank rows of 8 x 24 GB cards); every used stage within ``card - 2`` GB.
``--write_budgets`` writes both recipes' planned peaks to the package's ``weight_streaming_budgets.json``
(``diffusers_magi2.pipelines.weight_streaming_budget`` refuses budgets from it).

Traced without the memory (``tests/helpers/memory_plan.py``, ``memory_plan_training.py`` and
``memory_plan_codecs.py``: the model code on fake tensors, GPU attention and the fused MoE kernel modelled by their
allocations, ``memory_trace.py``); the method is checked against a CPU run's allocator peak in
``tests/pipelines/test_memory_plan.py`` (within 10 %). Prints a markdown table (``--json``: one JSON line
``{"stages": [...], "host_ram_GB": ...}`` instead) and, with ``--out``, writes the rows as JSON. Exit status 1
when a row of the 80 GB plan that must fit does not.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_memory [--out memory_plan.json] [--quick]
    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_memory --gpu_gb 80 --expert_dtype int4 --json
    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_memory --gpu_gb 24 --json
    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_memory --write_budgets
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from diffusers_magi2.pipelines.weight_streaming_budget import BUDGETS_FILE
from tests.helpers.memory_plan import GB, H100_BYTES, plan_preview_step, plan_refiner_step
from tests.helpers.memory_plan_codecs import (
    plan_audio_decode,
    plan_image_encode,
    plan_text_encode,
    plan_video_decode,
    plan_wan_decode,
)
from tests.helpers.memory_plan_consumer import budget_table, consumer_result
from tests.helpers.memory_plan_streaming import NVME_GBPS, PCIE_GBPS, gbps_key
from tests.helpers.memory_plan_training import plan_lora_training_step


FP8 = "float8_e4m3fn"
#: ``--expert_dtype`` spellings -> the model's ``expert_dtype``.
EXPERT_DTYPES = {"int4": "int4", "fp8": FP8, FP8: FP8, "bf16": None}
MARGIN_80 = 4 * GB
RES = ("272p", "540p")


def plan_rows(quick: bool = False) -> list:
    """Every stage's :class:`Magi2StageMemory` on a 141 GB H200 and per rank (``quick``: 540p preview rows only)."""
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


def plan_rows_80gb(expert_dtype: str | None = "int4", quick: bool = False) -> tuple[list, list, int]:
    """``(rows, what_if_rows, host_bytes)`` of the 1080p pipeline and a 272p LoRA step on one 80 GB GPU: the rows
    that must fit (4 GB spare), rows that show what a knob buys (not required to fit), and the host RAM of every
    component (``enable_model_cpu_offload`` keeps all but the running one there; ``quick``: the preview and
    training rows only, no host RAM)."""
    cap = {"capacity": H100_BYTES, "margin": MARGIN_80}
    stored = {"storage_dtype": torch.float8_e4m3fn}
    preview = [plan_preview_step(res, expert_dtype, **stored, **cap) for res in RES]  # the default forward chunk
    train = {"expert_dtype": expert_dtype, **stored, **cap}
    if quick:
        return [*preview, plan_lora_training_step(offload_block_inputs=True, **train)], [], 0
    refiner = plan_refiner_step(**cap)
    decoders = [plan_video_decode("1080p", **cap), plan_wan_decode("1080p", **cap), plan_audio_decode(**cap)]
    text, image = plan_text_encode(**cap), plan_image_encode("540p", **cap)
    rows = [text, image, *preview, refiner, *decoders]
    rows.append(plan_lora_training_step(offload_block_inputs=True, **train))
    what_if = [plan_lora_training_step(offload_block_inputs=False, **train)]
    components = [text, preview[0], refiner, *decoders, image]  # text encoder, transformer, refiner, 3 VAEs
    return rows, what_if, sum(r.weights for r in components)


def markdown(rows) -> str:
    """The README's table."""
    lines = [
        "| stage | device | weights | activations | peak | spare | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = f" ({'; '.join(r.notes)})" if r.notes else ""
        lines.append(
            f"| {r.stage}{note} | {r.layout}, {r.capacity / GB:.0f} GB | {r.weights / GB:.2f} GB | "
            f"{r.activations / GB:.2f} GB | {r.total / GB:.2f} GB | {r.spare / GB:.2f} GB | "
            f"{'yes' if r.fits else 'no'} (>= {r.margin / GB:.0f} GB spare) |"
        )
    return "\n".join(lines)


def _stage(row) -> dict:
    return {
        "stage": row.name,
        "weights_GB": round(row.weights / GB, 2),
        "activations_GB": round(row.activations / GB, 2),
        "peak_GB": round(row.total / GB, 2),
        "fits": row.fits,
        "what": row.stage,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="141 GB: the 540p preview rows; 80 GB: preview + training"
    )
    parser.add_argument("--gpu_gb", type=int, choices=(141, 80, 32, 24), default=141, help="the plan's GPU")
    parser.add_argument(
        "--write_budgets", action="store_true", help="write the 24 and 32 GB plans' peaks into the package"
    )
    parser.add_argument("--expert_dtype", choices=sorted(EXPERT_DTYPES), default="int4", help="80 GB plan")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    status = 0
    if args.write_budgets:
        path = write_json(budget_table(), BUDGETS_FILE)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
        return 0
    if args.gpu_gb in (24, 32):
        result = consumer_result(args.gpu_gb)
        status = 0 if result["all_used_stages_fit"] else 1
        table = consumer_markdown(result)
    elif args.gpu_gb == 80:
        rows, what_if, host = plan_rows_80gb(EXPERT_DTYPES[args.expert_dtype], args.quick)
        result = {
            "stages": [_stage(r) for r in rows],
            "what_if": [_stage(r) for r in what_if],
            "host_ram_GB": round(host / GB, 2),
            "host_ram": "every component's weights (text encoder, transformer, refiner, VAEs): "
            "enable_model_cpu_offload keeps all but the running one in host memory",
        }
        status = 0 if all(r.fits for r in rows) else 1
        table = markdown(rows + what_if) + f"\n\nhost RAM of the offloaded components: {host / GB:.2f} GB"
    else:
        rows = plan_rows(args.quick)
        result = {"rows": [r.as_dict() for r in rows]}
        table = markdown(rows)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(result))
    else:
        print(table)
        print(f"planned {len(result.get('stages') or result['rows'])} stages in {result['seconds']} s")
    if args.out:
        write_json(result, args.out)
    return status


def write_json(result: dict, path: str) -> str:
    """``result`` written to ``path`` through a temporary file in its folder (no half-written file)."""
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(f.name, path)
    return path


def consumer_markdown(result: dict) -> str:
    """The README's table of a streamed recipe (an autoencoder's copy and read: once per stage)."""
    pcie, nvme = (" / ".join(f"{g:g}" for g in rates) for rates in (PCIE_GBPS, NVME_GBPS))
    lines = [
        f"| stage | used | resident | ring | activations | peak | host (pinned / disk) | h2d | copy {pcie} GB/s | "
        f"compute | disk read {nvme} GB/s | disk step {nvme} GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["stages"]:
        per = "step" if "time_per_step" in r else "stage"
        t = r.get(f"time_per_{per}") or {}
        h2d = f"{r[f'h2d_GB_per_{per}']} GB per {per}" if f"h2d_GB_per_{per}" in r else ""

        def rates(key, gbps, t=t):
            values = [t.get(f"{key}_at_{gbps_key(g)}") for g in gbps]
            return "" if None in values else " / ".join(map(str, values)) + " s"

        lines.append(
            f"| {r['stage']} | {'yes' if r['used'] else 'no'} | {r['resident_GB']} GB | {r['ring_GB']} GB | "
            f"{r['activations_GB']} GB | {r['peak_GB']} GB | {r['host_GB']} / {r['host_disk_mode_GB']} GB | {h2d} | "
            f"{rates('copy_s', PCIE_GBPS)} | {str(t['compute_s']) + ' s' if 'compute_s' in t else ''} | "
            f"{rates('disk_read_s', NVME_GBPS)} | {rates('disk_step_s', NVME_GBPS)} |"
        )
    lines.append(
        f"\nhost memory at the run's peak: {result['host_ram_GB']} GB pinned mode, "
        f"{result['host_ram_disk_mode_GB']} GB disk mode ({result['largest_host_stage']})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
