"""The disk mode of weight streaming: each block's weights read from the safetensors files the model was loaded from,
through a bounded staging ring in host memory, into the device ring.

Host memory holds no block weights between uses: a block's tensors point at a one-element placeholder (every byte
0xFF, broadcast to their shapes: NaN in every float dtype, so a read outside the hook shows). Before block *i* runs,
its slot is filled as in the pinned mode, from a staging buffer instead of a packed host buffer::

    staging(slot) <- the stored bytes of block i's tensors, read at their byte offsets in the files
    slot <- copy_(staging(slot))            (on CUDA: non_blocking on the side stream, as the pinned mode)

One staging buffer per device slot, each the largest block's bytes (pinned on CUDA, plain on the CPU), so host
memory is ``ring_size x`` the largest block, plus the block tensors the files do not hold (LoRA adapters, buffers
not saved) kept in host memory as they are, and a cast buffer (below); a stage's release frees the staging ring and
the cast buffer with the device ring. Before a staging buffer is refilled, the copy out of it has finished (its
slot's event).

The reads run on one reader thread (a one-worker executor), so they overlap the blocks' compute, on the GPU and on
the CPU alike (``readinto`` releases the GIL). Block *i*'s hook, once block *i*'s weights point into its slot,
queues the read and the copy of the next blocks in the order the streamer needs them (*i+1* .. in the forward; in
inference past the last block on to the next forward's first ones, so only a stage's first forward waits for block
0's read; *i-1* .. in the backward's recomputes) and returns; block *i* computes while the thread reads. (The
pinned mode copies each block in the call that uses it: its host buffers may be written in place between calls.)
Block *i+1*'s hook waits for its read (an error there is raised, naming the block; nothing falls back to another
path; an interrupt leaves the read to be waited for again), then, on CUDA, the compute stream waits for the copy's
event as in the pinned mode. Correctness rests on the one worker running the reads first in, first out: a slot not
in use may be given to another block while its read is still queued, and the later read then runs after it, so the
slot holds the block it was last given once its last queued read is done. The thread starts with the first read;
the streamer's release and restore (``disable_weight_streaming``) stop it, dropping the reads not started. A
streamer dropped without either goes with its model at the cyclic garbage collection (diffusers' hook registry and
its module refer to each other), and the executor's thread exits then.

Each tensor is read with ``readinto`` straight into its place in the staging buffer (safetensors' ``get_slice``
would allocate a new tensor per read and cost a second copy). What the file stores must be what loading made of
it: the same shape, and either the same dtype (int4 codes and group scales, FP8 experts and their scales, a
``dense_storage_dtype`` repo's FP8 weights and ``weight_scale``, fp32 islands, all as stored) or two float dtypes,
where the bytes are cast as ``from_pretrained``'s ``torch_dtype`` or a later ``.to(dtype)`` cast them; and the
same bytes after that cast, every block tensor compared once before streaming starts. Anything else (experts
quantized while loading, ``enable_fp8_storage`` after loading, a fused LoRA, a LoRA fused then unloaded, weights
trained or edited in memory, expert parallelism) is refused before any weight moves, naming the tensor and saying to
``save_pretrained`` the model and load the saved folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..utils.safetensors_io import DTYPE_TO_TORCH, LOADED_FILES_ATTR, read_safetensors_header
from .weight_streaming_layout import StreamedBlock, next_pow2
from .weight_streaming_ring import RingSlot, WeightStreamer


__all__ = [
    "READER_THREAD_NAME",
    "BlockFileReader",
    "DiskWeightStreamer",
    "FileSource",
    "check_file_bytes",
    "extra_host_nbytes",
    "plan_file_sources",
]

_ADAPTER_NAME = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")

#: The name prefix of the disk mode's reader thread.
READER_THREAD_NAME = "magi2-weight-streaming-disk-reader"

_HOW_TO_GET_FILES = (
    "save it with model.save_pretrained(folder) and load it with from_pretrained(folder) (the pipeline: "
    "pipe.save_pretrained, then Magi2Pipeline.from_pretrained), or use host_memory='pinned'"
)


@dataclass(frozen=True)
class FileSource:
    """Where a block tensor's stored bytes are: ``path`` at byte ``offset``, ``nbytes`` long, in ``dtype``."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype


