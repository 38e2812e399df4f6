"""Per-modality building blocks of both MAGI-2 models (SandAI ``magi2_preview.py``: ``Modality``,
``ModalityDispatcher``, ``MultiModalityRMSNorm``, ``CustomGroupedLinear``).

A grouped weight holds one block per modality, modality-major along dim 0 (block ``m`` of video, audio, text
is rows ``m*out:(m+1)*out``), as in SandAI's checkpoints. Grouped ops take tokens sorted by modality and the
per-modality counts as Python ints (:class:`Magi2ModalityDispatch`); with one modality they ignore the counts.
Single-modality projections are :class:`Magi2Linear` (an ``nn.Linear``, so layerwise casting and PEFT see
them); a projection computes in its weight's dtype during the call (:func:`linear_compute_dtype`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK

from ..moe.activation import SWIGLU7_ALPHA, SWIGLU7_LIMIT, swiglu7_interleaved  # re-exported
from .fp8_storage_magi2 import fp8_storage_compute_dtype


__all__ = [
    "Modality",
    "Magi2ModalityDispatch",
    "Magi2MultiModalityRMSNorm",
    "Magi2ModalityGroupedLinear",
    "Magi2Linear",
    "chunk_group_sizes",
    "linear_compute_dtype",
    "modality_linear",
    "swiglu7_interleaved",
    "SWIGLU7_ALPHA",
    "SWIGLU7_LIMIT",
]


class Modality(IntEnum):
    """Token modality ids of ``modality_mapping`` (SandAI ``Modality``); ``TIME`` is dispatched as ``TEXT``."""

    VIDEO = 0
    AUDIO = 1
    TEXT = 2
    TIME = 3


NUM_MODALITIES = 3


@dataclass
class Magi2ModalityDispatch:
    """Modality-sorted token order of one packed sequence (SandAI ``ModalityDispatcher``).

    Attributes:
        modality_ids: ``[N]`` int64 per-token modality, packed order.
        permutation: stable ``argsort(modality_ids)`` (``x[permutation]`` is sorted), or ``None`` if already sorted.
        inverse_permutation: ``sorted[inverse_permutation] == packed``, or ``None``.
        group_sizes: tokens per modality (Python ints).
        sorted_modality_ids: ``modality_ids[permutation]``.
    """

    modality_ids: torch.Tensor
    permutation: Optional[torch.Tensor]
    inverse_permutation: Optional[torch.Tensor]
    group_sizes: tuple[int, ...]
    sorted_modality_ids: torch.Tensor

    @classmethod
    def from_modality_mapping(
        cls,
        modality_mapping: torch.Tensor,
        num_modalities: int = NUM_MODALITIES,
        group_sizes: Optional[Sequence[int]] = None,
    ) -> "Magi2ModalityDispatch":
        """Build the dispatch from a per-token modality tensor.

        Args:
            modality_mapping: ``[N]`` integer :class:`Modality` values.
            num_modalities: number of weight blocks (3).
            group_sizes: the tokens of each modality, when the caller knows them (the packer's layout): then
                nothing is checked or read back to the host; ``None`` counts them (one host read).

        Raises:
            ValueError: not 1-D, or ids outside ``[0, 3]`` (checked without ``group_sizes`` only).
        """
        ids = modality_mapping.to(torch.int64)
        ids = torch.where(ids == int(Modality.TIME), torch.full_like(ids, int(Modality.TEXT)), ids)
        if group_sizes is None:
            if modality_mapping.dim() != 1:
                raise ValueError(f"modality_mapping must be 1-D [N], got shape {tuple(modality_mapping.shape)}")
            if ids.numel() > 0 and (int(ids.min()) < 0 or int(ids.max()) >= num_modalities):
                raise ValueError(
                    f"modality_mapping holds ids outside [0, {num_modalities - 1}] (TIME=3 is mapped to TEXT)"
                )
            group_sizes = torch.bincount(ids, minlength=num_modalities).tolist()
        permutation = torch.argsort(ids, stable=True)
        inverse = torch.argsort(permutation)
        sorted_ids = ids.index_select(0, permutation)
        return cls(ids, permutation, inverse, tuple(int(c) for c in group_sizes), sorted_ids)

    @classmethod
    def from_sorted_group_sizes(
        cls, group_sizes: Sequence[int], device: Optional[torch.device] = None
    ) -> "Magi2ModalityDispatch":
        """The identity dispatch of a sequence already in modality order."""
        sizes = tuple(int(g) for g in group_sizes)
        ids = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
        return cls(ids, None, None, sizes, ids)

    def token_indices(self, modality: int) -> torch.Tensor:
        """The packed positions of ``modality``'s tokens, ascending (``(modality_ids == modality).nonzero()`` with
        no host read)."""
        start = sum(self.group_sizes[:modality])
        stop = start + self.group_sizes[modality]
        if self.permutation is None:
            return torch.arange(start, stop, device=self.modality_ids.device)
        return self.permutation[start:stop]

    def sort(self, x: torch.Tensor) -> torch.Tensor:
        """Packed order -> modality-sorted order along dim 0."""
        return x if self.permutation is None else x.index_select(0, self.permutation)

    def unsort(self, x: torch.Tensor) -> torch.Tensor:
        """Modality-sorted order -> packed order along dim 0."""
        return x if self.inverse_permutation is None else x.index_select(0, self.inverse_permutation)

    def to(self, device: torch.device) -> "Magi2ModalityDispatch":
        """A copy with the index tensors on ``device``."""

        def move(t):
            return None if t is None else t.to(device)

        return Magi2ModalityDispatch(
            self.modality_ids.to(device),
            move(self.permutation),
            move(self.inverse_permutation),
            self.group_sizes,
            self.sorted_modality_ids.to(device),
        )


def chunk_group_sizes(group_sizes: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    """Tokens per modality among modality-sorted rows ``[start, stop)`` of a sequence of ``group_sizes``."""
    sizes, lo = [], 0
    for g in group_sizes:
        hi = lo + int(g)
        sizes.append(max(0, min(stop, hi) - max(start, lo)))
        lo = hi
    return tuple(sizes)


def _check_groups(num_tokens: int, group_sizes: Optional[Sequence[int]], num_modality: int, what: str):
    if group_sizes is None:
        raise ValueError(f"{what}: modality group sizes are required when num_modality={num_modality} > 1")
    if len(group_sizes) != num_modality:
        raise ValueError(f"{what}: expected {num_modality} modality group sizes, got {len(group_sizes)}")
    if sum(group_sizes) != num_tokens:
        raise ValueError(
            f"{what}: modality group sizes {tuple(group_sizes)} sum to {sum(group_sizes)}, "
            f"but the input has {num_tokens} tokens"
        )


class _Magi2PerModalityModule(nn.Module):
    """Base of the modules holding one parameter block per modality: ``num_modality`` and the per-modality
    application to modality-sorted tokens."""

    def __init__(self, num_modality: int) -> None:
        super().__init__()
        self.num_modality = num_modality

    def _per_modality(self, fn, x: torch.Tensor, group_sizes: Optional[Sequence[int]]) -> torch.Tensor:
        """``fn(rows, m)`` on modality ``m``'s rows of ``x`` (sorted, ``group_sizes`` tokens each), concatenated
        along dim 0; with one modality ``fn(x, 0)``, the counts unused.

        Raises:
            ValueError: the group sizes do not match the modalities or the token count.
        """
        if self.num_modality == 1:
            return fn(x, 0)
        _check_groups(x.shape[0], group_sizes, self.num_modality, type(self).__name__)
        parts = torch.split(x, list(group_sizes), dim=0)
        return torch.cat([fn(p, m) for m, p in enumerate(parts)], dim=0)


class Magi2MultiModalityRMSNorm(_Magi2PerModalityModule):
    """Zero-centred RMSNorm, one fp32 weight block per modality (SandAI ``MultiModalityRMSNorm``):
    ``y = x * rsqrt(mean(x^2) + eps) * (1 + w_m)`` in fp32, on ``[N, ..., dim]``.

    Args:
        dim: normalised (last) dimension.
        num_modality: 1 or 3.
        eps: added to the mean square.
        out_dtype: output dtype; ``None`` keeps the input dtype.
    """

    def __init__(
        self,
        dim: int,
        num_modality: int = 1,
        eps: float = 1e-6,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(num_modality)
        self.dim = dim
        self.eps = eps
        self.out_dtype = out_dtype
        self.weight = nn.Parameter(torch.zeros(num_modality * dim, dtype=torch.float32))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_modality={self.num_modality}, eps={self.eps}, out_dtype={self.out_dtype}"

    def forward(self, x: torch.Tensor, group_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Normalise ``x`` ``[N, ..., dim]`` (sorted by modality, ``group_sizes`` tokens each).

        Raises:
            ValueError: last dim is not ``dim``, or the group sizes do not match.
        """
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm expects last dim {self.dim}, got input shape {tuple(x.shape)}")
        out_dtype = self.out_dtype if self.out_dtype is not None else x.dtype
        t = x.float()
        t = t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        gain = self.weight.float().view(self.num_modality, self.dim) + 1.0
        return self._per_modality(lambda rows, m: rows * gain[m], t, group_sizes).to(out_dtype)


