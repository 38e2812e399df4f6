"""Streamed vs resident block weights (``enable_weight_streaming``); prints one JSON object (not collected by pytest).

Run from the repository root::

    python -m tests.benchmarks.bench_weight_streaming [--layers 4] [--small] [--compile]
    python -m tests.benchmarks.bench_weight_streaming --recipe_24gb [--cap_gb 24] [--small] [--out report.json]

On CUDA: a released-width model of ``--layers`` MoE blocks (C 3072, 12 MoE heads x 256 experts, FP8 routed experts;
8,192 tokens, :func:`~tests.benchmarks.bench_gpu_block.inputs`) is timed resident on the GPU, then streamed through
a two-slot ring from pinned host memory. Reports:

* ``streamed_over_resident``: forward time streamed / resident (the target: <= 1.15 per block at 540p-sized inputs);
* ``copy_s_per_block``: one block's host-to-device ``copy_`` alone, and ``copy_hidden_fraction``
  ``= 1 - (streamed - resident) / (layers * copy_s_per_block)``, clipped to [0, 1];
* ``bit_equal``: whether the streamed output equals the resident one.

Without CUDA (or with ``--small``) a small configuration runs on the CPU ring (synchronous copies): the ratio is
then the ring mechanics' overhead (the hooks, the view swaps and one ``copy_`` per block). ``--compile`` also runs
the streamed model under ``compile_repeated_blocks()`` and reports its first-call and steady times and its rel-L2
against the eager resident output (the hook's swaps run eagerly, ``torch.compiler.disable``; the blocks compile).

``--recipe_24gb`` (``gpu_check.sh``'s ``streaming_24gb`` step): the 24 GB recipe on one card capped at ``--cap_gb``
(``torch.cuda.set_per_process_memory_fraction``): a released-width model of ``--layers`` MoE blocks with int4
routed experts and ``enable_fp8_storage`` dense weights, on the 116,212 packed tokens of one 540p CFG forward
(:func:`~tests.benchmarks.bench_preview_step.packed_inputs`, the default 16,384-token chunks), resident, then
streamed through the recipe's ring (``ring_size`` 2). Reports each block's time streamed and resident (CUDA events
around each block, the copy waits included), ``streamed_over_resident_per_block`` (the target: <= 1.15),
``copy_hidden_fraction`` as above, and the streamed forward's peak (``torch.cuda.max_memory_allocated``): above the
resident weights, the ring and the inputs against the plan's activations for the same model and tokens
(:func:`~tests.helpers.memory_plan.trace_preview_forward`; within 10 %), whole against the card's target
(``cap - 2`` GB) and beside the shipped 24 GB table's ``preview_540p`` row (the 40-layer model: the same parts, its
ring 3 blocks deep). Exit status 1 when one of these misses. ``--small`` (also without a GPU): the same code on a
tiny model and 1,024 tokens on the CPU ring, no cap, the CPU allocator's peak against the plan with
``kernels="cpu"``; the per-block ratio is then not checked.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.pipelines.weight_streaming_budget import streaming_budgets
from tests.benchmarks.bench_gpu_block import FP8, build, forward, inputs, rel_l2, timed
from tests.benchmarks.bench_preview_step import SMALL as SMALL_PREVIEW
from tests.benchmarks.bench_preview_step import packed_inputs
from tests.helpers.memory_plan import trace_preview_forward
from tests.helpers.memory_plan_streaming import preview_streamed_weights
from tests.helpers.memory_tracking import cpu_allocator_peak


GB = 1e9
#: Packed tokens per modality of one CFG half at 540p (the plan's 116,212-token forward), and the CPU run's.
HALF_540P = {"video": 57344, "audio": 250, "text": 512}
HALF_SMALL = {"video": 480, "audio": 16, "text": 16}


def _copy_seconds(streamer, device, repeats: int = 5) -> float:
    """One block's ``copy_`` from its host buffer into a ring slot (best of ``repeats``)."""
    block, slot = streamer.blocks[0], streamer.slots[0].buffer
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        slot.narrow(0, 0, block.nbytes).copy_(block.host, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def run(layers: int, small: bool, compile_blocks: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    small = small or device.type == "cpu"
    model = build(
        {"num_layers": layers, "multimodal_layers": [], "moe_layers": list(range(layers))},
        small,
        device,
        None if small else FP8,
    )
    batch = inputs(small, device)
    resident_out, resident_s = timed(lambda: forward(model, batch), device)
    streamer = model.enable_weight_streaming(device)
    streamed_out, streamed_s = timed(lambda: forward(model, batch), device)
    copy_s = _copy_seconds(streamer, device)
    exposed = max(streamed_s - resident_s, 0.0)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "small": small,
        "layers": layers,
        "block_GB": round(max(b.nbytes for b in streamer.blocks) / 1e9, 4),
        "host_GB": round(streamer.host_nbytes / 1e9, 4),
        "host_reserved_GB": round(streamer.host_reserved_nbytes / 1e9, 4),
        "ring_GB": round(streamer.ring_nbytes / 1e9, 4),
        "resident_s": round(resident_s, 4),
        "streamed_s": round(streamed_s, 4),
        "streamed_over_resident": round(streamed_s / resident_s, 3),
        "copy_s_per_block": round(copy_s, 5),
        "copy_GB_per_s": round(max(b.nbytes for b in streamer.blocks) / copy_s / 1e9, 2),
        "copy_hidden_fraction": round(min(max(1 - exposed / (layers * copy_s), 0.0), 1.0), 3),
        "bit_equal": bool(torch.equal(streamed_out, resident_out)),
    }
    if compile_blocks:
        start = time.perf_counter()
        model.compile_repeated_blocks()
        compiled_out = forward(model, batch)
        report["compile_first_call_s"] = round(time.perf_counter() - start, 2)
        _, compiled_s = timed(lambda: forward(model, batch), device)
        report["compiled_streamed_s"] = round(compiled_s, 4)
        report["compiled_rel_l2_vs_eager"] = rel_l2(compiled_out, resident_out)  # inductor's rounding
    return report


def _timed_blocks(model, inputs, device, repeats: int) -> tuple[torch.Tensor, float, list]:
    """``(output, seconds, per-block seconds)`` of the fastest of ``repeats`` ``forward_packed`` calls after a
    warm-up; each block timed from before its hooks (a streamed block's copy wait included) to its output."""
    cuda = device.type == "cuda"
    marks = []

    def mark(*_):
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
        else:
            marks.append(time.perf_counter())

    blocks = list(model.transformer_blocks)
    hooks = [b.register_forward_pre_hook(mark) for b in blocks] + [b.register_forward_hook(mark) for b in blocks]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    best = (None, float("inf"), [])
    try:
        with torch.no_grad():
            model.forward_packed(*inputs)  # warm-up: kernels compiled, configs chosen
            for _ in range(repeats):
                marks.clear()
                sync()
                start = time.perf_counter()
                out = model.forward_packed(*inputs)
                sync()
                seconds = time.perf_counter() - start
                pairs = zip(marks[0::2], marks[1::2])
                per_block = [a.elapsed_time(b) / 1e3 if cuda else b - a for a, b in pairs]
                if seconds < best[1]:
                    best = (out, seconds, per_block)
    finally:
        for h in hooks:
            h.remove()
    return best


def recipe_24gb(layers: int, small: bool, cap_gb: float, ring_size: int = 2, repeats: int = 2) -> dict:
    """The ``--recipe_24gb`` report (module docstring)."""
    cuda = torch.cuda.is_available() and not small
    device = torch.device("cuda" if cuda else "cpu")
    moe = {"num_layers": layers, "multimodal_layers": (), "moe_layers": tuple(range(layers))}
    config = {**(moe if cuda else {**SMALL_PREVIEW, **moe}), **({} if cuda else {"expert_int4_group_size": 32})}
    half = HALF_540P if cuda else HALF_SMALL
    torch.manual_seed(0)
    with torch.device(device):
        model = Magi2Transformer3DModel(**config, params_dtype=torch.bfloat16, expert_dtype="int4").eval()
    model.enable_fp8_storage(compute_dtype=torch.bfloat16)
    if not cuda:
        model.set_moe_backend("torch_grouped")
        model.enable_forward_chunking(256)
    chunk = {} if cuda else {"forward_chunk_size": 256}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap_gb * GB / torch.cuda.get_device_properties(device).total_memory)
    inputs = packed_inputs(half, model.config.text_in_channels, device)
    resident_out, resident_s, resident_blocks = _timed_blocks(model, inputs, device, repeats)

    streamer = model.enable_weight_streaming(device, ring_size=ring_size)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the resident weights, the ring and the inputs
        streamed_out, streamed_s, streamed_blocks = _timed_blocks(model, inputs, device, repeats)
        peak = torch.cuda.max_memory_allocated()
        activations = peak - base
    else:  # the CPU allocator's peak during the calls (weights, ring and inputs allocated before)
        (streamed_out, streamed_s, streamed_blocks), activations = cpu_allocator_peak(
            lambda: _timed_blocks(model, inputs, device, 1)
        )
    copy_s = _copy_seconds(streamer, device)  # (after the streamed calls: it overwrites a slot)
    seg = sum(half.values())
    trace = trace_preview_forward(
        {k: 2 * v for k, v in half.items()}, (seg, seg), config, "int4", kernels="cuda" if cuda else "cpu",
        count_inputs=False, storage_dtype=torch.float8_e4m3fn, **chunk,
    )  # fmt: skip
    weights = preview_streamed_weights("int4", torch.float8_e4m3fn, transformer_config=config)
    input_bytes = sum(t.numel() * t.element_size() for t in inputs)
    planned_weights = weights.resident + ring_size * max(weights.blocks)
    resident_block = sum(resident_blocks) / len(resident_blocks)
    streamed_block = sum(streamed_blocks) / len(streamed_blocks)
    exposed = max(streamed_s - resident_s, 0.0)
    row = streaming_budgets()["recipes"]["24"]["stages"]["preview_540p"]
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "small": not cuda,
        "cap_GB": cap_gb if cuda else None,
        "layers": layers,
        "tokens": 2 * seg,
        "ring_size": ring_size,
        "block_GB": round(max(b.nbytes for b in streamer.blocks) / GB, 4),
        "ring_GB": round(streamer.ring_nbytes / GB, 4),
        "resident_s": round(resident_s, 4),
        "streamed_s": round(streamed_s, 4),
        "resident_s_per_block": round(resident_block, 5),
        "streamed_s_per_block": round(streamed_block, 5),
        "streamed_over_resident_per_block": round(streamed_block / resident_block, 3),
        "copy_s_per_block": round(copy_s, 5),
        "copy_GB_per_s": round(max(b.nbytes for b in streamer.blocks) / copy_s / GB, 2),
        "copy_hidden_fraction": round(min(max(1 - exposed / (layers * copy_s), 0.0), 1.0), 3),
        "bit_equal": bool(torch.equal(streamed_out, resident_out)),
        "measured_peak_GB": round(peak / GB, 3) if cuda else None,
        "planned_peak_GB": round((planned_weights + input_bytes + trace.activations) / GB, 3),
        "measured_activations_GB": round(activations / GB, 4),
        "planned_activations_GB": round(trace.activations / GB, 4),
        "planned_over_measured": round(trace.activations / max(activations, 1), 3),
        "plan_peak_at": trace.peak_at,
        "planned_40_layers_preview_540p_GB": row["peak_GB"],
        "within_card_target": bool(not cuda or peak <= (cap_gb - 2) * GB),
    }


