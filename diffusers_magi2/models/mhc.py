"""Manifold hyper-connections (mHC) of the MAGI-2 Preview (SandAI ``MHCHandler``).

The residual state is ``n`` streams ``s`` ``[T, n, C]``. Each site (attention, MLP) projects the RMS-normed,
flattened state, ``h = norm(s) @ phi`` (``phi`` ``[n*C, 2n + n^2]``), into, with ``sigma = 1 / sqrt(n*C)``::

    h_pre  = sigmoid(alpha_pre * sigma * h[:, :n] + bias_pre)            site input  u  = sum_j h_pre[j] s[j]
    h_post = 2 sigmoid(alpha_post * sigma * h[:, n:2n] + bias_post)      new state   s' = H_res s + h_post o
    H_res  = Sinkhorn(alpha_res * sigma * h[:, 2n:].view(n, n) + bias_res)

Coefficients are fp32, rounded to the residual dtype before use. "fused" mixing accumulates in fp32 and rounds
once (SandAI's Triton kernels); "torch" runs the einsums in the stream dtype (SandAI's torch path).

:class:`Magi2HyperConnection` holds one site's parameters (``alpha_*``, ``bias_*``, ``phi_fused``, all fp32); a
block owns two, ``mhc_attn`` and ``mhc_mlp``, and the ``mhc_norm`` they share. SandAI stores the same tensors flat
on its ``TransformerLayer`` as ``mhc_{param}_{site}``; the key plan renames them to ``mhc_{site}.{param}``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..utils.elementwise import sigmoid
from .feedforward_magi2 import run_token_chunks


__all__ = [
    "Magi2HyperConnection",
    "sinkhorn_knopp",
    "mhc_coefficients",
    "mhc_reduce_streams",
    "mhc_hyper_connect",
    "mhc_matmul_scale",
]

MHC_SINKHORN_ITERS = 20
MHC_SINKHORN_EPS = 1e-12
# token chunk of the fused mixing (bounds its fp32 temporaries; exact)
MHC_FUSED_CHUNK = 8192


def mhc_matmul_scale(num_streams: int, hidden_size: int) -> float:
    """``sigma = 1 / sqrt(n * C)``."""
    return 1.0 / math.sqrt(float(num_streams * hidden_size))


def sinkhorn_knopp(
    z: torch.Tensor, num_iters: int = MHC_SINKHORN_ITERS, eps: float = MHC_SINKHORN_EPS
) -> torch.Tensor:
    """Sinkhorn of ``[..., n, n]`` logits in fp32 (SandAI ``_sinkhorn_knopp``): ``exp(z - max)``, then
    ``num_iters`` times column- then row-normalised (``+eps``)."""
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
    """The site projection ``h`` ``[T, 2n + n^2]`` -> ``(h_pre [T, n], h_post [T, n], H_res [T, n, n])`` in
    ``out_dtype`` (module docstring); ``alpha_*`` ``[1]``, ``bias_pre``/``bias_post`` ``[n]``, ``bias_res`` ``[n, n]``."""
    n = num_streams
    h = h_fused.float()
    pre, post, res = torch.split(h, [n, n, n * n], dim=-1)
    h_pre = sigmoid(alpha_pre.float() * matmul_scale * pre + bias_pre.float())
    h_post = 2.0 * sigmoid(alpha_post.float() * matmul_scale * post + bias_post.float())
    z = alpha_res.float() * matmul_scale * res.reshape(-1, n, n) + bias_res.float()
    h_res = sinkhorn_knopp(z)
    return h_pre.to(out_dtype), h_post.to(out_dtype), h_res.to(out_dtype)


def mhc_reduce_streams(h_pre: torch.Tensor, streams: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Site input ``u`` ``[T, C]`` from ``h_pre`` ``[T, n]`` and ``streams`` ``[T, n, C]``, in the stream dtype."""
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
    """New state ``s'`` ``[T, n, C]`` from ``streams``, ``site_out`` ``[T, C]``, ``h_post`` ``[T, n]`` and ``h_res``
    ``[T, n, n]``, in the stream dtype."""
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


class Magi2HyperConnection(nn.Module):
    r"""One mHC site (attention or MLP) of a Preview layer: its fp32 parameters and its coefficients (SandAI
    ``TransformerLayer``'s ``mhc_*_{site}`` tensors with ``MHCHandler.apply_norm_and_compute_h_``).

    Args:
        num_streams: residual streams ``n``.
        hidden_size: width ``C`` of one stream.
        alpha_init: initial value of the three ``alpha`` scalars (SandAI ``mhc_config.alpha_init``; the checkpoint
            overwrites it).

    Parameters (all fp32): ``alpha_pre``, ``alpha_post``, ``alpha_res`` ``[1]``; ``bias_pre``, ``bias_post``
    ``[n]``; ``bias_res`` ``[n, n]``; ``phi_fused`` ``[n*C, 2n + n^2]`` (used as ``x @ phi``).
    """

    def __init__(self, num_streams: int, hidden_size: int, alpha_init: float = 0.01) -> None:
        super().__init__()
        n, c = num_streams, hidden_size
        self.num_streams = n
        self.hidden_size = c
        self.matmul_scale = mhc_matmul_scale(n, c)
        f32 = torch.float32
        self.alpha_pre = nn.Parameter(torch.full((1,), alpha_init, dtype=f32))
        self.alpha_post = nn.Parameter(torch.full((1,), alpha_init, dtype=f32))
        self.alpha_res = nn.Parameter(torch.full((1,), alpha_init, dtype=f32))
        self.bias_pre = nn.Parameter(torch.zeros(n, dtype=f32))
        self.bias_post = nn.Parameter(torch.zeros(n, dtype=f32))
        self.bias_res = nn.Parameter(torch.zeros(n, n, dtype=f32))
        self.phi_fused = nn.Parameter(torch.zeros(n * c, 2 * n + n * n, dtype=f32))

    def forward(
        self,
        streams: torch.Tensor,
        norm: Callable[[torch.Tensor, Optional[Sequence[int]]], torch.Tensor],
        group_sizes: Optional[Sequence[int]] = None,
        chunk_size: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The site's coefficients from the state before it.

        Args:
            streams: ``[T, n, C]`` residual streams, modality-sorted.
            norm: the block's shared ``mhc_norm``, called as ``norm(x [t, n*C], group_sizes)`` -> fp32.
            group_sizes: tokens per modality (``None``: one modality).
            chunk_size: tokens per chunk of the norm and projection (bounds the fp32 ``[t, n*C]`` temporary).

        Returns:
            ``(h_pre [T, n], h_post [T, n], H_res [T, n, n])`` in ``streams.dtype``.
        """
        flat = streams.reshape(streams.shape[0], self.num_streams * self.hidden_size)
        phi = self.phi_fused.float()
        h = run_token_chunks(lambda x, g: torch.matmul(norm(x, g), phi), flat, group_sizes, chunk_size)
        return mhc_coefficients(
            h,
            self.alpha_pre,
            self.alpha_post,
            self.alpha_res,
            self.bias_pre,
            self.bias_post,
            self.bias_res,
            self.num_streams,
            self.matmul_scale,
            streams.dtype,
        )
