"""Torch twin of the fused multi-head expert kernel: the CPU backend and the oracle for ``experts_triton.py``.

The computation follows SandAI's ``_mh_moe_fwd_kernel`` (``inference/flash_mh_moe/triton/mh_moe_fwd.py``,
commit ``f68a0f9``) with its rounding points, see ``magi2_reference_spec.md`` §1.11 and §3.4:

* gate/up GEMMs: inputs in the activation/weight dtype, fp32 accumulation (no rounding of gate/up);
* swiglu7 in fp32, the result rounded to the ``W_down`` dtype;
* down GEMM with fp32 accumulation, times the (already ``route_scale``-d) fp32 route weight;
* rounded to the activation dtype and summed per (token, head) in the activation dtype, in ascending global
  expert id order (the reference's deterministic scatter order).
"""

from __future__ import annotations

import torch

__all__ = ["swiglu7_pair", "torch_mh_moe_forward"]

SWIGLU7_LIMIT = 7.0
SWIGLU7_ALPHA = 1.702

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 0-dim CPU fp32 constants for the in-place swiglu7 of the no-grad path (usable with tensors on any device, as Python scalars are).
_ALPHA_FP32 = torch.tensor(SWIGLU7_ALPHA, dtype=torch.float32)
_ONE_FP32 = torch.tensor(1.0, dtype=torch.float32)


def swiglu7_pair(gate: torch.Tensor, up: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """MAGI-2's clamped SwiGLU on separate gate and linear ("up") tensors.

    ``g = min(gate, 7)``, ``u = clamp(up, -7, 7)``, ``out = g * sigmoid(1.702 * g) * (u + 1)``, computed in fp32.
    The gate is clamped from above only, and the ``+ 1`` on the linear half is part of the model (gpt-oss style),
    not a bug. Matches SandAI reference ``swiglu7`` / ``_swiglu7_fwd`` (spec §1.8, §3.4).

    Args:
        gate: gate (glu) half, any float dtype, any shape.
        up: linear half, same shape as ``gate``.
        out_dtype: dtype of the result; default: the promoted dtype of ``gate`` and ``up`` (as the reference,
            which returns the input dtype).

    Returns:
        Tensor of ``gate``'s shape, rounded once from fp32 to ``out_dtype``.

    Raises:
        ValueError: shapes differ or an input is not floating point.
    """
    if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)):
        raise ValueError("gate and up must be tensors")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    if not (gate.is_floating_point() and up.is_floating_point()):
        raise ValueError(f"gate and up must be floating point; got {gate.dtype} and {up.dtype}")
    if out_dtype is None:
        out_dtype = torch.promote_types(gate.dtype, up.dtype)
    g = gate.to(torch.float32).clamp(max=SWIGLU7_LIMIT)
    u = up.to(torch.float32).clamp(min=-SWIGLU7_LIMIT, max=SWIGLU7_LIMIT)
    out = g * torch.sigmoid(SWIGLU7_ALPHA * g) * (u + 1.0)
    return out.to(out_dtype)


