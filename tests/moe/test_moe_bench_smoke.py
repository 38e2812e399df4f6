"""Smoke test of ``tests/benchmarks/bench_moe.py`` at a tiny size, so the benchmark cannot rot (no time asserted)."""

from __future__ import annotations

import importlib.util
import json

import torch
from conftest import REPO_ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_moe", REPO_ROOT / "tests" / "benchmarks" / "bench_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_moe_cpu_section_runs_and_reports_ratios() -> None:
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        result = bench.bench_cpu(num_tokens=32, heads=2, experts=4, top_k=2, head_dim=16, expert_dim=16, repeats=1)
    finally:
        torch.set_num_threads(threads)
    json.dumps(result)  # JSON-serialisable
    assert result["shape"]["S"] == 32
    for key in ("full_forward_s", "experts_only_s", "dense_gemms_s"):
        assert result[key] > 0
    assert abs(result["ratio_gemms_over_full_forward"] - result["dense_gemms_s"] / result["full_forward_s"]) < 1e-12
