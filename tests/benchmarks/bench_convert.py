"""Converter benchmark: peak memory and throughput of ``magi2-convert`` (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python tests/benchmarks/bench_convert.py [--total_mb 2300] [--shard_mb 600] \
        [--dtype keep] [--workdir /tmp] [--out bench_convert.json]

1. Builds a synthetic SandAI-format preview checkpoint (random bytes; keys, shapes and dtypes of a
   scaled-down preview config from the real model built on the meta device, so it runs the real
   plan): source shards of about ``--shard_mb`` MB (each >= 512 MB by default), ``--total_mb`` MB
   in all (>= 2 GB by default).
2. Twice (``os.sync()`` before every timed step, so no step pays for the previous one's
   writeback), with the source files in the page cache ("warm") and evicted from it ("cold",
   ``fsync`` + ``POSIX_FADV_DONTNEED`` on these files only; the released 228 GB never fits in RAM,
   so cold is the realistic case): times reading the shard files to ``/dev/null`` (64 MB reads),
   then converts ``--components transformer`` in a fresh child process, which records its RSS just
   before the conversion starts (imports done, nothing read) and its peak RSS (``VmHWM``, reset via
   ``/proc/self/clear_refs`` where allowed, plus a 2 ms RSS sampler).

Prints and writes (JSON):
  * ``peak_rss_over_largest_shard`` = (peak RSS - RSS before the first read) / largest source shard,
    target <= 1.5;
  * ``throughput_ratio`` = conversion throughput / read-to-/dev/null throughput, target >= 0.5;
  * ``data_throughput_ratio``: the same without the fixed header-only planning time (``plan_s``,
    config + meta model + headers, independent of the checkpoint's size);
  * for context, ``plain_copy_ratio`` (the same ratio for ``shutil.copyfile`` of the shards, the
    most any converter that writes its output could reach on this disk) and
    ``convert_vs_plain_copy``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


_CHILD = "--_child"


def _bench_config(total_mb: int, experts: int | None = None) -> dict:
    """A preview-shaped SandAI config whose checkpoint is about ``total_mb`` MB (bf16 experts dominate).

    The expert count is solved from the exact sizes of two trial configs (the size is linear in it).
    """
    hidden, heads, d_expert = 1536, 6, 1280

    def config(e: int) -> dict:
        return {
            "arch_config": {
                "num_layers": 4,
                "hidden_size": hidden,
                "head_dim": 128,
                "num_query_groups": 12,
                "video_in_channels": 48,
                "audio_in_channels": 64,
                "text_in_channels": 512,
                "params_dtype": "bfloat16",
                "intermediate_factor": 4,
                "mm_layers": [0, 3],
                "activation_type": "swiglu7",
                "attn_softcap": -1.0,
                "attn_gating": {"enable": True},
                "attn_sinks": {"enable": True, "sink_token_num": 1},
                "mhc_config": {"enable": True, "num_stream": 4, "alpha_init": 0.01},
                "moe_config": {
                    "num_experts": e,
                    "top_k": 6,
                    "score_func": "sigmoid",
                    "route_norm": True,
                    "route_scale": 4.9,
                    "moe_layers": [1, 2],
                    "expert_intermediate_size": d_expert,
                    "shared_expert_intermediate_size": 1280,
                    "modality_specific_expert_intermediate_size": 1280,
                    "num_heads": heads,
                },
            },
            "evaluation_config": {"data_proxy_config": {"time_channel_dim": 64, "patch_size": 1, "t_patch_size": 1}},
        }

    if experts is None:
        a, b = _checkpoint_bytes(config(8)), _checkpoint_bytes(config(16))
        experts = max(8, round(8 + (total_mb * 10**6 - a) * 8 / (b - a)))
    return config(experts)


def _specs(cfg: dict):
    from diffusers_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.loaders.original_checkpoint import (
        build_meta_model,
        expected_specs_from_model,
        original_format,
    )

    kwargs = original_format(Magi2Transformer3DModel).model_kwargs(cfg)
    return expected_specs_from_model(build_meta_model(Magi2Transformer3DModel, kwargs), "BF16")


def _checkpoint_bytes(cfg: dict) -> int:
    from diffusers_magi2.utils.safetensors_io import DTYPE_ITEMSIZE

    total = 0
    for spec in _specs(cfg).values():
        n = DTYPE_ITEMSIZE[spec.dtype]
        for d in spec.shape:
            n *= d
        total += n
    return total


def _write_source(ckpt: Path, cfg: dict, shard_mb: int) -> list[Path]:
    """Random-byte SandAI checkpoint for ``cfg``: shards named like the release, plus the index."""
    import torch

    from diffusers_magi2.loaders.key_plan import target_to_source_key
    from diffusers_magi2.utils.safetensors_io import DTYPE_ITEMSIZE, OutputTensor, ShardWriter, plan_shards

    specs = _specs(cfg)
    tensors = [OutputTensor(target_to_source_key(k), s.dtype, s.shape) for k, s in specs.items()]
    # grow the limit until every shard (the last one too) reaches ``shard_mb`` * 0.86 (>= 512 MB at 600)
    limit = shard_mb * 10**6
    layouts = plan_shards(tensors, limit, "model.safetensors")
    while len(layouts) > 1 and min(lay.file_size for lay in layouts) < 0.86 * shard_mb * 10**6:
        limit = int(limit * 1.05)
        layouts = plan_shards(tensors, limit, "model.safetensors")
    ckpt.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    chunk = 32 * 2**20
    with ShardWriter(ckpt, layouts) as writer:
        for t in tensors:
            left = t.nbytes
            while left:
                n = min(chunk, left)
                n -= n % DTYPE_ITEMSIZE[t.dtype]
                raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
                if t.dtype == "F32":  # keep fp32 values finite: random bytes, exponent bits cleared
                    raw.view(torch.int32).bitwise_and_(0x3FFFFFFF)
                writer.write_chunk(t.name, raw)
                left -= n
    weight_map = {name: lay.filename for lay in layouts for name in lay.offsets}
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map})
    )
    (ckpt / "magi2_preview.json").write_text(json.dumps(cfg))
    return [ckpt / lay.filename for lay in layouts]


def _read_to_devnull(files: list[Path]) -> float:
    """Seconds to read every file to /dev/null in 64 MB reads."""
    buf = bytearray(64 * 2**20)
    view = memoryview(buf)
    start = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while True:
                    n = fh.readinto(buf)
                    if not n:
                        break
                    sink.write(view[:n])
    return time.perf_counter() - start


def _evict(files: list[Path]) -> None:
    """Drop these files (only) from the page cache: flush, then ``POSIX_FADV_DONTNEED``."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _settle(files: list[Path], cache: str) -> None:
    """Before each timed step: flush every dirty page (``os.sync``) so the previous step's writeback
    does not run during this one; for the cold runs also evict the source files."""
    os.sync()
    if cache == "cold":
        _evict(files)
    else:
        _read_to_devnull(files)  # make sure they are cached


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(args: list[str]) -> None:
    """In a fresh process: convert and report RSS figures (kB) and wall time as one JSON line."""
    import accelerate  # noqa: F401  - everything the conversion imports, so RSS "before" excludes imports
    import diffusers  # noqa: F401
    import safetensors.torch  # noqa: F401

    import diffusers_magi2.models.transformer_magi2  # noqa: F401
    from diffusers_magi2.conversion.repo import ConversionRequest, convert_checkpoint
    from diffusers_magi2.utils.safetensors_io import parse_size

    ckpt, out, dtype, shard = Path(args[0]), Path(args[1]), args[2], args[3]
    req = ConversionRequest(
        output_path=out,
        components=["transformer"],
        inputs={"transformer": ckpt},
        config=ckpt / "magi2_preview.json",
        dtype=dtype,
        max_shard_size=parse_size(shard),
    )
    peak = {"kb": 0}
    stop = threading.Event()

    def sample():
        page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
        with open("/proc/self/statm") as fh:
            while not stop.is_set():
                fh.seek(0)
                peak["kb"] = max(peak["kb"], int(fh.read().split()[1]) * page_kb)
                time.sleep(0.002)

    from diffusers_magi2.conversion.convert_transformer import prepare_transformer_conversion

    start = time.perf_counter()  # the header-only planning alone (what every run pays before moving data)
    prepare_transformer_conversion(
        "transformer", ckpt, ckpt / "magi2_preview.json", dtype=dtype, max_shard_size=parse_size(shard)
    )
    plan_seconds = time.perf_counter() - start
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
        hwm_reset = True
    except OSError:
        hwm_reset = False
    before = _status_kb("VmRSS")
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    convert_checkpoint(req, log=lambda msg: None)
    seconds = time.perf_counter() - start
    stop.set()
    thread.join()
    hwm = _status_kb("VmHWM") if hwm_reset else 0
    print(
        json.dumps(
            {
                "rss_before_kb": before,
                "peak_sampled_kb": peak["kb"],
                "vmhwm_kb": hwm,
                "hwm_reset": hwm_reset,
                "seconds": seconds,
                "plan_seconds": plan_seconds,
            }
        )
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total_mb", type=int, default=2300)
    p.add_argument("--shard_mb", type=int, default=600)
    p.add_argument("--dtype", default="keep", choices=("keep", "bf16", "fp32"))
    p.add_argument("--max_shard_size", default="5GB", help="output shard size")
    p.add_argument("--workdir", default=None, help="where to build the synthetic checkpoint (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the result JSON here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        files = _write_source(work / "ckpt", _bench_config(args.total_mb), args.shard_mb)
        sizes = [f.stat().st_size for f in files]
        build_s = time.perf_counter() - t0
        runs = {}
        for cache in ("warm", "cold"):
            _settle(files, cache)
            read_s = _read_to_devnull(files)
            _settle(files, cache)
            out = work / f"out_{cache}"
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            res = subprocess.run(
                [sys.executable, __file__, _CHILD, str(work / "ckpt"), str(out), args.dtype, args.max_shard_size],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if res.returncode != 0:
                raise RuntimeError(f"conversion failed:\n{res.stderr[-4000:]}")
            child = json.loads(res.stdout.strip().splitlines()[-1])
            out_bytes = sum(f.stat().st_size for f in (out / "transformer").glob("*.safetensors"))
            shutil.rmtree(out)
            # context: a plain file copy of the same shards (shutil.copyfile: kernel copy), same cache state
            _settle(files, cache)
            copy_dir = work / "plain_copy"
            copy_dir.mkdir()
            start = time.perf_counter()
            for f in files:
                shutil.copyfile(f, copy_dir / f.name)
            copy_s = time.perf_counter() - start
            shutil.rmtree(copy_dir)
            peak_kb = max(child["peak_sampled_kb"], child["vmhwm_kb"])
            runs[cache] = {
                "convert_s": round(child["seconds"], 3),
                "read_to_devnull_s": round(read_s, 3),
                "convert_throughput_MBps": round(sum(sizes) / child["seconds"] / 1e6, 1),
                "read_throughput_MBps": round(sum(sizes) / read_s / 1e6, 1),
                "throughput_ratio": round(read_s / child["seconds"], 3),
                "plan_s": round(child["plan_seconds"], 3),
                "data_throughput_ratio": round(read_s / max(1e-9, child["seconds"] - child["plan_seconds"]), 3),
                "plain_copy_s": round(copy_s, 3),
                "plain_copy_ratio": round(read_s / copy_s, 3),
                "convert_vs_plain_copy": round(copy_s / child["seconds"], 3),
                "rss_before_first_read_MB": round(child["rss_before_kb"] / 1024, 1),
                "peak_rss_MB": round(peak_kb / 1024, 1),
                "peak_rss_over_largest_shard": round((peak_kb - child["rss_before_kb"]) * 1024 / max(sizes), 3),
                "output_bytes": out_bytes,
            }
        result = {
            "source_shards": len(files),
            "source_bytes": sum(sizes),
            "largest_source_shard_bytes": max(sizes),
            "smallest_source_shard_bytes": min(sizes),
            "build_source_s": round(build_s, 2),
            "dtype": args.dtype,
            "warm_page_cache": runs["warm"],
            "cold_page_cache": runs["cold"],
            "targets": {"peak_rss_over_largest_shard": "<= 1.5", "throughput_ratio": ">= 0.5"},
            "vmhwm_reset": child["hwm_reset"],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        _child(sys.argv[2:])
    else:
        main()
