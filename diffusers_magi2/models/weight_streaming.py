"""Streamed block weights: a model's transformer blocks live in host memory and pass through a small device ring.

Every tensor a block registers (parameters and buffers, whatever their dtype: int4 codes and their group scales,
FP8 or bf16 dense weights, fp32 islands) is packed by bytes into one flat host buffer per block, except the
parameters of PEFT adapter layers (LoRA factors), which stay resident on the device (small, and trainable: their
gradients accumulate there); each tensor at an offset aligned to :data:`ALIGNMENT` bytes; the block's tensors then
become views into that buffer, so host memory holds the weights once. On CUDA the buffers are pinned, packed into
a few arenas (torch's pinned host allocator rounds each allocation up to a power of two, so one allocation per
block could cost up to 2x; :func:`plan_pinned_arenas` chooses arenas whose rounding is small).

The device holds a ring of ``ring_size`` preallocated byte buffers (slots), each as large as the largest block. A
diffusers :class:`~diffusers.hooks.ModelHook` on each block, before the block runs::

    slot(i) <- copy_(host(i))            unless a prefetch already did; then wait for that copy
    params(i) <- views of slot(i)        (``tensor.data = view``: the Parameter objects stay the same)
    prefetch i+1 .. i+ring_size-1        into free slots, on a side CUDA stream (events order the two streams)

and after it: ``params(i) <- views of host(i)``, slot(i) released (on CUDA, with an event the next copy into the
slot waits for). So the device holds at most ``ring_size`` blocks' weights; everything outside the blocks
(embedders, adapters, final projections) stays resident on the device. Training (per-block gradient checkpointing,
the backward prefetching in reverse order) is :mod:`.weight_streaming_training`. On the CPU the ring is host memory and the
copies are synchronous, so the suite runs the same mechanism.

With ``host_memory="disk"`` host memory holds no block weights: :class:`DiskWeightStreamer` reads each block from
the safetensors files the model was loaded from into a staging buffer per slot, then copies it into the slot as
above (:mod:`.weight_streaming_disk`).

diffusers' ``enable_group_offload`` is not used: it pins a second copy of every tensor (``use_stream=True``) and
onloads into new device tensors, so neither a single host copy nor a bounded device share. Ending streaming:
:mod:`.weight_streaming_restore`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..utils.safetensors_io import record_loaded_files
from .weight_streaming_disk import BlockFileReader, extra_host_nbytes, plan_file_sources
from .weight_streaming_restore import check_restore, return_pinned_memory
from .weight_streaming_training import StreamedCheckpointCall, check_streamed_training


#: Byte alignment of every tensor inside a block's buffer (a CUDA allocation's alignment; Triton's 16 divides it).
ALIGNMENT = 256

#: The :class:`~diffusers.hooks.HookRegistry` name of the streaming hook on each block.
WEIGHT_STREAMING_HOOK = "magi2_weight_streaming"

#: The host memory modes of :meth:`enable_weight_streaming`.
HOST_MEMORY_MODES = ("pinned", "disk")


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_pinned_arenas(block_nbytes: Sequence[int]) -> List[List[int]]:
    """Group consecutive blocks into pinned arenas so that the power-of-two rounding of each arena's allocation
    costs least: a list of the block indices in each arena."""
    best, best_cost = None, None
    cap = _next_pow2(max(block_nbytes))
    while True:
        groups, total = [[]], 0
        for i, n in enumerate(block_nbytes):
            if groups[-1] and total + n > cap:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += n
        cost = sum(_next_pow2(sum(block_nbytes[i] for i in g)) for g in groups)
        if best_cost is None or cost < best_cost:
            best, best_cost = groups, cost
        if len(groups) == 1:
            return best
        cap *= 2


def pinned_bytes(block_nbytes: Sequence[int]) -> int:
    """Bytes torch's pinned host allocator reserves for :func:`plan_pinned_arenas`' arenas."""
    return sum(_next_pow2(sum(block_nbytes[i] for i in g)) for g in plan_pinned_arenas(block_nbytes))


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


def _streamed_tensors(block: torch.nn.Module) -> List[torch.Tensor]:
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
class _Entry:
    tensor: torch.Tensor  # the block's Parameter or buffer (its .data is repointed)
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        raw = flat.narrow(0, self.offset, self.nbytes)
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype, device=flat.device)
        return raw.view(self.dtype).as_strided(self.shape, self.stride)


@dataclass
class _StreamedBlock:
    index: int
    module: torch.nn.Module
    entries: List[_Entry]
    nbytes: int
    resident: set = field(default_factory=set)  # ids of the adapters' parameters, not streamed
    tensor_ids: frozenset = frozenset()  # every parameter and buffer object of the block
    host: Optional[torch.Tensor] = None  # uint8 [nbytes], a view into its arena (pinned mode)
    host_views: List[torch.Tensor] = field(default_factory=list)


def _layout(block: torch.nn.Module, index: int) -> _StreamedBlock:
    """Offsets of every tensor of ``block`` in its flat buffer (nothing is copied yet)."""
    entries, offset = [], 0
    for t in _streamed_tensors(block):
        if not _dense(t):
            raise ValueError(f"block {index}: a tensor of shape {tuple(t.shape)} overlaps itself; it cannot be packed")
        nbytes = _span_nbytes(t)
        entries.append(_Entry(t, offset, nbytes, t.dtype, t.shape, t.stride()))
        offset = _align(offset + nbytes)
    return _StreamedBlock(index, block, entries, offset, _adapter_ids(block), _tensor_ids(block))


def _tensor_ids(block: torch.nn.Module) -> frozenset:
    return frozenset(id(t) for t in [*block.parameters(), *block.buffers()])


@dataclass(eq=False)
class _Slot:
    buffer: torch.Tensor  # uint8 [slot_nbytes] on the device
    block: Optional[int] = None
    in_use: bool = False
    held: bool = False  # recomputed for the backward: kept until the next block is acquired
    ready: Optional[object] = None  # CUDA event: the copy into this slot finished
    free: Optional[object] = None  # CUDA event: the compute that read this slot finished
    views: dict = field(default_factory=dict)  # block index -> its tensors' views into this slot


class WeightStreamer:
    """The host buffers, the device ring and the per-block hooks of one streamed model; built by
    :func:`apply_weight_streaming`.

    Attributes:
        blocks: the streamed blocks, in call order.
        slots: the device ring.
        host_nbytes: bytes of the packed host buffers (the weights once, plus alignment).
        host_reserved_nbytes: bytes the host allocator reserves for them (pinned rounding included).
        ring_nbytes: bytes of the device ring.
    """

    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        device: torch.device,
        ring_size: int,
        use_stream: bool,
        allocate: bool = True,
    ):
        self.device = device
        self.blocks = [_layout(b, i) for i, b in enumerate(blocks)]
        sizes = [b.nbytes for b in self.blocks]
        self.pinned = device.type == "cuda"
        self.host_nbytes = sum(sizes)
        self.host_reserved_nbytes = pinned_bytes(sizes) if self.pinned else self.host_nbytes
        self.ring_size = ring_size
        #: the device budget streaming was enabled with, GB (checked when the weights are made resident again)
        self.vram_gb: Optional[float] = None
        self.ring_nbytes = max(sizes) * ring_size
        self.stream = torch.cuda.Stream(device) if use_stream else None
        self.slots: List[_Slot] = []
        #: called with each slot as it is released (tests poison it here)
        self.on_release: Optional[Callable[[torch.Tensor], None]] = None
        #: ``None`` outside a checkpointed block call, else ``"forward"`` or ``"recompute"``
        #: (:class:`~.weight_streaming_training.StreamedCheckpointCall` sets it)
        self.phase: Optional[str] = None
        if allocate:
            self.allocate()

    def allocate(self, read: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None) -> None:
        """Allocate the host buffers and the device ring. Each tensor's host view is filled by ``read(tensor, view)``
        (default: a copy of the tensor's current data, which is then freed) and the tensor pointed at it."""
        sizes = [b.nbytes for b in self.blocks]
        arenas = plan_pinned_arenas(sizes) if self.pinned else [[i] for i in range(len(sizes))]
        for group in arenas:
            arena = torch.empty(sum(sizes[i] for i in group), dtype=torch.uint8, pin_memory=self.pinned)
            offset = 0
            for i in group:
                self._pack(self.blocks[i], arena.narrow(0, offset, sizes[i]), read)
                offset += sizes[i]
        self.slots = [
            _Slot(torch.empty(max(sizes), dtype=torch.uint8, device=self.device)) for _ in range(self.ring_size)
        ]
        if self.stream is not None:
            for slot in self.slots:
                slot.ready, slot.free = torch.cuda.Event(), torch.cuda.Event()

    def free(self) -> None:
        """Free the host buffers and the device ring: every block tensor becomes empty until :meth:`allocate` (a
        slot a forward that raised left in use is released first)."""
        self.release_held()
        self.release_aborted()
        if self.stream is not None:
            self.stream.synchronize()
        for block in self.blocks:
            for e in block.entries:
                e.tensor.data = torch.empty(0, dtype=e.dtype)
            block.host, block.host_views = None, []
        self.slots = []
        self._free_host_buffers()

    def _free_host_buffers(self) -> None:
        """Drop the host buffers nothing points into any more and return their pinned memory."""
        return_pinned_memory(self.pinned)

    def _copy_in(self, slot: _Slot, block: _StreamedBlock, non_blocking: bool) -> None:
        """Copy ``block``'s weights into ``slot`` (on the current stream)."""
        slot.buffer.narrow(0, 0, block.nbytes).copy_(block.host, non_blocking=non_blocking)

    def _host_bytes(self, block: _StreamedBlock) -> torch.Tensor:
        """A host buffer holding ``block``'s weights as its slot lays them out."""
        return block.host

    @staticmethod
    def _pack(block: _StreamedBlock, host: torch.Tensor, read=None) -> None:
        """Fill ``host`` with the block's tensors and point them at their views there (the originals are freed)."""
        block.host, block.host_views = host, []
        for e in block.entries:
            view = e.view(host)
            if read is None:
                view.copy_(e.tensor.data)
            else:
                read(e.tensor, view)
            e.tensor.data = view
            block.host_views.append(view)

    # --- the ring

    def _find(self, index: int) -> Optional[_Slot]:
        return next((s for s in self.slots if s.block == index), None)

    def _load(self, index: int, window: Sequence[int]) -> Optional[_Slot]:
        """Start copying block ``index`` into a slot not in use (preferring one whose block is outside ``window``);
        ``None`` when every slot is taken."""
        free = [s for s in self.slots if not s.in_use and s.block not in window]
        if not free:
            return None
        slot = next((s for s in free if s.block is None), free[0])
        block = self.blocks[index]
        if self.stream is None:
            self._copy_in(slot, block, non_blocking=False)
        else:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(slot.free)  # the compute that last read this slot is done
                self._copy_in(slot, block, non_blocking=True)
                slot.ready.record(self.stream)
        slot.block = index
        return slot

    def acquire(self, index: int, step: int = 1, hold: bool = False) -> None:
        """Point block ``index``'s tensors at a ring slot holding its weights; prefetch the next blocks in call order
        (``step``: 1 in the forward, -1 in the backward's recomputes). With ``hold`` (a recompute) the slot stays
        taken until the next acquire, which releases it first (by then that block's backward has run)."""
        self.release_held()
        if step > 0 and index == 0:
            self.release_aborted()
        block = self.blocks[index]
        self._check_unchanged(block)
        end = index + step * len(self.slots)
        window = range(index, min(end, len(self.blocks)) if step > 0 else max(end, -1), step)
        slot = self._find(index) or self._load(index, window)
        if slot is None:
            raise RuntimeError(f"weight streaming: no free ring slot for block {index} (a block did not finish)")
        slot.in_use, slot.held = True, hold
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        views = slot.views.get(index)
        if views is None:
            views = slot.views[index] = [e.view(slot.buffer) for e in block.entries]
        for e, view in zip(block.entries, views):
            e.tensor.data = view
        for j in window[1:]:
            if self._find(j) is None and self._load(j, window) is None:
                break

    def release_aborted(self) -> None:
        """Release the slots a forward that raised left in use (its block's hook never ran ``post_forward``): called
        where no block of this model can be running, as the forward's first block starts or the buffers are freed."""
        for slot in self.slots:
            if slot.in_use and not slot.held:
                self.release(slot.block)

    def release_held(self) -> None:
        """Release the slots :meth:`acquire` held for a recomputed block's backward (run by now)."""
        for slot in self.slots:
            if slot.held:
                slot.held = False
                self.release(slot.block)

    def release(self, index: int) -> None:
        """Point block ``index``'s tensors back at the host and free its slot for the next copy."""
        block = self.blocks[index]
        for e, view in zip(block.entries, block.host_views):
            e.tensor.data = view
        slot = self._find(index)
        slot.in_use = False
        if self.stream is not None:
            slot.free.record(torch.cuda.current_stream(self.device))
        if self.on_release is not None:
            self.on_release(slot.buffer)
            slot.block = None

    def _check_unchanged(self, block: _StreamedBlock) -> None:
        """Refuse a block whose tensors were replaced or added after streaming started (e.g. a LoRA loaded later)."""
        if _tensor_ids(block.module) != block.tensor_ids:
            raise RuntimeError(
                f"block {block.index}'s tensors changed after enable_weight_streaming (an adapter loaded, fused or "
                "deleted, or a weight replaced); call disable_weight_streaming() first and enable it again after"
            )
        for e, view in zip(block.entries, block.host_views):
            if e.tensor.data_ptr() != view.data_ptr():
                raise RuntimeError(
                    f"block {block.index}'s tensor {tuple(e.shape)} {e.dtype} no longer lives in its host buffer (a "
                    "weight was replaced); call disable_weight_streaming() first and enable it again after"
                )

    def restore(self, device=None) -> None:
        """Give every block its own tensors again, in host memory (``device=None``: block by block, each block's
        host buffer freed once copied out) or on ``device`` (every copy made before any tensor points at it, so a
        failure leaves streaming as it was); the ring is freed (:mod:`.weight_streaming_restore`)."""
        if self.stream is not None:
            self.stream.synchronize()
        copies = []
        for block in self.blocks:
            host = self._host_bytes(block)
            views = [e.view(host).to("cpu" if device is None else device, copy=True) for e in block.entries]
            if device is None:
                self._point(block, views)
            else:
                copies.append(views)
        for block, views in zip(self.blocks, copies):
            self._point(block, views)
        self.slots = []
        self._free_host_buffers()

    @staticmethod
    def _point(block: _StreamedBlock, tensors: List[torch.Tensor]) -> None:
        for e, t in zip(block.entries, tensors):
            e.tensor.data = t
        block.host, block.host_views = None, []


class DiskWeightStreamer(WeightStreamer):
    """:class:`WeightStreamer` of ``host_memory="disk"``: each block read from the safetensors files
    (:mod:`.weight_streaming_disk`) into a staging ring of ``ring_size`` host buffers, one per slot (pinned on CUDA),
    then copied into its slot; between uses the block's tensors point at a one-element placeholder of 0xFF bytes
    (NaN in every float dtype) broadcast to their shapes.

    Attributes (besides the base's):
        staging: the staging buffers (uint8, each the largest block's bytes).
        reader: the :class:`~.weight_streaming_disk.BlockFileReader` (its ``cast_buffer``, the tensors it holds).
    """

    def __init__(self, blocks, device, ring_size: int, use_stream: bool, sources, allocate: bool = True):
        super().__init__(blocks, device, ring_size, use_stream, allocate=False)
        self.reader = BlockFileReader([b.entries for b in self.blocks], sources)  # while the tensors hold weights
        if allocate:
            self.allocate()

    def allocate(self, read=None) -> None:
        """Allocate the staging ring and the device ring; the block tensors' weights are dropped (read back from the
        files before each use; ``read`` is not used)."""
        slot, ring_size, pinned = max(b.nbytes for b in self.blocks), self.ring_size, self.pinned
        self.staging = [torch.empty(slot, dtype=torch.uint8, pin_memory=pinned) for _ in range(ring_size)]
        placeholders = {}
        for block in self.blocks:
            for e in block.entries:
                if e.dtype not in placeholders:
                    placeholders[e.dtype] = torch.full((e.tensor.element_size(),), 0xFF, dtype=torch.uint8)
                view = placeholders[e.dtype].view(e.dtype)[0].expand(e.shape)
                e.tensor.data = view
                block.host_views.append(view)
        self.host_nbytes = ring_size * slot + self.reader.extra_nbytes
        self.host_reserved_nbytes = ring_size * (_next_pow2(slot) if pinned else slot) + self.reader.extra_nbytes
        self.slots = [_Slot(torch.empty(slot, dtype=torch.uint8, device=self.device)) for _ in range(ring_size)]
        if self.stream is not None:
            for s in self.slots:
                s.ready, s.free = torch.cuda.Event(), torch.cuda.Event()

    def _copy_in(self, slot: _Slot, block: _StreamedBlock, non_blocking: bool) -> None:
        staging = self.staging[self.slots.index(slot)]
        if self.stream is not None:
            slot.ready.synchronize()  # the last copy out of this staging buffer finished
        self.reader.read(block.index, block.entries, staging)
        slot.buffer.narrow(0, 0, block.nbytes).copy_(staging.narrow(0, 0, block.nbytes), non_blocking=non_blocking)

    def _host_bytes(self, block: _StreamedBlock) -> torch.Tensor:
        if self.stream is not None:
            self.stream.synchronize()
        self.reader.read(block.index, block.entries, self.staging[0])
        return self.staging[0]

    def _free_host_buffers(self) -> None:
        self.staging = []
        return_pinned_memory(self.pinned)

    def restore(self, device=None) -> None:
        super().restore(device)
        self.reader.close()


class WeightStreamingHook(ModelHook):
    """Before the block runs, its weights come into a ring slot; after it, the slot is released (a recomputed block's
    is held for its backward, :mod:`.weight_streaming_training`)."""

    def __init__(self, streamer: WeightStreamer, index: int) -> None:
        super().__init__()
        self.streamer, self.index = streamer, index

    @torch.compiler.disable  # the swaps run eagerly; a compiled block sees its weights as inputs
    def pre_forward(self, module, *args, **kwargs):
        phase = self.streamer.phase
        if torch.is_grad_enabled():
            check_streamed_training(self.streamer.blocks[self.index], phase)
        recompute = phase == "recompute"
        self.streamer.acquire(self.index, step=-1 if recompute else 1, hold=recompute)
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module, output):
        if self.streamer.phase != "recompute":  # a recomputed block's slot stays for its backward
            self.streamer.release(self.index)
        return output