def _saved_names(model: torch.nn.Module) -> Dict[int, str]:
    """``{id(tensor): state-dict name}`` of the tensors ``save_pretrained`` writes (buffers not saved are absent)."""
    return {id(t): name for name, t in model.state_dict(keep_vars=True).items()}


def _check_model(model: torch.nn.Module) -> list:
    """The recorded files, after the model-level refusals."""
    files = getattr(model, LOADED_FILES_ATTR, None)
    # a transformers model loaded outside Magi2Pipeline.from_pretrained (which records the text encoder's files as
    # loaded): its folder's files as they are now, so a change before this check goes unseen
    folder = getattr(model, "name_or_path", None)
    if not files and folder and os.path.isdir(folder):
        paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        files = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    if not files:
        raise ValueError(
            f"host_memory='disk' reads the block weights from the safetensors files the model was loaded from, but "
            f"this {type(model).__name__} was not loaded with from_pretrained (built in memory, or from a single "
            f"file or an original checkpoint); {_HOW_TO_GET_FILES}"
        )
    not_safetensors = [f for f, _, _ in files if not f.endswith(".safetensors")]
    if not_safetensors:
        raise ValueError(
            f"host_memory='disk' reads safetensors files; this model was loaded from {not_safetensors[0]}; "
            f"{_HOW_TO_GET_FILES}"
        )
    for path, size, mtime in files:
        try:
            stat = os.stat(path)
        except OSError:
            raise ValueError(f"host_memory='disk': {path}, which the model was loaded from, is gone") from None
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
            raise ValueError(
                f"host_memory='disk': {path} changed since the model was loaded from it; load the model again"
            )
    if any(getattr(m, "ep_size", 1) > 1 for m in model.modules()):
        raise ValueError(
            "host_memory='disk' does not stream an expert-parallel model (a rank holds only its experts' rows); "
            "use host_memory='pinned'"
        )
    if any(getattr(m, "merged_adapters", None) for m in model.modules()):
        raise ValueError(
            "host_memory='disk' streams what the files hold, but a LoRA is fused into this model's weights in "
            "memory; unfuse_lora() first (the adapter then streams beside the stored weights), or save the fused "
            "model and load it"
        )
    return files


