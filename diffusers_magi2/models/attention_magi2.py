"""MAGI-2 Preview attention: gated, qk-normed, 3-axis-rope, varlen self-attention with sinks.

Follows SandAI reference ``Attention`` (``magi2_preview.py``, spec §1.7) and diffusers'
attention-processor pattern: :class:`Magi2Attention` owns the weights (checkpoint names
``attention.pre_norm``, ``linear_g``, ``linear_qkv``, ``linear_proj``, ``q_norm``, ``k_norm``,
``sinks``), :class:`Magi2AttnProcessor` does the math and calls diffusers'
``dispatch_attention_fn``, so ``set_attention_backend`` picks the kernel.

Sinks are applied **exactly** through an extra key, for any backend: the head dim is padded by 8
zero channels; query head ``h`` carries ``sink_h / scale`` (split into a bf16 high and low part
so the sink logit is exact to ~bf16² in bf16 runs) in two of them, and one extra key with ones in
those channels and a zero value is appended to every segment. Its scaled logit is exactly
``sink_h``; since its value is zero this equals MagiAttention's ``out * sigmoid(lse - sink)``.
Several sink tokens combine to ``logsumexp_s sink[s, h]``. Varlen segments (one per packed sample)
are attended separately, so they are isolated without a mask.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn

from .embeddings_magi2 import apply_magi2_rotary_emb
from .modality import Magi2ModalityDispatch, Magi2ModalityGroupedLinear, Magi2MultiModalityRMSNorm

__all__ = ["Magi2Attention", "Magi2AttnProcessor", "magi2_attention_with_sinks"]

_SINK_PAD = 8


def magi2_attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: Optional[torch.Tensor],
    segment_lengths: Sequence[int],
    scale: float,
    backend=None,
    parallel_config=None,
) -> torch.Tensor:
    """Bidirectional varlen attention with per-head sink logits, via ``dispatch_attention_fn``.

    Args:
        query: ``[N, Hq, D]``; key, value: ``[N, Hkv, D]`` (same dtype; the backend's compute dtype).
            ``Hq`` must be a multiple of ``Hkv``; query head ``h`` reads kv head ``h // (Hq/Hkv)``.
        sinks: ``[S, Hq]`` fp32 sink logits in the scaled-logit domain, or ``None`` (no sinks).
        segment_lengths: Python ints summing to ``N``; tokens of different segments never attend
            to each other (the packed samples, ``diff(cu_seqlens)``).
        scale: softmax scale (``D ** -0.5`` in MAGI-2).
        backend: diffusers ``AttentionBackendName`` or ``None`` (the active default).

    Returns:
        ``[N, Hq, D]`` in the query dtype.

    Raises:
        ValueError: if the segment lengths do not sum to ``N`` or the head counts do not divide.
    """
    n, hq, d = query.shape
    hkv = key.shape[1]
    if sum(segment_lengths) != n:
        raise ValueError(f"segment lengths {list(segment_lengths)} sum to {sum(segment_lengths)}, expected {n} tokens")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if hq != hkv:
        rep = hq // hkv
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    dtype = query.dtype
    if sinks is not None:
        sink_logit = torch.logsumexp(sinks.float(), dim=0) if sinks.shape[0] > 1 else sinks.float()[0]
        target = sink_logit / scale  # [Hq]
        hi = target.to(dtype)
        lo = (target - hi.float()).to(dtype)
        pad = query.new_zeros(n, hq, _SINK_PAD)
        q_aug = torch.cat([query, pad], dim=-1)
        q_aug[:, :, d] = hi.unsqueeze(0)
        q_aug[:, :, d + 1] = lo.unsqueeze(0)
        k_aug = torch.cat([key, pad], dim=-1)
        v_aug = torch.cat([value, pad], dim=-1)
        sink_k = query.new_zeros(1, hq, d + _SINK_PAD)
        sink_k[:, :, d] = 1
        sink_k[:, :, d + 1] = 1
        sink_v = query.new_zeros(1, hq, d + _SINK_PAD)
    else:
        q_aug, k_aug, v_aug = query, key, value
    outs = []
    start = 0
    for length in segment_lengths:
        if length == 0:
            continue
        q_s = q_aug[start : start + length]
        k_s = k_aug[start : start + length]
        v_s = v_aug[start : start + length]
        if sinks is not None:
            k_s = torch.cat([k_s, sink_k], dim=0)
            v_s = torch.cat([v_s, sink_v], dim=0)
        o = dispatch_attention_fn(
            q_s.unsqueeze(0),
            k_s.unsqueeze(0),
            v_s.unsqueeze(0),
            scale=scale,
            backend=backend,
            parallel_config=parallel_config,
        )
        outs.append(o[0, :, :, :d])
        start += length
    if not outs:
        return query.new_zeros(0, hq, d)
    return torch.cat(outs, dim=0).to(dtype)


class Magi2AttnProcessor:
    """Default processor of :class:`Magi2Attention` (SandAI ``Attention.forward``).

    Steps (tokens modality-sorted on entry and exit): pre_norm -> ``linear_g`` (one gate per q
    head) and ``linear_qkv`` -> fp32 q/k RMSNorm -> back to packed order -> rope on q, k (fp32) ->
    cast q, k to the residual dtype -> :func:`magi2_attention_with_sinks` -> sorted order ->
    ``out * sigmoid(g)`` -> ``linear_proj``.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, upcast_off_cuda: bool = True) -> None:
        self.upcast_off_cuda = upcast_off_cuda

    def __call__(
        self,
        attn: "Magi2Attention",
        hidden_states: torch.Tensor,
        rope: torch.Tensor,
        dispatch: Magi2ModalityDispatch,
        segment_lengths: Sequence[int],
    ) -> torch.Tensor:
        gs = dispatch.group_sizes if attn.num_modality > 1 else None
        num_tokens = hidden_states.shape[0]
        dtype = hidden_states.dtype
        x = attn.pre_norm(hidden_states, gs)
        g = attn.linear_g(x, gs)
        qkv = attn.linear_qkv(x, gs)
        q, k, v = torch.split(qkv, [attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(num_tokens, attn.num_heads, attn.head_dim)
        k = k.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
        q = attn.q_norm(q, gs)
        k = attn.k_norm(k, gs)
        q, k, v = dispatch.unsort(q), dispatch.unsort(k), dispatch.unsort(v)
        q = apply_magi2_rotary_emb(q, rope).to(dtype)
        k = apply_magi2_rotary_emb(k, rope).to(dtype)
        v = v.to(dtype)
        if self.upcast_off_cuda and not q.is_cuda and dtype != torch.float32:
            # SandAI's FA3 takes bf16 q/k/v but keeps the softmax and P@V accumulation in fp32; CPU
            # kernels fed bf16 round far more, so off CUDA the (already bf16-rounded) q/k/v are
            # attended in fp32 and the result is rounded back once, as in the golden fixtures.
            q, k, v = q.float(), k.float(), v.float()
        out = magi2_attention_with_sinks(
            q,
            k,
            v,
            attn.sinks if attn.use_sinks else None,
            segment_lengths,
            attn.scale,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = dispatch.sort(out.to(dtype))
        out = out * torch.sigmoid(g.to(out.dtype)).unsqueeze(-1)
        out = out.reshape(num_tokens, attn.q_size).to(dtype)
        return attn.linear_proj(out, gs)


class Magi2Attention(nn.Module, AttentionModuleMixin):
    """Weights of one MAGI-2 attention (checkpoint prefix ``transformer_blocks.{i}.attention.``).

    Args:
        hidden_size: model width ``C``.
        head_dim: ``Dh``; query heads ``Hq = C // Dh``.
        num_kv_heads: ``Hkv`` (``num_query_groups``).
        num_modality: 3 for multimodal layers (grouped weights), else 1.
        num_sink_tokens: sinks per head (0 disables sinks; the preview uses 1, shape ``[1, Hq]``).
        params_dtype: dtype of ``linear_g``, ``linear_qkv``, ``linear_proj`` (bf16 released).

    Parameters: ``pre_norm.weight [M*C]``, ``linear_g.weight [M*Hq, C]``,
    ``linear_qkv.weight [M*(Hq+2Hkv)*Dh, C]``, ``linear_proj.weight [M*C, Hq*Dh]``,
    ``q_norm.weight``/``k_norm.weight [M*Dh]``, ``sinks [max(1,S), Hq]`` (fp32 except the linears).
    """

    _default_processor_cls = Magi2AttnProcessor
    _available_processors = [Magi2AttnProcessor]
    _supports_qkv_fusion = False

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_kv_heads: int,
        num_modality: int = 1,
        num_sink_tokens: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        processor=None,
    ) -> None:
        super().__init__()
        if hidden_size % head_dim:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of head_dim ({head_dim})")
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.num_heads = hidden_size // head_dim
        self.num_kv_heads = num_kv_heads
        if self.num_heads % num_kv_heads:
            raise ValueError(f"query heads ({self.num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_modality = num_modality
        self.q_size = self.num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.use_sinks = num_sink_tokens > 0
        self.pre_norm = Magi2MultiModalityRMSNorm(hidden_size, num_modality)
        self.linear_g = Magi2ModalityGroupedLinear(hidden_size, self.num_heads, num_modality, dtype=params_dtype)
        self.linear_qkv = Magi2ModalityGroupedLinear(
            hidden_size, self.q_size + 2 * self.kv_size, num_modality, dtype=params_dtype
        )
        self.linear_proj = Magi2ModalityGroupedLinear(self.q_size, hidden_size, num_modality, dtype=params_dtype)
        self.sinks = nn.Parameter(torch.zeros(max(1, num_sink_tokens), self.num_heads, dtype=torch.float32))
        self.q_norm = Magi2MultiModalityRMSNorm(head_dim, num_modality, out_dtype=torch.float32)
        self.k_norm = Magi2MultiModalityRMSNorm(head_dim, num_modality, out_dtype=torch.float32)
        self.set_processor(processor if processor is not None else self._default_processor_cls())

    def forward(
        self,
        hidden_states: torch.Tensor,
        rope: torch.Tensor,
        dispatch: Magi2ModalityDispatch,
        segment_lengths: Sequence[int],
    ) -> torch.Tensor:
        """``hidden_states`` ``[T, C]`` (modality-sorted, residual dtype) -> ``[T, C]`` same dtype.

        ``rope`` is ``[T, 6*Dh/8]`` in packed order; ``segment_lengths`` are the packed samples.
        """
        return self.processor(self, hidden_states, rope, dispatch, segment_lengths)
