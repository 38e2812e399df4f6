"""Memory benchmark of expert-parallel loading; prints one JSON object (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_ep_memory [--ep 4] [--out ep_memory.json]

Writes a synthetic diffusers-format ``Magi2Transformer3DModel`` checkpoint (bf16 experts, 8 MoE heads so every N in
{1, 2, 4, 8} divides them; 805 MB of routed experts in 4 MoE layers, sharded per layer), then loads it with
``from_pretrained(..., expert_parallel=Magi2ExpertParallelConfig(ep_degree=N))`` for N = 1 (baseline, one process)
and N = ``--ep`` (gloo ranks via ``torch.multiprocessing.spawn``). Per rank it prints

    ratio = (peak RSS after load − RSS before load − non-expert parameter bytes) / local expert bytes

(target ≤ 1.1: the load costs the local experts and nothing of the other ranks'; every weight is read once after
the load so memory-mapped tensors count in full), and ``full_bank_allocated`` =
whether the RSS growth reached the full expert bank (must be false for N > 1). The checkpoint is written tensor by
tensor, so the parent never holds the model either.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


CONFIG = {
    "num_layers": 6,
    "num_attention_heads": 4,
    "attention_head_dim": 64,
    "num_key_value_heads": 4,
    "in_channels": 16,
    "audio_in_channels": 16,
    "text_in_channels": 32,
    "intermediate_factor": 2,
    "multimodal_layers": [0, 5],
    "moe_layers": [1, 2, 3, 4],
    "num_streams": 2,
    "moe_num_heads": 8,
    "moe_num_experts": 256,
    "moe_top_k": 2,
    "moe_expert_intermediate_size": 512,
    "shared_expert_intermediate_size": 64,
    "modality_specific_expert_intermediate_size": 64,
    "time_embed_dim": 64,
}
EXPERT_SUFFIXES = ("moe_mlp.W_gate", "moe_mlp.W_up", "moe_mlp.W_down")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """``VmHWM`` (peak RSS of this process image; unlike ``ru_maxrss`` it is not inherited across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` value 5); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def write_checkpoint(folder: Path) -> dict:
    """Random bf16/fp32 tensors under the model's keys, one safetensors file per layer + index; returns sizes."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel

    with init_empty_weights():
        model = Magi2Transformer3DModel(**CONFIG)
    model.save_config(folder)
    g = torch.Generator().manual_seed(0)
    shapes = model.state_dict()
    shards: dict[str, list[str]] = {}
    for key in shapes:
        shards.setdefault(key.split(".")[1] if key.startswith("transformer_blocks.") else "global", []).append(key)
    expert_bytes = other_bytes = 0
    weight_map = {}
    for i, (shard, keys) in enumerate(sorted(shards.items())):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key in keys:  # one shard in memory at a time
            dtype = torch.float32 if model.is_fp32_island(key) else torch.bfloat16
            tensors[key] = (torch.randn(shapes[key].shape, generator=g) * 0.02).to(dtype)
            nbytes = tensors[key].numel() * tensors[key].element_size()
            if key.endswith(EXPERT_SUFFIXES):
                expert_bytes += nbytes
            else:
                other_bytes += nbytes
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": expert_bytes + other_bytes}, "weight_map": weight_map})
    )
    return {"full_expert_bytes": expert_bytes, "non_expert_bytes_in_file": other_bytes}


def measure(folder: str, ep_degree: int, rank: int) -> dict:
    """Load on this rank and report the RSS accounting (called after the process group exists)."""
    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.parallel.expert_parallel import Magi2ExpertParallelConfig, resolve_expert_parallel

    cfg = Magi2ExpertParallelConfig(ep_degree=ep_degree)
    resolve_expert_parallel(cfg)
    import gc

    gc.collect()
    peak_reset = _reset_peak_rss()
    before, peak_before = _rss_bytes(), _peak_rss_bytes()
    model = Magi2Transformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16, expert_parallel=cfg)
    peak_untouched = _peak_rss_bytes()
    # safetensors may hand back tensors that share the file's memory map, whose pages only count once read: read one
    # element of every 4 KiB page of every tensor (no large temporary) so the RSS holds the whole loaded model
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()
    peak_after = _peak_rss_bytes()
    local_expert = non_expert = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if name.endswith(EXPERT_SUFFIXES):
            local_expert += nbytes
        else:
            non_expert += nbytes
    growth = peak_after - before
    return {
        "rank": rank,
        "rss_before_mb": before / 2**20,
        "peak_rss_after_load_mb": peak_untouched / 2**20,
        "peak_rss_after_reading_all_weights_mb": peak_after / 2**20,
        "peak_reset_before_load": peak_reset,
        "peak_reached_before_load": peak_before >= peak_after,
        "non_expert_bytes": non_expert,
        "local_expert_bytes": local_expert,
        "ratio": (growth - non_expert) / local_expert,
        "growth_bytes": growth,
    }


def _worker(rank: int, world: int, port: int, folder: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        res = measure(folder, world, rank)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(res))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ep: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        folder.mkdir()
        sizes = write_checkpoint(folder)
        results = {}
        for world in (1, ep):
            out_dir = Path(tmp) / f"out{world}"
            out_dir.mkdir()
            mp.spawn(_worker, args=(world, _free_port(), str(folder), str(out_dir)), nprocs=world, join=True)
            ranks = [json.loads((out_dir / f"{r}.json").read_text()) for r in range(world)]
            for r in ranks:
                r["full_bank_allocated"] = r["growth_bytes"] >= sizes["full_expert_bytes"]
            results[f"N={world}"] = ranks
    worst = max(r["ratio"] for r in results[f"N={ep}"])
    return {
        "benchmark": "ep_memory",
        "config": CONFIG,
        **sizes,
        "results": results,
        "baseline_ratio_N1": results["N=1"][0]["ratio"],
        "worst_ratio": worst,
        "target": "ratio <= 1.1 on every rank; full_bank_allocated false for N > 1",
        "pass": worst <= 1.1 and not any(r["full_bank_allocated"] for r in results[f"N={ep}"]),
        "platform": {"python": sys.version.split()[0], "torch": torch.__version__},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=4, help="EP degree to compare with N=1 (must divide 8)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.ep < 2 or CONFIG["moe_num_heads"] % args.ep:
        raise ValueError(f"--ep must be >= 2 and divide {CONFIG['moe_num_heads']}, got {args.ep}")
    report = run(args.ep)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
