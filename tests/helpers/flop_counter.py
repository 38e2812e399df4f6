"""FLOP counting with ``torch.utils.flop_counter.FlopCounterMode``, including CPU attention.

torch does not count ``aten._scaled_dot_product_flash_attention_for_cpu``; this registers torch's own SDPA count
for it, ``2 B H Lq Lk (D + Dv)`` with ``H`` the query heads (grouped-query attention included; softmax not counted).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula, sdpa_flop_count


__all__ = ["register_cpu_sdpa_flop_formula", "count_flops"]

_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # grouped-query attention counted per query head (torch before 2.13 asserts equal head counts)
    heads = query_shape[1]
    key_shape, value_shape = ((b, heads, *rest) for b, _, *rest in (key_shape, value_shape))
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def register_cpu_sdpa_flop_formula() -> None:
    """Teach ``FlopCounterMode`` the CPU SDPA kernel (idempotent; a formula torch already has is kept)."""
    if _CPU_SDPA not in flop_registry:
        register_flop_formula(_CPU_SDPA)(_cpu_sdpa_flop)


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` under ``FlopCounterMode`` (CPU SDPA included); return ``(result, total FLOPs)``."""
    register_cpu_sdpa_flop_formula()
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, counter.get_total_flops()
