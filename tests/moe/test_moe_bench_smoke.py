"""Smoke tests of ``tests/benchmarks/bench_moe.py`` and ``bench_int4_format.py`` at a tiny size, so the benchmarks
cannot rot (no time asserted)."""

from __future__ import annotations

import importlib.util
import json

import torch
from helpers.fixtures import REPO_ROOT


def load_bench(name: str = "bench_moe"):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tests" / "benchmarks" / f"{name}.py")
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


def test_bench_moe_grouped_mm_baseline_computes_the_layer() -> None:
    """The ``torch._grouped_mm`` baseline the CUDA part times is the same layer as the torch path (fp32, CPU)."""
    from helpers.moe_cases import random_case

    from diffusers_magi2.moe.experts import torch_mh_moe_forward
    from diffusers_magi2.moe.routing import global_sort_routes

    bench = load_bench()
    x, probs, idx, w_gate, w_up, w_down = random_case(10, 2, 4, 2, 16, 32, torch.float32, seed=4)
    args = (x, *global_sort_routes(probs, idx, 4), w_gate, w_up, w_down)
    torch.testing.assert_close(bench._grouped_mm_experts(*args), torch_mh_moe_forward(*args), atol=1e-5, rtol=1e-5)


def test_bench_int4_format_reports_every_format_and_ratios_to_the_chosen_one() -> None:
    result = load_bench("bench_int4_format").bench(contraction_dims=(128,), n=8, rows=4)
    json.dumps(result)
    for entry in result["rel_l2"].values():
        assert {"nf4_g128", "nf4_absmax_g128", "int4_sym7_g64", "int4_sym8_g32"} <= set(entry)
        assert entry["ratio_to_nf4_g128"]["nf4_g128"] == 1.0
        assert all(0 < v < 1 for k, v in entry.items() if k != "ratio_to_nf4_g128")
