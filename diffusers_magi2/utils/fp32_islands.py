"""The fp32-island rule: which tensors of a model stay float32 whatever the model's dtype.

A model class lists its islands in ``_keep_in_fp32_modules`` (diffusers' attribute). A tensor is an island
when one component of its dotted name equals a listed entry, the test diffusers' loader applies with
``from_pretrained(dtype=...)``: ``"transformer_blocks.3.mlp.moe_mlp.router.expert_bias"`` is an island
for ``["router"]``, ``"transformer_blocks.3.attention.linear_qkv.weight"`` is not for ``["q"]``. Dtype moves,
the converter and ``from_original_checkpoint`` ask :func:`is_fp32_island`; ``from_pretrained`` (expert-parallel
loading included) is diffusers' loader, which applies the same test.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["is_fp32_island"]


def is_fp32_island(name: str, keep_in_fp32_modules: Iterable[str] | None) -> bool:
    """Whether the parameter/buffer ``name`` is an fp32 island under ``keep_in_fp32_modules``.

    Args:
        name: dotted parameter or buffer name (SandAI's or diffusers' spelling: the rule reads components).
        keep_in_fp32_modules: a model class's ``_keep_in_fp32_modules`` (``None`` = no islands).
    """
    if not keep_in_fp32_modules:
        return False
    parts = set(name.split("."))
    return any(module in parts for module in keep_in_fp32_modules)
