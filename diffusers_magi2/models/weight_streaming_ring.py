"""The device ring of weight streaming: ``ring_size`` preallocated byte buffers (slots), each as large as the largest
block, through which the streamed blocks' weights pass (:mod:`.weight_streaming_layout` lays each block out).

Before block *i* runs (:meth:`WeightStreamer.acquire`, from the block's hook)::

    slot(i) <- copy_(host(i))            unless a prefetch already did; then wait for that copy
    params(i) <- views of slot(i)        (``tensor.data = view``: the Parameter objects stay the same)
    prefetch i+1 .. i+ring_size-1        into free slots, on a side CUDA stream (events order the two streams)

and after it (:meth:`WeightStreamer.release`): ``params(i) <- views of host(i)``, slot(i) released (on CUDA, with
an event the next copy into the slot waits for). So the device holds at most ``ring_size`` blocks' weights. On the
CPU the ring is host memory (the pinned mode's copies made at once, the disk mode's reads on its reader thread), so
the suite runs the same mechanism. The backward's reverse order: :mod:`.weight_streaming_training`; the disk mode's
staging ring: :mod:`.weight_streaming_disk`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from .weight_streaming_layout import StreamedBlock, block_layout, block_tensor_ids, pinned_bytes, plan_pinned_arenas
from .weight_streaming_restore import return_pinned_memory


__all__ = ["RingSlot", "WeightStreamer"]


@dataclass(eq=False)
class RingSlot:
    """One device buffer of the ring, and which block it holds."""

    buffer: torch.Tensor  # uint8 [slot_nbytes] on the device
    block: Optional[int] = None
    in_use: bool = False
    held: bool = False  # recomputed for the backward: kept until the next block is acquired
    ready: Optional[object] = None  # CUDA event: the copy into this slot finished
    free: Optional[object] = None  # CUDA event: the compute that read this slot finished
    views: dict = field(default_factory=dict)  # block index -> its tensors' views into this slot


class WeightStreamer:
    """The host buffers, the device ring and the per-block hooks of one streamed model; built by
    :func:`~.weight_streaming.apply_weight_streaming`.

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
        self.blocks = [block_layout(b, i) for i, b in enumerate(blocks)]
        sizes = [b.nbytes for b in self.blocks]
        self.pinned = device.type == "cuda"
        self.host_nbytes = sum(sizes)
        self.host_reserved_nbytes = pinned_bytes(sizes) if self.pinned else self.host_nbytes
        self.ring_size = ring_size
        #: the device budget streaming was enabled with, GB (checked when the weights are made resident again)
        self.vram_gb: Optional[float] = None
        self.ring_nbytes = max(sizes) * ring_size
        self.stream = torch.cuda.Stream(device) if use_stream else None
        self.slots: List[RingSlot] = []
        #: called with each slot as it is released (tests poison it here)
        self.on_release: Optional[Callable[[torch.Tensor], None]] = None
        #: ``None`` outside a checkpointed block call, else ``"forward"`` or ``"recompute"``
        #: (:class:`~.weight_streaming_training.StreamedCheckpointCall` sets it)
        self.phase: Optional[str] = None
        if allocate:
            self.allocate()

    def allocate(self, read: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None) -> None:
        """Allocate the host buffers and the device ring. Each tensor's host view is filled by ``read(tensor, view)``
        (default: a copy of the tensor's current data, which is then freed) and the tensor pointed at it. Inside
        ``torch.inference_mode()`` too they are made as normal tensors: they outlive the call, and are written in place
        outside it (the next call, the disk mode's reader thread, :meth:`restore`)."""
        with torch.inference_mode(False):
            self._allocate_host(read)
            self._allocate_ring()

    def _allocate_host(self, read) -> None:
        """The packed host buffers (:meth:`allocate`)."""
        sizes = [b.nbytes for b in self.blocks]
        arenas = plan_pinned_arenas(sizes) if self.pinned else [[i] for i in range(len(sizes))]
        for group in arenas:
            arena = torch.empty(sum(sizes[i] for i in group), dtype=torch.uint8, pin_memory=self.pinned)
            offset = 0
            for i in group:
                self._pack(self.blocks[i], arena.narrow(0, offset, sizes[i]), read)
                offset += sizes[i]

    def _allocate_ring(self) -> None:
        """The ``ring_size`` device slots, each the largest block's bytes (with their events on a side stream)."""
        nbytes = max(b.nbytes for b in self.blocks)
        self.slots = [
            RingSlot(torch.empty(nbytes, dtype=torch.uint8, device=self.device)) for _ in range(self.ring_size)
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

    def _copy_in(self, slot: RingSlot, block: StreamedBlock, non_blocking: bool) -> None:
        """Copy ``block``'s weights into ``slot`` (on the current stream)."""
        slot.buffer.narrow(0, 0, block.nbytes).copy_(block.host, non_blocking=non_blocking)

    def _host_bytes(self, block: StreamedBlock) -> torch.Tensor:
        """A host buffer holding ``block``'s weights as its slot lays them out."""
        return block.host

    @staticmethod
    def _pack(block: StreamedBlock, host: torch.Tensor, read=None) -> None:
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

    def _find(self, index: int) -> Optional[RingSlot]:
        return next((s for s in self.slots if s.block == index), None)

    def _load(self, index: int, window: Sequence[int]) -> Optional[RingSlot]:
        """Start copying block ``index`` into a slot not in use (preferring one whose block is outside ``window``);
        ``None`` when every slot is taken."""
        free = [s for s in self.slots if not s.in_use and s.block not in window]
        if not free:
            return None
        slot = next((s for s in free if s.block is None), free[0])
        self._start_copy(slot, self.blocks[index])
        slot.block = index
        return slot

    def _start_copy(self, slot: RingSlot, block: StreamedBlock) -> None:
        """Copy ``block``'s weights into ``slot``: at once on the CPU, queued on the side stream on CUDA."""
        if self.stream is None:
            self._copy_in(slot, block, non_blocking=False)
        else:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(slot.free)  # the compute that last read this slot is done
                self._copy_in(slot, block, non_blocking=True)
                slot.ready.record(self.stream)

    def _wait_copied(self, slot: RingSlot) -> None:
        """Order the compute that reads ``slot`` after the copy into it."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)

    def _window(self, index: int, step: int) -> Sequence[int]:
        """Block ``index`` and the next ones in call order, as many as there are slots."""
        end = index + step * len(self.slots)
        return range(index, min(end, len(self.blocks)) if step > 0 else max(end, -1), step)

    def acquire(self, index: int, step: int = 1, hold: bool = False) -> None:
        """Point block ``index``'s tensors at a ring slot holding its weights; prefetch the next blocks in call order
        (``step``: 1 in the forward, -1 in the backward's recomputes). With ``hold`` (a recompute) the slot stays
        taken until the next acquire, which releases it first (by then that block's backward has run)."""
        self.release_held()
        if step > 0 and index == 0:
            self.release_aborted()
        block = self.blocks[index]
        self._check_unchanged(block)
        window = self._window(index, step)
        slot = self._find(index) or self._load(index, window)
        if slot is None:
            raise RuntimeError(f"weight streaming: no free ring slot for block {index} (a block did not finish)")
        self._wait_copied(slot)
        slot.in_use, slot.held = True, hold
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

    def _check_unchanged(self, block: StreamedBlock) -> None:
        """Refuse a block whose tensors were replaced or added after streaming started (e.g. a LoRA loaded later)."""
        if block_tensor_ids(block.module) != block.tensor_ids:
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
        failure leaves streaming as it was); the ring is freed (:mod:`.weight_streaming_restore`). The copies are
        normal tensors, as :meth:`allocate`'s buffers."""
        if self.stream is not None:
            self.stream.synchronize()
        copies = []
        with torch.inference_mode(False):
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
    def _point(block: StreamedBlock, tensors: List[torch.Tensor]) -> None:
        for e, t in zip(block.entries, tensors):
            e.tensor.data = t
        block.host, block.host_views = None, []