def plan_file_sources(
    model: torch.nn.Module, block_tensors: Sequence[Sequence[torch.Tensor]], check_bytes: bool = True
) -> List[List[Optional[FileSource]]]:
    """For each block's tensors (``model``'s parameters and buffers, in the streamer's packing order), where their
    stored bytes are, or ``None`` for a tensor the files do not hold and host memory keeps (LoRA adapters, buffers not
    saved). With ``check_bytes`` (all but sizing), every block tensor the files hold is compared with its stored bytes
    cast as loading cast them (:func:`check_file_bytes`: one read of the block weights).

    Raises:
        ValueError: the model has no recorded safetensors files (built in memory), a file changed or is gone, an
            expert-parallel model, a fused LoRA, block tensors whose stored form loading did not turn into the
            in-memory one as a plain cast (missing from the files, another shape, or a non-float dtype change; the
            first few named), or (``check_bytes``) a block tensor whose bytes differ from the files' (changed in
            memory after loading, e.g. a LoRA fused and unloaded; naming it), all before any weight moves.
    """
    files = _check_model(model)
    stored = {}
    for path, _, _ in files:
        header = read_safetensors_header(path)
        for key, t in header.tensors.items():
            begin, end = t.data_offsets
            stored[key] = (FileSource(path, header.data_start + begin, end - begin, DTYPE_TO_TORCH[t.dtype]), t.shape)
    names = _saved_names(model)
    plan, problems = [], []
    for tensors in block_tensors:
        sources = []
        for t in tensors:
            name = names.get(id(t))
            if name is None or _ADAPTER_NAME.search(name):
                sources.append(None)
                continue
            key = name.replace(".base_layer.", ".")
            found = stored.get(key)
            if found is None:
                problems.append(f"{key} is not in the files (made after loading?)")
            elif tuple(found[1]) != tuple(t.shape):
                problems.append(f"{key}: stored {list(found[1])}, in memory {list(t.shape)}")
            elif found[0].dtype != t.dtype and not (found[0].dtype.is_floating_point and t.dtype.is_floating_point):
                problems.append(f"{key}: stored {found[0].dtype}, in memory {t.dtype}")
            sources.append(None if found is None else found[0])
        plan.append(sources)
    if problems:
        raise ValueError(
            f"host_memory='disk' reads each block tensor as the files store it, but {len(problems)} differ from the "
            f"model in memory (e.g. experts quantized while loading, enable_fp8_storage after loading): "
            f"{'; '.join(problems[:3])}; {_HOW_TO_GET_FILES}"
        )
    if not check_bytes:
        return plan
    read = [(t, s) for ts, ss in zip(block_tensors, plan) for t, s in zip(ts, ss) if s is not None]
    keys = {id(t): names[id(t)].replace(".base_layer.", ".") for t, _ in read}
    files = {keys[id(t)]: s.path for t, s in read}
    why = f"changed in memory after loading (fused, trained, quantized or edited), so the files no longer hold it; {_HOW_TO_GET_FILES}"
    check_file_bytes(type(model).__name__, [t for t, _ in read], keys, files, names, why)
    return plan


def check_file_bytes(owner: str, tensors, keys: Dict[int, str], files: Dict[str, str], names, why: str) -> None:
    """Each of ``tensors`` equals its file counterpart (``keys[id(t)]`` in ``files[key]``) cast to its dtype, byte
    for byte; else a ``ValueError`` naming ``owner``'s tensor (``names[id(t)]``), the file key and ``why``."""
    from safetensors import safe_open

    by_file: Dict[str, List[torch.Tensor]] = {}
    for t in tensors:
        by_file.setdefault(files[keys[id(t)]], []).append(t)
    for path, group in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            for t in group:
                held = t.detach().to("cpu").contiguous()
                read = f.get_tensor(keys[id(t)]).to(held.dtype).contiguous()
                if held.numel() and not torch.equal(held.view(torch.uint8), read.view(torch.uint8)):
                    raise ValueError(
                        f"{owner}'s {names[id(t)]} differs from {keys[id(t)]} in {path} cast to {held.dtype}: {why}"
                    )


def extra_host_nbytes(block_tensors: Sequence[Sequence[torch.Tensor]], sources) -> int:
    """Host bytes of the disk mode besides the staging ring: the tensors the files do not hold, and the cast buffer
    (the largest tensor read in another dtype or layout)."""
    pairs = [(t, s) for ts, ss in zip(block_tensors, sources) for t, s in zip(ts, ss)]
    held = sum(t.nbytes for t, s in pairs if s is None)
    return held + max((s.nbytes for t, s in pairs if _needs_cast(t, s)), default=0)


def _needs_cast(tensor: torch.Tensor, source: Optional[FileSource]) -> bool:
    """Whether ``source`` is read through the cast buffer (another dtype, or a tensor not in C order)."""
    return source is not None and (source.dtype != tensor.dtype or not tensor.is_contiguous())


def _read_into(fh, offset: int, out: torch.Tensor) -> None:
    """Read ``out.numel()`` bytes at ``offset`` of ``fh`` into the uint8 tensor ``out``."""
    view, done = memoryview(out.numpy()), 0
    fh.seek(offset)
    while done < len(view):
        n = fh.readinto(view[done:])
        if not n:
            raise OSError(f"{fh.name}: ends {len(view) - done} bytes early at offset {offset + done}")
        done += n


