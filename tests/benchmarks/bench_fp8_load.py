"""Peak memory of quantize-at-load, FP8 and int4; prints one JSON object (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_fp8_load [--out fp8_load.json]

Writes the synthetic bf16 diffusers-format checkpoint of ``bench_ep_memory`` (805 MB of routed experts in 4 MoE
layers, one shard per layer), then loads it in a fresh process each:

* baseline: ``from_pretrained(folder, dtype=torch.bfloat16)`` (the bf16 model);
* ``from_pretrained(folder, dtype=torch.bfloat16, expert_dtype="float8_e4m3fn")`` (quantized tensor by tensor
  while each shard is read);
* ``from_pretrained(folder, dtype=torch.bfloat16, expert_dtype="int4", expert_int4_group_size=32)`` (the same for
  4-bit experts; the synthetic MoE heads are 32 wide).

For each it prints the RSS growth of the load (peak RSS after the load, every weight read once so memory-mapped
tensors count, minus the RSS before) and

    ratio = growth / (loaded model bytes + largest source shard bytes)

(target for each quantized load: <= 1.3, i.e. the full bf16 model never exists; the baseline's ratio is printed beside
it).
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
#: label -> from_pretrained's expert arguments
LOADS = {
    "bf16 (baseline)": {},
    "fp8 quantize-at-load": {"expert_dtype": "float8_e4m3fn"},
    "int4 quantize-at-load": {"expert_dtype": "int4", "expert_int4_group_size": 32},
}


def _measure(folder: str, expert_kwargs: dict, out: str) -> None:
    import gc

    torch.set_num_threads(1)
    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel

    gc.collect()
    peak_reset = _reset_peak_rss()
    before = _rss_bytes()
    model = Magi2Transformer3DModel.from_pretrained(folder, dtype=torch.bfloat16, **expert_kwargs)
    with torch.no_grad():  # read one element per 4 KiB page of every tensor: memory-mapped weights count in full
        for t in list(model.parameters()) + list(model.buffers()):
            t.reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()
    peak = _peak_rss_bytes()
    model_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    quantized = sum(p.numel() for p in model.parameters() if p.dtype in (torch.float8_e4m3fn, torch.uint8))
    Path(out).write_text(
        json.dumps(
            {
                **expert_kwargs,
                "rss_before_mb": before / 2**20,
                "peak_rss_mb": peak / 2**20,
                "growth_bytes": peak - before,
                "model_bytes": model_bytes,
                "quantized_params": quantized,
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
        for label, expert_kwargs in LOADS.items():
            out = Path(tmp) / f"{label.split()[0]}.json"
            proc = ctx.Process(target=_measure, args=(str(folder), expert_kwargs, str(out)))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"{label} load failed (exit {proc.exitcode})")
            r = json.loads(out.read_text())
            r["ratio"] = r["growth_bytes"] / (r["model_bytes"] + largest_shard)
            results[label] = r
    quantized = {label: r for label, r in results.items() if "quantize-at-load" in label}
    return {
        "benchmark": "fp8_load",
        "config": CONFIG,
        **sizes,
        "largest_source_shard_bytes": largest_shard,
        "results": results,
        "ratio": {label: r["ratio"] for label, r in quantized.items()},
        "baseline_ratio_bf16": results["bf16 (baseline)"]["ratio"],
        "target": f"ratio <= {TARGET} (RSS growth of each quantized load / (its model bytes + largest source shard))",
        "pass": all(r["ratio"] <= TARGET and r["quantized_params"] > 0 for r in quantized.values()),
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
