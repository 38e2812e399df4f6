"""MAGI-2 attention of both models (SandAI ``Attention`` in ``magi2_preview.py`` and ``magi2_refiner.py``):
gated, qk-normed, 3-axis-rope GQA self-attention over packed, modality-sorted tokens::

    u = pre_norm(x);  q, k, v = split(linear_qkv(u));  q, k = rope(q_norm(q)), rope(k_norm(k))
    y = linear_proj(attention(q, k, v; mask) * sigmoid(linear_g(u)))

:class:`Magi2Attention` owns the weights; a processor does the math (``set_attn_processor``):
:class:`Magi2AttnProcessor` (varlen with sinks, through the backend ``set_attention_backend`` picks) and
:class:`Magi2WindowAttnProcessor` (the refiner's block window).

Sinks (MagiAttention's ``correct_attn_out_lse_with_sink``), several per head combining to ``sink_h =
logsumexp_s sink[s, h]``: the sink is one more logit in each query row's softmax, with a zero value. Two exact ways:

* by log-sum-exp, where the backend returns ``lse_i = log sum_j exp(s_ij)`` (:data:`SINK_ATTENTION_PATHS`): run it
  at the real head dim and scale, ``out_i * w_i`` with ``w_i = exp(lse_i - logaddexp(lse_i, sink_h)) =
  sigmoid(lse_i - sink_h)`` (MagiAttention's correction). Its gradient is the kernel's own backward at the
  corrected output and LSE, plus ``d sink_h = -sum_i (1 - w_i) (dO_i . O_i)``;
* padded, for any backend: pad the head dim by 8; query head ``h`` carries ``sink_h / scale`` (as a high + low
  pair in the compute dtype) in two pad channels, and each segment gets one extra key with ones there and a zero
  value, whose logit is then ``sink_h``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..parallel.context_parallel import Magi2LocalAttention
from ..utils.backends import check_backend, resolve_backend
from ..utils.elementwise import sigmoid
from .embeddings_magi2 import apply_magi2_rotary_emb
from .modality import Magi2ModalityDispatch, Magi2MultiModalityRMSNorm, linear_compute_dtype, modality_linear
from .window_attention import (
    DEFAULT_MAX_DENSE_MASK_ELEMENTS,
    Magi2WindowGeometry,
    block_window_attention,
    cached_flex_block_mask,
)


__all__ = [
    "Magi2Attention",
    "Magi2AttentionGeometry",
    "Magi2AttentionMask",
    "Magi2ForwardContext",
    "Magi2AttnProcessor",
    "Magi2WindowAttnProcessor",
    "check_attention_kwargs",
    "check_transformer_geometry",
    "SINK_ATTENTION_PATHS",
    "magi2_attention_with_sinks",
    "sink_attention_path",
    "register_block_for_caching_hooks",
]

_SINK_PAD = 8


@dataclass
class Magi2AttentionMask:
    """Which tokens attend to which in one forward; built once by the model, read by every layer.

    Attributes:
        segment_lengths: tokens per packed sample; samples never attend to each other.
        window: block-window geometry of a single-sample sequence (window processors).
        dense_mask: explicit ``[N, N]`` bool mask (True = attend), evaluated with SDPA.

    The mask always describes the whole packed sequence, also where a context-parallel rank holds a shard of it.
    """

    segment_lengths: tuple
    window: Optional[Magi2WindowGeometry] = None
    dense_mask: Optional[torch.Tensor] = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def wrap(cls, mask: Union["Magi2AttentionMask", Sequence[int]]) -> "Magi2AttentionMask":
        """A mask as is, or the varlen mask of a sequence of segment lengths."""
        if isinstance(mask, cls):
            return mask
        return cls(tuple(int(n) for n in mask))

    def cached(self, key, build):
        """``build()`` once per mask."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


