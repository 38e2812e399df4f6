"""Backward of the routed-expert op (``torch.ops.diffusers_magi2.mh_moe_experts``): only the asked-for gradients.

For a route ``r`` of expert ``g`` (head ``h``, token ``s``, weight ``p``) the forward computed
``a = x[s, h] W_gate[g]``, ``b = x[s, h] W_up[g]``, ``u = round_w(swiglu7(a, b))``, ``y = u W_down[g]`` and added
``p y`` to ``out[s, h]`` (:mod:`.reference`). With ``G = dL/d out[s, h]``::

    dL/dp             = <G, y>
    (dL/da, dL/db)    = swiglu7'(a, b) * ((p G) W_down[g]^T)          (the rounding passes the gradient through)
    dL/dx[s, h]      += dL/da W_gate[g]^T + dL/db W_up[g]^T
    dL/dW_down[g]     = sum_r u^T (p G),    dL/dW_gate[g] = sum_r x^T dL/da,    dL/dW_up[g] = sum_r x^T dL/db

``needs`` (the op's ``ctx.needs_input_grad`` for ``x``, ``probs``, ``W_gate``, ``W_up``, ``W_down``) says which to
compute: a gradient not asked for is an empty ``(0,)`` tensor and none of its work is done (frozen experts: no
weight-gradient buffer, no weight-gradient GEMM; only ``x`` and ``probs`` asked: no ``u^T`` products).

Per head, one head's bank at a time (its storage's :meth:`~.expert_storage.ExpertStorage.head_banks`: quantized
banks dequantized, int4 into reused buffers, as the forward's torch paths do), each projection is one ``torch.nn.functional.grouped_mm`` over the head's experts with device-side offsets, on
:data:`BACKWARD_ROWS` routes at a time (bounding the ``[rows, De]`` temporaries; a route block cut mid-expert just
splits that expert's group, and weight gradients add up over the blocks). Top-k routes (``T = S*H*k``, every head's
``S*k`` routes contiguous, as :func:`~diffusers_magi2.moe.routing.global_sort_routes` lays them out) read nothing on
the host; if their offsets do not have that layout every gradient is NaN rather than wrong. Other route counts (a
hand-made CSR through the seed functions) read the ``H + 1`` head bounds on the host once. GEMM operands are fp32,
except bf16 activations on CUDA, where the grouped GEMM runs without a host read only in bf16 (fp32
accumulation, bf16 results); the elementwise parts and every accumulation are fp32.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .activation import swiglu7, swiglu7_backward
from .expert_checks import top_k_layout_poison
from .expert_formats import storage_of
from .expert_storage import ExpertStorage


__all__ = ["BACKWARD_ROWS", "device_kernels", "experts_backward", "grouped_mm"]

#: torch's grouped GEMM: ``torch.nn.functional.grouped_mm`` (public from torch 2.10), ``torch._grouped_mm`` before
grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

#: routes per grouped-GEMM step of the backward: its ``[rows, De]`` fp32 temporaries hold 84 MB each at De 1280
BACKWARD_ROWS = 16384


def device_kernels(
    device_type: str, dtype: torch.dtype, storage: Optional[ExpertStorage] = None
) -> tuple[torch.dtype, Optional[Callable]]:
    """``(GEMM operand dtype, dequantizer (stored, scales, out) -> out or None)`` of the backward for activations of
    ``dtype`` on a ``device_type`` device: on CUDA ``storage``'s device dequantizer (straight into the buffer's
    dtype), with bf16 GEMMs for bf16 activations; elsewhere fp32 GEMMs and the storage's own torch dequantization
    (``None``)."""
    if device_type != "cuda":
        return torch.float32, None
    dequantizer = None if storage is None else storage.device_dequantizer()
    return (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32), dequantizer


def experts_backward(
    grad_out: Tensor,
    x: Tensor,
    routes: Sequence[Tensor],
    weights: Sequence[Tensor],
    scales: Optional[Sequence[Tensor]],
    needs: Sequence[bool],
    *,
    top_k_routes: bool = False,
    chunk_rows: int = BACKWARD_ROWS,
    kernels: Optional[tuple] = None,
) -> list[Tensor]:
    """Gradients ``[x, probs, w_gate, w_up, w_down]`` of the expert op (module docstring); arguments as
    ``torch_mh_moe_forward``'s, ``needs`` five bools, ``top_k_routes`` whether the routes are top-k routes in
    ``global_sort_routes``' layout (head ``h``'s at rows ``h·S·k``: no host read; else the head bounds are read once),
    ``chunk_rows`` routes per grouped-GEMM step, ``kernels`` as :func:`device_kernels` returns them (default:
    ``x``'s device's; the memory plan traces the CUDA choice on CPU). Each gradient is in its input's dtype (fp32
    for FP8 banks), or ``(0,)`` when not asked for."""
    (gather_ids, probs, expert_offsets), w_gate = routes, weights[0]
    want_x, want_p, *want_w = (bool(n) for n in needs)
    num_tokens, num_heads, head_dim = x.shape
    num_routes, num_experts = gather_ids.numel(), w_gate.shape[0] // num_heads
    scales = scales or None
    storage = storage_of(weights, scales)
    device, f32 = x.device, torch.float32
    grad_x = torch.zeros(x.shape, dtype=f32, device=device) if want_x else None
    grad_p = torch.zeros(num_routes, dtype=f32, device=device) if want_p else None
    grad_dtype = storage.grad_dtype()
    grad_w = [torch.zeros(w.shape, dtype=grad_dtype, device=device) if n else None for w, n in zip(weights, want_w)]
    if num_routes and num_tokens and (want_x or want_p or any(want_w)):
        compute, dequantize_into = kernels or device_kernels(x.device.type, x.dtype, storage)
        round_hidden = storage.hidden_dtype(x.dtype)
        blocks, poison = _head_blocks(expert_offsets, num_tokens, num_heads, num_experts, num_routes, top_k_routes)
        scratch, accum = [None] * 3, [None] * 3
        for head, (lo, count) in enumerate(blocks):
            if count == 0:
                continue
            experts = slice(head * num_experts, (head + 1) * num_experts)
            wg, wu, wd = storage.head_banks(weights, scales, experts, compute, scratch, dequantize_into)
            for i, w in enumerate(weights):  # per-head fp32 weight-gradient sums (the bank's own rows if fp32)
                if want_w[i]:
                    if grad_w[i].dtype == f32:
                        accum[i] = grad_w[i][experts]
                    else:
                        accum[i] = torch.zeros(wg.shape[0], *w.shape[1:], dtype=f32, device=device)
            ends = expert_offsets[experts.start + 1 : experts.stop + 1].to(torch.int64) - lo
            for start in range(0, count, chunk_rows):
                rows = min(chunk_rows, count - start)
                offs = (ends - start).clamp_(0, rows).to(torch.int32)
                span = slice(lo + start, lo + start + rows)
                tokens = gather_ids[span].to(torch.int64)
                xs = x[tokens, head].to(compute)
                gate = grouped_mm(xs, wg, offs=offs).float()
                up = grouped_mm(xs, wu, offs=offs).float()
                hidden = swiglu7(gate, up).to(round_hidden).to(compute)
                g_out = grad_out[tokens, head].float()
                if want_p:
                    grad_p[span] = (g_out * grouped_mm(hidden, wd, offs=offs).float()).sum(1)
                grad_down = (g_out * probs[span].float().unsqueeze(1)).to(compute)
                del g_out
                if want_w[2]:
                    accum[2] += grouped_mm(hidden.t(), grad_down, offs=offs)
                del hidden
                if not (want_x or want_w[0] or want_w[1]):
                    continue
                grad_hidden = grouped_mm(grad_down, wd.transpose(1, 2), offs=offs)
                grad_gate, grad_up = (g.to(compute) for g in swiglu7_backward(gate, up, grad_hidden))
                del gate, up, grad_hidden
                if want_x:
                    dx = grouped_mm(grad_gate, wg.transpose(1, 2), offs=offs).float()
                    dx += grouped_mm(grad_up, wu.transpose(1, 2), offs=offs)
                    grad_x[:, head].index_add_(0, tokens, dx)
                for i, grad in ((0, grad_gate), (1, grad_up)):
                    if want_w[i]:
                        accum[i] += grouped_mm(xs.t(), grad, offs=offs)
            for i, grad in enumerate(grad_w):
                if want_w[i] and grad.dtype != f32:
                    grad[experts] = accum[i]
        for grad in (grad_x, grad_p, *grad_w):
            if grad is not None:
                grad.add_(poison)
    grads = [None if grad_x is None else grad_x.to(x.dtype), None if grad_p is None else grad_p.to(probs.dtype)]
    grads += grad_w
    dtypes = (x.dtype, probs.dtype, grad_dtype, grad_dtype, grad_dtype)
    return [grad_like(t, False, d) if g is None else g for g, t, d in zip(grads, (x, probs, *weights), dtypes)]


def _head_blocks(expert_offsets, num_tokens: int, num_heads: int, num_experts: int, num_routes: int, top_k: bool):
    """``([(first route, count)] per head, poison)``: top-k routes from the host-known layout, with ``poison`` a
    0-dim fp32 tensor that is NaN where the offsets disagree with it (else 0); other routes from one host read."""
    per_head, remainder = divmod(num_routes, num_tokens * num_heads)
    if remainder or not top_k:
        bounds = expert_offsets[::num_experts].tolist()  # a hand-made CSR: the one host read
        poison = torch.zeros((), device=expert_offsets.device)
        return [(a, b - a) for a, b in zip(bounds, bounds[1:])], poison
    per_head *= num_tokens
    poison = top_k_layout_poison(expert_offsets, num_experts, per_head)
    return [(h * per_head, per_head) for h in range(num_heads)], poison


def grad_like(t: Tensor, needed: bool, dtype: torch.dtype) -> Tensor:
    """An empty ``dtype`` tensor of ``t``'s gradient shape, or ``(0,)`` when it is not asked for (the op's fake)."""
    return t.new_empty(tuple(t.shape) if needed else (0,), dtype=dtype)
