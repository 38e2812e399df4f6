"""Peak-memory accounting for the memory plan: live tensor storages under a dispatch mode, and the CPU
allocator's own count.

:class:`LiveStorageTracker` is a ``TorchDispatchMode`` that adds every new storage an op returns to a running
total and drops it when the storage is freed (a weak reference), keeping the peak::

    live(t) = sum of nbytes of storages created inside the mode and still referenced at t;  peak = max_t live(t)

It works on real tensors and on ``FakeTensorMode`` tensors alike (a fake tensor carries its storage size), so a
model at the released size can be traced without its memory. Storages that exist before the mode (weights,
inputs) are not counted unless passed to :meth:`LiveStorageTracker.count`. It sees op outputs only: workspace an
op allocates and frees internally is added by the caller (:meth:`LiveStorageTracker.add_transient`).

:func:`cpu_allocator_peak` measures the other way, for the check: the CPU allocator's bytes allocated and not
yet freed while a function runs, read from ``torch.profiler``'s memory events (every allocation, op internals
included), as a peak above the level at entry.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


__all__ = ["LiveStorageTracker", "cpu_allocator_peak"]


class LiveStorageTracker(TorchDispatchMode):
    """Live bytes of the storages created under this mode, and their peak (module docstring).

    Attributes:
        live: bytes held now.
        peak: the largest ``live`` (plus any transient added at that moment) seen so far.
        peak_op: name of the op at which ``peak`` was reached.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0
        self.peak_op: Optional[str] = None

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (weights and inputs that exist before the traced call)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._sizes.setdefault(t.untyped_storage(), 0)

    def count(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages as live from now on (inputs made outside the mode)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        self._mark("count")

    def add_transient(self, nbytes: int, what: str) -> None:
        """A workspace of ``nbytes`` allocated and freed inside one op: a peak candidate, never live after."""
        if self.live + nbytes > self.peak:
            self.peak, self.peak_op = self.live + nbytes, what

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak, self.peak_op = self.live, None

    def _add(self, storage) -> None:
        if storage in self._sizes:
            return
        nbytes = int(storage.nbytes())
        self._sizes[storage] = nbytes
        self.live += nbytes
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _mark(self, what: str) -> None:
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, what

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        self._mark(str(func))
        return out


def cpu_allocator_peak(fn: Callable[[], object]) -> tuple[object, int]:
    """Run ``fn()`` under ``torch.profiler`` with memory profiling; return ``(result, peak)``, ``peak`` the largest
    number of CPU-allocator bytes allocated during the call and not yet freed (0 if nothing was allocated)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak
