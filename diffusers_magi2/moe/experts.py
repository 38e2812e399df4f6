"""Optimised torch path of the routed-expert compute (the CPU backend), and the expert call as a custom op.

The math is :mod:`diffusers_magi2.moe.reference` (SandAI ``_mh_moe_fwd_kernel``, with its rounding points).
``"torch"`` computes the same bits with reused buffers and ``out=`` GEMMs, reading the expert offsets on the host
once per call. The banks reach the math through their storage (:mod:`.expert_formats`, looked up once per call):
quantized banks are dequantized just in time, never the whole layer (FP8 per expert, int4 one head's bank at a time
into reused fp32 buffers, for ``"torch"``; one head's bank at a time for ``"torch_grouped"``).
``"torch_grouped"`` has no host sync (for context parallelism): per head, one grouped GEMM
(:data:`~.experts_backward.grouped_mm`) per projection over that head's experts with device-side offsets, the ``k``
routes of each (token, head) summed in ascending expert id; it needs top-k routes, and its one-block swiglu7 may
differ from the per-expert one in the last fp32 bit.
``torch.ops.diffusers_magi2.mh_moe_experts`` is the expert call as a ``torch.library.custom_op`` (fake and backward
ops, so ``torch.compile(fullgraph=True)`` traces a whole MoE block); its backward computes only the gradients asked
for, with grouped GEMMs and no host read for top-k routes (:mod:`.experts_backward`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .activation import swiglu7
from .expert_checks import check_expert_inputs, check_expert_tensors
from .expert_formats import storage_of
from .experts_backward import experts_backward, grad_like, grouped_mm


__all__ = ["check_expert_inputs", "mh_moe_experts", "mh_moe_experts_backward", "torch_mh_moe_forward"]

#: Concrete backends of :func:`mh_moe_experts`.
EXPERT_BACKENDS = ("torch", "torch_grouped", "triton")


def torch_mh_moe_forward(
    x: Tensor,
    gather_ids: Tensor,
    probs: Tensor,
    expert_offsets: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    *,
    scales: Optional[Sequence[Tensor]] = None,
) -> Tensor:
    """Routed-expert compute of MAGI-2's multi-head MoE in plain torch (differentiable): the small-shape oracle of
    the fused kernel, with vLLM-Omni's ``mh_moe`` signature.

    The reference's bits; bf16 weights are upcast, FP8 ones dequantized per expert and int4 ones per head, never
    the whole layer.

    Args:
        x: ``[S, H, Dh]`` activations, fp32/bf16/fp16.
        gather_ids: ``[T]`` int32/int64 token index per route, in CSR (expert-major) order, as
            :func:`~diffusers_magi2.moe.routing.global_sort_routes` returns it.
        probs: ``[T]`` float route weights in the same order (``route_scale`` already applied).
        expert_offsets: ``[H*E + 1]`` int CSR offsets; the routes of expert ``g`` are
            ``expert_offsets[g]:expert_offsets[g+1]``.
        w_gate: ``[H*E, Dh, De]``, used as ``x @ W``.
        w_up: ``[H*E, Dh, De]``.
        w_down: ``[H*E, De, Dh]``; the three are fp32/bf16/fp16, ``float8_e4m3fn`` with ``scales``, or ``uint8``
            int4 codes with ``scales`` (``w_gate``/``w_up [H*E, Dh, De/2]``, ``w_down [H*E, De, Dh/2]``,
            :mod:`~diffusers_magi2.moe.quantize_int4`).
        scales: keyword-only, quantized experts only: FP8: fp32 ``(w_gate_scale [H*E, De], w_up_scale [H*E, De],
            w_down_scale [H*E, Dh])``; int4: the bf16 group scales ``([H*E, Dh/G, De], [H*E, Dh/G, De],
            [H*E, De/G, Dh])``.

    Returns:
        ``[S, H, Dh]`` in ``x.dtype``; heads/tokens without routes are zero.

    Raises:
        ValueError: an argument that is not a tensor, ``scales`` not three tensors, bad shapes, dtypes or devices
            (see ``check_expert_inputs``), or offsets that do not end at ``T`` or decrease.
    """
    routes, weights = [gather_ids, probs, expert_offsets], [w_gate, w_up, w_down]
    check_expert_tensors(x, routes, weights, scales)  # a ValueError here, not the op's schema error
    return mh_moe_experts(x, routes, weights, [] if scales is None else list(scales), "torch", False, False)


def _torch_experts(x, routes, weights, scales=None) -> torch.Tensor:
    """The torch backend of :func:`mh_moe_experts` (inputs already checked; no autograd)."""
    (gather_ids, probs, expert_offsets), w_gate = routes, weights[0]
    num_tokens, num_heads = x.shape[:2]
    num_experts = w_gate.shape[0] // num_heads
    offsets = expert_offsets.tolist()  # one host sync; this is the CPU path
    num_routes = gather_ids.numel()
    if offsets[0] != 0 or offsets[-1] != num_routes or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"expert_offsets must be non-decreasing from 0 to len(gather_ids) = {num_routes}; "
            f"got first {offsets[0]}, last {offsets[-1]}"
        )
    if num_routes == 0 or num_tokens == 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    # Per-expert route counts, grouped per head (the CSR is head-major: a head's routes are one contiguous block).
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    head_counts = [counts[h * num_experts : (h + 1) * num_experts] for h in range(num_heads)]
    token_ids = gather_ids.to(torch.int64)
    route_probs = probs.to(torch.float32).unsqueeze(1)
    return _forward_inference(x, token_ids, route_probs, offsets, head_counts, weights, scales)


def _forward_inference(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    route_probs: torch.Tensor,
    offsets: list[int],
    head_counts: list[list[int]],
    weights: Sequence[Tensor],
    scales: Optional[Sequence[Tensor]],
) -> torch.Tensor:
    """Per head and expert: gate/up GEMMs and swiglu7 in two reused buffers, down GEMM into the head's fp32 block."""
    num_tokens, num_heads, head_dim = x.shape
    storage = storage_of(weights, scales)
    num_experts, expert_dim = len(head_counts[0]), storage.logical_shape(weights[0].shape)[2]
    f32 = torch.float32
    round_to = storage.hidden_dtype(x.dtype)
    max_block = max(sum(c) for c in head_counts)
    max_rows = max(max(c) for c in head_counts)
    x_rows = torch.empty(max_block, head_dim, dtype=f32, device=x.device)  # gathered rows of one head, fp32
    expert_bufs = torch.empty(2, max_rows, expert_dim, dtype=f32, device=x.device).unbind(0)  # gate/up, hidden
    expert_temps: dict[int, tuple[torch.Tensor, ...]] = {}
    down_rows = torch.empty(max_block, head_dim, dtype=f32, device=x.device)  # one head's route rows, CSR order
    head_sum = torch.empty(num_tokens, head_dim, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    matrices = storage.expert_matrices(weights, scales)  # fp32 per expert, never the whole bank
    for head, counts in enumerate(head_counts):
        base = offsets[head * num_experts]
        block = sum(counts)
        if block == 0:
            out[:, head].zero_()
            continue
        matrices.load_head(slice(head * num_experts, (head + 1) * num_experts))
        tokens = token_ids[base : base + block]
        if x.dtype == f32:
            x_head = torch.index_select(x[:, head], 0, tokens, out=x_rows[:block])
        else:
            x_head = x_rows[:block].copy_(x[:, head].index_select(0, tokens))
        x_parts = x_head.split(counts)
        down_parts = down_rows[:block].split(counts)
        prob_parts = route_probs[base : base + block].split(counts)
        for e, rows in enumerate(counts):
            if rows == 0:
                continue
            temps = expert_temps.get(rows)
            if temps is None:  # views of the expert buffers, sliced once per distinct expert size
                temps = expert_temps[rows] = tuple(buf[:rows] for buf in expert_bufs)
            g = head * num_experts + e
            wg, wu, wd = (rows_[g] for rows_ in matrices)
            # gate/up with fp32 accumulation, swiglu7 in fp32, rounded to the hidden dtype, down in fp32, x prob
            # (while the rows are still in cache)
            scratch, hidden_buf = temps
            xs = x_parts[e]
            # the up GEMM reuses the gate's buffer once swiglu7 has consumed the gate half
            hidden = swiglu7(torch.mm(xs, wg, out=scratch), lambda: torch.mm(xs, wu, out=scratch), out=hidden_buf)
            if round_to != f32:
                hidden = hidden.to(round_to).float()
            torch.mm(hidden, wd, out=down_parts[e]).mul_(prob_parts[e])
        contrib = down_rows[:block].to(x.dtype)  # rounded to the activation dtype (no-op in fp32)
        _sum_head_routes_(head_sum, contrib, tokens)
        out[:, head].copy_(head_sum)
    return out


def _sum_head_routes_(out_head: torch.Tensor, contrib: torch.Tensor, tokens: torch.Tensor) -> None:
    """Per-token sums of one head's route rows into ``out_head``, rounded after every add in ascending expert id
    (fp32 CPU: ``index_add_``, which adds in index order; else ``k - 1`` column adds of the token-sorted rows)."""
    if contrib.dtype == torch.float32 and contrib.device.type == "cpu":
        out_head.zero_().index_add_(0, tokens, contrib)
        return
    num_tokens, count = out_head.shape[0], tokens.numel()
    if count % num_tokens == 0:
        top_k = count // num_tokens
        sorted_tokens, order = torch.sort(tokens.to(torch.int32), stable=True)
        expected = torch.arange(num_tokens, device=tokens.device, dtype=torch.int32).repeat_interleave(top_k)
        if torch.equal(sorted_tokens, expected):
            rows = contrib.index_select(0, order).view(num_tokens, top_k, -1)
            out_head.copy_(rows[:, 0])
            for j in range(1, top_k):
                out_head.add_(rows[:, j])
            return
    out_head.zero_().index_add_(0, tokens, contrib)


def _grouped_experts(x, routes, weights, scales=None) -> torch.Tensor:
    """The ``"torch_grouped"`` backend (module docstring): no offset, count or index leaves the device; one
    head's experts are upcast at a time (top-k routes put head ``h``'s ``S·k`` routes at rows ``h·S·k``).

    Raises:
        ValueError: ``T`` is not a multiple of ``S·H`` (not top-k routes).
    """
    (gather_ids, probs, expert_offsets), w_gate = routes, weights[0]
    num_tokens, num_heads, head_dim = x.shape
    num_routes = gather_ids.numel()
    if num_routes == 0 or num_tokens == 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    if num_routes % (num_tokens * num_heads):
        raise ValueError(
            f"the torch_grouped expert backend needs top-k routes (the same number per (token, head)): "
            f"T={num_routes} is not a multiple of S*H={num_tokens * num_heads}"
        )
    top_k = num_routes // (num_tokens * num_heads)
    per_head, num_experts = num_tokens * top_k, w_gate.shape[0] // num_heads
    f32 = torch.float32
    storage = storage_of(weights, scales)
    round_to = storage.hidden_dtype(x.dtype)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    scratch = [None] * 3  # buffers a storage dequantizes into, reused across heads
    for h in range(num_heads):
        lo, experts = h * per_head, slice(h * num_experts, (h + 1) * num_experts)
        wg, wu, wd = storage.head_banks(weights, scales, experts, f32, scratch)
        offs = (expert_offsets[experts.start + 1 : experts.stop + 1] - lo).to(torch.int32)
        tokens = gather_ids[lo : lo + per_head].to(torch.int64)
        rows = x[tokens, h].to(f32)  # [S·k, Dh], this head's CSR block (upcast exact)
        hidden = swiglu7(grouped_mm(rows, wg, offs=offs), grouped_mm(rows, wu, offs=offs))
        if round_to != f32:
            hidden = hidden.to(round_to).float()
        contrib = grouped_mm(hidden, wd, offs=offs).mul_(probs[lo : lo + per_head].to(f32).unsqueeze(1))
        contrib = contrib.to(x.dtype)
        # token-major with a stable sort: each token's k rows stay in CSR (= ascending expert) order
        per_token = contrib.index_select(0, torch.sort(tokens, stable=True).indices).view(num_tokens, top_k, head_dim)
        total = out[:, h]
        total.copy_(per_token[:, 0])
        for j in range(1, top_k):
            total.add_(per_token[:, j])
    return out


# --------------------------------------------------------------------------------------------- the custom op

_TORCH_BACKENDS = {"torch": _torch_experts, "torch_grouped": _grouped_experts}


@torch.library.custom_op("diffusers_magi2::mh_moe_experts", mutates_args=())
def mh_moe_experts(
    x: Tensor,
    routes: list[Tensor],
    weights: list[Tensor],
    scales: list[Tensor],
    backend: str,
    deterministic: bool,
    top_k_routes: bool,
) -> Tensor:
    """The expert call with a concrete ``backend`` (one of :data:`EXPERT_BACKENDS`); ``x``, ``routes`` and
    ``weights`` as :func:`torch_mh_moe_forward`, ``scales`` their three FP8 or int4 scales or empty (a custom op
    takes no optional list), ``deterministic`` and ``top_k_routes`` as ``triton_mh_moe_forward`` (``True`` from
    ``Magi2MultiHeadMoE``, whose routes are top-k; ``False`` for a CSR of any other form).

    Raises:
        ValueError: an unknown backend, ``"torch_grouped"`` without top-k routes, or the chosen path's input errors.
    """
    bank_scales = scales or None
    if backend in _TORCH_BACKENDS:
        check_expert_inputs(x, routes, weights, bank_scales)
        if backend == "torch_grouped" and not top_k_routes:
            raise ValueError(
                "the torch_grouped expert backend takes top-k routes only (Magi2MultiHeadMoE's); use 'torch'"
            )
        return _TORCH_BACKENDS[backend](x, routes, weights, bank_scales)
    if backend == "triton":
        from . import experts_triton  # Triton is imported on first use

        return experts_triton.triton_mh_moe_forward(
            x, *routes, *weights, scales=bank_scales, deterministic=deterministic, top_k_routes=top_k_routes
        )
    raise ValueError(f"mh_moe_experts backend must be one of {EXPERT_BACKENDS}; got {backend!r}")


@mh_moe_experts.register_fake
def _mh_moe_experts_fake(x, routes, weights, scales, backend, deterministic, top_k_routes):
    check_expert_inputs(x, routes, weights, scales or None)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("diffusers_magi2::mh_moe_experts_backward", mutates_args=())
def mh_moe_experts_backward(
    grad_out: Tensor,
    x: Tensor,
    routes: list[Tensor],
    weights: list[Tensor],
    scales: list[Tensor],
    needs: list[bool],
    top_k_routes: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(x, probs, w_gate, w_up, w_down)`` of :func:`mh_moe_experts` (same ``routes``, ``weights``,
    ``scales``, ``top_k_routes``) for the five ``needs`` (``ctx.needs_input_grad``); one not asked for is an empty
    ``(0,)`` tensor (:mod:`.experts_backward`)."""
    return tuple(experts_backward(grad_out, x, routes, weights, scales, needs, top_k_routes=top_k_routes))


@mh_moe_experts_backward.register_fake
def _mh_moe_experts_backward_fake(grad_out, x, routes, weights, scales, needs, top_k_routes):
    storage = storage_of(weights, scales or None)
    dtypes = [x.dtype, routes[1].dtype] + [storage.grad_dtype()] * 3
    return tuple(grad_like(t, need, dtype) for t, need, dtype in zip((x, routes[1], *weights), needs, dtypes))


def _mh_moe_experts_setup_context(ctx, inputs, output) -> None:
    x, routes, weights, scales = inputs[:4]
    ctx.top_k_routes = inputs[6]
    ctx.save_for_backward(x, *routes, *weights, *scales)


def _mh_moe_experts_backward(ctx, grad_out):
    saved = ctx.saved_tensors  # read once: under gradient checkpointing each saved tensor unpacks only once
    x, *routes = saved[:4]
    weights, scales = saved[4:7], saved[7:]
    needs_x, needs_routes, needs_weights = ctx.needs_input_grad[:3]
    needs = [needs_x, needs_routes[1], *needs_weights]  # the token ids and offsets are integers
    grad_x, grad_probs, *grad_w = mh_moe_experts_backward(
        grad_out, x, routes, weights, scales, needs, ctx.top_k_routes
    )
    return (
        grad_x if needs_x else None,
        [None, grad_probs if needs[1] else None, None],
        [grad if needed else None for grad, needed in zip(grad_w, needs_weights)],
        [None] * len(scales),  # frozen FP8 / int4 scales
        None,
        None,
        None,
    )


mh_moe_experts.register_autograd(_mh_moe_experts_backward, setup_context=_mh_moe_experts_setup_context)