@dataclass
class Magi2ForwardContext:
    """What every block of one forward reads beside its hidden states; built once by the model.

    Attributes:
        rotary_emb: ``[N, 6D/8]`` fp32 rope bands, packed order (this rank's tokens under context parallelism).
        dispatch: the modality sort of those tokens.
        attention_mask: a :class:`Magi2AttentionMask` (segment lengths are wrapped into one) of the whole sequence.
        shard_plan: the forward's ``Magi2SequenceShardPlan`` under context parallelism, else ``None``; read only by
            the exchanges ``enable_parallelism`` installs on the attention and MoE layers.
    """

    rotary_emb: torch.Tensor
    dispatch: Magi2ModalityDispatch
    attention_mask: Union[Magi2AttentionMask, Sequence[int]]
    shard_plan: Optional[Any] = None

    def __post_init__(self) -> None:
        self.attention_mask = Magi2AttentionMask.wrap(self.attention_mask)


#: How each diffusers backend serves sinks (README "Attention sinks"): ``"cpu_flash"`` / ``"aten_flash"`` /
#: ``"aten_efficient"`` / ``"aten_cudnn"``: the aten op with its log-sum-exp, called by us; ``"lse_bhs"`` /
#: ``"lse_bsh"``: ``dispatch_attention_fn(return_lse)``, LSE ``[B, H, S]`` / ``[B, S, H]``; ``None``: refused
#: (no LSE and no padded head dim); every other backend: ``"padded"``.
SINK_ATTENTION_PATHS = {
    "native": "aten",
    "_native_flash": "aten_flash",
    "_native_efficient": "aten_efficient",
    "_native_cudnn": "aten_cudnn",
    "flash": "lse_bhs",
    "flash_hub": "lse_bhs",
    "_flash_3_hub": "lse_bhs",
    "flash_4_hub": "lse_bhs",
    "aiter_fa2_hub": "lse_bhs",
    "sage": "lse_bhs",
    "sage_hub": "lse_bhs",
    "_flash_3": "lse_bsh",
    "sage_blackwell_hub": None,
}

#: The ``attention_kwargs`` key that asks a dispatched backend for its LSE (diffusers 0.42 names it two ways).
_LSE_FLAG = {"_flash_3_hub": "return_attn_probs"}


def _backend_name(backend) -> str:
    if backend is None:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        backend = _AttentionBackendRegistry.get_active_backend()[0]
    return str(getattr(backend, "value", backend))


