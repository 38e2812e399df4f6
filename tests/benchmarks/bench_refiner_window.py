"""Block-window attention backends of the refiner: time and peak memory vs dense-mask SDPA (same run).

Not collected by pytest. Run:  OMP_NUM_THREADS=1 .venv/bin/python tests/benchmarks/bench_refiner_window.py
Prints, per backend, wall time and the ratio to the dense-mask SDPA baseline measured in the same run,
and the fraction of score entries the window keeps (the work the sparse backends may skip). On CUDA it
also times compiled flex_attention and reports peak memory.
"""

from __future__ import annotations

import time

import torch

from diffusers_magi2.models.window_attention import Magi2WindowGeometry, block_window_attention


def _time(fn, reps=3):
    fn()  # warm-up (compiles flex on CUDA)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # a 1080p-shaped slab: 8x4x4 blocks, radius 2, released head layout (32 q / 8 kv heads of 128)
    grid = (16, 20, 40) if device == "cuda" else (16, 12, 20)
    heads = (32, 8) if device == "cuda" else (8, 2)
    geom = Magi2WindowGeometry(grid, (8, 4, 4), (2, 2, 2), 64)
    n = geom.num_tokens
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n, heads[0], 128, device=device, dtype=dtype, generator=g)
    k = torch.randn(n, heads[1], 128, device=device, dtype=dtype, generator=g)
    v = torch.randn(n, heads[1], 128, device=device, dtype=dtype, generator=g)
    keep = geom.dense_mask().float().mean().item()
    print(f"device={device} tokens={n} grid={grid} heads={heads} kept score fraction={keep:.3f}")
    base = _time(lambda: block_window_attention(q, k, v, geom, backend="sdpa"))
    print(f"sdpa (dense mask, baseline): {base * 1e3:8.1f} ms  ratio 1.00")
    backends = ["gather"] + (["flex"] if device == "cuda" else [])
    for b in backends:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = _time(lambda: block_window_attention(q, k, v, geom, backend=b))
        mem = f" peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device == "cuda" else ""
        print(f"{b:27s}: {t * 1e3:8.1f} ms  ratio {t / base:.2f}{mem}")


if __name__ == "__main__":
    main()