def check_weight_streaming_args(device, ring_size: int, host_memory: str, use_stream: Optional[bool]):
    """Resolve and check :func:`apply_weight_streaming`'s arguments before anything moves: ``(device, use_stream)``.

    Raises:
        ValueError: an unknown ``host_memory``, ``ring_size`` below 2, CUDA where torch sees none, or a side stream
            without CUDA."""
    if host_memory not in HOST_MEMORY_MODES:
        raise ValueError(f"host_memory must be one of {HOST_MEMORY_MODES}, got {host_memory!r}")
    if not isinstance(ring_size, int) or ring_size < 2:
        raise ValueError(f"ring_size must be an int >= 2 (one slot computes while the next loads), got {ring_size!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "weight streaming onto a CUDA device, but this torch sees no CUDA device; pass device='cpu' to run the "
            "same ring in host memory (what the CPU tests do)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if use_stream is None:
        use_stream = device.type == "cuda"
    if use_stream and device.type != "cuda":
        raise ValueError(f"a side stream for the weight copies needs a CUDA device, got device={str(device)!r}")
    return device, use_stream


def apply_weight_streaming(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module],
    device,
    ring_size: int = 2,
    host_memory: str = "pinned",
    use_stream: Optional[bool] = None,
    allocate: bool = True,
    sources=None,
) -> WeightStreamer:
    """Stream ``blocks``' weights through a ``ring_size``-slot device ring; move the rest of ``model`` to ``device``.

    Args:
        model: the model owning ``blocks``; its other weights become resident on ``device``.
        blocks: the modules streamed, in call order (each called once per forward).
        device: where the blocks compute (a CUDA device, or ``"cpu"``: the same ring in host memory).
        ring_size: slots in the device ring (2 or 3: one computes while the others load).
        host_memory: ``"pinned"`` (the weights held once in host memory, pinned on CUDA) or ``"disk"`` (read from
            the safetensors files ``model`` was loaded from, :mod:`.weight_streaming_disk`).
        use_stream: copy on a side CUDA stream (``None``: on CUDA).
        allocate: build the host buffers and the ring now; ``False`` leaves the blocks' tensors as they are until
            :meth:`WeightStreamer.allocate` (which must run before the first block does).
        sources: ``"disk"``: :func:`plan_streamed_file_sources` of ``model`` and ``blocks``, if already checked.

    Returns:
        The :class:`WeightStreamer` (held by the model; its sizes say what the host and the device hold).

    Raises:
        ValueError: :func:`check_weight_streaming_args`' and (disk) :func:`plan_streamed_file_sources`' refusals, or
            weights streamed already.
    """
    device, use_stream = check_weight_streaming_args(device, ring_size, host_memory, use_stream)
    if any(HookRegistry.check_if_exists_or_initialize(b).get_hook(WEIGHT_STREAMING_HOOK) for b in blocks):
        raise ValueError("weights are streamed already; call disable_weight_streaming() first")
    tensors = {id(b): _streamed_tensors(b) for b in blocks}
    if host_memory == "disk" and sources is None:
        sources = plan_file_sources(model, list(tensors.values()))
    block_ids = {id(t) for ts in tensors.values() for t in ts}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) not in block_ids:
                t.data = t.data.to(device)
        for b in blocks if allocate else ():  # the blocks' tensors on the host first (block by block)
            for t in _streamed_tensors(b):
                if t.device.type != "cpu":
                    t.data = t.data.cpu()
        if host_memory != "disk":
            streamer = WeightStreamer(blocks, device, ring_size, use_stream, allocate)
        else:
            streamer = DiskWeightStreamer(blocks, device, ring_size, use_stream, sources, allocate)
    for i, b in enumerate(blocks):
        HookRegistry.check_if_exists_or_initialize(b).register_hook(
            WeightStreamingHook(streamer, i), WEIGHT_STREAMING_HOOK
        )
    return streamer


