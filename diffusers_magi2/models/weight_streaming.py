"""Streamed block weights: a model's transformer blocks live in host memory (or on disk) and pass through a small
device ring; everything outside the blocks (embedders, adapters, final projections) stays resident on the device.

A diffusers :class:`~diffusers.hooks.ModelHook` on each block brings its weights into a ring slot before the block
runs and releases the slot after it, so the device holds at most ``ring_size`` blocks' weights. The pieces:

- :mod:`.weight_streaming_layout`: each block's tensors packed by bytes into one flat buffer (the weights held once;
  on CUDA pinned, in a few arenas that keep the allocator's power-of-two rounding small);
- :mod:`.weight_streaming_ring`: the device ring, its copies and prefetches (:class:`WeightStreamer`);
- :mod:`.weight_streaming_disk`: ``host_memory="disk"``, each block read from the safetensors files the model was
  loaded from through a staging ring (:class:`DiskWeightStreamer`);
- :mod:`.weight_streaming_training`: per-block gradient checkpointing, the backward prefetching in reverse order;
- :mod:`.weight_streaming_restore`: ending streaming.

diffusers' ``enable_group_offload`` is not used: it pins a second copy of every tensor (``use_stream=True``) and
onloads into new device tensors, so neither a single host copy nor a bounded device share.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..utils.safetensors_io import record_loaded_files
from .weight_streaming_disk import DiskWeightStreamer, extra_host_nbytes, plan_file_sources
from .weight_streaming_layout import (
    ALIGNMENT,
    block_layout,
    next_pow2,
    pinned_bytes,
    plan_pinned_arenas,
    streamed_tensors,
)
from .weight_streaming_restore import check_restore
from .weight_streaming_ring import WeightStreamer
from .weight_streaming_training import StreamedCheckpointCall, check_streamed_training


__all__ = [
    "ALIGNMENT",
    "HOST_MEMORY_MODES",
    "WEIGHT_STREAMING_HOOK",
    "DiskWeightStreamer",
    "Magi2WeightStreamingMixin",
    "WeightStreamer",
    "WeightStreamingHook",
    "apply_weight_streaming",
    "check_weight_streaming_args",
    "pinned_bytes",
    "plan_pinned_arenas",
    "plan_streamed_file_sources",
    "remove_weight_streaming",
    "streaming_device_nbytes",
    "streaming_host_nbytes",
]

#: The :class:`~diffusers.hooks.HookRegistry` name of the streaming hook on each block.
WEIGHT_STREAMING_HOOK = "magi2_weight_streaming"

#: The host memory modes of :meth:`enable_weight_streaming`.
HOST_MEMORY_MODES = ("pinned", "disk")


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
    tensors = {id(b): streamed_tensors(b) for b in blocks}
    if host_memory == "disk" and sources is None:
        sources = plan_file_sources(model, list(tensors.values()))
    block_ids = {id(t) for ts in tensors.values() for t in ts}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) not in block_ids:
                t.data = t.data.to(device)
        for b in blocks if allocate else ():  # the blocks' tensors on the host first (block by block)
            for t in streamed_tensors(b):
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
    return plan_file_sources(model, [streamed_tensors(b) for b in blocks])


def streaming_host_nbytes(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], host_memory: str, ring_size: int, pinned: bool
) -> int:
    """Host bytes streaming ``blocks`` holds, with the pinned allocator's rounding when ``pinned`` (CUDA):
    ``"pinned"``: their packed buffers; ``"disk"``: the staging ring of ``ring_size`` buffers, the block tensors the
    files do not hold and a cast buffer (a ``ValueError`` where the files cannot be streamed, bytes not checked)."""
    sizes = [block_layout(b, i).nbytes for i, b in enumerate(blocks)]
    if host_memory == "disk":
        tensors = [streamed_tensors(b) for b in blocks]
        staging = next_pow2(max(sizes)) if pinned else max(sizes)
        return ring_size * staging + extra_host_nbytes(tensors, plan_file_sources(model, tensors, check_bytes=False))
    return pinned_bytes(sizes) if pinned else sum(sizes)


def streaming_device_nbytes(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], ring_size: int = 2) -> int:
    """Device bytes of ``model``'s weights, ``blocks`` streamed: all else plus ``ring_size`` slots of the largest."""
    sizes = [block_layout(b, i).nbytes for i, b in enumerate(blocks)]
    block_ids = {id(t) for b in blocks for t in streamed_tensors(b)}
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
            device: the compute device (``"cpu"`` runs the same ring in host memory).
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