class BlockFileReader:
    """Reads each streamed block's tensors from the files into a buffer laid out as its ring slot.

    Built while the blocks' tensors still hold their weights (it keeps those the files do not hold).

    Args:
        block_entries: per block, its packing entries (``tensor``, ``offset``, ``shape``, ``view(buffer)``).
        sources: :func:`plan_file_sources` of the same blocks.

    Attributes:
        cast_buffer: where a tensor stored in another dtype (or laid out other than in C order) is read first
            (uint8, the largest such tensor's stored bytes, between :meth:`allocate` and :meth:`free`; else empty).
        extra_nbytes: host bytes besides the staging ring (:func:`extra_host_nbytes`).
    """

    def __init__(self, block_entries, sources: List[List[Optional[FileSource]]]):
        self.sources = sources
        self.held = {}
        self.cast = set()
        for i, (entries, ss) in enumerate(zip(block_entries, sources)):
            for k, (e, src) in enumerate(zip(entries, ss)):
                if src is None:
                    self.held[i, k] = e.tensor.data
                elif _needs_cast(e.tensor, src):
                    self.cast.add((i, k))
        self.extra_nbytes = extra_host_nbytes([[e.tensor for e in entries] for entries in block_entries], sources)
        self.cast_nbytes = max((sources[i][k].nbytes for i, k in self.cast), default=0)
        self.free()
        paths = {s.path for ss in sources for s in ss if s is not None}
        self.files = {path: open(path, "rb", buffering=0) for path in paths}

    def read(self, index: int, entries, out: torch.Tensor) -> None:
        """Fill ``out`` (uint8) with block ``index``'s tensors at their ``entries``' offsets."""
        for k, (e, src) in enumerate(zip(entries, self.sources[index])):
            if src is None:
                e.view(out).copy_(self.held[index, k])
            elif (index, k) in self.cast:
                raw = self.cast_buffer.narrow(0, 0, src.nbytes)
                _read_into(self.files[src.path], src.offset, raw)
                e.view(out).copy_(raw.view(src.dtype).view(e.shape))
            elif src.nbytes:
                _read_into(self.files[src.path], src.offset, out.narrow(0, e.offset, src.nbytes))

    def allocate(self) -> None:
        """Allocate the cast buffer."""
        self.cast_buffer = torch.empty(self.cast_nbytes, dtype=torch.uint8)

    def free(self) -> None:
        """Free the cast buffer."""
        self.cast_buffer = torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        """Close the files and drop the held tensors."""
        for fh in self.files.values():
            fh.close()
        self.files, self.held = {}, {}