def plan_streamed_file_sources(model: torch.nn.Module, blocks: Sequence[torch.nn.Module]):
    """:func:`~.weight_streaming_disk.plan_file_sources` (bytes checked) of the tensors ``blocks`` stream."""
    return plan_file_sources(model, [_streamed_tensors(b) for b in blocks])


def streaming_host_nbytes(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], host_memory: str, ring_size: int, pinned: bool
) -> int:
    """Host bytes streaming ``blocks`` holds, with the pinned allocator's rounding when ``pinned`` (CUDA):
    ``"pinned"``: their packed buffers; ``"disk"``: the staging ring of ``ring_size`` buffers, the block tensors the
    files do not hold and a cast buffer (a ``ValueError`` where the files cannot be streamed, bytes not checked)."""
    sizes = [_layout(b, i).nbytes for i, b in enumerate(blocks)]
    if host_memory == "disk":
        tensors = [_streamed_tensors(b) for b in blocks]
        staging = _next_pow2(max(sizes)) if pinned else max(sizes)
        return ring_size * staging + extra_host_nbytes(tensors, plan_file_sources(model, tensors, check_bytes=False))
    return pinned_bytes(sizes) if pinned else sum(sizes)


def streaming_device_nbytes(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], ring_size: int = 2) -> int:
    """Device bytes of ``model``'s weights, ``blocks`` streamed: all else plus ``ring_size`` slots of the largest."""
    sizes = [_layout(b, i).nbytes for i, b in enumerate(blocks)]
    block_ids = {id(t) for b in blocks for t in _streamed_tensors(b)}
    resident = sum(t.nbytes for t in [*model.parameters(), *model.buffers()] if id(t) not in block_ids)
    return resident + ring_size * max(sizes)


