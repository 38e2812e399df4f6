"""Loop-over-experts reference of the routed-expert compute: the oracle of the torch and Triton paths.

For every route ``r`` of global expert ``g = h*E + e`` (rows ``expert_offsets[g]:expert_offsets[g+1]``), with token
``s = gather_ids[r]`` and weight ``p = probs[r]``:

    y[s, h] += cast_act(p * (cast_w(swiglu7(x[s,h] @ W_gate[g], x[s,h] @ W_up[g])) @ W_down[g]))

GEMMs accumulate in fp32; ``cast_w`` rounds to the ``W_down`` dtype (to the activation dtype for FP8 and int4
experts, whose weights are their dequantized values in fp32: the storage's
:meth:`~diffusers_magi2.moe.expert_storage.ExpertStorage.hidden_dtype`), ``cast_act``
to the activation dtype, and the sum runs in the activation dtype in ascending ``g`` (SandAI ``_mh_moe_fwd_kernel``
with its deterministic scatter). Written for clarity, not speed; differentiable.
"""

from __future__ import annotations

import torch

from .activation import swiglu7
from .expert_formats import storage_of


__all__ = ["expert_route_blocks", "reference_mh_moe_forward"]


def expert_route_blocks(x, gather_ids, expert_offsets, num_flat: int):
    """Yield ``(g, head, routes, tokens, rows)`` for every non-empty expert ``g`` in ascending order: its route
    slice, token ids and fp32 input rows ``x[tokens, head]``."""
    num_experts = num_flat // x.shape[1]
    offsets = expert_offsets.tolist()
    for g in range(num_flat):
        if offsets[g] == offsets[g + 1]:
            continue
        head = g // num_experts
        routes = slice(offsets[g], offsets[g + 1])
        tokens = gather_ids[routes].long()
        yield g, head, routes, tokens, x[tokens, head].float()


def reference_mh_moe_forward(
    x, gather_ids, probs, expert_offsets, w_gate, w_up, w_down, *, scales=None
) -> torch.Tensor:
    """The formula of the module docstring; arguments and result as
    :func:`diffusers_magi2.moe.experts.torch_mh_moe_forward` (no input checks)."""
    weights = (w_gate, w_up, w_down)
    storage = storage_of(weights, scales)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    scales = (None, None, None) if scales is None else scales
    for g, head, span, tokens, rows in expert_route_blocks(x, gather_ids, expert_offsets, w_down.shape[0]):
        wg, wu, wd = (storage.dequantize(w[g], None if s is None else s[g]) for w, s in zip(weights, scales))
        hidden = swiglu7(rows @ wg, rows @ wu).to(storage.hidden_dtype(x.dtype))
        down = (hidden.float() @ wd) * probs[span, None].float()
        out[tokens, head] = out[tokens, head] + down.to(x.dtype)
    return out
