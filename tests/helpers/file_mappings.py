"""Whether a tensor's bytes lie in a memory map of a file (``/proc/self/maps``): what safetensors hands out on the
CPU, file-backed pages rather than anonymous memory."""

from __future__ import annotations

import torch


def file_mapped(tensors: dict[str, torch.Tensor], suffix: str = ".safetensors") -> dict[str, bool]:
    """``{name: whether the tensor's first byte lies in a mapping of a file ending in suffix}`` (empty tensors, with
    no bytes, left out)."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(suffix):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                spans.append((start, end))
    return {n: any(a <= t.data_ptr() < b for a, b in spans) for n, t in tensors.items() if t.numel()}
