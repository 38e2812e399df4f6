"""FP8 routed experts (``expert_dtype="float8_e4m3fn"``): e4m3 banks with one fp32 scale per (expert, output
channel), ``W ~= q * s[n]`` (:mod:`.quantize` gives the rule).

The banks are frozen parameters and the scales fp32 buffers (``W_gate_scale``, ``W_up_scale``, ``W_down_scale``,
fp32 islands of the models); both keep their dtypes through dtype moves. The torch paths dequantize one expert (or
one head) at a time; the fused Triton kernel loads FP8 tiles, converts them to the activation dtype in registers
(exact) and scales its fp32 accumulators per output channel (compute capability 8.9 and newer). The hidden
activation is rounded to the activation dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .expert_storage import ExpertStorage, check_kernel_device
from .quantize import FP8_DTYPE, FP8_SCALE_NAMES, quantize_fp8


__all__ = ["Fp8ExpertStorage", "check_fp8_capability", "check_fp8_device"]


def check_fp8_capability(capability: Optional[tuple[int, int]], name: str = "this GPU") -> None:
    """Raise ``ValueError`` for FP8 experts on a CUDA ``capability`` below 8.9 (``None``: the interpreter, fine)."""
    if capability is not None and tuple(capability) < (8, 9):
        raise ValueError(
            f"FP8 (float8_e4m3fn) experts need a GPU with compute capability >= 8.9 for the Triton kernel; {name} "
            f"has {capability[0]}.{capability[1]}, without FP8 conversions or FP8 tensor cores. Load the experts in bf16 "
            '(expert_dtype=None) or int4 (expert_dtype="int4") on this GPU.'
        )


class Fp8ExpertStorage(ExpertStorage):
    """``float8_e4m3fn`` banks with fp32 per-output-channel scales ``[R, N]``."""

    expert_dtype = FP8_DTYPE
    scale_suffix = "_scale"
    scale_names = FP8_SCALE_NAMES
    keeps_dtype = True
    scaled_kernel = True
    kernel_scale_dtypes = (torch.float32,)
    config_name = "float8_e4m3fn"
    stored_label = "float8_e4m3fn"
    label = "FP8"
    repo_label = "an FP8"
    stored_as = "in FP8 (float8_e4m3fn with {name}_scale)"
    load_hint = " (the FP8 repo's config.json says so)"

    def __repr__(self) -> str:
        return "float8_e4m3fn"

    def stored_layout(self, shape):
        rows, _, n = shape
        return tuple(shape), FP8_DTYPE, (rows, n), torch.float32

    def quantize(self, bank: Tensor, *, name: str = "expert bank", first_row: int = 0, num_experts=None):
        return quantize_fp8(bank, name=name, first_row=first_row, num_experts=num_experts)

    def dequantize(self, bank: Tensor, scale: Optional[Tensor], *, out: Optional[Tensor] = None) -> Tensor:
        return bank.float().mul_(scale.unsqueeze(-2))

    def check_stored_checkpoint(self, name, scale_name, shape, full, infos) -> None:
        self.check_bank(name, shape, full)
        expected_scale = [full[0], full[2]]
        if scale_name not in infos:
            raise ValueError(
                f"{name} is FP8 but the checkpoint has no {scale_name} (its fp32 scale {expected_scale}, one per "
                "expert and output channel)"
            )
        scale_dtype, scale_shape = infos[scale_name]
        if list(scale_shape) != expected_scale or not scale_dtype.is_floating_point:
            raise ValueError(
                f"{scale_name}: checkpoint has {str(scale_dtype).removeprefix('torch.')}{list(scale_shape)}, expected "
                f"float32{expected_scale} (one scale per expert and output channel of {name})"
            )

    def describe_banks(self, count: int) -> str:
        return f"routed experts in FP8 (float8_e4m3fn): {count} banks, each with an fp32 _scale"

    def check_capability(self, capability, name: str = "this GPU") -> None:
        check_fp8_capability(capability, name)

    def describe(self) -> str:
        return ", expert_dtype=float8_e4m3fn"


def check_fp8_device(device: torch.device) -> None:
    """Raise ``ValueError`` if the fused kernel cannot run FP8 experts on ``device`` (CUDA below compute capability
    8.9; the interpreter runs them)."""
    check_kernel_device(Fp8ExpertStorage(), device)
