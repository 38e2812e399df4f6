"""Manifold hyper-connections (mHC) of the MAGI-2 Preview (reference spec §1.5).

The residual state of every layer is ``n`` parallel streams ``s`` of shape ``[T, n, C]``. Each of the
two sites of a layer (attention, MLP) projects the RMS-normalised flattened state with
``phi`` (``[n*C, 2n+n^2]``, used as ``x @ phi``) into three coefficient groups:

* ``h_pre  = sigmoid(alpha_pre * sigma * h[:, 0:n] + bias_pre)``  — mixes the streams into the site input;
* ``h_post = 2 * sigmoid(alpha_post * sigma * h[:, n:2n] + bias_post)`` — spreads the site output;
* ``H_res  = Sinkhorn(alpha_res * sigma * h[:, 2n:].view(n, n) + bias_res)`` — mixes the streams,

with ``sigma = 1 / sqrt(n*C)``. The coefficient math is fp32; the coefficients are rounded to the
residual dtype (bf16 in the released setting) before they are applied, and the stream mixing
accumulates in fp32 and rounds once, as SandAI's Triton kernels do (``mhc_sigmoid_affine_fwd``,
``mhc_sinkhorn_knopp_affine_fwd``, ``mhc_apply_hpre_fwd``, ``mhc_hyper_connect_fwd``).
Independent implementation of the reference ``MHCHandler`` behaviour.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sinkhorn_knopp", "mhc_coefficients", "mhc_reduce_streams", "mhc_hyper_connect", "mhc_matmul_scale"]

MHC_SINKHORN_ITERS = 20
MHC_SINKHORN_EPS = 1e-12
# Token chunk of the fused (fp32-accumulating) stream mixing: keeps the fp32 temporaries of a
# 100k-token, 4 x 3072 state at a few hundred MB instead of several GB. Chunking is exact.
MHC_FUSED_CHUNK = 8192


def mhc_matmul_scale(num_streams: int, hidden_size: int) -> float:
    """``sigma = 1 / sqrt(n * C)`` (0.0090211 for the released n=4, C=3072)."""
    return 1.0 / math.sqrt(float(num_streams * hidden_size))


def sinkhorn_knopp(
    z: torch.Tensor, num_iters: int = MHC_SINKHORN_ITERS, eps: float = MHC_SINKHORN_EPS
) -> torch.Tensor:
    """Sinkhorn normalisation of ``[..., n, n]`` logits, fp32 (SandAI ``_sinkhorn_knopp``).

    ``m = exp(z - max over the n x n block)``; ``num_iters`` times: divide by column sums (+eps),
    then by row sums (+eps). Rows therefore sum to 1 exactly (up to rounding); columns to about 1.
    """
    z = z.float()
    m = torch.exp(z - z.amax(dim=(-2, -1), keepdim=True))
    for _ in range(num_iters):
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
    return m


def mhc_coefficients(
    h_fused: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    bias_pre: torch.Tensor,
    bias_post: torch.Tensor,
    bias_res: torch.Tensor,
    num_streams: int,
    matmul_scale: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn the site projection into ``(h_pre [T,n], h_post [T,n], H_res [T,n,n])`` in ``out_dtype``.

    Args:
        h_fused: ``[T, 2n + n^2]`` fp32 = ``mhc_norm(flatten(s)) @ phi``; columns
            ``[pre n | post n | res n*n (row-major i, j)]``.
        alpha_*: ``[1]`` fp32 scalars; bias_pre/bias_post ``[n]``; bias_res ``[n, n]`` (fp32).
        num_streams: ``n``.
        matmul_scale: ``sigma`` from :func:`mhc_matmul_scale`.
        out_dtype: dtype the coefficients are rounded to (the residual dtype).
    """
    n = num_streams
    h = h_fused.float()
    pre, post, res = torch.split(h, [n, n, n * n], dim=-1)
    h_pre = torch.sigmoid(alpha_pre.float() * matmul_scale * pre + bias_pre.float())
    h_post = 2.0 * torch.sigmoid(alpha_post.float() * matmul_scale * post + bias_post.float())
    z = alpha_res.float() * matmul_scale * res.reshape(-1, n, n) + bias_res.float()
    h_res = sinkhorn_knopp(z)
    return h_pre.to(out_dtype), h_post.to(out_dtype), h_res.to(out_dtype)


def mhc_reduce_streams(h_pre: torch.Tensor, streams: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Site input ``u = sum_j h_pre[:, j] * s[:, j]`` -> ``[T, C]`` in the stream dtype.

    Args:
        h_pre: ``[T, n]`` (already rounded to the stream dtype); streams: ``[T, n, C]``.
        fused: True = accumulate in fp32 and round once (SandAI's Triton kernel, used on CUDA);
            False = einsum in the stream dtype (SandAI's torch fallback, used elsewhere).
    """
    if not fused:
        return torch.einsum("tn,tnc->tc", h_pre.to(streams.dtype), streams)
    if streams.dtype == torch.float32:
        return torch.einsum("tn,tnc->tc", h_pre.float(), streams)
    out = streams.new_empty(streams.shape[0], streams.shape[2])
    for start in range(0, streams.shape[0], MHC_FUSED_CHUNK):  # bound the fp32 temporaries
        sl = slice(start, start + MHC_FUSED_CHUNK)
        out[sl] = torch.einsum("tn,tnc->tc", h_pre[sl].float(), streams[sl].float()).to(streams.dtype)
    return out


def mhc_hyper_connect(
    streams: torch.Tensor,
    site_out: torch.Tensor,
    h_post: torch.Tensor,
    h_res: torch.Tensor,
    fused: bool = True,
) -> torch.Tensor:
    """New state ``s'[i] = sum_j H_res[i, j] s[j] + h_post[i] * o`` -> ``[T, n, C]`` in the stream dtype.

    Args:
        streams: ``[T, n, C]`` current state; site_out: ``[T, C]``; h_post ``[T, n]``; h_res ``[T, n, n]``.
        fused: True = fp32 accumulation, one rounding (SandAI Triton ``mhc_hyper_connect_fwd``, CUDA);
            False = the two einsums and their sum in the stream dtype (SandAI's torch fallback).
    """
    if not fused:
        dt = streams.dtype
        site_term = torch.einsum("tn,tc->tnc", h_post.to(dt), site_out.to(dt))
        return torch.einsum("tij,tjc->tic", h_res.to(dt), streams) + site_term
    out = torch.empty_like(streams)
    for start in range(0, streams.shape[0], MHC_FUSED_CHUNK):  # bound the fp32 temporaries
        sl = slice(start, start + MHC_FUSED_CHUNK)
        mixed = torch.einsum("tij,tjc->tic", h_res[sl].float(), streams[sl].float())
        mixed = mixed + h_post[sl].float().unsqueeze(-1) * site_out[sl].float().unsqueeze(1)
        out[sl] = mixed.to(streams.dtype)
    return out