def sink_attention_path(backend, device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str:
    """The exact path :func:`magi2_attention_with_sinks` takes (one of :data:`SINK_ATTENTION_PATHS`'s kinds).

    ``native`` is the CPU flash op on CPU, else the CUDA flash op (fp16/bf16) or the efficient op (fp32). Under
    autograd only ``cpu_flash`` (our backward, exact for the sinks too) keeps the LSE; the rest take ``padded``,
    since their kernels do not differentiate the LSE.

    Raises:
        ValueError: a backend that can serve sinks neither way (``sage_blackwell_hub``).
    """
    name = _backend_name(backend)
    if name in SINK_ATTENTION_PATHS and SINK_ATTENTION_PATHS[name] is None:
        raise ValueError(
            f"attention backend {name!r} cannot serve attention sinks: it returns no log-sum-exp and accepts no "
            f"padded head dim; choose one of {sorted(k for k, v in SINK_ATTENTION_PATHS.items() if v)} (log-sum-exp) "
            "or another diffusers backend (padded head dim)"
        )
    kind = SINK_ATTENTION_PATHS.get(name, "padded")
    if kind == "aten":
        if device.type == "cpu":
            kind = "cpu_flash"
        else:
            kind = "aten_flash" if dtype in (torch.float16, torch.bfloat16) else "aten_efficient"
    elif kind == "aten_flash" and device.type == "cpu":
        kind = "cpu_flash"
    if needs_grad and kind != "cpu_flash":
        kind = "padded"
    return kind


def _aten_attention_lse(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """``[1, H, L, D]`` q/k/v -> ``(out [1, H, L, D], lse [1, H, L] fp32)`` through one aten SDPA op."""
    if kind == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    elif kind == "aten_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
    elif kind == "aten_efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[:2]
    else:  # aten_cudnn (contiguous inputs, as diffusers' own cuDNN op notes)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, scale=scale)[:2]
    if lse.dim() == 4:  # cuDNN on newer torch: [B, H, L, 1]
        lse = lse[..., 0]
    return out, lse[..., : q.shape[2]].to(_accumulate_dtype(q.dtype))  # the efficient op pads L to 32k


def _dispatched_attention_lse(kind, q, k, v, scale, backend, name):
    """``[1, L, H, D]`` -> ``(out [1, L, H, D], lse [1, H, L] fp32)`` through ``dispatch_attention_fn``."""
    result = dispatch_attention_fn(
        q, k, v, scale=scale, backend=backend, attention_kwargs={_LSE_FLAG.get(name, "return_lse"): True}
    )
    if not isinstance(result, tuple) or len(result) < 2 or result[1] is None:
        raise RuntimeError(f"attention backend {name!r} returned no log-sum-exp although asked for one")
    out, lse = result[0], result[1]
    _, length, heads, _ = q.shape
    expected = (1, heads, length) if kind == "lse_bhs" else (1, length, heads)
    if tuple(lse.shape) != expected:
        raise RuntimeError(
            f"attention backend {name!r} returned an LSE of shape {tuple(lse.shape)}, expected {expected}"
        )
    return out, (lse if kind == "lse_bhs" else lse.transpose(1, 2)).to(_accumulate_dtype(q.dtype))


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input dtype when wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, sink_logit: torch.Tensor):
    """``out [1, H, L, D]``, ``lse [1, H, L]``, ``sink_logit [H]`` -> ``(out * w, lse with the sink, w)``, in fp32
    (fp64 inputs: fp64) but the output (``out``'s dtype), ``w = exp(lse - logaddexp(lse, sink))``."""
    acc = _accumulate_dtype(out.dtype)
    lse = lse.to(acc)
    lse_all = torch.logaddexp(lse, sink_logit.to(acc).view(1, -1, 1))
    w = torch.exp(lse - lse_all)
    return (out.to(acc) * w.unsqueeze(-1)).to(out.dtype), lse_all, w


class _CpuFlashSinkAttention(torch.autograd.Function):
    """Sink attention through the CPU flash op with an exact backward: the op's own backward at the
    sink-corrected output and LSE, and ``d sink = -sum_i (1 - w_i) (dO_i . O_i)``."""

    @staticmethod
    def forward(ctx, q, k, v, sink_logit, scale):
        out, lse = _aten_attention_lse("cpu_flash", q, k, v, scale)
        out, lse_all, w = _apply_sink(out, lse, sink_logit)
        ctx.save_for_backward(q, k, v, out, lse_all, w)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse_all, w = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse_all, 0.0, False, scale=ctx.scale
        )
        row = (grad_out.to(w.dtype) * out.to(w.dtype)).sum(-1)  # D_i, [1, H, L]
        g_sink = -((1 - w) * row).sum(dim=(0, 2))
        return gq, gk, gv, g_sink, None


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
    """Bidirectional varlen attention with per-head sink logits, one kernel call per packed segment.

    With sinks, backends that return a log-sum-exp are called at the real head dim and corrected exactly
    (MagiAttention's ``out * sigmoid(lse - sink)``); the others get the padded head dim (module docstring).
    :func:`sink_attention_path` names the path per backend.

    Args:
        query: ``[N, Hq, D]``; key, value: ``[N, Hkv, D]``, one dtype, ``Hq % Hkv == 0``.
        sinks: ``[S, Hq]`` fp32 sink logits, or ``None``.
        segment_lengths: ints summing to ``N``; segments never attend to each other.
        scale: softmax scale.
        backend: diffusers ``AttentionBackendName`` or ``None`` (the active default).
        parallel_config: diffusers' own CP config for the backend (never set by the MAGI-2 models; with sinks it
            takes the padded path).

    Returns ``[N, Hq, D]`` in the query dtype.

    Raises:
        ValueError: lengths not summing to ``N``, heads not dividing, or a backend that cannot serve sinks.
    """
    n, hq, d = query.shape
    hkv = key.shape[1]
    if sum(segment_lengths) != n:
        raise ValueError(f"segment lengths {list(segment_lengths)} sum to {sum(segment_lengths)}, expected {n} tokens")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    dtype = query.dtype
    kind = None
    if sinks is not None:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, sinks))
        kind = sink_attention_path(backend, query.device, dtype, needs_grad)
        if parallel_config is not None:
            kind = "padded"
    if hq != hkv:
        rep = hq // hkv
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if kind is not None and kind != "padded":
        sink_logit = torch.logsumexp(sinks.float(), dim=0) if sinks.shape[0] > 1 else sinks.float()[0]
        return _attention_with_sinks_by_lse(query, key, value, sink_logit, segment_lengths, scale, backend, kind)
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


