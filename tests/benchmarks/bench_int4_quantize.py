"""Speed of ``quantize_int4`` (weights per second) against its plain vectorised form, measured in the same run;
prints one JSON object (not collected by pytest).

Run from the repository root::

    python -m tests.benchmarks.bench_int4_quantize [--rows 8] [--repeats 3] [--out int4_quantize.json]

Banks of the released expert shapes, bf16: ``W_gate``/``W_up`` ``[rows, 256, 1280]`` and ``W_down``
``[rows, 1280, 256]``, group 128. Timed (best of ``--repeats``, the two forms interleaved):

* ``plain``: ``tests/helpers/int4_reference.py`` (``torch.bucketize`` over the NF4 midpoints, 16 experts per step:
  the form ``quantize_int4`` had before), one thread;
* ``quantize_int4`` with one thread and with every thread torch uses here (``torch.get_num_threads()``);
* ``quantize_int4`` on CUDA, where there is one.

Each result is checked against ``plain`` (codes and scales bit for bit on CPU; on CUDA the share of scales that
differ is printed: its sums round differently). ``speedup`` = plain time / quantize_int4 time (one thread), and
``full_size_hours`` projects the 108.7 B routed-expert weights of the release (36 MoE layers x 3 banks x 12 heads x
256 experts x 256 x 1280) at each measured rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from diffusers_magi2.moe.quantize_int4 import quantize_int4
from tests.helpers.int4_reference import plain_quantize_int4


RELEASED_EXPERT_WEIGHTS = 36 * 3 * 12 * 256 * 256 * 1280
GROUP = 128


def _timed(fn, threads: int) -> tuple[float, tuple]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        out = fn()
        if out[0].is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, out
    finally:
        torch.set_num_threads(previous)


def bench(rows: int = 8, repeats: int = 3, seed: int = 0) -> dict:
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(seed)
    banks = {
        "W_gate": (torch.randn(rows, 256, 1280, generator=gen) * 256**-0.5).bfloat16(),
        "W_down": (torch.randn(rows, 1280, 256, generator=gen) * 1280**-0.5).bfloat16(),
    }
    runs = {"plain_1_thread": (plain_quantize_int4, 1), "quantize_int4_1_thread": (quantize_int4, 1)}
    if threads > 1:
        runs[f"quantize_int4_{threads}_threads"] = (quantize_int4, threads)
    seconds = dict.fromkeys(runs, 0.0)
    identical = True
    for weight in banks.values():
        best = {label: float("inf") for label in runs}
        for _ in range(repeats):
            outs = {}
            for label, (fn, n) in runs.items():
                elapsed, outs[label] = _timed(lambda fn=fn: fn(weight, GROUP), n)
                best[label] = min(best[label], elapsed)
            reference = outs["plain_1_thread"]
            identical &= all(all(torch.equal(a, b) for a, b in zip(o, reference)) for o in outs.values())
        for label in runs:
            seconds[label] += best[label]
    numel = sum(w.numel() for w in banks.values())
    result = {
        "benchmark": "int4_quantize",
        "weights": numel,
        "group_size": GROUP,
        "threads": threads,
        "seconds": seconds,
        "weights_per_s": {label: numel / s for label, s in seconds.items()},
        "full_size_hours": {label: RELEASED_EXPERT_WEIGHTS * s / numel / 3600 for label, s in seconds.items()},
        "speedup": seconds["plain_1_thread"] / seconds["quantize_int4_1_thread"],
        "bit_identical_to_plain": identical,
    }
    if torch.cuda.is_available():
        cuda_seconds, differing = 0.0, 0
        for weight in banks.values():
            on_gpu = weight.cuda()
            quantize_int4(on_gpu[:1], GROUP)  # warm-up
            cuda_seconds += min(_timed(lambda: quantize_int4(on_gpu, GROUP), threads)[0] for _ in range(repeats))
            differing += int((quantize_int4(on_gpu, GROUP)[1].cpu() != quantize_int4(weight, GROUP)[1]).sum())
        result["cuda"] = {
            "device": torch.cuda.get_device_name(),
            "seconds": cuda_seconds,
            "weights_per_s": numel / cuda_seconds,
            "full_size_hours": RELEASED_EXPERT_WEIGHTS * cuda_seconds / numel / 3600,
            "scales_differing_from_cpu": differing,
        }
    result["platform"] = {"python": sys.version.split()[0], "torch": torch.__version__}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="experts per bank (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per form; the best counts (default 3)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = bench(args.rows, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["bit_identical_to_plain"] else 1


if __name__ == "__main__":
    sys.exit(main())
