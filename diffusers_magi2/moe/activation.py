"""swiglu7, MAGI-2's clamped SwiGLU: the one definition used by the experts, the dense MLPs and (through its
constants) the Triton kernel.

With ``g = min(gate, 7)`` and ``u = clamp(up, -7, 7)``:

    swiglu7(gate, up) = g * sigmoid(1.702 * g) * (u + 1),

in fp32; the gate is clamped from above only and the ``+ 1`` is part of the model (SandAI ``swiglu7``, ``_swiglu7_fwd``).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from ..utils.elementwise import sigmoid, sigmoid_


__all__ = ["SWIGLU7_ALPHA", "SWIGLU7_LIMIT", "swiglu7", "swiglu7_backward", "swiglu7_interleaved", "swiglu7_pair"]

SWIGLU7_LIMIT = 7.0
SWIGLU7_ALPHA = 1.702

_ALPHA_FP32 = torch.tensor(SWIGLU7_ALPHA, dtype=torch.float32)
_ONE_FP32 = torch.tensor(1.0, dtype=torch.float32)


def swiglu7(
    gate: torch.Tensor,
    up: Union[torch.Tensor, Callable[[], torch.Tensor]],
    *,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """swiglu7 on separate gate and linear ("up") halves.

    Args:
        gate: gate half, any float dtype and shape.
        up: linear half of ``gate``'s shape; with ``out=`` also a callable returning it once ``gate`` is consumed.
        out_dtype: dtype of the result; default: the promoted dtype of ``gate`` and ``up``.
        out: fp32 buffer for the in-place form (no autograd; fp32 ``gate``/``up`` used as scratch; same bits).

    Returns:
        ``gate``'s shape, rounded once from fp32 to ``out_dtype`` (``out`` itself with ``out=``).

    Raises:
        ValueError: shapes differ, an input is not floating point, or ``out=`` with non-fp32 tensors or a
            non-fp32 ``out_dtype``.
    """
    if out is not None:
        if gate.dtype != torch.float32 or out.dtype != torch.float32 or out_dtype not in (None, torch.float32):
            raise ValueError("swiglu7(out=...) computes in place on fp32 gate, up and out")
        g = gate.clamp_(max=SWIGLU7_LIMIT)
        hidden = sigmoid_(torch.mul(g, _ALPHA_FP32, out=out)).mul_(g)
        up = up() if callable(up) else up
        if up.dtype != torch.float32 or up.shape != hidden.shape:
            raise ValueError("swiglu7(out=...) computes in place on fp32 gate, up and out of one shape")
        return hidden.mul_(up.clamp_(min=-SWIGLU7_LIMIT, max=SWIGLU7_LIMIT).add_(_ONE_FP32))
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
    return (g * sigmoid(SWIGLU7_ALPHA * g) * (u + 1.0)).to(out_dtype)


def swiglu7_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu7` of separate gate and up halves, evaluated in fp32 and returned in ``gate``'s dtype (the
    vLLM-Omni ``mh_moe`` form).

    Raises:
        ValueError: as :func:`swiglu7`.
    """
    return swiglu7(gate, up, out_dtype=gate.dtype if isinstance(gate, torch.Tensor) else None)


def swiglu7_interleaved(x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`swiglu7` on ``[..., 2I]`` with gate/linear columns interleaved (SandAI's layout) -> ``[..., I]``.

    Raises:
        ValueError: the last dim is odd.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu7_interleaved needs an even last dim, got {x.shape[-1]}")
    return swiglu7(x[..., 0::2], x[..., 1::2], out_dtype=x.dtype if out_dtype is None else out_dtype)


def swiglu7_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(d gate, d up)`` of :func:`swiglu7` for the output gradient ``grad``, in fp32.

    With ``s = sigmoid(1.702 g)``: ``d/dg [g s] = s (1 + 1.702 g (1 - s))``; each clamp passes the gradient where
    its input lies inside the clamp range (boundaries included, as torch's ``clamp``).
    """
    gate, up, grad = gate.to(torch.float32), up.to(torch.float32), grad.to(torch.float32)
    g = gate.clamp(max=SWIGLU7_LIMIT)
    u = up.clamp(min=-SWIGLU7_LIMIT, max=SWIGLU7_LIMIT)
    s = torch.sigmoid(SWIGLU7_ALPHA * g)
    d_gate = grad * (u + 1.0) * s * (1.0 + SWIGLU7_ALPHA * g * (1.0 - s)) * (gate <= SWIGLU7_LIMIT)
    d_up = grad * g * s * ((up >= -SWIGLU7_LIMIT) & (up <= SWIGLU7_LIMIT))
    return d_gate, d_up
