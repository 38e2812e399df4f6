"""Argument checks shared by the routed-expert paths (the torch paths of :mod:`.experts` and the Triton kernel of
:mod:`.experts_triton`), in a module of their own so that neither path imports the other for them."""

from __future__ import annotations

import torch
from torch import Tensor

from .expert_formats import check_weight_dtype, storage_of
from .expert_storage import SCALE_ARGS as _SCALE_NAMES


__all__ = ["check_expert_inputs", "check_expert_tensors", "top_k_layout_poison"]

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUTE_NAMES = ("gather_ids", "probs", "expert_offsets")
_WEIGHT_NAMES = ("w_gate", "w_up", "w_down")


def check_expert_tensors(x, routes, weights, scales=None) -> None:
    """``x``, the three ``routes`` (``gather_ids, probs, expert_offsets``), the three ``weights`` (``w_gate, w_up,
    w_down``) and, unless ``None``, the three ``scales`` are tensors (the tensor lists the expert op takes).

    Raises:
        ValueError: naming the argument that is not a tensor, or ``scales`` that are not three tensors.
    """
    if not isinstance(x, Tensor):
        raise ValueError(f"x must be a tensor [S, H, Dh]; got {type(x).__name__}")
    if scales is not None and (not isinstance(scales, (tuple, list)) or len(scales) != 3):
        got = f"{len(scales)} items" if isinstance(scales, (tuple, list)) else type(scales).__name__
        raise ValueError(f"scales must be None or three tensors ({', '.join(_SCALE_NAMES)}); got {got}")
    for names, group in ((_ROUTE_NAMES, routes), (_WEIGHT_NAMES, weights), (_SCALE_NAMES, scales or ())):
        for name, t in zip(names, group):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a tensor; got {type(t).__name__}")


def check_expert_inputs(x, routes, weights, scales=None) -> tuple[int, int, int, int, int]:
    """Validate the arguments shared by the expert paths, without host sync: ``x``, the three ``routes`` and
    ``weights`` (:func:`check_expert_tensors`) and, for quantized experts only (else ``None``), their three
    ``scales``; the banks' own shapes and scales are checked by their storage (:mod:`.expert_formats`).

    Returns:
        ``(S, H, Dh, E, De)``.

    Raises:
        ValueError: naming the offending argument and what is allowed.
    """
    check_expert_tensors(x, routes, weights, scales)
    (gather_ids, probs, expert_offsets), (w_gate, w_up, w_down) = routes, weights
    if x.dim() != 3:
        raise ValueError(f"x must be a 3-D tensor [S, H, Dh]; got {tuple(x.shape)}")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x dtype must be one of {_ACT_DTYPES}; got {x.dtype}")
    num_tokens, num_heads, head_dim = x.shape
    for name, w in zip(_WEIGHT_NAMES, (w_gate, w_up, w_down)):
        if w.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor; got {tuple(w.shape)}")
        check_weight_dtype(name, w)
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    if w_up.shape != w_gate.shape or w_up.dtype != w_gate.dtype:
        raise ValueError(
            f"w_up must match w_gate [H*E, Dh, De] in shape and dtype; got {tuple(w_up.shape)} {w_up.dtype} vs "
            f"{tuple(w_gate.shape)} {w_gate.dtype}"
        )
    storage = storage_of(weights, scales)
    flat_experts, w_head_dim, _ = w_gate.shape
    if w_head_dim != head_dim:
        raise ValueError(f"w_gate must be [H*E, Dh={head_dim}, De]; got {tuple(w_gate.shape)} ({storage} experts)")
    if num_heads < 1 or flat_experts % num_heads != 0 or flat_experts == 0:
        raise ValueError(
            f"w_gate.shape[0] = {flat_experts} must be a positive multiple of the number of heads H = {num_heads}"
        )
    expert_dim = storage.check_kernel_banks(weights, scales, head_dim)
    if gather_ids.dim() != 1 or gather_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("gather_ids must be a 1-D int32/int64 tensor [T]")
    if probs.shape != gather_ids.shape or not probs.is_floating_point():
        raise ValueError(f"probs must be a 1-D float tensor with the same length as gather_ids ({gather_ids.numel()})")
    if (
        expert_offsets.dim() != 1
        or expert_offsets.numel() != flat_experts + 1
        or expert_offsets.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"expert_offsets must be a 1-D int32/int64 tensor of length H*E+1 = {flat_experts + 1}")
    for name, t in zip(_ROUTE_NAMES, (gather_ids, probs, expert_offsets)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return num_tokens, num_heads, head_dim, flat_experts // num_heads, expert_dim


def top_k_layout_poison(expert_offsets: Tensor, num_experts: int, per_head: int) -> Tensor:
    """0-dim fp32, NaN unless head ``h``'s routes start at ``h * per_head`` (the top-k CSR layout of
    :func:`~diffusers_magi2.moe.routing.global_sort_routes`, which the per-head paths assume), else 0; added to a
    result, it makes one computed on another layout NaN instead of silently wrong, with no host read."""
    heads = expert_offsets[::num_experts].to(torch.int64)  # [H + 1] head bounds
    expected = torch.arange(heads.numel(), device=heads.device) * per_head
    return torch.where((heads != expected).any(), float("nan"), 0.0).to(torch.float32)
