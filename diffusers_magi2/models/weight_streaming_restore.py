"""Ending weight streaming without running out of memory: where the streamed block weights go, and the budget checked
before any of them moves.

diffusers leaves weights where its offloading put them when the hooks are removed (group offloading: on the offload
device; accelerate's CPU offload: in host memory), and ``disable_weight_streaming()`` does the same by default: the
streamed block weights come back as plain host tensors, block by block (each block's host buffer is freed once its
tensors are copied out; the disk mode reads them from the files), and every other weight stays where it is. Asked for
a ``device``, they become resident there, refused before any of them moves when::

    bytes of the streamed blocks > free memory of the device     (CUDA: the driver's free bytes plus what torch's
                                                                   caching allocator holds unused)
    bytes of every weight         > vram_gb                       (the budget streaming was enabled with, when
                                                                   ``device`` is the device it streamed to)

The copies to a device are all made before any tensor points at them, so a copy that still fails (another process
took the memory) leaves streaming as it was: its hooks are removed only after the weights are in place. A freed
or restored streamer hands its pinned buffers back to the OS (:func:`return_pinned_memory`).
"""

from __future__ import annotations

from typing import Optional

import torch


__all__ = ["check_restore", "device_free_bytes", "return_pinned_memory"]


def return_pinned_memory(pinned: bool) -> None:
    """Hand freed pinned buffers back to the OS, where ``pinned`` ones were freed and CUDA is present: torch's pinned
    host allocator caches a freed block for a later pinned allocation, so a released stage would keep its arenas.
    Call once nothing points into them and the copies out of them have finished."""
    if pinned and torch.cuda.is_available():
        torch._C._host_emptyCache()


def device_free_bytes(device: torch.device) -> Optional[int]:
    """Bytes a new allocation on ``device`` can take (CUDA), ``None`` for host memory."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_restore(
    device, moved_nbytes: int, resident_nbytes: int, vram_gb: Optional[float], streamed_to: torch.device
) -> Optional[torch.device]:
    """Refuse making the streamed weights resident on ``device`` where they would not fit, before any moves.

    Args:
        device: where the streamed block weights go (``None``: host memory, nothing checked).
        moved_nbytes: bytes of the streamed block weights that would be copied there.
        resident_nbytes: bytes of every weight that is then resident there.
        vram_gb: the budget streaming was enabled with, GB (10^9 bytes), or ``None``.
        streamed_to: the device the weights streamed to (``vram_gb`` is its budget).

    Returns:
        ``device`` resolved (a CUDA device with its index), or ``None``.

    Raises:
        ValueError: a CUDA device where torch sees none, weights above ``vram_gb``, or above the device's free memory;
            the message says how to proceed.
    """
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"disable_weight_streaming(device={str(device)!r}): this torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    how = (
        "call disable_weight_streaming() without a device (the streamed weights then come back to host memory; move "
        "what fits yourself), or keep streaming"
    )
    if vram_gb is not None and device == streamed_to and resident_nbytes > vram_gb * 1e9:
        raise ValueError(
            f"disable_weight_streaming(device={str(device)!r}) would make {resident_nbytes / 1e9:.2f} GB of weights "
            f"resident there, above vram_gb={vram_gb} that streaming was enabled with; {how}"
        )
    free = device_free_bytes(device)
    if free is not None and moved_nbytes > free:
        raise ValueError(
            f"disable_weight_streaming(device={str(device)!r}) would copy {moved_nbytes / 1e9:.2f} GB of streamed "
            f"block weights there, which has {free / 1e9:.2f} GB free; {how}"
        )
    return device
