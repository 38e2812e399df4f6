"""Streamed vs resident block weights (``enable_weight_streaming``); prints one JSON object (not collected by pytest).

Run from the repository root::

    python -m tests.benchmarks.bench_weight_streaming [--layers 4] [--small] [--compile]

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
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tests.benchmarks.bench_gpu_block import FP8, build, forward, inputs, rel_l2, timed


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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="MoE blocks in the model (default 4)")
    parser.add_argument("--small", action="store_true", help="the small configuration on the CPU ring")
    parser.add_argument("--compile", action="store_true", help="also time the streamed model under compile")
    args = parser.parse_args(argv)
    report = run(args.layers, args.small, args.compile)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