def remove_weight_streaming(streamer: WeightStreamer, device=None) -> None:
    """Give every block its own tensors again, in host memory or on ``device`` (:meth:`WeightStreamer.restore`),
    then remove the hooks (a failed restore leaves them)."""
    streamer.restore(device)
    for block in streamer.blocks:
        HookRegistry.check_if_exists_or_initialize(block.module).remove_hook(WEIGHT_STREAMING_HOOK, recurse=False)


class Magi2WeightStreamingMixin:
    """``enable_weight_streaming`` / ``disable_weight_streaming`` for a model whose ``transformer_blocks`` run in
    order once per forward."""

    def enable_weight_streaming(
        self,
        device="cuda",
        vram_gb: Optional[float] = None,
        ring_size: int = 2,
        host_memory: str = "pinned",
        use_stream: Optional[bool] = None,
    ) -> WeightStreamer:
        """Stream the ``transformer_blocks``' weights through a ring of ``ring_size`` device buffers (module
        docstring); everything else (the blocks' LoRA factors included) moves to ``device``. Inference, or training
        the LoRA factors with :meth:`enable_gradient_checkpointing` (:mod:`.weight_streaming_training`).

        Args:
            device: the compute device (``"cpu"`` runs the same ring in host memory, with synchronous copies).
            vram_gb: the card's memory in GB (10^9 bytes): refused when the resident weights plus the ring exceed it
                (activations are not counted here).
            ring_size: device slots, each the largest block's bytes (2 or 3).
            host_memory: ``"pinned"`` (page-locked on CUDA; on the CPU there is nothing to pin) or ``"disk"`` (each
                block read from the safetensors files this model was loaded from into a staging ring of
                ``ring_size`` host buffers, :mod:`.weight_streaming_disk`; needs a model from ``from_pretrained``).
            use_stream: copy on a side CUDA stream (default: on CUDA).

        Returns:
            The :class:`WeightStreamer`: ``host_nbytes``, ``host_reserved_nbytes``, ``ring_nbytes``.

        Raises:
            ValueError: bad arguments, streaming enabled already, ``vram_gb`` below the resident weights plus the
                ring, or (disk) :func:`~.weight_streaming_disk.plan_file_sources`' refusals; before any weight moves.
        """
        check_weight_streaming_args(device, ring_size, host_memory, use_stream)
        if vram_gb is not None:
            need = self.weight_streaming_device_nbytes(ring_size)
            if need > vram_gb * 1e9:
                raise ValueError(
                    f"vram_gb={vram_gb}: the resident weights plus a {ring_size}-block ring need {need / 1e9:.2f} GB"
                )
        self._weight_streamer = apply_weight_streaming(
            self, list(self.transformer_blocks), device, ring_size, host_memory, use_stream
        )
        self._weight_streamer.vram_gb = vram_gb
        return self._weight_streamer

    def weight_streaming_device_nbytes(self, ring_size: int = 2) -> int:
        """Device bytes of the weights under streaming: everything outside the blocks plus ``ring_size`` slots."""
        return streaming_device_nbytes(self, self.transformer_blocks, ring_size)

    def weight_streaming_host_nbytes(
        self, pinned: bool = True, host_memory: str = "pinned", ring_size: int = 2
    ) -> int:
        """:func:`streaming_host_nbytes` of the ``transformer_blocks``."""
        return streaming_host_nbytes(self, list(self.transformer_blocks), host_memory, ring_size, pinned)

    def _checkpointed_block(self, block: torch.nn.Module):
        """What gradient checkpointing calls for ``block``: the block, or under streaming a
        :class:`~.weight_streaming_training.StreamedCheckpointCall` that tells the streamer forward from recompute."""
        streamer = getattr(self, "_weight_streamer", None)
        return block if streamer is None else StreamedCheckpointCall(streamer, block)

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, resolved_model_file, *args, **kwargs):
        # diffusers' loading step, where the checkpoint files are resolved: recorded for host_memory="disk"
        record_loaded_files(model, resolved_model_file)
        return super()._load_pretrained_model(model, state_dict, resolved_model_file, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        if getattr(self, "_weight_streamer", None) is not None:
            raise RuntimeError(
                "this model's block weights are streamed (enable_weight_streaming): moving or casting it would copy "
                "every block to the device; call disable_weight_streaming() first"
            )
        return super()._apply(fn, recurse)

    def disable_weight_streaming(self, device=None) -> None:
        """Stop streaming: the blocks' weights come back as plain host tensors (default, as diffusers leaves offloaded
        weights when its hooks are removed; everything else stays where it is), or resident on ``device``.

        Raises:
            ValueError: ``device`` without room for the weights (:func:`~.weight_streaming_restore.check_restore`:
                its free memory, the ``vram_gb`` streaming was enabled with), before any weight moves; streaming stays.
        """
        streamer = getattr(self, "_weight_streamer", None)
        if streamer is None:
            return
        moved = sum(b.nbytes for b in streamer.blocks)
        resident = sum(t.nbytes for t in {id(t): t for t in [*self.parameters(), *self.buffers()]}.values())
        device = check_restore(device, moved, resident, streamer.vram_gb, streamer.device)
        remove_weight_streaming(streamer, device)
        self._weight_streamer = None