class Magi2ModalityGroupedLinear(_Magi2PerModalityModule):
    """One weight matrix per modality (SandAI ``CustomGroupedLinear``): ``y = x @ W_m.T`` for the tokens of
    modality ``m``, ``[N, in] -> [N, out]``, in the weight dtype (the input is cast to it).

    Args:
        in_features, out_features: per-modality matrix size.
        num_modality: 1 or 3.
        bias: add a per-modality bias.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_modality: int = 1,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(num_modality)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(num_modality * out_features, in_features, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_modality * out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init per block (no-op on meta)."""
        if self.weight.is_meta:
            return
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_modality={self.num_modality}, bias={self.bias is not None}"
        )

    def forward(
        self,
        x: torch.Tensor,
        group_sizes: Optional[Sequence[int]] = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> torch.Tensor:
        """Apply the per-modality matrices (tokens sorted, ``group_sizes`` each), output in ``out_dtype``.

        Raises:
            ValueError: wrong input width or group sizes that do not match the token count.
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(f"grouped linear expects input width {self.in_features}, got shape {tuple(x.shape)}")
        m = self.num_modality
        weights = self.weight.view(m, self.out_features, self.in_features)
        biases = [None] * m if self.bias is None else self.bias.view(m, self.out_features)
        y = self._per_modality(lambda rows, i: F.linear(rows, weights[i], biases[i]), x.to(weights.dtype), group_sizes)
        return y if out_dtype is None else y.to(out_dtype)


class Magi2Linear(nn.Linear):
    """``nn.Linear`` of a single-modality projection; casts the input to the weight's dtype and ignores
    ``group_sizes`` (so it drops in for a grouped linear).

    Raises:
        ValueError: the input's last dim is not ``in_features``.
    """

    def forward(self, input: torch.Tensor, group_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        if input.shape[-1] != self.in_features:
            raise ValueError(f"linear expects input width {self.in_features}, got shape {tuple(input.shape)}")
        return F.linear(input.to(self.weight.dtype), self.weight, self.bias)


def modality_linear(
    in_features: int, out_features: int, num_modality: int = 1, bias: bool = False, dtype: Optional[torch.dtype] = None
) -> nn.Module:
    """A :class:`Magi2Linear` for one modality, else a :class:`Magi2ModalityGroupedLinear`."""
    if num_modality == 1:
        return Magi2Linear(in_features, out_features, bias=bias, dtype=dtype)
    return Magi2ModalityGroupedLinear(in_features, out_features, num_modality, bias=bias, dtype=dtype)


def linear_compute_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype ``linear`` computes in: layerwise casting's or FP8 storage's compute dtype, else the weight's
    (through PEFT)."""
    while hasattr(linear, "base_layer"):
        linear = linear.base_layer
    registry = getattr(linear, "_diffusers_hook", None)
    hook = registry.get_hook(_LAYERWISE_CASTING_HOOK) if registry is not None else None
    stored = fp8_storage_compute_dtype(linear)
    return hook.compute_dtype if hook is not None else stored if stored is not None else linear.weight.dtype
