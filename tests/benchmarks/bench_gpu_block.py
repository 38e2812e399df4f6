"""Released-width transformer checks for the prepared GPU run; prints one JSON object (not collected by pytest).

Run from the repository root::

    python -m tests.benchmarks.bench_gpu_block [--out block.json] [--small]

* ``block``: a one-block Preview model at the released width (C 3072, 24 heads of 128, 4 mHC streams, an MoE
  block with 12 heads x 256 experts, top-6, De 1280) in bf16, and again with FP8 routed experts
  (``expert_dtype="float8_e4m3fn"``). Reference: the torch path (``_native_math`` attention, torch expert loop); candidates: SDPA
  flash and cuDNN attention with the Triton experts. Reports rel-L2 against the reference and the forward time.
* ``group_offload``: a two-block released-width model (a dense multimodal block and an MoE block), bf16, on the
  GPU as is and under ``enable_group_offload(onload_device="cuda", offload_type="block_level",
  num_blocks_per_group=1, use_stream=True)``: rel-L2 between the two, peak GPU memory of each, forward times,
  and whether the fp32 islands and the expert dtype are unchanged afterwards.

Without CUDA (or with ``--small``) the same code runs on a tiny configuration on the CPU, with the torch
paths only, so the script can be checked to start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch

from diffusers_magi2 import Magi2Transformer3DModel


RELEASED = {"num_attention_heads": 24, "attention_head_dim": 128, "num_key_value_heads": 24}
SMALL = {
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "num_key_value_heads": 4,
    "in_channels": 12,
    "audio_in_channels": 16,
    "text_in_channels": 48,
    "moe_num_heads": 4,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_expert_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "modality_specific_expert_intermediate_size": 64,
    "intermediate_factor": 2,
}
FP8 = "float8_e4m3fn"


def build(layers: dict, small: bool, device, expert_dtype=None) -> Magi2Transformer3DModel:
    """A random bf16 model (fp32 islands fp32) built on ``device``; every routed-expert tensor is filled."""
    kwargs = dict(SMALL if small else RELEASED, **layers, params_dtype=torch.bfloat16)
    if expert_dtype is not None:
        kwargs["expert_dtype"] = expert_dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = Magi2Transformer3DModel(**kwargs)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("W_gate", "W_up", "W_down", "gate") and "moe_mlp" in name:
                fan = p.shape[-2] if leaf != "gate" else p.shape[-1]
                value = torch.randn(p.shape, generator=g, device=device)
                p.copy_((value if p.dtype == torch.float8_e4m3fn else value * fan**-0.5).to(p.dtype))
            elif leaf.endswith("_scale") and "moe_mlp" in name:
                bank = getattr(model.get_submodule(name.rsplit(".", 1)[0]), leaf.removesuffix("_scale"))
                p.fill_(bank.shape[-2] ** -0.5)
    return model.eval()


def inputs(small: bool, device):
    """One sample: video ``[1, Cv, T, H, W]``, audio, text and a timestep (8,192 tokens at released width)."""
    g = torch.Generator(device=device).manual_seed(2)
    cfg = SMALL if small else {"in_channels": 48, "audio_in_channels": 64, "text_in_channels": 5120}
    t, h, w, la, lt = (2, 4, 4, 8, 8) if small else (8, 30, 32, 256, 256)
    return {
        "hidden_states": torch.randn(1, cfg["in_channels"], t, h, w, generator=g, device=device),
        "timestep": torch.tensor([613.5], device=device),
        "encoder_hidden_states": torch.randn(1, lt, cfg["text_in_channels"], generator=g, device=device),
        "audio_hidden_states": torch.randn(1, la, cfg["audio_in_channels"], generator=g, device=device),
    }


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def timed(fn, device, repeats=3):
    """``(result, best seconds)`` over ``repeats`` calls after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return out, best


def forward(model, batch):
    with torch.no_grad():
        out = model(**batch)
    return torch.cat([out.sample.flatten(), out.audio_sample.flatten()])


def block_check(device, small: bool) -> dict:
    batch = inputs(small, device)
    layers = {"num_layers": 1, "multimodal_layers": [], "moe_layers": [0]}
    candidates = ["_native_flash", "_native_cudnn"] if device.type == "cuda" else ["native"]
    report = {}
    for variant in ("bf16", "fp8_experts"):
        model = build(layers, small, device, FP8 if variant == "fp8_experts" else None)
        entry = {}
        model.set_attention_backend("_native_math")
        model.set_moe_backend("torch")
        reference, entry["torch_path_s"] = timed(lambda model=model: forward(model, batch), device)
        entry["tokens"] = model.pack_inputs(**batch).hidden_states.shape[0]
        model.set_moe_backend("triton" if device.type == "cuda" else "torch")
        for backend in candidates:
            try:
                model.set_attention_backend(backend)
                out, seconds = timed(lambda model=model: forward(model, batch), device)
                entry[backend] = {
                    "seconds": seconds,
                    "rel_l2_vs_torch_path": rel_l2(out, reference),
                    "finite": bool(torch.isfinite(out).all()),
                }
            except Exception as error:  # reported, not hidden: the run goes on to the next backend
                entry[backend] = f"failed: {type(error).__name__}: {error}"
        report[variant] = entry
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _dtypes(model):
    return {n: t.dtype for n, t in model.state_dict().items()}


def group_offload_check(device, small: bool) -> dict:
    batch = inputs(small, device)
    model = build({"num_layers": 2, "multimodal_layers": [0], "moe_layers": [1]}, small, device)
    before = _dtypes(model)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    reference, on_device_s = timed(lambda: forward(model, batch), device, repeats=2)
    peak_on_device = torch.cuda.max_memory_allocated() if cuda else None
    model.to("cpu")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model.enable_group_offload(
        onload_device=device, offload_type="block_level", num_blocks_per_group=1, use_stream=cuda
    )
    out, offload_s = timed(lambda: forward(model, batch), device, repeats=2)
    peak_offload = torch.cuda.max_memory_allocated() if cuda else None
    after = _dtypes(model)
    islands = [n for n in before if model.is_fp32_island(n) and before[n] == torch.float32]
    experts = [n for n in before if n.endswith(("W_gate", "W_up", "W_down"))]
    return {
        "rel_l2_offload_vs_on_device": rel_l2(out, reference),
        "on_device_s": on_device_s,
        "group_offload_s": offload_s,
        "peak_gpu_bytes_on_device": peak_on_device,
        "peak_gpu_bytes_group_offload": peak_offload,
        "fp32_islands_kept": all(after[n] == torch.float32 for n in islands),
        "expert_dtype_kept": all(after[n] == before[n] for n in experts),
        "num_islands": len(islands),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--small", action="store_true", help="tiny configuration (the CPU smoke run)")
    parser.add_argument("--only", choices=["block", "group_offload"], help="run one part")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small or device.type != "cuda"
    report = {
        "benchmark": "diffusers_magi2 released-width block and group offload",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "configuration": "small (CPU smoke)" if small else "released width",
    }
    for part, fn in (("block", block_check), ("group_offload", group_offload_check)):
        if args.only in (None, part):
            try:
                report[part] = fn(device, small)
            except Exception:  # reported in the JSON; the exit status says it failed
                report[part] = "failed:\n" + traceback.format_exc()
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(args.out + ".tmp", args.out)
    failed = any(isinstance(v, str) and v.startswith("failed") for v in report.values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
