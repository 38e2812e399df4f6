"""The fp32-island rule: a tensor stays float32 when a component of its dotted name is in the model's
``_keep_in_fp32_modules`` (diffusers' loader applies the same test)."""

from __future__ import annotations

from collections.abc import Iterable


__all__ = ["is_fp32_island"]


def is_fp32_island(name: str, keep_in_fp32_modules: Iterable[str] | None) -> bool:
    """Whether the dotted parameter/buffer ``name`` is an fp32 island under ``keep_in_fp32_modules``."""
    if not keep_in_fp32_modules:
        return False
    parts = set(name.split("."))
    return any(module in parts for module in keep_in_fp32_modules)