def _attention_with_sinks_by_lse(query, key, value, sink_logit, segment_lengths, scale, backend, kind):
    """The log-sum-exp path of :func:`magi2_attention_with_sinks` (``key``/``value`` already at ``Hq`` heads)."""
    n, hq, d = query.shape
    name = _backend_name(backend)
    outs = []
    start = 0
    for length in segment_lengths:
        if length == 0:
            continue
        q_s, k_s, v_s = (t[start : start + length].unsqueeze(0) for t in (query, key, value))
        start += length
        if kind.startswith("lse_"):
            out, lse = _dispatched_attention_lse(kind, q_s, k_s, v_s, scale, backend, name)
            outs.append(_apply_sink(out.transpose(1, 2), lse, sink_logit)[0].transpose(1, 2)[0])
            continue
        q_s, k_s, v_s = (t.transpose(1, 2) for t in (q_s, k_s, v_s))  # [1, H, L, D]
        if (
            kind == "cpu_flash"
            and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q_s, k_s, v_s, sink_logit))
        ):
            out = _CpuFlashSinkAttention.apply(q_s, k_s, v_s, sink_logit, scale)
        else:
            out = _apply_sink(*_aten_attention_lse(kind, q_s, k_s, v_s, scale), sink_logit)[0]
        outs.append(out.transpose(1, 2)[0])
    if not outs:
        return query.new_zeros(0, hq, d)
    return torch.cat(outs, dim=0).to(query.dtype)