def check_expert_inputs(
    x: torch.Tensor,
    gather_ids: torch.Tensor,
    probs: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """Validate the arguments shared by the torch and Triton expert paths (no host synchronisation).

    Returns:
        ``(S, H, Dh, E, De)``.

    Raises:
        ValueError: naming the offending argument and what is allowed.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a 3-D tensor [S, H, Dh]; got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x dtype must be one of {_ACT_DTYPES}; got {x.dtype}")
    num_tokens, num_heads, head_dim = x.shape
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor; got {tuple(getattr(w, 'shape', ()))}")
        if w.dtype not in _ACT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {_ACT_DTYPES}; got {w.dtype}")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    if w_up.shape != w_gate.shape or w_up.dtype != w_gate.dtype:
        raise ValueError(
            f"w_up must match w_gate [H*E, Dh, De] in shape and dtype; got {tuple(w_up.shape)} {w_up.dtype} vs "
            f"{tuple(w_gate.shape)} {w_gate.dtype}"
        )
    flat_experts, w_head_dim, expert_dim = w_gate.shape
    if w_head_dim != head_dim:
        raise ValueError(f"w_gate must be [H*E, Dh={head_dim}, De]; got {tuple(w_gate.shape)}")
    if num_heads < 1 or flat_experts % num_heads != 0 or flat_experts == 0:
        raise ValueError(
            f"w_gate.shape[0] = {flat_experts} must be a positive multiple of the number of heads H = {num_heads}"
        )
    if w_down.shape != (flat_experts, expert_dim, head_dim) or w_down.dtype != w_gate.dtype:
        raise ValueError(
            f"w_down must be [H*E={flat_experts}, De={expert_dim}, Dh={head_dim}] with dtype {w_gate.dtype}; "
            f"got {tuple(w_down.shape)} {w_down.dtype}"
        )
    if not isinstance(gather_ids, torch.Tensor) or gather_ids.dim() != 1 or gather_ids.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError("gather_ids must be a 1-D int32/int64 tensor [T]")
    if not isinstance(probs, torch.Tensor) or probs.shape != gather_ids.shape or not probs.is_floating_point():
        raise ValueError(f"probs must be a 1-D float tensor with the same length as gather_ids ({gather_ids.numel()})")
    if (
        not isinstance(expert_offsets, torch.Tensor)
        or expert_offsets.dim() != 1
        or expert_offsets.numel() != flat_experts + 1
        or expert_offsets.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"expert_offsets must be a 1-D int32/int64 tensor of length H*E+1 = {flat_experts + 1}")
    for name, t in (("gather_ids", gather_ids), ("probs", probs), ("expert_offsets", expert_offsets)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return num_tokens, num_heads, head_dim, flat_experts // num_heads, expert_dim


def torch_mh_moe_forward(
    x: torch.Tensor,
    gather_ids: torch.Tensor,
    probs: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Routed-expert compute of MAGI-2's multi-head MoE in plain torch (one loop over the flat expert bank).

    For every route ``r`` of global expert ``g = h*E + e`` (rows ``expert_offsets[g]:expert_offsets[g+1]``), token
    ``s = gather_ids[r]`` and weight ``p = probs[r]``:
    ``y[s, h] += cast_act(p * (cast_w(swiglu7(x[s,h] @ W_gate[g], x[s,h] @ W_up[g])) @ W_down[g]))``
    with fp32 GEMM accumulation, summed in the activation dtype in ascending ``g``. Equals SandAI's
    ``_mh_moe_fwd_kernel`` with its deterministic scatter (spec §3.4; fixtures README, "flash_mh_moe Triton
    forward"). bf16 weights are upcast per expert slice (exact), so gate/up are *not* rounded to bf16.

    Two code paths compute the same bits: without autograd (``torch.no_grad()`` or no input requiring grad) every
    temporary lives in a few reused buffers and swiglu7 runs in place; with autograd the same operations run
    out of place so that backward works. Both reduce a head's route rows per token with
    :func:`_sum_head_routes_` (ascending expert id, rounded to the activation dtype after every add).

    Args:
        x: ``[S, H, Dh]`` activations, fp32/bf16/fp16.
        gather_ids: ``[T]`` int32/int64 token index per route, CSR (expert-major) order.
        probs: ``[T]`` float route weights in the same order (``route_scale`` already applied).
        expert_offsets: ``[H*E + 1]`` int CSR offsets.
        w_gate: ``[H*E, Dh, De]``; used as ``x @ W``.
        w_up: ``[H*E, Dh, De]``.
        w_down: ``[H*E, De, Dh]``.

    Returns:
        ``[S, H, Dh]`` in ``x.dtype``; heads/tokens without routes are zero.

    Raises:
        ValueError: bad shapes, dtypes or devices (see ``check_expert_inputs``), or offsets that do not end at
            ``T`` or decrease.
    """
    num_tokens, num_heads, head_dim, num_experts, _ = check_expert_inputs(
        x, gather_ids, probs, expert_offsets, w_gate, w_up, w_down
    )
    offsets = expert_offsets.tolist()  # one host sync; this is the CPU/oracle path
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
    track_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, probs, w_gate, w_up, w_down))
    run = _forward_autograd if track_grad else _forward_inference
    return run(x, token_ids, route_probs, offsets, head_counts, w_gate, w_up, w_down)


