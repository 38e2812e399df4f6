"""Peak memory of quantize-at-load; prints one JSON object (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_fp8_load [--out fp8_load.json]

Writes the synthetic bf16 diffusers-format checkpoint of ``bench_ep_memory`` (805 MB of routed experts in 4 MoE
layers, one shard per layer), then loads it in a fresh process each:

* baseline: ``from_pretrained(folder, dtype=torch.bfloat16)`` (the bf16 model);
* ``from_pretrained(folder, dtype=torch.bfloat16, expert_dtype="float8_e4m3fn")`` (quantized tensor by tensor
  while each shard is read).

For each it prints the RSS growth of the load (peak RSS after the load, every weight read once so memory-mapped
tensors count, minus the RSS before) and

    ratio = growth / (loaded model bytes + largest source shard bytes)

(target for the FP8 load: <= 1.3, i.e. the full bf16 model never exists; the baseline's ratio is printed beside it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path

import torch

from tests.benchmarks.bench_ep_memory import CONFIG, _peak_rss_bytes, _reset_peak_rss, _rss_bytes, write_checkpoint


TARGET = 1.3


def _measure(folder: str, expert_dtype, out: str) -> None:
    import gc

    torch.set_num_threads(1)
    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel

    gc.collect()
    peak_reset = _reset_peak_rss()
    before = _rss_bytes()
    model = Magi2Transformer3DModel.from_pretrained(folder, dtype=torch.bfloat16, expert_dtype=expert_dtype)
    with torch.no_grad():  # read one element per 4 KiB page of every tensor: memory-mapped weights count in full
        for t in list(model.parameters()) + list(model.buffers()):
            t.reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()
    peak = _peak_rss_bytes()
    model_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    fp8 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    Path(out).write_text(
        json.dumps(
            {
                "expert_dtype": expert_dtype,
                "rss_before_mb": before / 2**20,
                "peak_rss_mb": peak / 2**20,
                "growth_bytes": peak - before,
                "model_bytes": model_bytes,
                "fp8_params": fp8,
                "peak_reset_before_load": peak_reset,
            }
        )
    )


def run() -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        folder.mkdir()
        sizes = write_checkpoint(folder)
        largest_shard = max(p.stat().st_size for p in folder.glob("*.safetensors"))
        results = {}
        for label, expert_dtype in (("bf16 (baseline)", None), ("fp8 quantize-at-load", "float8_e4m3fn")):
            out = Path(tmp) / f"{label.split()[0]}.json"
            proc = ctx.Process(target=_measure, args=(str(folder), expert_dtype, str(out)))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"{label} load failed (exit {proc.exitcode})")
            r = json.loads(out.read_text())
            r["ratio"] = r["growth_bytes"] / (r["model_bytes"] + largest_shard)
            results[label] = r
    fp8 = results["fp8 quantize-at-load"]
    return {
        "benchmark": "fp8_load",
        "config": CONFIG,
        **sizes,
        "largest_source_shard_bytes": largest_shard,
        "results": results,
        "ratio": fp8["ratio"],
        "baseline_ratio_bf16": results["bf16 (baseline)"]["ratio"],
        "target": f"ratio <= {TARGET} (RSS growth of the FP8 load / (FP8 model bytes + largest source shard))",
        "pass": fp8["ratio"] <= TARGET and fp8["fp8_params"] > 0,
        "platform": {"python": sys.version.split()[0], "torch": torch.__version__},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    report = run()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