class _Magi2AttnProcessorBase:
    """The steps both processors share; subclasses give :meth:`attend` (packed order)."""

    _attention_backend = None
    _parallel_config = None

    def attend(self, attn, query, key, value, attention_mask: Magi2AttentionMask, heads=None) -> torch.Tensor:
        """``[N, Hq, D]``, ``[N, Hkv, D]`` x2 -> ``[N, Hq, D]``; ``heads``: the query heads this rank computes
        under context parallelism (``None``: all)."""
        raise NotImplementedError

    def __call__(self, attn: "Magi2Attention", hidden_states: torch.Tensor, context: Magi2ForwardContext):
        dispatch, mask = context.dispatch, context.attention_mask
        gs = dispatch.group_sizes if attn.num_modality > 1 else None
        n = hidden_states.shape[0]
        dtype = attn.compute_dtype
        u = attn.pre_norm(hidden_states, gs)
        q, k, v = torch.split(attn.linear_qkv(u, gs), [attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = attn.q_norm(q.reshape(n, attn.heads, attn.head_dim), gs)
        k = attn.k_norm(k.reshape(n, attn.kv_heads, attn.head_dim), gs)
        v = v.reshape(n, attn.kv_heads, attn.head_dim)
        q = dispatch.unsort(q)  # one at a time: each sorted copy (and then qkv) is freed at once
        k = dispatch.unsort(k)
        v = dispatch.unsort(v)
        q = apply_magi2_rotary_emb(q, context.rotary_emb).to(dtype)
        k = apply_magi2_rotary_emb(k, context.rotary_emb).to(dtype)
        # the installed exchange brings the tokens this rank attends over (one process: all of them, here)
        out = attn.exchange(
            q,
            k,
            v.to(dtype),
            lambda q_, k_, v_, heads: self.attend(attn, q_, k_, v_, mask, heads),
            context.shard_plan,
        )
        out = dispatch.sort(out.to(dtype))
        if attn.linear_g is not None:
            g = attn.linear_g(u, gs)
            g = g.float() if attn.gate_in_fp32 else g.to(out.dtype)
            out = out * sigmoid(g).unsqueeze(-1)
        return attn.linear_proj(out.reshape(n, attn.q_size).to(dtype), gs)


class Magi2AttnProcessor(_Magi2AttnProcessorBase):
    """Varlen attention with sinks, one segment per packed sample (SandAI preview ``Attention.forward``).

    Args:
        upcast_off_cuda: attend the (rounded) q/k/v in fp32 off CUDA, as FA3 keeps softmax and ``P @ V`` in fp32.
    """

    def __init__(self, upcast_off_cuda: bool = True) -> None:
        self.upcast_off_cuda = upcast_off_cuda

    def attend(self, attn, query, key, value, attention_mask: Magi2AttentionMask, heads=None) -> torch.Tensor:
        sinks = attn.sinks
        if heads is not None and sinks is not None:
            sinks = sinks[:, heads.start : heads.stop]
        if self.upcast_off_cuda and not query.is_cuda and query.dtype != torch.float32:
            query, key, value = query.float(), key.float(), value.float()
        return magi2_attention_with_sinks(
            query,
            key,
            value,
            sinks,
            attention_mask.segment_lengths,
            attn.scale,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )


class Magi2WindowAttnProcessor(_Magi2AttnProcessorBase):
    """Block-window attention of one packed Refiner sample (SandAI refiner ``Attention.forward``).

    Reads ``attention_mask.window`` or ``.dense_mask``; with neither it attends densely per segment.

    Args:
        backend: ``"auto"``, ``"sdpa"``, ``"flex"`` or ``"gather"`` (ValueError otherwise).
        max_dense_mask_elements: largest ``N * N`` dense mask the ``"sdpa"`` kernel may build.
    """

    def __init__(self, backend: str = "auto", max_dense_mask_elements: int = DEFAULT_MAX_DENSE_MASK_ELEMENTS) -> None:
        self.backend = check_backend("window_attn", backend)
        self.max_dense_mask_elements = int(max_dense_mask_elements)

    def attend(self, attn, query, key, value, attention_mask: Magi2AttentionMask, heads=None) -> torch.Tensor:
        mask = attention_mask
        backend, max_dense, geometry = self.backend, self.max_dense_mask_elements, mask.window
        if mask.dense_mask is not None:
            return block_window_attention(
                query, key, value, None, dense_mask=mask.dense_mask, backend=backend, scale=attn.scale
            )
        if geometry is None:
            return magi2_attention_with_sinks(
                query,
                key,
                value,
                None,
                mask.segment_lengths,
                attn.scale,
                self._attention_backend,
                self._parallel_config,
            )
        device = query.device
        backend = resolve_backend(
            "window_attn", backend, device, num_tokens=geometry.num_tokens, max_dense_elements=max_dense
        )
        dense = block = None
        if backend == "sdpa":
            dense = mask.cached(
                ("dense", geometry, str(device), max_dense),
                lambda: geometry.dense_mask(device, max_elements=max_dense),
            )
        elif backend == "flex":
            block = mask.cached(("flex", geometry, str(device)), lambda: cached_flex_block_mask(geometry, device))
        return block_window_attention(
            query,
            key,
            value,
            None if dense is not None else geometry,
            dense_mask=dense,
            backend=backend,
            scale=attn.scale,
            block_mask=block,
            max_dense_elements=max_dense,
        )


@dataclass(frozen=True)
class Magi2AttentionGeometry:
    """Head layout of a model's attention layers, the same in every layer: ``num_attention_heads`` query heads
    ``Hq`` and ``num_key_value_heads`` kv heads of ``attention_head_dim`` ``D`` (width ``C = Hq * D``), and
    ``num_sink_tokens`` sinks per head (0: none)."""

    num_attention_heads: int
    num_key_value_heads: int
    attention_head_dim: int
    num_sink_tokens: int = 0

    @property
    def hidden_size(self) -> int:
        """Model width ``C = Hq * D``."""
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_config(cls, config) -> "Magi2AttentionGeometry":
        """The geometry a model config names (``num_sink_tokens`` 0 where it names none)."""
        heads = (config.num_attention_heads, config.num_key_value_heads, config.attention_head_dim)
        return cls(*heads, config.get("num_sink_tokens", 0))


class Magi2Attention(nn.Module, AttentionModuleMixin):
    """Weights of one MAGI-2 attention (checkpoint prefix ``transformer_blocks.{i}.attention.``).

    Args:
        query_dim: model width ``C``.
        heads: query heads ``Hq``; ``Hq * dim_head`` is the attention width.
        kv_heads: key/value heads ``Hkv`` (``Hq % Hkv == 0``).
        dim_head: head dim ``D`` (``6 * D / 8`` dims carry rope).
        num_modality: 3 for multimodal layers (grouped weights), else 1.
        num_sink_tokens: sinks per head (0: none, no ``sinks`` parameter; the Preview uses 1).
        gated: per-head sigmoid output gate ``linear_g``.
        gate_in_fp32: apply the gate in fp32 (the Refiner) instead of the compute dtype (the Preview).
        eps: RMSNorm epsilon.
        params_dtype: dtype of ``linear_g``, ``linear_qkv``, ``linear_proj`` (``None`` = torch default).
        processor: a processor instance (default :class:`Magi2AttnProcessor`).

    Parameters (fp32 but the three linears): ``pre_norm [M*C]``, ``linear_g [M*Hq, C]``, ``linear_qkv
    [M*(Hq+2Hkv)*D, C]`` (rows q | k | v), ``linear_proj [M*C, Hq*D]``, ``sinks [S, Hq]``, ``q_norm``/``k_norm [M*D]``.
    """

    _default_processor_cls = Magi2AttnProcessor
    _available_processors = [Magi2AttnProcessor, Magi2WindowAttnProcessor]
    _supports_qkv_fusion = False

    def __init__(
        self,
        query_dim: int,
        heads: int,
        kv_heads: int,
        dim_head: int,
        num_modality: int = 1,
        num_sink_tokens: int = 0,
        gated: bool = True,
        gate_in_fp32: bool = False,
        eps: float = 1e-6,
        params_dtype: Optional[torch.dtype] = None,
        processor=None,
    ) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim_head
        self.num_modality = num_modality
        self.q_size = heads * dim_head
        self.kv_size = kv_heads * dim_head
        self.scale = dim_head**-0.5
        self.gate_in_fp32 = gate_in_fp32
        grouped = {"num_modality": num_modality, "dtype": params_dtype}
        self.pre_norm = Magi2MultiModalityRMSNorm(query_dim, num_modality, eps=eps)
        self.linear_g = modality_linear(query_dim, heads, **grouped) if gated else None
        self.linear_qkv = modality_linear(query_dim, self.q_size + 2 * self.kv_size, **grouped)
        self.linear_proj = modality_linear(self.q_size, query_dim, **grouped)
        if num_sink_tokens > 0:
            self.sinks = nn.Parameter(torch.zeros(num_sink_tokens, heads, dtype=torch.float32))
        else:
            self.sinks = None
        self.q_norm = Magi2MultiModalityRMSNorm(dim_head, num_modality, eps=eps, out_dtype=torch.float32)
        self.k_norm = Magi2MultiModalityRMSNorm(dim_head, num_modality, eps=eps, out_dtype=torch.float32)
        self.set_processor(processor if processor is not None else self._default_processor_cls())
        #: how the attention meets its tokens: all here (one process), or the Ulysses exchange that
        #: ``enable_parallelism`` installs (:mod:`diffusers_magi2.parallel.context_parallel`)
        self.exchange = Magi2LocalAttention()

    @classmethod
    def from_geometry(cls, geometry: Magi2AttentionGeometry, num_modality: int = 1, **kwargs) -> "Magi2Attention":
        """The attention of a layer with ``num_modality`` weight blocks in a model of ``geometry``; ``kwargs`` are
        the remaining constructor arguments (``gated``, ``eps``, ``processor``, ...)."""
        g = geometry
        heads = (g.num_attention_heads, g.num_key_value_heads, g.attention_head_dim)
        return cls(g.hidden_size, *heads, num_modality, g.num_sink_tokens, **kwargs)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype the attention runs in (``linear_qkv``'s compute dtype)."""
        return linear_compute_dtype(self.linear_qkv)

    def forward(self, hidden_states: torch.Tensor, context: Magi2ForwardContext) -> torch.Tensor:
        """``hidden_states`` ``[N, C]`` modality-sorted, ``context`` the forward's :class:`Magi2ForwardContext` ->
        ``[N, C]`` compute dtype."""
        return self.processor(self, hidden_states, context)


def check_transformer_geometry(
    num_layers: int, num_attention_heads: int, num_key_value_heads: int, attention_head_dim: int, **layer_lists
) -> None:
    """Check a MAGI-2 config's attention geometry and its per-layer index lists (``name=[indices]``).

    Raises:
        ValueError: a count below 1, ``Hq % Hkv != 0``, a head dim that is not a multiple of 8 (rope), or
            a layer index outside ``[0, num_layers)``.
    """
    if num_layers < 1 or num_attention_heads < 1 or num_key_value_heads < 1:
        raise ValueError("num_layers, num_attention_heads and num_key_value_heads must be >= 1")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({num_key_value_heads})"
        )
    if attention_head_dim % 8:
        raise ValueError(f"attention_head_dim must be a multiple of 8, got {attention_head_dim}")
    for name, layers in layer_lists.items():
        if layers is not None and any(not 0 <= int(i) < num_layers for i in layers):
            raise ValueError(f"{name} must hold layer indices in [0, {num_layers}), got {list(layers)}")


#: Keys the refiner's ``attention_kwargs`` no longer take, and the diffusers-style call that sets each.
_MOVED_ATTENTION_KWARGS = {
    "window_backend": "set_attn_processor(Magi2WindowAttnProcessor(backend=...))",
    "max_dense_mask_elements": "set_attn_processor(Magi2WindowAttnProcessor(max_dense_mask_elements=...))",
    "mlp_chunk_size": "enable_forward_chunking(chunk_size)",
}


def check_attention_kwargs(owner: str, attention_kwargs, supported: Sequence[str]) -> dict:
    """``attention_kwargs`` as a dict after checking that ``owner`` (a model or pipeline name) uses every key.

    Raises:
        ValueError: not a dict/``None``, or a key outside ``supported`` (never silently dropped); the
            message names the processor or method that now sets a moved key.
    """
    if attention_kwargs is None:
        return {}
    if not isinstance(attention_kwargs, dict):
        raise ValueError(f"attention_kwargs must be a dict or None, got {type(attention_kwargs).__name__}")
    unknown = sorted(k for k in attention_kwargs if k not in supported)
    if unknown:
        moved = "; ".join(f"for {k} use {_MOVED_ATTENTION_KWARGS[k]}" for k in unknown if k in _MOVED_ATTENTION_KWARGS)
        raise ValueError(
            f"{owner} does not support attention_kwargs {unknown}; allowed keys: {list(supported)} "
            f"({moved or 'choose attention kernels with set_attention_backend / set_attn_processor'})"
        )
    return dict(attention_kwargs)


def _skip_magi2_attention(module, *args, **kwargs):
    """LayerSkip hooks: a skipped attention returns its input."""
    hidden_states = kwargs.get("hidden_states")
    return hidden_states if hidden_states is not None else args[0]


def register_block_for_caching_hooks(block_cls) -> None:
    """Register a block class and the processors with diffusers' hook registries (FirstBlockCache, MagCache,
    TaylorSeer; private API of diffusers 0.42)."""
    from diffusers.hooks._helpers import (
        AttentionProcessorMetadata,
        AttentionProcessorRegistry,
        TransformerBlockMetadata,
        TransformerBlockRegistry,
    )

    for processor_cls in Magi2Attention._available_processors:
        AttentionProcessorRegistry.register(
            model_class=processor_cls,
            metadata=AttentionProcessorMetadata(skip_processor_output_fn=_skip_magi2_attention),
        )
    TransformerBlockRegistry.register(
        model_class=block_cls,
        metadata=TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None),
    )
