"""Attention with sinks per attention backend: time, and max error against an independent fp32 reference
(``softmax`` over the keys plus one sink logit per head with a zero value, computed in query chunks) and against
the padded path, in one run (not collected by pytest).

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_attention_sinks [--small] [--out sinks.json]

CUDA: one 540p CFG segment (57,344 video + 250 audio + 512 text tokens), 24 heads of 128, bf16, through
``magi2_attention_with_sinks(..., backend=name)`` for every diffusers backend that runs here (``native``,
``_native_flash``, ``_native_cudnn``, ``_native_efficient``, ``_native_math`` skipped above 16 k tokens,
``flash``, ``_flash_3``, ``sage``, ``flex``); a backend that raises is listed with its error. The padded path is
the same call with the head dim padded by 8 to carry the sink (the sink as an extra key), the form every backend
can serve. ``--small`` (also the CPU default): 512 tokens, 4 heads of 32, fp32, the ``native`` backend.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from diffusers_magi2.models.attention_magi2 import magi2_attention_with_sinks


CUDA_BACKENDS = ("native", "_native_flash", "_native_cudnn", "_native_efficient", "_native_math", "flash", "_flash_3")
CUDA_BACKENDS += ("sage", "flex")


def reference_attention(q, k, v, sinks, scale, chunk: int = 2048) -> torch.Tensor:
    """fp32 softmax over the keys and the sink logit (zero value), ``[N, H, D]``, ``chunk`` queries at a time."""
    qf, kf, vf = q.float(), k.float(), v.float()
    sink = torch.logsumexp(sinks.float(), dim=0)  # [H]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a in range(0, q.shape[0], chunk):
        s = torch.einsum("qhd,khd->hqk", qf[a : a + chunk], kf) * scale  # [H, c, N]
        m = torch.maximum(s.amax(-1), sink[:, None])
        p = torch.exp(s - m[..., None])
        denom = p.sum(-1) + torch.exp(sink[:, None] - m)
        out[a : a + chunk] = torch.einsum("hqk,khd->qhd", p / denom[..., None], vf)
    return out


def padded_attention(q, k, v, sinks, scale, backend) -> torch.Tensor:
    """The sink as one extra key through the backend: q, k, v padded by 8 channels (SandAI's equivalent form)."""
    n, h, d = q.shape
    target = (torch.logsumexp(sinks.float(), dim=0) / scale).to(q.dtype)
    pad = q.new_zeros(n, h, 8)
    qa = torch.cat([q, pad], -1)
    qa[:, :, d] = target
    ka, va = torch.cat([k, pad], -1), torch.cat([v, pad], -1)
    sink_k = q.new_zeros(1, h, d + 8)
    sink_k[:, :, d] = 1
    ka, va = torch.cat([ka, sink_k], 0), torch.cat([va, q.new_zeros(1, h, d + 8)], 0)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    o = dispatch_attention_fn(qa[None], ka[None], va[None], scale=scale, backend=backend)
    return o[0, :, :, :d]


def _timed(fn, device, repeats: int):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return out, best


def run(small: bool, repeats: int = 3) -> dict:
    """Every backend's row (module docstring)."""
    cuda = torch.cuda.is_available() and not small
    device = torch.device("cuda" if cuda else "cpu")
    n, h, d, dtype = (57344 + 250 + 512, 24, 128, torch.bfloat16) if cuda else (512, 4, 32, torch.float32)
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    sinks = torch.randn(1, h, device=device, generator=gen) * 2
    scale = d**-0.5
    ref = reference_attention(q, k, v, sinks, scale)
    rows = {}
    for name in CUDA_BACKENDS if cuda else ("native",):
        if name == "_native_math" and n > 16384:
            rows[name] = {"skipped": "N^2 scores at this size"}
            continue
        try:
            out, seconds = _timed(
                lambda: magi2_attention_with_sinks(q, k, v, sinks, [n], scale, backend=name), device, repeats
            )
            padded, padded_s = _timed(lambda: padded_attention(q, k, v, sinks, scale, name), device, repeats)
        except Exception as error:  # a backend missing here is reported, not fatal
            rows[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
        rows[name] = {
            "seconds": seconds,
            "padded_seconds": padded_s,
            "speedup_vs_padded": padded_s / seconds,
            "max_abs_err_vs_fp32_reference": float((out.float() - ref).abs().max()),
            "max_abs_err_vs_padded": float((out.float() - padded.float()).abs().max()),
            "padded_max_abs_err_vs_fp32_reference": float((padded.float() - ref).abs().max()),
        }
    return {"device": str(device), "tokens": n, "heads": h, "head_dim": d, "dtype": str(dtype), "backends": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="512 tokens on CPU (the dry run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run(args.small, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    ok = any("seconds" in row for row in result["backends"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
