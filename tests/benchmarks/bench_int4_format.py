"""Which 4-bit expert format: the output error of ``x @ W`` per format, group size and weight distribution at the
released expert shapes; prints one JSON object (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_int4_format [--out int4_format.json]

For ``W [K, N]`` at the released contraction dims (``K = Dh = 256`` for ``W_gate``/``W_up``, ``K = De = 1280`` for
``W_down``), drawn normal and Student-t (5 and 3 degrees of freedom: heavier tails, as trained weights have), and
``x [64, K]`` normal: ``||x Wq - x W|| / ||x W||`` of

* ``nf4``: the package's format (:func:`~diffusers_magi2.moe.quantize_int4.quantize_int4`, dequantized: NF4 levels,
  the scale of least error among ``amax * r`` and its least-squares refits);
* ``nf4_absmax``: NF4 levels at the plain ``amax`` scale (bf16);
* ``int4_sym7``: uniform levels ``-7..7``, scale ``amax / 7`` (bf16);
* ``int4_sym8``: uniform levels ``-8..7``, scale ``amax / 8`` (bf16; the largest positive values clip to 7/8);

at group sizes 32, 64 and 128 (bits per weight ``4 + 16 / G`` with a bf16 scale), each also as a ratio to
``nf4`` at ``G = 128`` (the chosen format) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from diffusers_magi2.moe.quantize_int4 import NF4_LEVELS, dequantize_int4, quantize_int4


FORMATS = ("nf4", "nf4_absmax", "int4_sym7", "int4_sym8")
GROUPS = (32, 64, 128)
DISTRIBUTIONS = ("normal", "student_t5", "student_t3")


def _uniform(w: torch.Tensor, group: int, levels: int) -> torch.Tensor:
    """Uniform symmetric int4 of ``w [K, N]`` dequantized: ``clamp(round(w / s), -8, 7) * s``, ``s = amax / levels``."""
    k, n = w.shape
    g = w.view(k // group, group, n)
    s = (g.abs().amax(1, keepdim=True) / levels).bfloat16().float()
    return (torch.round(g / torch.where(s > 0, s, torch.ones_like(s))).clamp(-8, 7) * s).view(k, n)


def dequantized(w: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """``w [K, N]`` stored in ``fmt`` at group size ``group`` and read back in fp32."""
    if fmt == "nf4":
        return dequantize_int4(*quantize_int4(w.unsqueeze(0), group))[0]
    if fmt == "nf4_absmax":
        k, n = w.shape
        g = w.view(k // group, group, n)
        s = g.abs().amax(1, keepdim=True).bfloat16().float()
        levels = torch.tensor(NF4_LEVELS)
        codes = (g / torch.where(s > 0, s, torch.ones_like(s))).unsqueeze(-1).sub(levels).abs().argmin(-1)
        return (levels[codes] * s).view(k, n)
    return _uniform(w, group, {"int4_sym7": 7, "int4_sym8": 8}[fmt])


def _weights(distribution: str, k: int, n: int) -> torch.Tensor:
    if distribution == "normal":
        return torch.randn(k, n)
    return torch.distributions.StudentT(float(distribution.removeprefix("student_t"))).sample((k, n))


def bench(contraction_dims=(256, 1280), n: int = 512, rows: int = 64, seed: int = 0) -> dict:
    torch.manual_seed(seed)  # a script: the global generator (torch's StudentT takes no generator)
    results: dict = {"shape": {"K": list(contraction_dims), "N": n, "rows": rows}, "bits_per_weight": {}, "rel_l2": {}}
    for group in GROUPS:
        results["bits_per_weight"][f"g{group}"] = 4 + 16 / group
    for dist in DISTRIBUTIONS:
        for k in contraction_dims:
            w = _weights(dist, k, n)
            x = torch.randn(rows, k)
            ref = x @ w
            entry = {}
            for fmt in FORMATS:
                for group in (g for g in GROUPS if k % g == 0):
                    entry[f"{fmt}_g{group}"] = ((x @ dequantized(w, fmt, group) - ref).norm() / ref.norm()).item()
            base = entry.get(f"nf4_g{max(g for g in GROUPS if k % g == 0)}")
            entry["ratio_to_nf4_g128"] = {key: value / base for key, value in entry.items()}
            results["rel_l2"][f"{dist}_K{k}"] = entry
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = bench()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