class DiskWeightStreamer(WeightStreamer):
    """:class:`WeightStreamer` of ``host_memory="disk"`` (module docstring).

    Attributes (besides the base's):
        staging: the staging buffers (uint8, each the largest block's bytes).
        reader: the :class:`BlockFileReader`.
        read_ahead: the reader thread's one-worker executor, or ``None``.
    """

    def __init__(self, blocks, device, ring_size: int, use_stream: bool, sources, allocate: bool = True):
        super().__init__(blocks, device, ring_size, use_stream, allocate=False)
        self.reader = BlockFileReader([b.entries for b in self.blocks], sources)  # while the tensors hold weights
        self.read_ahead: Optional[ThreadPoolExecutor] = None
        self._reads: Dict[RingSlot, Future] = {}  # the last read queued into each slot
        if allocate:
            self.allocate()

    def _allocate_host(self, read=None) -> None:
        """The staging ring and the cast buffer; the block tensors' weights are dropped (read back from the files
        before each use; ``read`` is not used)."""
        slot, ring_size, pinned = max(b.nbytes for b in self.blocks), self.ring_size, self.pinned
        self.staging = [torch.empty(slot, dtype=torch.uint8, pin_memory=pinned) for _ in range(ring_size)]
        self.reader.allocate()
        placeholders = {}
        for block in self.blocks:
            for e in block.entries:
                if e.dtype not in placeholders:
                    placeholders[e.dtype] = torch.full((e.tensor.element_size(),), 0xFF, dtype=torch.uint8)
                view = placeholders[e.dtype].view(e.dtype)[0].expand(e.shape)
                e.tensor.data = view
                block.host_views.append(view)
        self.host_nbytes = ring_size * slot + self.reader.extra_nbytes
        self.host_reserved_nbytes = ring_size * (next_pow2(slot) if pinned else slot) + self.reader.extra_nbytes

    def _copy_in(self, slot: RingSlot, block: StreamedBlock, non_blocking: bool) -> None:
        staging = self.staging[self.slots.index(slot)]
        if self.stream is not None:
            slot.ready.synchronize()  # the last copy out of this staging buffer finished
        self.reader.read(block.index, block.entries, staging)
        slot.buffer.narrow(0, 0, block.nbytes).copy_(staging.narrow(0, 0, block.nbytes), non_blocking=non_blocking)

    def _window(self, index: int, step: int) -> Sequence[int]:
        """The base's window, in inference past the last block on to the next forward's first ones (a checkpointed
        forward is followed by its backward, which ends with block 0 in the ring)."""
        if step < 0 or self.phase is not None:
            return super()._window(index, step)
        n = len(self.blocks)
        return [(index + k) % n for k in range(min(len(self.slots), n))]

    def _start_copy(self, slot: RingSlot, block: StreamedBlock) -> None:
        """Queue the read of ``block`` into ``slot``'s staging buffer, and its copy into ``slot``, on the reader
        thread (in the order the blocks are needed; ``max_workers=1``: first in, first out, module docstring)."""
        if self.read_ahead is None:
            self.read_ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix=READER_THREAD_NAME)
        self._reads[slot] = self.read_ahead.submit(self._read_and_copy, slot, block)

    def _read_and_copy(self, slot: RingSlot, block: StreamedBlock) -> None:
        """The reader thread's job: the base's copy, its staging buffer filled from the files first."""
        device = torch.cuda.device(self.device) if self.stream is not None else contextlib.nullcontext()
        with torch.no_grad(), device:
            super()._start_copy(slot, block)

    def _wait_copied(self, slot: RingSlot) -> None:
        """Wait for the reader thread's read into ``slot``; its error is raised here, naming the block. The read is
        forgotten only once it finished: an interrupt (``KeyboardInterrupt``) leaves it for the next acquire."""
        read = self._reads.get(slot)
        if read is not None:
            try:
                read.result()
            except Exception as error:
                del self._reads[slot]
                index, slot.block = slot.block, None  # read again at the next use
                raise RuntimeError(
                    f"weight streaming (host_memory='disk'): reading block {index}'s weights from the files failed "
                    f"on the reader thread: {error!r}"
                ) from error
            del self._reads[slot]
        super()._wait_copied(slot)

    def _stop_reading(self) -> None:
        """Stop the reader thread: the reads not started are dropped, the running one finished (the slots go with
        the ring, so no error of a read no block used is raised)."""
        self._reads = {}
        if self.read_ahead is not None:
            self.read_ahead.shutdown(wait=True, cancel_futures=True)
            self.read_ahead = None

    def _host_bytes(self, block: StreamedBlock) -> torch.Tensor:
        if self.stream is not None:
            self.stream.synchronize()
        self.reader.read(block.index, block.entries, self.staging[0])
        return self.staging[0]

    def _free_host_buffers(self) -> None:
        self.staging = []
        self.reader.free()
        super()._free_host_buffers()

    def free(self) -> None:
        self._stop_reading()
        super().free()

    def restore(self, device=None) -> None:
        self._stop_reading()
        super().restore(device)
        self.reader.close()
