"""Benchmark of the multi-head MoE core; prints one JSON object (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_moe [--out moe_bench.json] [--expert_dtype bf16 fp8_e4m3]

CPU (1 thread; S=4096, H=12, E=32, k=6, Dh=64, De=128, fp32): time of the full torch-path forward
(``Magi2MultiHeadMoE.forward``: routing, CSR sort, experts) against the time of the same three GEMMs per expert run as
plain dense matmuls over pre-gathered rows, measured in the same run. Target: ``gemm_s / full_forward_s >= 0.6``.

CUDA (only when a GPU is present; otherwise the JSON says so): the released shape (H=12, E=256, k=6, Dh=256,
De=1280, bf16 activations) at 4,096 and 29,184 tokens, once per ``--expert_dtype`` (``bf16`` experts, ``fp8_e4m3``:
FP8 experts with fp32 scales): TFLOP/s of the Triton kernel (atomic and deterministic), of the torch path, of the
same layer as bf16 ``torch._grouped_mm`` calls, and of one dense bf16 GEMM with the same FLOPs; ``--per_config``
adds every launch-table tile candidate of the device. What gpu_check.sh runs::

    python -m tests.benchmarks.bench_moe --cuda_only --per_config --no_torch_path --repeats 3 \
        --expert_dtype bf16 fp8_e4m3 --out "$RESULTS/bench_moe.json" With ``fp8_e4m3`` the CPU part also times the torch-path forward with FP8
experts against the fp32 one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time

import torch

from diffusers_magi2.moe.activation import swiglu7
from diffusers_magi2.moe.experts import torch_mh_moe_forward
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.moe.routing import global_sort_routes


def _best_of(fn, repeats: int, sync=lambda: None, clock=time.perf_counter) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = clock()
        fn()
        sync()
        best = min(best, clock() - start)
    return best


EXPERT_DTYPES = {"bf16": None, "fp8_e4m3": "float8_e4m3fn"}  # --expert_dtype -> Magi2MultiHeadMoEConfig.expert_dtype


def _module(num_tokens, heads, experts, top_k, head_dim, expert_dim, dtype, device, seed=0, expert_dtype=None):
    torch.manual_seed(seed)
    cfg = Magi2MultiHeadMoEConfig(
        hidden_size=heads * head_dim,
        num_heads=heads,
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=expert_dim,
        params_dtype=dtype,
        route_scale=4.9,
        expert_dtype=expert_dtype,
    )
    with torch.device(device):  # build (and randomly initialise) the bank directly on the device
        module = Magi2MultiHeadMoE(cfg)
    hidden = torch.randn(num_tokens, heads * head_dim, device=device).to(dtype)
    return module, hidden


def bench_cpu(
    num_tokens=4096, heads=12, experts=32, top_k=6, head_dim=64, expert_dim=128, repeats=3, fp8=False
) -> dict:
    """Full torch-path forward vs the same GEMMs as dense matmuls over pre-gathered rows (1 thread, fp32); with
    ``fp8`` also the full forward with FP8 experts (same shape and inputs)."""
    torch.set_num_threads(1)
    module, hidden = _module(num_tokens, heads, experts, top_k, head_dim, expert_dim, torch.float32, "cpu")
    module.set_backend("torch")
    x = hidden.view(num_tokens, heads, head_dim)
    with torch.no_grad():
        probs, idx = module.route(x)
        routes = global_sort_routes(probs, idx, experts)
        gather_ids, _, offsets = routes
        bounds = offsets.tolist()
        tokens = gather_ids.long()
        gathered = []
        for g in range(heads * experts):
            rows = tokens[bounds[g] : bounds[g + 1]]
            gathered.append(x[:, g // experts].index_select(0, rows))
        hid = [torch.randn(r.shape[0], expert_dim) for r in gathered]

        def gemms_only():
            for g, rows in enumerate(gathered):
                rows @ module.W_gate[g]
                rows @ module.W_up[g]
                hid[g] @ module.W_down[g]

        def experts_only():
            torch_mh_moe_forward(x, *routes, module.W_gate, module.W_up, module.W_down)

        # Interleaved rounds, best of each, on the process CPU clock (1 thread): robust to other jobs sharing
        # the cores, which would otherwise inflate wall times unevenly.
        clock = time.process_time
        full_s = experts_s = gemm_s = float("inf")
        for _ in range(repeats):
            full_s = min(full_s, _best_of(lambda: module(hidden), 1, clock=clock))
            experts_s = min(experts_s, _best_of(experts_only, 1, clock=clock))
            gemm_s = min(gemm_s, _best_of(gemms_only, 1, clock=clock))
        wall_full_s = _best_of(lambda: module(hidden), 1)
        fp8_s = None
        if fp8:
            fp8_module, _ = _module(
                num_tokens,
                heads,
                experts,
                top_k,
                head_dim,
                expert_dim,
                torch.float32,
                "cpu",
                expert_dtype="float8_e4m3fn",
            )
            fp8_module.set_backend("torch")
            fp8_s = min(_best_of(lambda: fp8_module(hidden), 1, clock=clock) for _ in range(repeats))
    routes = num_tokens * heads * top_k
    flops = 6.0 * routes * head_dim * expert_dim
    return {
        "shape": {
            "S": num_tokens,
            "H": heads,
            "E": experts,
            "k": top_k,
            "Dh": head_dim,
            "De": expert_dim,
            "dtype": "float32",
        },
        "threads": torch.get_num_threads(),
        "clock": "process CPU time (best of interleaved rounds)",
        "full_forward_s": full_s,
        "full_forward_wall_s": wall_full_s,
        "experts_only_s": experts_s,
        "dense_gemms_s": gemm_s,
        "ratio_gemms_over_full_forward": gemm_s / full_s,
        "ratio_gemms_over_experts_only": gemm_s / experts_s,
        "target_ratio": 0.6,
        "meets_target_full_forward": gemm_s / full_s >= 0.6,
        "meets_target_experts_only": gemm_s / experts_s >= 0.6,
        "full_forward_gflops": flops / full_s / 1e9,
        **(
            {}
            if fp8_s is None
            else {"fp8_experts_full_forward_s": fp8_s, "fp8_over_fp32_full_forward": fp8_s / full_s}
        ),
    }


def _grouped_mm_experts(x, gather_ids, probs, offsets, w_gate, w_up, w_down):
    """The same layer as ``torch._grouped_mm`` calls over all H·E experts at once (gather, gate, up, swiglu7 rounded
    to x's dtype, down, weighted fp32 scatter-add): the library baseline. Raises where the build has no grouped GEMM
    for x's dtype; arguments as ``torch_mh_moe_forward``."""
    num_tokens, num_heads, head_dim = x.shape
    num_experts = w_gate.shape[0] // num_heads
    offs = offsets[1:].to(torch.int32)
    route = torch.arange(gather_ids.numel(), device=x.device)
    head = torch.div(torch.searchsorted(offsets, route, right=True) - 1, num_experts, rounding_mode="floor")
    rows = x[gather_ids.long(), head]
    hidden = swiglu7(
        torch._grouped_mm(rows, w_gate, offs=offs), torch._grouped_mm(rows, w_up, offs=offs), out_dtype=x.dtype
    )
    down = torch._grouped_mm(hidden, w_down, offs=offs) * probs.unsqueeze(1).to(x.dtype)
    out = torch.zeros(num_tokens * num_heads, head_dim, device=x.device, dtype=torch.float32)
    out.index_add_(0, gather_ids.long() * num_heads + head, down.float())
    return out.view(num_tokens, num_heads, head_dim).to(x.dtype)


def bench_cuda(
    token_counts=(4096, 29184), repeats=5, expert_dtype: str = "bf16", per_config: bool = False, torch_path=True
) -> dict:
    """Released shape on the GPU: Triton kernel vs torch path vs ``torch._grouped_mm`` vs one dense bf16 GEMM of
    equal FLOPs.

    ``expert_dtype``: ``"bf16"`` or ``"fp8_e4m3"`` (FP8 banks with their scales; activations stay bf16; the
    ``torch._grouped_mm`` baseline then runs on the bf16-dequantized banks). ``per_config``: also time every tile
    candidate of the launch table for this device and shape (atomic and deterministic; a candidate that does not
    fit records its error). ``torch_path``: time the loop-over-experts torch path too (slow).
    """
    from diffusers_magi2.moe import experts_triton
    from diffusers_magi2.moe.experts_triton import triton_mh_moe_forward

    heads, experts, top_k, head_dim, expert_dim = 12, 256, 6, 256, 1280
    device = torch.device("cuda")
    sync = torch.cuda.synchronize
    results = {
        "device": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "shape": {
            "H": heads,
            "E": experts,
            "k": top_k,
            "Dh": head_dim,
            "De": expert_dim,
            "dtype": "bfloat16",
            "experts": expert_dtype,
        },
    }
    module, _ = _module(
        8,
        heads,
        experts,
        top_k,
        head_dim,
        expert_dim,
        torch.bfloat16,
        device,
        expert_dtype=EXPERT_DTYPES[expert_dtype],
    )
    scales = tuple(getattr(module, f"{n}_scale") for n in ("W_gate", "W_up", "W_down")) if module.fp8_experts else None
    weights = (module.W_gate, module.W_up, module.W_down)
    keys = experts_triton.device_key(device)
    candidates = experts_triton.tile_candidates(keys, head_dim, expert_dim, torch.bfloat16, module.W_gate.dtype)
    results["table_entry"] = experts_triton.resolve_device_entry(keys)
    results["candidates"] = [list(dataclasses.astuple(c)) for c in candidates]
    with torch.no_grad():
        if scales is None:
            bf16_banks = weights
        else:
            bf16_banks = tuple((w.float() * s.unsqueeze(1)).to(torch.bfloat16) for w, s in zip(weights, scales))
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
            probs, idx = module.route(x)
            routing = global_sort_routes(probs, idx, experts)
            flops = 6.0 * num_tokens * heads * top_k * head_dim * expert_dim
            entry = {}
            entry["triton_atomic_s"] = _best_of(
                lambda: triton_mh_moe_forward(x, *routing, *weights, scales=scales), repeats, sync
            )
            entry["triton_deterministic_s"] = _best_of(
                lambda: triton_mh_moe_forward(x, *routing, *weights, deterministic=True, scales=scales), repeats, sync
            )
            if torch_path:
                entry["torch_path_s"] = _best_of(
                    lambda: torch_mh_moe_forward(x, *routing, *weights, scales=scales), 1, sync
                )
            try:
                entry["grouped_mm_bf16_s"] = _best_of(
                    lambda: _grouped_mm_experts(x, *routing, *bf16_banks), repeats, sync
                )
            except (RuntimeError, NotImplementedError) as err:
                entry["grouped_mm_bf16_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            m = num_tokens * heads * top_k
            a = torch.randn(m, head_dim, device=device, dtype=torch.bfloat16)
            w13 = torch.randn(head_dim, 2 * expert_dim, device=device, dtype=torch.bfloat16)
            w2 = torch.randn(expert_dim, head_dim, device=device, dtype=torch.bfloat16)

            def dense():
                h = a @ w13
                swiglu7(h[:, :expert_dim], h[:, expert_dim:], out_dtype=torch.bfloat16) @ w2

            entry["dense_bf16_gemm_s"] = _best_of(dense, repeats, sync)
            for key in ("triton_atomic", "triton_deterministic", "torch_path", "grouped_mm_bf16", "dense_bf16_gemm"):
                if f"{key}_s" in entry:
                    entry[f"{key}_tflops"] = flops / entry[f"{key}_s"] / 1e12
            entry["triton_atomic_over_dense"] = entry["dense_bf16_gemm_s"] / entry["triton_atomic_s"]
            if "grouped_mm_bf16_s" in entry:
                entry["triton_atomic_speedup_vs_grouped_mm"] = entry["grouped_mm_bf16_s"] / entry["triton_atomic_s"]
            if "torch_path_s" in entry:
                entry["triton_atomic_speedup_vs_torch"] = entry["torch_path_s"] / entry["triton_atomic_s"]
            if per_config:
                entry["per_config"] = []
                for config in candidates:
                    row = {"config": list(dataclasses.astuple(config))}
                    for mode, det in (("atomic", False), ("deterministic", True)):
                        try:
                            seconds = _best_of(
                                lambda: triton_mh_moe_forward(
                                    x, routing, weights, scales=scales, deterministic=det, tile_config=config
                                ),
                                repeats,
                                sync,
                            )
                        except Exception as err:  # a candidate that does not fit this GPU: recorded, not fatal
                            row[f"{mode}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
                            continue
                        row[f"{mode}_s"] = seconds
                        row[f"{mode}_tflops"] = flops / seconds / 1e12
                        row[f"{mode}_over_dense"] = entry["dense_bf16_gemm_s"] / seconds
                    entry["per_config"].append(row)
            results[f"S={num_tokens}"] = entry
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--tokens", type=int, default=4096, help="CPU token count (default 4096)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--expert_dtype",
        nargs="+",
        choices=tuple(EXPERT_DTYPES),
        default=["bf16"],
        help="routed-expert storage(s) to benchmark: bf16, fp8_e4m3 (default: bf16)",
    )
    parser.add_argument(
        "--per_config",
        action="store_true",
        help="CUDA: also time every launch-table tile candidate for the device (atomic and deterministic)",
    )
    parser.add_argument("--cuda_only", action="store_true", help="skip the CPU part")
    parser.add_argument(
        "--cuda_tokens", type=int, nargs="+", default=[4096, 29184], help="CUDA token counts (default 4096 29184)"
    )
    parser.add_argument("--no_torch_path", action="store_true", help="CUDA: skip the slow loop-over-experts path")
    args = parser.parse_args(argv)
    report = {
        "benchmark": "diffusers_magi2.moe",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if not args.cuda_only:
        report["cpu"] = bench_cpu(num_tokens=args.tokens, repeats=args.repeats, fp8="fp8_e4m3" in args.expert_dtype)
    if torch.cuda.is_available():
        report["cuda"] = {
            dtype: bench_cuda(
                token_counts=tuple(args.cuda_tokens),
                repeats=args.repeats,
                expert_dtype=dtype,
                per_config=args.per_config,
                torch_path=not args.no_torch_path,
            )
            for dtype in args.expert_dtype
        }
    else:
        report["cuda"] = "skipped: no CUDA device on this machine (the Triton/GPU part needs one)"
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text + "\n")
        import os

        os.replace(args.out + ".tmp", args.out)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
