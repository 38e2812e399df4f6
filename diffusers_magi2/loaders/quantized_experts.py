"""Quantized routed experts through diffusers' loading (FP8 and int4): a saved quantized repo loads as stored, a bf16
repo is quantized while read.

diffusers 0.42 casts every floating checkpoint tensor to the load dtype, so with quantized experts the routed-expert
tensors take this path (the rest stays diffusers'): stored banks are placed as they are with their scales (FP8:
``float8_e4m3fn`` with fp32 ``W_*_scale``; int4: ``uint8`` codes with bf16 ``W_*_group_scale``), floating banks are
quantized (:func:`~diffusers_magi2.moe.quantize.quantize_fp8`,
:func:`~diffusers_magi2.moe.quantize_int4.quantize_int4`) as each shard is read, so the full-precision model never
exists (peak: the quantized model plus one shard). :func:`plan_quantized_expert_loading` checks the headers first,
before any tensor is read: a stored int4 bank must come with group scales of the model's group size, and a scale
of another group size names the config key ``expert_int4_group_size``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from ..moe.expert_formats import stored_format
from ..moe.expert_storage import BANKS as _BANKS
from ..moe.expert_storage import ExpertStorage
from ..moe.layer import Magi2MultiHeadMoE
from ..moe.quantize import EXPERT_DTYPES, parse_expert_dtype
from ..parallel.distributed import first_failure_on_any_rank
from ..parallel.expert_parallel import Magi2ExpertParallelGroup
from ..utils.safetensors_io import DTYPE_TO_TORCH, check_safetensors_file, read_safetensors_header


__all__ = [
    "QuantizedExpertShards",
    "check_checkpoint_bank",
    "check_quantized_expert_arguments",
    "expert_bank_names",
    "plan_quantized_expert_loading",
]


def expert_bank_names(model: nn.Module) -> dict[str, tuple[Magi2MultiHeadMoE, str]]:
    """``{state-dict name: (MoE module, bank)}`` of every routed-expert bank of ``model``."""
    return {
        f"{path}.{bank}": (module, bank)
        for path, module in model.named_modules()
        if isinstance(module, Magi2MultiHeadMoE)
        for bank in _BANKS
    }


def _scale_name(bank_name: str, module: Magi2MultiHeadMoE, bank: str) -> str:
    """The state-dict name of ``bank_name``'s scale in ``module``'s expert storage."""
    return f"{bank_name.rsplit('.', 1)[0]}.{module.expert_scale_names[_BANKS.index(bank)]}"


def _full_shape(module: Magi2MultiHeadMoE, bank: str) -> tuple[int, int, int]:
    """``[H E, K, N]`` of an unquantized bank of ``module`` (all heads)."""
    rows, dh, de = module.num_heads * module.num_experts, module.head_dim, module.expert_intermediate_size
    return (rows, de, dh) if bank == "W_down" else (rows, dh, de)


def check_quantized_expert_arguments(pretrained_model_name_or_path: Union[str, os.PathLike], kwargs: Mapping) -> bool:
    """Check ``from_pretrained``'s expert arguments against a local repo's ``config.json``, before anything loads.

    A bf16 repo takes any ``expert_dtype`` (quantized while read). A quantized repo (FP8 or int4) loads only as it
    is stored: an explicit ``expert_dtype`` other than its own (another quantization, or ``None`` for the load
    dtype) would need its stored codes re-quantized or dequantized, which loading does not do, so it is refused
    (diffusers keeps a quantized checkpoint's own ``quantization_config`` over a passed one with a warning; here the
    argument names the storage wanted, and loading another in its place would be a silent fallback). With int4, an
    ``expert_int4_group_size`` or ``expert_int4_packing`` other than the repo records would reinterpret its codes.
    A Hub repo's stored dtypes and scales are checked from the headers (:func:`plan_quantized_expert_loading`).

    Returns:
        whether the routed experts load quantized (``expert_dtype`` passed, or the local config's).

    Raises:
        ValueError: naming the config key, the repo's value and the one passed, and what is allowed.
    """
    path = Path(pretrained_model_name_or_path) / (kwargs.get("subfolder") or "") / "config.json"
    saved = {}
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}  # diffusers' own config loading names the problem
    saved = saved if isinstance(saved, dict) else {}
    expert_dtype = kwargs.get("expert_dtype", saved.get("expert_dtype"))
    stored = saved.get("expert_dtype")
    if (
        stored in EXPERT_DTYPES[1:]
        and "expert_dtype" in kwargs
        and parse_expert_dtype(expert_dtype) != parse_expert_dtype(stored)
    ):
        raise ValueError(
            f"expert_dtype={_dtype_name(expert_dtype)!r}: the routed experts of {path.parent} are stored as "
            f"{stored} (its config.json has expert_dtype={stored!r}), and a quantized repo loads only as stored; "
            f"drop the argument (or pass expert_dtype={stored!r}), or load a bf16 repo with "
            f"expert_dtype={_dtype_name(expert_dtype)!r}"
            + (" to quantize it while reading" if expert_dtype is not None else "")
        )
    if stored == "int4" and expert_dtype == "int4":
        for key in ("expert_int4_group_size", "expert_int4_packing"):
            if key in kwargs and key in saved and kwargs[key] != saved[key]:
                raise ValueError(
                    f"{key}={kwargs[key]!r}: the routed experts of {path.parent} were written as int4 with "
                    f"{key}={saved[key]!r} (its config.json), and their codes and scales cannot be read otherwise; "
                    f"drop the argument, or quantize a bf16 repo with expert_dtype='int4', {key}={kwargs[key]!r}"
                )
    return expert_dtype is not None


def _dtype_name(expert_dtype) -> Union[str, None]:
    """An ``expert_dtype`` argument as its config name (``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``)."""
    return str(expert_dtype).removeprefix("torch.") if isinstance(expert_dtype, torch.dtype) else expert_dtype


def _tensor_infos(
    state_dict: Mapping[str, torch.Tensor] | None, files: Sequence[Any], strict: bool
) -> dict[str, tuple[torch.dtype, tuple]]:
    """``{name: (dtype, shape)}`` of the checkpoint, from ``state_dict`` or the safetensors headers of ``files``
    (``strict``: every file must be safetensors and hold every tensor's bytes)."""
    if state_dict is not None:
        return {k: (v.dtype, tuple(v.shape)) for k, v in state_dict.items()}
    infos = {}
    for f in files:
        if isinstance(f, Mapping):
            infos.update({k: (v.dtype, tuple(v.shape)) for k, v in f.items()})
            continue
        if not str(f).endswith(".safetensors"):
            if strict:
                raise ValueError(f"quantized routed experts load from safetensors checkpoints; got {f}")
            continue  # a model without quantized experts: nothing to check in a pickled checkpoint
        if strict:
            check_safetensors_file(f)  # a truncated shard names the tensors cut off
        header = read_safetensors_header(f)
        for name, t in header.tensors.items():
            infos[name] = (DTYPE_TO_TORCH[t.dtype], tuple(t.shape))
    return infos


def check_checkpoint_bank(
    name: str, storage: ExpertStorage, scale_name: Optional[str], dtype, shape, full, infos
) -> bool:
    """Check checkpoint bank ``name`` (``dtype``, ``shape``; its neighbours in ``infos``) against a layer bank of
    ``full [R, K, N]`` stored as ``storage``, before anything is read; returns whether it is quantized while read.

    A bank stored in another quantized format is refused (a quantized repo loads only as stored); one stored in
    this format is checked with its scale (:meth:`~diffusers_magi2.moe.expert_storage.ExpertStorage.check_stored_checkpoint`),
    a float one is quantized while read; unquantized experts leave the rest to diffusers.

    Raises:
        ValueError: naming the tensor and what is allowed.
    """
    stored = stored_format(name, dtype, infos, storage)
    if stored is not None and stored.scale_names and not isinstance(storage, stored):
        how = (
            f"{name} is stored {stored.stored_as.format(name=name)} but the model's routed experts are {storage.label}"
        )
        if storage.scale_names:
            raise ValueError(
                f"{how}: {stored.repo_label} repo loads only as stored (its config.json has "
                f"expert_dtype={stored.config_name!r}); drop expert_dtype, or load a bf16 repo with "
                f"expert_dtype={storage.config_name!r}"
            )
        raise ValueError(f"{how}: load it with expert_dtype={stored.config_name!r}{stored.load_hint}")
    if not storage.scale_names:
        return False
    if stored is None:
        storage.refuse_source_dtype(name, scale_name, dtype)
    if isinstance(storage, stored):
        storage.check_stored_checkpoint(name, scale_name, shape, full, infos)
        return False
    storage.check_float_checkpoint(name, scale_name, dtype, shape, full, infos)
    return True


def plan_quantized_expert_loading(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None, files: Sequence[Any]
) -> tuple[set[str], set[str]]:
    """Check a checkpoint's routed-expert tensors against ``model`` before anything is read.

    Args:
        model: the model built for loading (meta banks; under EP, still the full-size MoE layers).
        state_dict: the checkpoint when diffusers already read it (single file), else ``None``.
        files: the checkpoint's shard files.

    Returns:
        ``(quantized, filled)``: the banks quantized while read, and the scales this loader fills itself.

    Raises:
        ValueError: naming the tensor: quantized banks (or scales) in a model whose experts are stored otherwise, a
            missing or misshaped scale, a bank of the wrong shape or dtype, a scale beside a float bank, the bytes of
            a tensor missing from a truncated shard; an int4 scale written at another group size also names
            ``expert_int4_group_size``.
    """
    banks = expert_bank_names(model)
    if not banks:
        return set(), set()
    infos = _tensor_infos(state_dict, files, strict=any(module.expert_scale_names for module, _ in banks.values()))
    quantized, filled = set(), set()
    for name, (module, bank) in banks.items():
        if name not in infos:
            continue  # a missing key: diffusers' (and the EP loader's) missing-key report names it
        dtype, shape = infos[name]
        storage = module.expert_storage
        scale_name = _scale_name(name, module, bank) if storage.scale_names else None
        to_quantize = check_checkpoint_bank(name, storage, scale_name, dtype, shape, _full_shape(module, bank), infos)
        if to_quantize:
            quantized.add(name)
            filled.add(scale_name)
    return quantized, filled


def place_as_stored(model: nn.Module, name: str, value: torch.Tensor, device_map, what: str) -> None:
    """Put checkpoint tensor ``value`` into ``model`` as ``name`` in its own dtype (not the load dtype), where
    diffusers' ``device_map`` puts it; on the CPU a view of the shard's memory map stays one (no copy).

    Raises:
        ValueError: the ``device_map`` offloads ``name`` to disk (``what`` names the kind of tensor).
    """
    from accelerate.utils import set_module_tensor_to_device
    from diffusers.models.model_loading_utils import _determine_param_device

    device = _determine_param_device(name, device_map)
    if device == "disk":
        raise ValueError(f"{name}: {what} cannot be offloaded to disk by device_map")
    set_module_tensor_to_device(model, name, device, value=value, dtype=value.dtype)


class QuantizedExpertShards(Sequence):
    """Checkpoint shards as diffusers' loader reads them, the quantized experts' tensors taken out and placed here.

    Each item is the shard's state dict without the quantized layers' banks and scales, which go into ``model``
    directly (a float bank quantized first, with the row of its first expert in the messages); the other tensors are
    handed on as copies where a bank was quantized from the shard, so its memory map is released, else as read.

    Under expert parallelism each rank quantizes its own rows, so a non-finite weight is seen by the rank that holds
    it only: after each shard with banks to quantize the ranks agree (one all-reduce of a flag,
    :func:`~diffusers_magi2.parallel.distributed.first_failure_on_any_rank`), and every rank raises the same error,
    the group left usable, rather than one rank raising while the others return a model that waits at its first
    collective.

    Args:
        shards: shard paths or state dicts (possibly a :class:`~diffusers_magi2.loaders.expert_parallel_loading.RowShardedShards`).
        model: the model being loaded.
        device_map: the ``device_map`` diffusers loads with (``None``: CPU).
        ep: the expert-parallel group loading the model (``None``: one process).
    """

    def __init__(
        self,
        shards: Sequence[Union[str, Mapping[str, torch.Tensor]]],
        model: nn.Module,
        device_map=None,
        ep: Optional[Magi2ExpertParallelGroup] = None,
    ):
        self.shards = shards
        self.model = model
        self.device_map = device_map
        self.ep = ep if ep is not None and ep.size > 1 else None
        self.banks = {n: b for n, b in expert_bank_names(model).items() if b[0].expert_scale_names}
        self.scales = {_scale_name(n, module, bank): n for n, (module, bank) in self.banks.items()}
        # the stored dtype of every tensor placed here (the meta model's banks, its scale buffers)
        self.dtypes = {n: model.get_parameter(n).dtype for n in self.banks}
        self.dtypes.update({n: model.get_buffer(n).dtype for n in self.scales})

    def __len__(self) -> int:
        return len(self.shards)

    def _place(self, name: str, value: torch.Tensor) -> None:
        place_as_stored(self.model, name, value.to(self.dtypes[name]), self.device_map, "quantized routed experts")

    def _quantize(self, name: str, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stored bank, scale)`` of float bank ``name`` (under expert parallelism: this rank's rows)."""
        module = self.banks[name][0]
        first_row = module.local_head_start * module.num_experts
        return module.expert_storage.quantize(value, name=name, first_row=first_row, num_experts=module.num_experts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from diffusers.models.model_loading_utils import load_state_dict

        state = dict(load_state_dict(self.shards[index]))
        taken = [k for k in state if k in self.banks or k in self.scales]
        # the same names and dtypes on every EP rank (the same files, cut to rows): all agree on the same shards
        agree = self.ep is not None and any(k in self.banks and state[k].dtype != self.dtypes[k] for k in taken)
        failure, quantized = None, False
        for name in taken:
            value = state.pop(name)
            if name in self.banks and value.dtype != self.dtypes[name]:
                quantized = True
                try:
                    stored, scale = self._quantize(name, value)
                except ValueError as err:  # a non-finite weight in this rank's rows
                    if not agree:
                        raise
                    failure = str(err)
                    break
                del value
                module, bank = self.banks[name]
                self._place(_scale_name(name, module, bank), scale)
                value = stored
            self._place(name, value)
        if agree:
            failure = first_failure_on_any_rank(failure, self.ep.group, torch.device(self.ep.device_type))
            if failure is not None:
                raise ValueError(failure)
        if quantized:
            # the rest may be views of the shard's memory map, which would keep the pages of the float banks just
            # read and quantized resident for the model's lifetime: own copies release the map. Stored banks are
            # themselves views of it, so then the rest stays views too (file-backed pages, no anonymous copy).
            state = {k: v.clone() for k, v in state.items()}
        return state
