"""Unquantized routed experts: banks stored in ``params_dtype`` (bf16, fp16 or fp32), no scales.

The banks are trainable parameters, follow every dtype move, and reach a kernel as they are (fp32: the stored
tensors themselves; bf16/fp16: upcast exactly, one expert or one head at a time). The hidden activation is
rounded to the ``W_down`` dtype, as SandAI's kernel does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .expert_storage import ExpertStorage
from .quantize import raise_non_finite_weight


__all__ = ["UNQUANTIZED_DTYPES", "UnquantizedExpertStorage"]

#: the dtypes unquantized banks are stored in
UNQUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class UnquantizedExpertStorage(ExpertStorage):
    """Banks in ``dtype`` (:data:`UNQUANTIZED_DTYPES`), trainable, no scales.

    Args:
        dtype: the banks' dtype (the layer's object: at creation; a dtype move changes the banks, and the backends
            look the storage of the banks they get up again, :func:`~diffusers_magi2.moe.expert_formats.storage_of`).
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype

    def __repr__(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def stored_layout(self, shape):
        return tuple(shape), self.dtype, None, None

    def quantize(self, bank: Tensor, *, name: str = "expert bank", first_row: int = 0, num_experts=None):
        if not isinstance(bank, Tensor) or bank.dim() != 3 or not bank.is_floating_point():
            raise ValueError(f"{name}: expected a 3-D float expert bank [R, K, N]; got {getattr(bank, 'shape', bank)}")
        if not is_fake(bank) and not bool(torch.isfinite(bank).all()):
            raise_non_finite_weight(bank, name, first_row, num_experts, "the outputs of that expert")
        return bank.to(self.dtype), None

    def dequantize(self, bank: Tensor, scale: Optional[Tensor], *, out: Optional[Tensor] = None) -> Tensor:
        return bank.float()  # exact; no copy for fp32

    def head_banks(self, weights, scales, experts, dtype, scratch, dequantize_into=None):
        return [w[experts].to(dtype) for w in weights]  # a view when stored in dtype

    def hidden_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return self.dtype  # the W_down dtype

    def grad_dtype(self) -> torch.dtype:
        return self.dtype
