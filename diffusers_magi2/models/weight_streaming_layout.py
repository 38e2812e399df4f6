"""How a streamed block's weights are laid out in one flat byte buffer, and how those buffers are grouped into pinned
arenas.

Every tensor a block registers (parameters and buffers, whatever their dtype: int4 codes and their group scales,
FP8 or bf16 dense weights, fp32 islands) is packed by bytes into one flat buffer per block, except the parameters of
PEFT adapter layers (LoRA factors), which stay resident on the device (small, and trainable: their gradients
accumulate there); each tensor at an offset aligned to :data:`ALIGNMENT` bytes, a dense tensor keeping its strides::

    offset(0) = 0,   offset(k+1) = align(offset(k) + span(k)),   nbytes(block) = align(offset(last) + span(last))

The block's tensors then become views into that buffer (host) or into a ring slot laid out the same way (device),
so host memory holds the weights once. On CUDA the host buffers are pinned, packed into a few arenas: torch's pinned
host allocator rounds each allocation up to a power of two, so one allocation per block could cost up to 2x;
:func:`plan_pinned_arenas` chooses consecutive groups of blocks whose rounding costs least.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch


__all__ = [
    "ALIGNMENT",
    "StreamedBlock",
    "TensorEntry",
    "block_layout",
    "block_tensor_ids",
    "next_pow2",
    "pinned_bytes",
    "plan_pinned_arenas",
    "streamed_tensors",
]

#: Byte alignment of every tensor inside a block's buffer (a CUDA allocation's alignment; Triton's 16 divides it).
ALIGNMENT = 256


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (what torch's pinned host allocator reserves for ``n`` bytes)."""
    return 1 << max(n - 1, 0).bit_length()


def plan_pinned_arenas(block_nbytes: Sequence[int]) -> List[List[int]]:
    """Group consecutive blocks into pinned arenas so that the power-of-two rounding of each arena's allocation
    costs least: a list of the block indices in each arena."""
    best, best_cost = None, None
    cap = next_pow2(max(block_nbytes))
    while True:
        groups, total = [[]], 0
        for i, n in enumerate(block_nbytes):
            if groups[-1] and total + n > cap:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += n
        cost = sum(next_pow2(sum(block_nbytes[i] for i in g)) for g in groups)
        if best_cost is None or cost < best_cost:
            best, best_cost = groups, cost
        if len(groups) == 1:
            return best
        cap *= 2


def pinned_bytes(block_nbytes: Sequence[int]) -> int:
    """Bytes torch's pinned host allocator reserves for :func:`plan_pinned_arenas`' arenas."""
    return sum(next_pow2(sum(block_nbytes[i] for i in g)) for g in plan_pinned_arenas(block_nbytes))


def _adapter_ids(block: torch.nn.Module) -> set:
    """``id`` of every parameter of the PEFT adapter layers in ``block`` (LoRA factors): kept resident."""
    if not any(hasattr(m, "adapter_layer_names") for m in block.modules()):
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {
        id(p)
        for m in block.modules()
        if isinstance(m, BaseTunerLayer)
        for name in m.adapter_layer_names
        for p in getattr(m, name).parameters()
    }


def streamed_tensors(block: torch.nn.Module) -> List[torch.Tensor]:
    """:func:`_block_tensors` less the adapters' parameters."""
    resident = _adapter_ids(block)
    return [t for t in _block_tensors(block) if id(t) not in resident]


def _block_tensors(block: torch.nn.Module) -> List[torch.Tensor]:
    """The block's parameters and buffers, each storage once, in registration order."""
    seen, out = set(), []
    for t in [*block.parameters(), *block.buffers()]:
        if t.data_ptr() not in seen or t.numel() == 0:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its storage span exactly once (contiguous in some order of its dims)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _span_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage span ``t`` covers with its own strides (dense, non-overlapping tensors)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


@dataclass
class TensorEntry:
    """One streamed tensor of a block: where its bytes sit in the block's flat buffer, and how to view them."""

    tensor: torch.Tensor  # the block's Parameter or buffer (its .data is repointed)
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor as it lies in ``flat`` (a uint8 buffer laid out as the block's: host, staging or ring slot)."""
        raw = flat.narrow(0, self.offset, self.nbytes)
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype, device=flat.device)
        return raw.view(self.dtype).as_strided(self.shape, self.stride)


@dataclass
class StreamedBlock:
    """A streamed block: its module, its tensors' :class:`TensorEntry` and, once packed, its host buffer."""

    index: int
    module: torch.nn.Module
    entries: List[TensorEntry]
    nbytes: int
    resident: set = field(default_factory=set)  # ids of the adapters' parameters, not streamed
    tensor_ids: frozenset = frozenset()  # every parameter and buffer object of the block
    host: Optional[torch.Tensor] = None  # uint8 [nbytes], a view into its arena (pinned mode)
    host_views: List[torch.Tensor] = field(default_factory=list)


def block_layout(block: torch.nn.Module, index: int) -> StreamedBlock:
    """Offsets of every tensor of ``block`` in its flat buffer (nothing is copied yet)."""
    entries, offset = [], 0
    for t in streamed_tensors(block):
        if not _dense(t):
            raise ValueError(f"block {index}: a tensor of shape {tuple(t.shape)} overlaps itself; it cannot be packed")
        nbytes = _span_nbytes(t)
        entries.append(TensorEntry(t, offset, nbytes, t.dtype, t.shape, t.stride()))
        offset = _align(offset + nbytes)
    return StreamedBlock(index, block, entries, offset, _adapter_ids(block), block_tensor_ids(block))


def block_tensor_ids(block: torch.nn.Module) -> frozenset:
    """``id`` of every parameter and buffer object of ``block`` (a tensor replaced or added later changes it)."""
    return frozenset(id(t) for t in [*block.parameters(), *block.buffers()])
