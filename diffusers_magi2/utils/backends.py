"""Kernel backend selection: one policy for every kernel switch of the package.

Each switch has a set of concrete backends and ``"auto"``. The policy, for all of them:

1. A name is checked when it is set (:func:`check_backend`): an unknown name is a ``ValueError`` listing the
   allowed ones.
2. ``"auto"`` is resolved per call from the tensors the kernel receives (:func:`resolve_backend`), never from
   the environment.
3. A concrete name is never replaced: if that kernel cannot run, it raises (no silent fallback).

=================  ===========================  =====================================================================
switch             backends                     ``"auto"`` resolves to
=================  ===========================  =====================================================================
``moe_experts``    ``torch``, ``triton``,       ``triton`` for CUDA tensors (bf16, FP8 and int4 experts); otherwise
                   ``torch_grouped``            ``torch_grouped`` when the caller must not synchronise with the host
                                                (``sync_free``: context parallelism), else ``torch``
``mhc``            ``fused``, ``torch``         ``fused`` for CUDA tensors without autograd, ``torch`` otherwise
``window_attn``    ``sdpa``, ``flex``,          ``flex`` for CUDA tensors; otherwise ``sdpa`` when the dense mask
                   ``gather``                   (``num_tokens**2``) has at most ``max_dense_elements`` entries, else
                                                ``gather``
=================  ===========================  =====================================================================

Where each switch is set: ``moe_experts`` by ``Magi2Transformer3DModel.set_moe_backend`` (or
``Magi2MultiHeadMoE.set_backend``), ``mhc`` by ``Magi2Transformer3DModel.set_mhc_backend``, ``window_attn`` by
``Magi2WindowAttnProcessor(backend=...)`` through ``set_attn_processor``.
"""

from __future__ import annotations

from typing import Callable

import torch


__all__ = ["BACKEND_CHOICES", "check_backend", "resolve_backend"]


def _moe_experts_auto(device: torch.device, *, sync_free: bool = False, **_: object) -> str:
    if device.type == "cuda":
        return "triton"
    return "torch_grouped" if sync_free else "torch"


def _mhc_auto(device: torch.device, *, grad_enabled: bool = False, **_: object) -> str:
    return "fused" if device.type == "cuda" and not grad_enabled else "torch"


def _window_attn_auto(device: torch.device, *, num_tokens: int, max_dense_elements: int, **_: object) -> str:
    if device.type == "cuda":
        return "flex"
    return "sdpa" if num_tokens * num_tokens <= max_dense_elements else "gather"


_AUTO: dict[str, Callable[..., str]] = {
    "moe_experts": _moe_experts_auto,
    "mhc": _mhc_auto,
    "window_attn": _window_attn_auto,
}

#: Concrete backends of each switch (``"auto"`` is allowed everywhere in addition).
BACKEND_CHOICES: dict[str, tuple[str, ...]] = {
    "moe_experts": ("torch", "torch_grouped", "triton"),
    "mhc": ("fused", "torch"),
    "window_attn": ("sdpa", "flex", "gather"),
}


def check_backend(switch: str, backend: object) -> str:
    """Validate a backend name for ``switch`` and return it.

    Args:
        switch: one of :data:`BACKEND_CHOICES` (``"moe_experts"``, ``"mhc"``, ``"window_attn"``).
        backend: ``"auto"`` or one of ``BACKEND_CHOICES[switch]``.

    Raises:
        ValueError: unknown ``switch``, or ``backend`` not allowed for it (the message lists the allowed names).
    """
    if switch not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend switch {switch!r}; allowed: {sorted(BACKEND_CHOICES)}")
    allowed = ("auto", *BACKEND_CHOICES[switch])
    if not isinstance(backend, str) or backend not in allowed:
        raise ValueError(f"{switch} backend must be one of {allowed}; got {backend!r}")
    return backend


def resolve_backend(switch: str, backend: str, device: torch.device | str, **conditions: object) -> str:
    """The concrete backend to run: ``backend`` itself, or what ``"auto"`` stands for (see the module table).

    Args:
        switch: the kernel switch (see :func:`check_backend`).
        backend: ``"auto"`` or a concrete name; a concrete name is returned unchanged.
        device: device of the tensors the kernel receives.
        conditions: what the switch's ``"auto"`` rule reads besides the device: ``sync_free`` (``moe_experts``),
            ``grad_enabled`` (``mhc``), ``num_tokens`` and ``max_dense_elements`` (``window_attn``).

    Raises:
        ValueError: as :func:`check_backend`.
    """
    check_backend(switch, backend)
    if backend != "auto":
        return backend
    return _AUTO[switch](torch.device(device), **conditions)
