"""Benchmark of the multi-head MoE core; prints one JSON object (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_moe [--out moe_bench.json] [--expert_dtype bf16 fp8_e4m3 int4]

CPU (1 thread; S=4096, H=12, E=32, k=6, Dh=64, De=128, fp32): time of the full torch-path forward
(``Magi2MultiHeadMoE.forward``: routing, CSR sort, experts) against the time of the same three GEMMs per expert run as
plain dense matmuls over pre-gathered rows, measured in the same run. Target: ``gemm_s / full_forward_s >= 0.6``.

CUDA (only when a GPU is present; otherwise the JSON says so): the released shape (H=12, E=256, k=6, Dh=256,
De=1280, bf16 activations) at 4,096 and 29,184 tokens, once per ``--expert_dtype`` (``bf16`` experts, ``fp8_e4m3``:
FP8 experts with fp32 scales, ``int4``: NF4 codes with bf16 group scales): TFLOP/s of the Triton kernel (atomic and
deterministic), of the torch path, of the same layer as bf16 ``torch._grouped_mm`` calls, and of one dense bf16 GEMM
with the same FLOPs; with several ``--expert_dtype`` each one's Triton time over bf16's (``over_bf16``); int4 adds
the time of its dequantization pass alone; ``--per_config`` adds every launch-table tile candidate of the device.
What gpu_check.sh runs::

    python -m tests.benchmarks.bench_moe --cuda_only --per_config --no_torch_path --repeats 3 \
        --expert_dtype bf16 fp8_e4m3 --out "$RESULTS/bench_moe.json"
    python -m tests.benchmarks.bench_moe --cuda_only --no_torch_path --repeats 3 --cuda_tokens 4096 8192 16384 29184 \
        --expert_dtype bf16 fp8_e4m3 int4 --out "$RESULTS/bench_moe_int4.json"

With ``fp8_e4m3`` or ``int4`` the CPU part also times the torch-path forward with those experts (int4 at group 64,
which the CPU shape's Dh divides) against the fp32 one; with ``int4`` it adds :func:`int4_estimate`, the
bandwidth-based estimate of the int4 path at the released shape (and of the in-loop alternative it was chosen over:
``diffusers_magi2/moe/dequantize_triton.py``). ``--w4a16_builds`` builds that alternative for sm_90/89/80 on CPU.
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


#: --expert_dtype -> Magi2MultiHeadMoEConfig.expert_dtype
EXPERT_DTYPES = {"bf16": None, "fp8_e4m3": "float8_e4m3fn", "int4": "int4"}

#: H200 SXM: HBM bandwidth, dense bf16 tensor-core peak, CUDA-core fp32 lane operations (132 SMs x 128 x 1.98 GHz)
H200 = {"bandwidth_Bps": 4.8e12, "bf16_flops": 989e12, "cuda_core_ops": 3.3e13}


def int4_estimate(
    token_counts=(4096, 29184, 116736),
    heads=12,
    experts=256,
    top_k=6,
    head_dim=256,
    expert_dim=1280,
    group=128,
    block_t=64,
    kernel_efficiency=0.55,
    decode_ops=5,
    device=H200,
) -> dict:
    """Bandwidth/FLOP model of one MoE layer call with int4 experts (no GPU needed), per token count.

    ``a_dequant_s``: the path taken, one pass reading the codes and scales and writing bf16 banks (at HBM bandwidth)
    before the bf16 kernel. ``b_extra_s``: decoding inside the kernel's ``De`` loop instead, once per tile of
    ``block_t`` routes (``decode_ops`` CUDA-core operations a weight: unpack, look up, scale, cast, store for the
    MMA), less the bf16 weight reads it saves (both against bf16 experts). ``mma_s``: the expert GEMMs at ``kernel_efficiency`` of
    the bf16 peak. ``crossover_rows_per_expert``: below it (b) would cost less.
    """
    weights = heads * experts * 3 * head_dim * expert_dim
    int4_bytes, bf16_bytes = weights * (4 + 16 / group) / 8, 2 * weights
    bandwidth, ops = device["bandwidth_Bps"], device["cuda_core_ops"]
    dequant_s = (int4_bytes + bf16_bytes) / bandwidth
    saved_s = (bf16_bytes - int4_bytes) / bandwidth  # (b) reads codes, not bf16 banks, in the kernel
    per_tile_s = 3 * head_dim * expert_dim * decode_ops / ops
    rows = {}
    for num_tokens in token_counts:
        routes = num_tokens * heads * top_k
        tiles = routes / block_t + heads * experts / 2  # a partly filled last tile per expert, on average
        mma_s = 6.0 * routes * head_dim * expert_dim / (device["bf16_flops"] * kernel_efficiency)
        b_extra = tiles * per_tile_s - saved_s
        rows[f"S={num_tokens}"] = {
            "rows_per_expert": routes / (heads * experts),
            "mma_s": mma_s,
            "a_dequant_s": dequant_s,
            "a_over_mma": dequant_s / mma_s,
            "b_extra_s": b_extra,
            "b_extra_over_mma": b_extra / mma_s,
            "path": "a: dequantize, then the bf16 kernel" if dequant_s <= b_extra else "b: decode in the kernel",
        }
    crossover_tiles = (dequant_s + saved_s) / per_tile_s
    return {
        "device_model": device,
        "int4_GB": int4_bytes / 1e9,
        "bf16_GB": bf16_bytes / 1e9,
        "one_head_bf16_GB": bf16_bytes / heads / 1e9,
        "crossover_rows_per_expert": (crossover_tiles - heads * experts / 2) * block_t / (heads * experts),
        **rows,
    }


def _module(
    num_tokens, heads, experts, top_k, head_dim, expert_dim, dtype, device, seed=0, expert_dtype=None, group=128
):
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
        int4_group_size=group,
    )
    if expert_dtype == "int4" and torch.device(device).type == "cuda":
        return _random_int4_module(cfg, device), torch.randn(num_tokens, heads * head_dim, device=device).to(dtype)
    with torch.device(device):  # build (and randomly initialise) the bank directly on the device
        module = Magi2MultiHeadMoE(cfg)
    hidden = torch.randn(num_tokens, heads * head_dim, device=device).to(dtype)
    return module, hidden


def _random_int4_module(cfg, device) -> Magi2MultiHeadMoE:
    """A released-size int4 layer with random codes and group scales (timing needs no quantization pass)."""
    from diffusers_magi2.moe.layer import moe_tensors_on_meta

    with moe_tensors_on_meta():
        module = Magi2MultiHeadMoE(cfg)
    module = module.to_empty(device=device)
    with torch.no_grad():
        module.gate.normal_(0.0, 0.02)
        module.router.expert_bias.zero_()
        for bank, scale, fan_in in zip(("W_gate", "W_up", "W_down"), module.expert_scale_names, (256, 256, 1280)):
            module.get_parameter(bank).copy_(torch.randint(0, 256, module.get_parameter(bank).shape))
            module.get_buffer(scale).fill_(fan_in**-0.5 / 0.5)  # NF4 levels have an rms of ~0.5
    return module


def bench_cpu(
    num_tokens=4096, heads=12, experts=32, top_k=6, head_dim=64, expert_dim=128, repeats=3, quantized=()
) -> dict:
    """Full torch-path forward vs the same GEMMs as dense matmuls over pre-gathered rows (1 thread, fp32); for each
    ``quantized`` ``--expert_dtype`` (``fp8_e4m3``, ``int4``) also the full forward with those experts (same shape
    and inputs; int4 at group 64)."""
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
        quantized_s = {}
        for name in quantized:
            shape = (num_tokens, heads, experts, top_k, head_dim, expert_dim, torch.float32, "cpu")
            other, _ = _module(*shape, expert_dtype=EXPERT_DTYPES[name], group=64)
            other.set_backend("torch")
            quantized_s[name] = min(_best_of(lambda: other(hidden), 1, clock=clock) for _ in range(repeats))
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
        **{f"{name}_experts_full_forward_s": t for name, t in quantized_s.items()},
        **{f"{name}_over_fp32_full_forward": t / full_s for name, t in quantized_s.items()},
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

    ``expert_dtype``: ``"bf16"``, ``"fp8_e4m3"`` (FP8 banks with their scales) or ``"int4"`` (random NF4 codes
    and group scales); activations stay bf16, and the ``torch._grouped_mm`` baseline runs on the bf16-dequantized
    banks. ``per_config``: also time every tile
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
    scales = tuple(module.get_buffer(n) for n in module.expert_scale_names) or None
    weights = (module.W_gate, module.W_up, module.W_down)
    keys = experts_triton.device_key(device)
    table_weights = torch.bfloat16 if module.int4_experts else module.W_gate.dtype  # int4: its bf16 banks
    candidates = experts_triton.tile_candidates(keys, head_dim, expert_dim, torch.bfloat16, table_weights)
    results["table_entry"] = experts_triton.resolve_device_entry(keys)
    results["candidates"] = [list(dataclasses.astuple(c)) for c in candidates]
    bf16 = {"device": device, "dtype": torch.bfloat16}
    with torch.no_grad():
        if scales is None:
            bf16_banks = weights
        elif module.int4_experts:
            from diffusers_magi2.moe.dequantize_triton import dequantize_int4_triton

            bf16_banks = tuple(
                dequantize_int4_triton(w, s, out=torch.empty(w.shape[0], w.shape[1], 2 * w.shape[2], **bf16))
                for w, s in zip(weights, scales)
            )
            head_rows = slice(0, experts)
            head_banks = [torch.empty_like(b[head_rows]) for b in bf16_banks]

            def dequantize_every_head():
                for h in range(heads):
                    rows = slice(h * experts, (h + 1) * experts)
                    for w, s, out in zip(weights, scales, head_banks):
                        dequantize_int4_triton(w[rows], s[rows], out=out)

            results["int4_dequant_pass_s"] = _best_of(dequantize_every_head, repeats, sync)
            results["int4_dequant_pass_GBps"] = (
                sum(w.numel() + s.numel() * 2 + b.numel() * 2 for w, s, b in zip(weights, scales, bf16_banks))
                / results["int4_dequant_pass_s"]
                / 1e9
            )
        else:
            bf16_banks = tuple((w.float() * s.unsqueeze(1)).to(torch.bfloat16) for w, s in zip(weights, scales))
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
            probs, idx = module.route(x)
            routing = global_sort_routes(probs, idx, experts)
            flops = 6.0 * num_tokens * heads * top_k * head_dim * expert_dim
            entry = {}
            entry["triton_atomic_s"] = _best_of(
                lambda: triton_mh_moe_forward(x, *routing, *weights, scales=scales, top_k_routes=True), repeats, sync
            )
            entry["triton_deterministic_s"] = _best_of(
                lambda: triton_mh_moe_forward(
                    x, *routing, *weights, deterministic=True, scales=scales, top_k_routes=True
                ),
                repeats,
                sync,
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
                                    x,
                                    *routing,
                                    *weights,
                                    scales=scales,
                                    deterministic=det,
                                    tile_config=config,
                                    top_k_routes=True,
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
        help="routed-expert storage(s) to benchmark: bf16, fp8_e4m3, int4 (default: bf16)",
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
    parser.add_argument(
        "--w4a16_builds",
        action="store_true",
        help="build the in-loop int4 variant for sm_90/89/80 on CPU (tests/benchmarks/w4a16_variant.py) and exit",
    )
    args = parser.parse_args(argv)
    if args.w4a16_builds:
        from tests.benchmarks.w4a16_variant import main as w4a16_main

        return w4a16_main()
    report = {
        "benchmark": "diffusers_magi2.moe",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if not args.cuda_only:
        quantized = [d for d in args.expert_dtype if d != "bf16"]
        report["cpu"] = bench_cpu(num_tokens=args.tokens, repeats=args.repeats, quantized=quantized)
        if "int4" in args.expert_dtype:
            calls = sorted({*args.cuda_tokens, 8192, 16384, 116736})  # 8,192 and the default chunks, unchunked 540p
            report["cpu"]["int4_estimate"] = int4_estimate(token_counts=calls)
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
        bf16 = report["cuda"].get("bf16")
        for dtype, entry in report["cuda"].items():
            for key in entry if bf16 is not None and dtype != "bf16" else ():
                if key.startswith("S="):
                    entry[key]["over_bf16"] = {
                        mode: entry[key][f"triton_{mode}_s"] / bf16[key][f"triton_{mode}_s"]
                        for mode in ("atomic", "deterministic")
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
