"""Argument checks shared by the routed-expert paths (the torch paths of :mod:`.experts` and the Triton kernel of
:mod:`.experts_triton`), in a module of their own so that neither path imports the other for them."""

from __future__ import annotations

import torch
from torch import Tensor

from .quantize import FP8_DTYPE
from .quantize_int4 import INT4_PACKED_DTYPE


__all__ = ["check_expert_inputs", "check_expert_tensors", "top_k_layout_poison"]

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = _ACT_DTYPES + (FP8_DTYPE, INT4_PACKED_DTYPE)
_ROUTE_NAMES = ("gather_ids", "probs", "expert_offsets")
_WEIGHT_NAMES = ("w_gate", "w_up", "w_down")
_SCALE_NAMES = ("w_gate_scale", "w_up_scale", "w_down_scale")


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


def _check_scales(w_gate: Tensor, scales, head_dim: int, expert_dim: int) -> None:
    """FP8 weights need their three fp32 scales (``[H*E, De]``, ``[H*E, De]``, ``[H*E, Dh]``), int4 weights their
    three bf16/fp16 group scales (``[H*E, Dh/G, De]``, ``[H*E, Dh/G, De]``, ``[H*E, De/G, Dh]``); others none."""
    flat = w_gate.shape[0]
    if w_gate.dtype not in (FP8_DTYPE, INT4_PACKED_DTYPE):
        if scales is not None:
            raise ValueError(
                f"scales are only used with {FP8_DTYPE} or int4 ({INT4_PACKED_DTYPE} codes) experts; the weights "
                f"are {w_gate.dtype}"
            )
        return
    kind = "int4" if w_gate.dtype == INT4_PACKED_DTYPE else str(FP8_DTYPE)
    if scales is None:
        raise ValueError(f"{kind} experts need scales=(w_gate_scale, w_up_scale, w_down_scale)")
    if w_gate.dtype == FP8_DTYPE:
        shapes, dtypes = ((flat, expert_dim), (flat, expert_dim), (flat, head_dim)), (torch.float32,)
    else:
        groups = scales[0].shape[1] if scales[0].dim() == 3 else 0
        group = head_dim // groups if groups and head_dim % groups == 0 else 0
        if not group or expert_dim % group:
            raise ValueError(
                f"w_gate_scale must be [H*E={flat}, Dh/G, De={expert_dim}] with a group size G dividing Dh={head_dim} "
                f"and De={expert_dim}; got {tuple(scales[0].shape)}"
            )
        shapes = ((flat, head_dim // group, expert_dim),) * 2 + ((flat, expert_dim // group, head_dim),)
        dtypes = (torch.bfloat16, torch.float16)
    for name, scale, shape in zip(_SCALE_NAMES, scales, shapes):
        if tuple(scale.shape) != shape or scale.dtype not in dtypes:
            allowed = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"{name} must be a {allowed} tensor of shape {list(shape)}; got {scale.dtype} {tuple(scale.shape)}"
            )
        if scale.device != w_gate.device:
            raise ValueError(f"{name} is on {scale.device} but the weights are on {w_gate.device}")


def check_expert_inputs(x, routes, weights, scales=None) -> tuple[int, int, int, int, int]:
    """Validate the arguments shared by the expert paths, without host sync: ``x``, the three ``routes`` and
    ``weights`` (:func:`check_expert_tensors`) and, for FP8 or int4 experts only (else ``None``), their three
    ``scales``.

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
        if w.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {_WEIGHT_DTYPES}; got {w.dtype}")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    if w_up.shape != w_gate.shape or w_up.dtype != w_gate.dtype:
        raise ValueError(
            f"w_up must match w_gate [H*E, Dh, De] in shape and dtype; got {tuple(w_up.shape)} {w_up.dtype} vs "
            f"{tuple(w_gate.shape)} {w_gate.dtype}"
        )
    packed = w_gate.dtype == INT4_PACKED_DTYPE  # int4 codes, two per byte along the last dim
    half = "/2" if packed else ""
    flat_experts, w_head_dim, gate_cols = w_gate.shape
    expert_dim = 2 * gate_cols if packed else gate_cols
    if w_head_dim != head_dim:
        raise ValueError(f"w_gate must be [H*E, Dh={head_dim}, De{half}]; got {tuple(w_gate.shape)}")
    if num_heads < 1 or flat_experts % num_heads != 0 or flat_experts == 0:
        raise ValueError(
            f"w_gate.shape[0] = {flat_experts} must be a positive multiple of the number of heads H = {num_heads}"
        )
    down_cols = head_dim // 2 if packed else head_dim
    if (
        (packed and head_dim % 2)
        or w_down.shape != (flat_experts, expert_dim, down_cols)
        or w_down.dtype != w_gate.dtype
    ):
        raise ValueError(
            f"w_down must be [H*E={flat_experts}, De={expert_dim}, Dh{half}={head_dim}{half}] with dtype "
            f"{w_gate.dtype}; got {tuple(w_down.shape)} {w_down.dtype}"
        )
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
    _check_scales(w_gate, scales, head_dim, expert_dim)
    return num_tokens, num_heads, head_dim, flat_experts // num_heads, expert_dim


def top_k_layout_poison(expert_offsets: Tensor, num_experts: int, per_head: int) -> Tensor:
    """0-dim fp32, NaN unless head ``h``'s routes start at ``h * per_head`` (the top-k CSR layout of
    :func:`~diffusers_magi2.moe.routing.global_sort_routes`, which the per-head paths assume), else 0; added to a
    result, it makes one computed on another layout NaN instead of silently wrong, with no host read."""
    heads = expert_offsets[::num_experts].to(torch.int64)  # [H + 1] head bounds
    expected = torch.arange(heads.numel(), device=heads.device) * per_head
    return torch.where((heads != expected).any(), float("nan"), 0.0).to(torch.float32)
