"""FP8 routed experts through diffusers' loading: a saved FP8 repo stays FP8, a bf16 repo is quantized while read.

diffusers 0.42 casts every floating checkpoint tensor to the load dtype, so with FP8 experts the routed-expert
tensors take this path (the rest stays diffusers'): FP8 banks are placed as stored with their fp32 scales, floating
banks are quantized (:func:`~diffusers_magi2.moe.quantize.quantize_fp8`) as each shard is read, so the full-precision
model never exists (peak: the FP8 model plus one shard). :func:`plan_fp8_expert_loading` checks the headers first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch
import torch.nn as nn

from ..moe.layer import Magi2MultiHeadMoE
from ..moe.quantize import FP8_DTYPE, quantize_fp8
from ..utils.safetensors_io import DTYPE_TO_TORCH, read_safetensors_header


__all__ = ["FP8ExpertShards", "expert_bank_names", "plan_fp8_expert_loading"]

_BANKS = ("W_gate", "W_up", "W_down")


def expert_bank_names(model: nn.Module) -> dict[str, tuple[Magi2MultiHeadMoE, str]]:
    """``{state-dict name: (MoE module, bank)}`` of every routed-expert bank of ``model``."""
    return {
        f"{path}.{bank}": (module, bank)
        for path, module in model.named_modules()
        if isinstance(module, Magi2MultiHeadMoE)
        for bank in _BANKS
    }


def _tensor_infos(
    state_dict: Mapping[str, torch.Tensor] | None, files: Sequence[Any], strict: bool
) -> dict[str, tuple[torch.dtype, tuple]]:
    """``{name: (dtype, shape)}`` of the checkpoint, from ``state_dict`` or the safetensors headers of ``files``."""
    if state_dict is not None:
        return {k: (v.dtype, tuple(v.shape)) for k, v in state_dict.items()}
    infos = {}
    for f in files:
        if isinstance(f, Mapping):
            infos.update({k: (v.dtype, tuple(v.shape)) for k, v in f.items()})
            continue
        if not str(f).endswith(".safetensors"):
            if strict:
                raise ValueError(f"routed experts in FP8 load from safetensors checkpoints; got {f}")
            continue  # a model without FP8 experts: nothing to check in a pickled checkpoint
        for name, t in read_safetensors_header(f).tensors.items():
            infos[name] = (DTYPE_TO_TORCH[t.dtype], tuple(t.shape))
    return infos


def plan_fp8_expert_loading(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None, files: Sequence[Any]
) -> tuple[set[str], set[str]]:
    """Check a checkpoint's routed-expert tensors against ``model`` before anything is read.

    Args:
        model: the model built for loading (meta banks; under EP, the local-size MoE layers).
        state_dict: the checkpoint when diffusers already read it (single file), else ``None``.
        files: the checkpoint's shard files.

    Returns:
        ``(quantized, filled)``: the banks quantized while read, and the scales this loader fills itself.

    Raises:
        ValueError: naming the tensor: FP8 banks in a model without FP8 experts, a missing or misshaped scale,
            a bank of the wrong shape or dtype, a scale beside a non-FP8 bank.
    """
    banks = expert_bank_names(model)
    if not banks:
        return set(), set()
    infos = _tensor_infos(state_dict, files, strict=any(module.fp8_experts for module, _ in banks.values()))
    quantized, filled = set(), set()
    for name, (module, bank) in banks.items():
        if name not in infos:
            continue  # a missing key: diffusers' (and the EP loader's) missing-key report names it
        dtype, shape = infos[name]
        scale_name = f"{name}_scale"
        full_rows = module.num_heads * module.num_experts
        expected = (full_rows, *getattr(module, bank).shape[1:])
        if not module.fp8_experts:
            if dtype == FP8_DTYPE or scale_name in infos:
                raise ValueError(
                    f"{name} is stored in FP8 (float8_e4m3fn with {scale_name}) but the model's routed experts are "
                    f"not: load it with expert_dtype='float8_e4m3fn' (the FP8 repo's config.json says so)"
                )
            continue
        if shape != expected:
            raise ValueError(f"{name}: checkpoint shape {list(shape)}, the model expects {list(expected)}")
        expected_scale = (full_rows, expected[2])
        if dtype == FP8_DTYPE:
            if scale_name not in infos:
                raise ValueError(
                    f"{name} is FP8 but the checkpoint has no {scale_name} (its fp32 scale "
                    f"{list(expected_scale)}, one per expert and output channel)"
                )
            scale_dtype, scale_shape = infos[scale_name]
            if scale_shape != expected_scale or not scale_dtype.is_floating_point:
                raise ValueError(
                    f"{scale_name}: checkpoint has {str(scale_dtype).removeprefix('torch.')}{list(scale_shape)}, "
                    f"expected float32{list(expected_scale)} (one scale per expert and output channel of {name})"
                )
        elif dtype.is_floating_point and dtype.itemsize >= 2:
            if scale_name in infos:
                raise ValueError(f"{scale_name} is in the checkpoint but {name} is {dtype}, not float8_e4m3fn")
            quantized.add(name)
            filled.add(scale_name)
        else:
            raise ValueError(
                f"{name}: checkpoint dtype {dtype}; routed experts load from float8_e4m3fn or a float dtype"
            )
    return quantized, filled


class FP8ExpertShards(Sequence):
    """Checkpoint shards as diffusers' loader reads them, the FP8 experts' tensors taken out and placed here.

    Each item is the shard's state dict without the FP8 layers' banks and scales, which go into ``model`` directly; the
    other tensors are handed on as copies, so the shard's memory map is released.

    Args:
        shards: shard paths or state dicts (possibly a :class:`~diffusers_magi2.loaders.expert_parallel_loading.RowShardedShards`).
        model: the model being loaded.
        device_map: the ``device_map`` diffusers loads with (``None``: CPU).
    """

    def __init__(self, shards: Sequence[Union[str, Mapping[str, torch.Tensor]]], model: nn.Module, device_map=None):
        self.shards = shards
        self.model = model
        self.device_map = device_map
        self.banks = {n: b for n, b in expert_bank_names(model).items() if b[0].fp8_experts}
        self.scales = {f"{n}_scale" for n in self.banks}

    def __len__(self) -> int:
        return len(self.shards)

    def _place(self, name: str, value: torch.Tensor) -> None:
        from accelerate.utils import set_module_tensor_to_device
        from diffusers.models.model_loading_utils import _determine_param_device

        device = _determine_param_device(name, self.device_map)
        if device == "disk":
            raise ValueError(f"{name}: routed experts in FP8 cannot be offloaded to disk by device_map")
        dtype = torch.float32 if name in self.scales else FP8_DTYPE
        set_module_tensor_to_device(self.model, name, device, value=value.to(dtype), dtype=dtype)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from diffusers.models.model_loading_utils import load_state_dict

        state = dict(load_state_dict(self.shards[index]))
        taken = [k for k in state if k in self.banks or k in self.scales]
        for name in taken:
            value = state.pop(name)
            if name in self.banks and value.dtype != FP8_DTYPE:
                module = self.banks[name][0]  # under expert parallelism: this rank's rows, from its first head's
                first_row = module.local_head_start * module.num_experts
                q, scale = quantize_fp8(value, name=name, first_row=first_row, num_experts=module.num_experts)
                del value
                self._place(f"{name}_scale", scale)
                value = q
            self._place(name, value)
        if taken:
            # the rest may be views of the shard's memory map, which would keep the pages of the banks just read
            # (quantized: their bf16 bytes) resident for the model's lifetime: own copies release the map
            state = {k: v.clone() for k, v in state.items()}
        return state
