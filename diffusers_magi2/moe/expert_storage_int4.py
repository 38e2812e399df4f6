"""4-bit routed experts (``expert_dtype="int4"``): NF4 codes two per byte along ``N`` with one bf16 scale per
(expert, group of ``G`` rows of ``K``, output channel) (:mod:`.quantize_int4` gives the format and its rule).

The codes are frozen ``uint8`` parameters ``[R, K, N/2]`` and the scales bf16 buffers ``W_*_group_scale
[R, K/G, N]``; both keep their dtypes through dtype moves. Every path dequantizes one head's bank at a time into
reused buffers (the torch paths: fp32, by torch ops; the fused Triton kernel: the activation dtype, by
:mod:`.dequantize_triton`, then the kernel as for experts stored in that dtype, compute capability 8.0 and newer).
The hidden activation is rounded to the activation dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .expert_storage import ExpertMatrices, ExpertStorage, check_kernel_device
from .quantize_int4 import (
    INT4_GROUP_SIZE,
    INT4_PACKED_DTYPE,
    INT4_PACKING,
    INT4_SCALE_DTYPE,
    INT4_SCALE_NAMES,
    check_int4_bank_shape,
    check_int4_banks,
    dequantize_int4,
    int4_shapes,
    quantize_int4,
)


__all__ = ["Int4ExpertStorage", "check_int4_capability", "check_int4_device"]


def check_int4_capability(capability: Optional[tuple[int, int]], name: str = "this GPU") -> None:
    """Raise ``ValueError`` for int4 experts on a CUDA ``capability`` below 8.0 (``None``: the interpreter, fine)."""
    if capability is not None and tuple(capability) < (8, 0):
        raise ValueError(
            f"int4 experts need a GPU with compute capability >= 8.0 for the Triton kernel (it runs one head's "
            f"experts dequantized to bf16 on the tensor cores); {name} has {capability[0]}.{capability[1]}. Run them "
            "with set_moe_backend('torch') on this GPU."
        )


class Int4ExpertStorage(ExpertStorage):
    """NF4 codes ``uint8 [R, K, N/2]`` with bf16 group scales ``[R, K/G, N]``.

    Args:
        group_size: ``G``, rows of ``K`` per scale.
    """

    expert_dtype = "int4"
    scale_suffix = "_group_scale"
    scale_names = INT4_SCALE_NAMES
    keeps_dtype = True
    per_head_kernel = True
    kernel_scale_dtypes = (torch.bfloat16, torch.float16)
    config_name = "int4"
    stored_label = "int4 codes (uint8)"
    label = "int4"
    repo_label = "an int4"
    stored_as = "as int4 codes (uint8 with {name}_group_scale)"
    load_hint = " and the repo's expert_int4_group_size (its config.json says so)"

    def __init__(self, group_size: int = INT4_GROUP_SIZE) -> None:
        self.group_size = group_size

    def __repr__(self) -> str:
        return "int4"

    def stored_layout(self, shape):
        (packed, scale) = int4_shapes(tuple(shape), self.group_size)
        return packed, INT4_PACKED_DTYPE, scale, INT4_SCALE_DTYPE

    def logical_shape(self, stored_shape):
        rows, k, half = stored_shape
        return rows, k, 2 * half

    def check_banks(self, head_dim: int, expert_dim: int, key: str = "group_size") -> None:
        check_int4_banks(head_dim, expert_dim, self.group_size, key)

    def check_bank(self, name, shape, expected, key: str = "group_size") -> None:
        super().check_bank(name, shape, expected)
        check_int4_bank_shape(tuple(shape), self.group_size, name, key)

    def quantize(self, bank: Tensor, *, name: str = "expert bank", first_row: int = 0, num_experts=None):
        return quantize_int4(bank, self.group_size, name=name, first_row=first_row, num_experts=num_experts)

    def dequantize(self, bank: Tensor, scale: Optional[Tensor], *, out: Optional[Tensor] = None) -> Tensor:
        return dequantize_int4(bank, scale, out=out)

    def _stored_dim(self, name: str, size: int) -> str:
        return f"{name}/2={size}/2"

    def check_kernel_scales(self, weights, scales, head_dim: int, expert_dim: int) -> None:
        flat = weights[0].shape[0]
        if scales is not None and not (scales[0].dim() == 3 and self._group_of(scales[0], head_dim, expert_dim)):
            raise ValueError(
                f"w_gate_scale must be [H*E={flat}, Dh/G, De={expert_dim}] with a group size G dividing Dh={head_dim} "
                f"and De={expert_dim}; got {tuple(scales[0].shape)}"
            )
        super().check_kernel_scales(weights, scales, head_dim, expert_dim)

    @staticmethod
    def _group_of(scale: Tensor, k: int, other_k: int) -> int:
        """``G`` of a group scale ``[R, K/G, N]`` of a bank with ``K = k`` that also divides ``other_k`` (else 0)."""
        groups = scale.shape[1]
        group = k // groups if groups and k % groups == 0 else 0
        return group if group and other_k % group == 0 else 0

    @classmethod
    def of_scale(cls, w_gate_scale: Optional[Tensor], head_dim: int) -> "Int4ExpertStorage":
        """The storage of int4 banks whose ``W_gate`` group scale is ``w_gate_scale`` (``K = head_dim``)."""
        if w_gate_scale is None or w_gate_scale.dim() != 3 or not w_gate_scale.shape[1]:
            return cls()
        return cls(max(1, head_dim // w_gate_scale.shape[1]))

    def head_banks(self, weights, scales, experts, dtype, scratch, dequantize_into=None):
        banks = []
        for i, (w, s) in enumerate(zip(weights, scales)):
            w, s = w[experts], s[experts]
            if dequantize_into is None and dtype != torch.float32:  # the torch code writes fp32 buffers only
                banks.append(self.dequantize(w, s).to(dtype))
                continue
            if scratch[i] is None:
                scratch[i] = torch.empty(*w.shape[:2], 2 * w.shape[2], dtype=dtype, device=w.device)
            if dequantize_into is None:
                banks.append(self.dequantize(w, s, out=scratch[i]))
            else:
                banks.append(dequantize_into(w, s, scratch[i]))
        return banks

    def expert_matrices(self, weights, scales):
        return _HeadAtATime(self, weights, scales)

    def device_dequantizer(self):
        return _triton_dequantize_into

    def kernel_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return act_dtype  # the dequantized banks

    def check_stored_checkpoint(self, name, scale_name, shape, full, infos) -> None:
        packed_shape, _, scale_shape, _ = self.stored_layout(full)
        if tuple(shape) != packed_shape:
            raise ValueError(
                f"{name}: checkpoint has uint8{list(shape)}, the model expects uint8{list(packed_shape)} (int4 codes "
                f"of [H*E, K, N] = {list(full)}, two per byte along N)"
            )
        if scale_name not in infos:
            raise ValueError(
                f"{name} holds int4 codes but the checkpoint has no {scale_name} (its bf16 group scales "
                f"{list(scale_shape)})"
            )
        scale_dtype, stored = infos[scale_name]
        k, group = full[1], self.group_size
        if (
            scale_dtype == INT4_SCALE_DTYPE
            and len(stored) == 3
            and (stored[0], stored[2]) == (scale_shape[0], scale_shape[2])
            and 0 < stored[1] != scale_shape[1]
            and k % stored[1] == 0
        ):
            raise ValueError(
                f"{scale_name} {list(stored)} was written with expert_int4_group_size={k // stored[1]} "
                f"(K={k} / {stored[1]} groups), but the model is built with expert_int4_group_size={group}: load the "
                f"repo with the group size it was written with (its config.json; drop an expert_int4_group_size "
                "argument), or quantize a bf16 repo at the size you want"
            )
        if (scale_dtype, tuple(stored)) != (INT4_SCALE_DTYPE, scale_shape):
            raise ValueError(
                f"{scale_name}: checkpoint has {str(scale_dtype).removeprefix('torch.')}{list(stored)}, expected "
                f"bfloat16{list(scale_shape)} (one scale per expert, group of {group} rows and output channel of "
                f"{name})"
            )

    def refuse_source_dtype(self, name: str, scale_name: str, dtype) -> None:
        raise ValueError(
            f"{name}: checkpoint dtype {dtype}; int4 routed experts load from int4 codes (uint8 with {scale_name}) or "
            "a float dtype (bf16, fp16, fp32: quantized while read)"
        )

    def config_entries(self) -> dict:
        return {"expert_int4_group_size": self.group_size, "expert_int4_packing": INT4_PACKING}

    def describe_banks(self, count: int) -> str:
        return (
            f"routed experts in int4 (NF4, group size {self.group_size}): {count} banks, each with a bf16 _group_scale"
        )

    def check_capability(self, capability, name: str = "this GPU") -> None:
        check_int4_capability(capability, name)

    def describe(self) -> str:
        return f", expert_dtype=int4, group_size={self.group_size}"


def _triton_dequantize_into(packed: Tensor, scale: Tensor, out: Tensor) -> Tensor:
    """Codes into ``out`` by the Triton dequantization kernel (:mod:`.dequantize_triton`, imported on first use)."""
    from .dequantize_triton import dequantize_int4_into

    dequantize_int4_into(packed, scale, out)
    return out


def check_int4_device(device: torch.device) -> None:
    """Raise ``ValueError`` if the fused kernel cannot run int4 experts on ``device`` (CUDA below compute
    capability 8.0; the interpreter runs them)."""
    check_kernel_device(Int4ExpertStorage(), device)


class _HeadAtATime(ExpertMatrices):
    """:meth:`Int4ExpertStorage.expert_matrices`: three sequences of fp32 ``[K, N]`` matrices indexed by row ``g``,
    each head's bank dequantized into three reused fp32 buffers by :meth:`load_head`."""

    def __init__(self, storage: Int4ExpertStorage, weights, scales) -> None:
        super().__init__([_HeadRows(self, i) for i in range(3)])
        self.storage, self.weights, self.scales = storage, weights, scales
        self.scratch, self.rows, self.first = [None] * 3, [()] * 3, 0

    def load_head(self, experts: slice) -> None:
        banks = self.storage.head_banks(self.weights, self.scales, experts, torch.float32, self.scratch)
        self.rows, self.first = [b.unbind(0) for b in banks], experts.start


class _HeadRows:
    def __init__(self, owner: _HeadAtATime, index: int) -> None:
        self.owner, self.index = owner, index

    def __getitem__(self, g: int) -> Tensor:
        return self.owner.rows[self.index][g - self.owner.first]