def _forward_inference(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    route_probs: torch.Tensor,
    offsets: list[int],
    head_counts: list[list[int]],
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """:func:`torch_mh_moe_forward` without autograd: reused buffers, ``out=`` GEMMs, in-place swiglu7.

    Per head: one gather of its routed rows (upcast once to fp32), then per expert the gate/up GEMMs and swiglu7 in
    two small buffers that stay cache-resident (:func:`_expert_swiglu7_into_`), the down GEMM straight into its
    rows of the head's fp32 block, scaled there by the route weights; the block is rounded to the activation dtype
    and reduced per token (:func:`_sum_head_routes_`). No allocation depends on the number of experts.
    """
    num_tokens, num_heads, head_dim = x.shape
    num_experts, expert_dim = len(head_counts[0]), w_gate.shape[2]
    f32 = torch.float32
    upcast_weights = w_gate.dtype != f32
    round_hidden = w_down.dtype != f32
    max_block = max(sum(c) for c in head_counts)
    max_rows = max(max(c) for c in head_counts)
    x_rows = torch.empty(max_block, head_dim, dtype=f32, device=x.device)  # gathered rows of one head, fp32
    scratch_buf, hidden_buf = torch.empty(2, max_rows, expert_dim, dtype=f32, device=x.device).unbind(0)
    expert_temps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    down_rows = torch.empty(max_block, head_dim, dtype=f32, device=x.device)  # one head's route rows, CSR order
    head_sum = torch.empty(num_tokens, head_dim, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # Per-expert weight views once (tuple indexing in the loop costs no torch dispatch).
    w_gate_rows, w_up_rows, w_down_rows = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)
    for head, counts in enumerate(head_counts):
        base = offsets[head * num_experts]
        block = sum(counts)
        if block == 0:
            out[:, head].zero_()
            continue
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
            if temps is None:  # views of the two expert buffers, sliced once per distinct expert size
                temps = expert_temps[rows] = (scratch_buf[:rows], hidden_buf[:rows])
            g = head * num_experts + e
            wg, wu, wd = w_gate_rows[g], w_up_rows[g], w_down_rows[g]
            if upcast_weights:  # per-expert upcast (exact); the bank itself is never copied
                wg, wu, wd = wg.float(), wu.float(), wd.float()
            # gate/up with fp32 accumulation, swiglu7 in fp32, rounded to the W_down dtype, down in fp32, x prob
            # (while the rows are still in cache)
            hidden = _expert_swiglu7_into_(x_parts[e], wg, wu, *temps)
            if round_hidden:
                hidden = hidden.to(w_down.dtype).float()
            torch.mm(hidden, wd, out=down_parts[e]).mul_(prob_parts[e])
        contrib = down_rows[:block].to(x.dtype)  # rounded to the activation dtype (no-op in fp32)
        _sum_head_routes_(head_sum, contrib, tokens)
        out[:, head].copy_(head_sum)
    return out


def _forward_autograd(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    route_probs: torch.Tensor,
    offsets: list[int],
    head_counts: list[list[int]],
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """:func:`torch_mh_moe_forward` under autograd: the operations of :func:`_forward_inference`, out of place."""
    num_tokens, num_heads, head_dim = x.shape
    num_experts = len(head_counts[0])
    upcast_weights = w_gate.dtype != torch.float32
    round_hidden = w_down.dtype != torch.float32
    heads = []
    for head, counts in enumerate(head_counts):
        base = offsets[head * num_experts]
        block = sum(counts)
        head_out = x.new_zeros(num_tokens, head_dim)
        if block:
            tokens = token_ids[base : base + block]
            x_parts = x[:, head].index_select(0, tokens).float().split(counts)
            parts = []
            for e, rows in enumerate(counts):
                if rows == 0:
                    continue
                g = head * num_experts + e
                wg, wu, wd = w_gate[g], w_up[g], w_down[g]
                if upcast_weights:
                    wg, wu, wd = wg.float(), wu.float(), wd.float()
                hidden = swiglu7_pair(torch.mm(x_parts[e], wg), torch.mm(x_parts[e], wu))
                if round_hidden:
                    hidden = hidden.to(w_down.dtype).float()
                parts.append(torch.mm(hidden, wd))
            contrib = (torch.cat(parts) * route_probs[base : base + block]).to(x.dtype)
            _sum_head_routes_(head_out, contrib, tokens)  # in place on a fresh tensor: autograd records it
        heads.append(head_out)
    return torch.stack(heads, dim=1)


def _expert_swiglu7_into_(
    xs: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, scratch: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``swiglu7_pair(xs @ wg, xs @ wu)`` for one expert's fp32 rows, written to ``out``, bit-identical.

    ``xs [n, Dh]``, ``wg``/``wu [Dh, De]`` fp32; ``scratch`` and ``out`` are ``[n, De]`` fp32 buffers (``scratch``
    is clobbered). The operations and their order per element are those of :func:`swiglu7_pair`: ``g = min(gate,
    7)``, ``sigmoid(1.702 * g) * g``, then times ``clamp(up, -7, 7) + 1`` (fp32 multiplication commutes exactly).
    Only the schedule differs: the gate half is finished before the up GEMM, so the up GEMM reuses the gate's
    buffer and one expert needs two ``[n, De]`` buffers instead of three (they stay in cache; measured ~7% faster
    on the CPU benchmark shape). The constants are fp32 0-dim tensors (the same fp32 values a Python float becomes),
    which spares the per-call wrapping of a Python scalar.
    """
    gate = torch.mm(xs, wg, out=scratch).clamp_(max=SWIGLU7_LIMIT)
    hidden = torch.mul(gate, _ALPHA_FP32, out=out).sigmoid_().mul_(gate)
    up = torch.mm(xs, wu, out=scratch)  # the gate values are no longer needed
    return hidden.mul_(up.clamp_(min=-SWIGLU7_LIMIT, max=SWIGLU7_LIMIT).add_(_ONE_FP32))


def _sum_head_routes_(out_head: torch.Tensor, contrib: torch.Tensor, tokens: torch.Tensor) -> None:
    """Overwrite ``out_head [S, Dh]`` with the per-token sums of one head's CSR-ordered route rows.

    Sums run in ``contrib.dtype`` (the activation dtype), rounded after every add, per token in ascending expert id,
    as the reference's sequential scatter:

    * fp32 on CPU: one ``index_add_`` into the zeroed rows. On CPU it adds each output row's source rows one at a
      time in index (CSR) order, with any thread count, and within a token the CSR order is ascending expert id;
      fp32 is its accumulation type, so every add rounds to fp32. (On CUDA ``index_add_`` uses atomics, whose order
      is not fixed, so CUDA tensors take the next path.)
    * otherwise (bf16/fp16, whose CPU ``index_add_`` accumulates in fp32 and rounds once, or CUDA): the rows are
      laid out per token (stable sort by token) and added column by column: with top-k routing every token owns
      exactly ``k`` routes of the head and ``k - 1`` adds reduce them. Any other CSR falls back to ``index_add_``.

    ``out_head`` may be a fresh tensor under autograd (the in-place ops are recorded).
    """
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
