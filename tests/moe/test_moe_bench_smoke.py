"""Smoke tests of ``tests/benchmarks/bench_moe.py``, ``bench_int4_format.py`` and the W4A16 variant
(``w4a16_variant.py``) at a tiny size, so the benchmarks cannot rot (no time asserted)."""

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
    shape = {"num_tokens": 32, "heads": 2, "experts": 4, "top_k": 2, "head_dim": 64, "expert_dim": 64}
    try:
        result = bench.bench_cpu(**shape, repeats=1, quantized=("fp8_e4m3", "int4"))
    finally:
        torch.set_num_threads(threads)
    json.dumps(result)  # JSON-serialisable
    assert result["shape"]["S"] == 32
    for key in ("full_forward_s", "experts_only_s", "dense_gemms_s", "int4_experts_full_forward_s"):
        assert result[key] > 0
    assert abs(result["ratio_gemms_over_full_forward"] - result["dense_gemms_s"] / result["full_forward_s"]) < 1e-12
    assert result["int4_over_fp32_full_forward"] == result["int4_experts_full_forward_s"] / result["full_forward_s"]


def test_bench_moe_int4_estimate_counts_the_released_bytes_and_picks_a_path_per_call() -> None:
    """The bandwidth model behind the int4 path: the released layer's bytes (4.125 bits a weight, one head's bf16
    bank 0.50 GB), the dequantization pass at HBM bandwidth, and the row count where the in-loop variant would win."""
    estimate = load_bench().int4_estimate(token_counts=(4096, 16384, 116736))
    json.dumps(estimate)
    weights = 12 * 256 * 3 * 256 * 1280
    assert estimate["int4_GB"] == weights * 4.125 / 8 / 1e9 and estimate["one_head_bf16_GB"] == 2 * weights / 12 / 1e9
    assert estimate["S=116736"]["a_dequant_s"] == (estimate["int4_GB"] + estimate["bf16_GB"]) * 1e9 / 4.8e12
    assert 200 < estimate["crossover_rows_per_expert"] < 400
    assert estimate["S=4096"]["path"].startswith("b") and estimate["S=16384"]["path"].startswith("a")
    assert estimate["S=16384"]["rows_per_expert"] == 384


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


def test_w4a16_variant_computes_the_int4_layer() -> None:
    """The in-loop variant whose builds the int4 path was chosen over computes the same layer (interpreter, fp32)."""
    from helpers.int4_models import BANKS, int4_copy
    from helpers.moe_cases import rel_l2, tiny_config

    from diffusers_magi2.moe.experts import torch_mh_moe_forward
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
    from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES
    from diffusers_magi2.moe.routing import global_sort_routes

    variant = load_bench("w4a16_variant")
    torch.manual_seed(0)
    module = int4_copy(Magi2MultiHeadMoE(tiny_config(num_experts=4, head_dim=32, expert_dim=32)), 16)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        routes = global_sort_routes(*module.route(x), 4)
        banks = [module.get_parameter(n) for n in BANKS]
        scales = [module.get_buffer(n) for n in INT4_SCALE_NAMES]
        ref = torch_mh_moe_forward(x, *routes, *banks, scales=scales)
        assert rel_l2(variant.run_variant(x, routes, banks, scales), ref) < 1e-5
