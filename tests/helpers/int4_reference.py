"""The int4 quantisation rule in its plain vectorised form (``torch.bucketize`` over the NF4 midpoints, then each
candidate scale's error, kept with ``torch.where``): the baseline that ``quantize_int4`` must equal bit for bit, and
that ``tests/benchmarks/bench_int4_quantize.py`` times it against."""

from __future__ import annotations

import torch

from diffusers_magi2.moe.quantize_int4 import NF4_LEVELS, SCALE_RATIOS, SCALE_REFITS


def _encode(groups, scale, levels, midpoints):
    s = scale.bfloat16().float()
    codes = torch.bucketize(groups / torch.where(s > 0, s, torch.ones_like(s)), midpoints, out_int32=True)
    return codes, s, levels[codes].mul_(s).sub_(groups).square_().sum(dim=2, keepdim=True)


def _keep_better(best: list, candidate: tuple) -> None:
    better = candidate[2] < best[2]
    for i, (old, new) in enumerate(zip(best, candidate)):
        best[i] = torch.where(better, new, old)


@torch.no_grad()
def plain_quantize_int4(weight: torch.Tensor, group_size: int, chunk_rows: int = 16):
    """``(codes [R, K, N/2] uint8, scale [R, K/G, N] bf16)`` of a finite bank ``[R, K, N]``, ``chunk_rows`` experts
    at a time."""
    rows, k, n = weight.shape
    packed = torch.empty(rows, k, n // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, k // group_size, n, dtype=torch.bfloat16, device=weight.device)
    levels = torch.tensor(NF4_LEVELS, device=weight.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    for start in range(0, rows, chunk_rows):
        w = weight[start : start + chunk_rows].float()
        groups = w.view(w.shape[0], k // group_size, group_size, n)
        amax = groups.abs().amax(dim=2, keepdim=True)
        best = list(_encode(groups, amax, levels, midpoints))
        for ratio in SCALE_RATIOS[1:]:
            _keep_better(best, _encode(groups, amax * ratio, levels, midpoints))
        for _ in range(SCALE_REFITS):
            chosen = levels[best[0]]
            fit = (chosen * groups).sum(dim=2, keepdim=True) / (chosen * chosen).sum(dim=2, keepdim=True)
            _keep_better(best, _encode(groups, torch.where(fit > 0, fit, amax), levels, midpoints))
        codes = best[0].to(torch.uint8).view(w.shape[0], k, n // 2, 2)
        packed[start : start + chunk_rows] = codes[..., 0] | (codes[..., 1] << 4)
        scale[start : start + chunk_rows] = best[1].squeeze(2)
    return packed, scale