def recipe_24gb_failures(report: dict) -> list:
    """What a ``--recipe_24gb`` report misses: bit equality, the plan within 10 %, the card's target (``cap - 2``
    GB) and, on a GPU, streamed <= 1.15 x resident per block."""
    checks = {
        "streamed output differs from resident": not report["bit_equal"],
        "plan off by more than 10 %": abs(report["planned_over_measured"] - 1) > 0.10,
        "peak above the card's target": not report["within_card_target"],
        "streamed > 1.15 x resident per block": not report["small"]
        and report["streamed_over_resident_per_block"] > 1.15,
    }
    return [what for what, failed in checks.items() if failed]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="MoE blocks in the model (default 4)")
    parser.add_argument("--small", action="store_true", help="the small configuration on the CPU ring")
    parser.add_argument("--compile", action="store_true", help="also time the streamed model under compile")
    parser.add_argument("--recipe_24gb", action="store_true", help="the 24 GB recipe at 540p under a memory cap")
    parser.add_argument("--cap_gb", type=float, default=24.0, help="--recipe_24gb: the card's memory, GB")
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.recipe_24gb:
        report = recipe_24gb(args.layers, args.small, args.cap_gb)
        report["failures"] = recipe_24gb_failures(report)
    else:
        report = run(args.layers, args.small, args.compile)
    text = json.dumps(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    raise SystemExit(1 if main().get("failures") else 0)
