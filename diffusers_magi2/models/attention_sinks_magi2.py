"""Varlen attention with attention sinks (MagiAttention's ``correct_attn_out_lse_with_sink``), the Preview's kernel.

Each head ``h`` has sink logits ``sink[s, h]`` that combine to ``sink_h = logsumexp_s sink[s, h]``: the sink is one
more logit in each query row's softmax, with a zero value. Two exact paths, chosen per backend by
:func:`sink_attention_path` from :data:`SINK_ATTENTION_PATHS` (the README's "Attention sinks per backend" table):

* **LSE**, where the backend returns ``lse_i = log sum_j exp(s_ij)``: run it at the real head dim ``D`` and scale
  each row, ``out_i * w_i`` with ``w_i = exp(lse_i - logaddexp(lse_i, sink_h)) = sigmoid(lse_i - sink_h)``. The
  kernels do not differentiate their LSE, so with autograd recording the padded path is taken instead;
* **padded**, for any backend: pad the head dim by 8; query head ``h`` carries ``sink_h / scale`` (as a high + low
  pair in the compute dtype) in two pad channels, and each segment gets one extra key with ones there and a zero
  value, whose logit is then ``sink_h``. Its gradient is the backend's own.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn


__all__ = ["SINK_ATTENTION_PATHS", "magi2_attention_with_sinks", "sink_attention_path"]

_SINK_PAD = 8

#: How each diffusers backend serves sinks (README "Attention sinks per backend"): ``"aten"`` (``native``: the CPU
#: flash op on CPU, else the CUDA flash op for fp16/bf16 or the efficient op for fp32) / ``"aten_flash"`` /
#: ``"aten_efficient"`` / ``"aten_cudnn"``: the aten op with its log-sum-exp, called by us; ``"lse_bhs"`` /
#: ``"lse_bsh"``: ``dispatch_attention_fn(return_lse)``, LSE ``[B, H, S]`` / ``[B, S, H]``; ``None``: refused (no
#: LSE and no padded head dim); every other backend: ``"padded"``.
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
    """The path :func:`magi2_attention_with_sinks` takes: ``"padded"``, or the LSE kind (``"cpu_flash"``,
    ``"aten_flash"``, ``"aten_efficient"``, ``"aten_cudnn"``, ``"lse_bhs"``, ``"lse_bsh"``).

    ``native`` is the CPU flash op on CPU, else the CUDA flash op (fp16/bf16) or the efficient op (fp32). Under
    autograd every backend takes ``padded``, since the LSE kernels do not differentiate their LSE.

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
    if needs_grad:
        kind = "padded"
    return kind


def magi2_attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: Optional[torch.Tensor],
    segment_lengths: Sequence[int],
    scale: float,
    backend=None,
) -> torch.Tensor:
    """Bidirectional varlen attention with per-head sink logits, one kernel call per packed segment (module
    docstring; :func:`sink_attention_path` names the path per backend).

    Args:
        query: ``[N, Hq, D]``; key, value: ``[N, Hkv, D]``, one dtype, ``Hq % Hkv == 0``.
        sinks: ``[S, Hq]`` fp32 sink logits, or ``None``.
        segment_lengths: ints summing to ``N``; segments never attend to each other.
        scale: softmax scale.
        backend: diffusers ``AttentionBackendName`` or ``None`` (the active default).

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
    kind = None
    if sinks is not None:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, sinks))
        kind = sink_attention_path(backend, query.device, query.dtype, needs_grad)
    if hq != hkv:
        rep = hq // hkv
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if sinks is None:
        return _attention_by_segment(query, key, value, None, segment_lengths, scale, backend)
    sink_logit = torch.logsumexp(sinks.float(), dim=0) if sinks.shape[0] > 1 else sinks.float()[0]
    if kind == "padded":
        return _attention_with_sinks_padded(query, key, value, sink_logit, segment_lengths, scale, backend)
    return _attention_with_sinks_by_lse(query, key, value, sink_logit, segment_lengths, scale, backend, kind)


# ---------------------------------------------------------------------------------------------------- padded path


def _attention_with_sinks_padded(query, key, value, sink_logit, segment_lengths, scale, backend):
    """The padded path (``key``/``value`` already at ``Hq`` heads; ``sink_logit [Hq]`` fp32)."""
    n, hq, d = query.shape
    dtype = query.dtype
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
    return _attention_by_segment(q_aug, k_aug, v_aug, (sink_k, sink_v), segment_lengths, scale, backend, d)


def _attention_by_segment(query, key, value, extra_key_value, segment_lengths, scale, backend, out_dim=None):
    """``dispatch_attention_fn`` once per non-empty segment, each segment's keys and values followed by
    ``extra_key_value`` (``None``: nothing); ``[N, Hq, D']`` -> ``[N, Hq, out_dim or D']`` in the query dtype."""
    out_dim = out_dim or query.shape[-1]
    outs = []
    start = 0
    for length in segment_lengths:
        if length == 0:
            continue
        q_s = query[start : start + length]
        k_s = key[start : start + length]
        v_s = value[start : start + length]
        if extra_key_value is not None:
            k_s = torch.cat([k_s, extra_key_value[0]], dim=0)
            v_s = torch.cat([v_s, extra_key_value[1]], dim=0)
        o = dispatch_attention_fn(q_s.unsqueeze(0), k_s.unsqueeze(0), v_s.unsqueeze(0), scale=scale, backend=backend)
        outs.append(o[0, :, :, :out_dim])
        start += length
    if not outs:
        return query.new_zeros(0, query.shape[1], out_dim)
    return torch.cat(outs, dim=0).to(query.dtype)


# ------------------------------------------------------------------------------------------------------- LSE path


def _attention_with_sinks_by_lse(query, key, value, sink_logit, segment_lengths, scale, backend, kind):
    """The log-sum-exp path (``key``/``value`` already at ``Hq`` heads; ``kind`` from :func:`sink_attention_path`)."""
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
            outs.append(_apply_sink(out.transpose(1, 2), lse, sink_logit).transpose(1, 2)[0])
            continue
        q_s, k_s, v_s = (t.transpose(1, 2) for t in (q_s, k_s, v_s))  # [1, H, L, D]
        out = _apply_sink(*_aten_attention_lse(kind, q_s, k_s, v_s, scale), sink_logit)
        outs.append(out.transpose(1, 2)[0])
    if not outs:
        return query.new_zeros(0, hq, d)
    return torch.cat(outs, dim=0).to(query.dtype)


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


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, sink_logit: torch.Tensor) -> torch.Tensor:
    """``out [1, H, L, D]``, ``lse [1, H, L]``, ``sink_logit [H]`` -> ``out * w`` in ``out``'s dtype, computed in fp32
    (fp64 inputs: fp64), ``w = exp(lse - logaddexp(lse, sink))``.

    ``lse`` is made contiguous first: a CPU kernel's SIMD body and its scalar remainder round ``exp`` and
    ``logaddexp`` differently in the last bit, and which one a row takes follows the innermost dimension; the CPU
    flash op returns ``lse`` head-innermost (strides ``(H L, 1, H)``), so a Ulysses rank holding fewer heads would
    take the other one. Length-innermost, every head's row takes the same path whatever the number of heads."""
    acc = _accumulate_dtype(out.dtype)
    lse = lse.to(acc).contiguous()
    w = torch.exp(lse - torch.logaddexp(lse, sink_logit.to(acc).view(1, -1, 1)))
    return (out.to(acc) * w.unsqueeze(-1)).to(out.dtype)
