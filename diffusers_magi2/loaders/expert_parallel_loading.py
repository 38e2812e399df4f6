"""Expert-parallel loading: ``from_pretrained(expert_parallel=...)`` and ``enable_expert_parallel`` load or cut
only this rank's routed experts.

It is diffusers' ``ModelMixin.from_pretrained`` with one step changed: on the meta model every
``Magi2MultiHeadMoE`` becomes its local-size twin (this rank's heads), and the shards reach diffusers' loader
through :class:`RowShardedShards`, cut to this rank's rows (:data:`EP_SHARDED_SUFFIXES`), so no rank allocates
another's experts. Quantized (FP8 or int4) experts load in a step of their own
(:mod:`diffusers_magi2.loaders.quantized_experts`) after the cut.

Rows: an EP-sharded tensor is ``[H E, ...]`` (row ``h E + e``); rank ``r`` keeps rows ``[local_head_start E,
+local_num_heads E)``, zero past ``H E`` (SandAI's per-rank loading rule). From a safetensors file the rows are read
into their own buffer (:func:`~diffusers_magi2.utils.safetensors_io.read_rows`), never through a memory map of the
whole tensor: safetensors' ``get_slice`` and ``load_file`` map (and the former materialises) the full tensor, and a
map that other loaded tensors keep alive keeps every page the slicing read resident, the full bank's share of them.

No tensor of a full expert bank exists on a rank at any step: the model is built with its MoE tensors on meta
(:func:`~diffusers_magi2.moe.layer.moe_tensors_on_meta`), each bank is read as this rank's rows only, quantizing
at load sees only those rows, and :func:`apply_expert_parallel` (a model already in memory) copies each layer's
rows and frees that layer's full tensors before the next.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn as nn

from ..moe.layer import Magi2MultiHeadMoE, moe_tensors_on_meta
from ..parallel.expert_parallel import (
    Magi2ExpertParallelConfig,
    Magi2ExpertParallelGroup,
    check_same_on_all_ranks,
    resolve_expert_parallel,
    warn_if_idle,
)
from ..utils.safetensors_io import (
    check_safetensors_file,
    read_index,
    read_rows,
    read_safetensors_header,
    record_loaded_files,
    take_rows,
)
from .quantized_experts import QuantizedExpertShards, check_quantized_expert_arguments, plan_quantized_expert_loading


__all__ = [
    "EP_SHARDED_SUFFIXES",
    "RowShard",
    "RowShardedShards",
    "ExpertParallelLoaderMixin",
    "apply_expert_parallel",
    "ep_row_plan",
    "local_experts_for_loading",
]

#: names (relative to a ``Magi2MultiHeadMoE``) of the tensors split across EP ranks along dim 0.
EP_SHARDED_SUFFIXES = Magi2MultiHeadMoE._EP_SHARDED_KEYS

# the EP group of the from_pretrained call in progress (read by the _load_pretrained_model hook)
_LOADING_EP_GROUP: contextvars.ContextVar[Optional[Magi2ExpertParallelGroup]] = contextvars.ContextVar(
    "magi2_loading_ep_group", default=None
)


class RowShard(NamedTuple):
    """This rank's rows of one row-sharded tensor: ``[row_start, row_start + num_rows)`` of ``full_rows``."""

    row_start: int
    num_rows: int
    full_rows: int


class RowShardedShards(Sequence):
    """Checkpoint shards as state dicts, each row-sharded tensor cut to this rank's rows (:func:`take_rows`).

    Stands in for the shard list of diffusers' ``_load_pretrained_model`` (``load_state_dict`` passes a dict through).

    A safetensors shard is read key by key: the planned tensors' rows with ``read_rows`` (no full-size tensor, no
    map), the others as diffusers reads them (memory-mapped). A state dict or another file format is read whole and cut.

    Args:
        shards: shard file paths, or already loaded (memory-mapped) state dicts.
        plan: tensor name -> its :class:`RowShard`.

    Raises (when a shard is read):
        ValueError: a planned tensor's dim 0 is not its ``full_rows`` (e.g. an already sharded checkpoint).
    """

    def __init__(self, shards: Sequence[Union[str, Mapping[str, torch.Tensor]]], plan: Mapping[str, RowShard]):
        self.shards = list(shards)
        self.plan = dict(plan)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        shard = self.shards[index]
        if not isinstance(shard, Mapping) and str(shard).endswith(".safetensors"):
            return self._read_safetensors(str(shard))
        from diffusers.models.model_loading_utils import load_state_dict

        state = dict(load_state_dict(shard))
        for key in self.plan.keys() & state.keys():
            self._check_rows(key, state[key].shape[0])
            row_start, num_rows, _ = self.plan[key]
            state[key] = take_rows(state[key], row_start, num_rows, key).clone()
        return state

    def _check_rows(self, key: str, rows: int) -> None:
        """ValueError unless tensor ``key`` of the checkpoint has the planned full row count."""
        if rows != self.plan[key].full_rows:
            raise ValueError(
                f"{key}: checkpoint has {rows} rows, expected num_heads·num_experts = {self.plan[key].full_rows} "
                "(expert-parallel loading needs the unsharded checkpoint)"
            )

    def _read_safetensors(self, path: str) -> dict[str, torch.Tensor]:
        """One safetensors shard: planned tensors as this rank's rows (``read_rows``), the rest memory-mapped."""
        from safetensors import safe_open

        header = read_safetensors_header(path)
        planned = self.plan.keys() & header.tensors.keys()
        for key in planned:
            self._check_rows(key, header.tensors[key].shape[0] if header.tensors[key].shape else 0)
        with safe_open(path, framework="pt") as handle:
            state = {key: handle.get_tensor(key) for key in handle.keys() if key not in planned}
        for key in sorted(planned):
            row_start, num_rows, _ = self.plan[key]
            state[key] = read_rows(header, key, row_start, num_rows)
        return state


def _moe_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Magi2MultiHeadMoE)]


def _local_twin(moe: Magi2MultiHeadMoE, ep: Magi2ExpertParallelGroup) -> Magi2MultiHeadMoE:
    """A MoE layer like ``moe`` holding only this rank's heads, its tensors on meta, with the exchange ``moe``'s
    gives for the new layout (a context-parallel layer stays context parallel).

    Raises:
        ValueError: the EP group does not fit ``moe``'s exchange (e.g. EP ranks that do not tile the CP ranks).
    """
    with moe_tensors_on_meta():
        local = type(moe)(moe.config, ep_group=ep.group, ep_rank=ep.rank, ep_size=ep.size)
    local.exchange = moe.exchange.for_expert_parallel(local.ep_layout, ep.group)
    local.train(moe.training)
    local._backend, local._deterministic = moe._backend, moe._deterministic
    return local


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted path ``name`` of ``model``."""
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def _swap_in_local_moes(model: nn.Module, ep: Magi2ExpertParallelGroup) -> None:
    """Replace every MoE layer of the meta model by its :func:`_local_twin`."""
    moes = _moe_modules(model)
    for name, moe in moes:
        _set_submodule(model, name, _local_twin(moe, ep))
    if moes:
        warn_if_idle(model.get_submodule(moes[0][0]).ep_layout)  # the first layer's head layout


def ep_row_plan(model: nn.Module) -> dict[str, RowShard]:
    """``{state-dict name: RowShard}`` of every EP-sharded tensor of a model whose MoE layers hold this rank's heads."""
    return {
        f"{name}.{suffix}": RowShard(
            m.local_head_start * m.num_experts, m.local_flatten_num_experts, m.num_heads * m.num_experts
        )
        for name, m in _moe_modules(model)
        for suffix in EP_SHARDED_SUFFIXES + m.expert_scale_names
    }


def local_experts_for_loading(model: nn.Module, config: Magi2ExpertParallelConfig, fingerprint: dict) -> dict:
    """Prepare a meta model built under :func:`~diffusers_magi2.moe.layer.moe_tensors_on_meta` for an
    expert-parallel load: check ``fingerprint`` is the same on every rank, swap in this rank's MoE layers and return
    :func:`ep_row_plan` (``{}`` for one rank).

    Raises:
        ValueError: EP set-up errors, or ranks disagreeing on ``fingerprint``.
    """
    ep = resolve_expert_parallel(config)
    check_same_on_all_ranks(fingerprint, ep, "checkpoint or config")
    if ep.size == 1:
        return {}
    _swap_in_local_moes(model, ep)
    return ep_row_plan(model)


def _public_config(model: nn.Module) -> dict:
    """The model's config without diffusers' private ``_*`` entries (e.g. the load path)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {"class": type(model).__name__}
    return {k: v for k, v in dict(cfg).items() if not k.startswith("_")}


def apply_expert_parallel(model: nn.Module, config: Magi2ExpertParallelConfig) -> nn.Module:
    """Shard an in-memory model's routed experts over the EP group; returns ``model``.

    Every ``Magi2MultiHeadMoE`` becomes a twin holding this rank's heads (zero rows for padded ones) and the
    exchange of its layer's setting (:func:`_local_twin`: before or after ``enable_parallelism``); all ranks call it
    with the same config (one ``all_gather_object`` checks).

    Raises:
        ValueError: EP set-up errors, ranks disagreeing on the config, no MoE layer, already sharded, or EP groups
            that do not tile the context-parallel ranks (raised at the first layer, before any is cut).
    """
    ep = resolve_expert_parallel(config)
    moes = _moe_modules(model)
    if not moes:
        raise ValueError(f"{type(model).__name__} has no Magi2MultiHeadMoE layer to shard")
    if any(getattr(m, "ep_size", 1) != 1 for _, m in moes):
        raise ValueError("expert parallelism is already enabled on this model")
    check_same_on_all_ranks(_public_config(model), ep, "transformer config")
    if ep.size == 1:
        return model
    for name, full in moes:  # one layer at a time: its full tensors are freed before the next layer is cut
        local = _local_twin(full, ep)
        with torch.no_grad():  # every MoE tensor is [H E, ...]: this rank's rows, in their own storage
            rows = {key: local.ep_slice(t).clone() for key, t in full.state_dict().items()}
        local.load_state_dict(rows, strict=True, assign=True)
        for n, p in local.named_parameters():
            p.requires_grad_(full.get_parameter(n).requires_grad)
        _set_submodule(model, name, local)
        full.to_empty(device="meta")  # free the full bank, even where the caller still holds the old layer
    warn_if_idle(model.get_submodule(moes[0][0]).ep_layout)
    return model


def _check_load_kwargs(kwargs: dict) -> None:
    """Reject what an expert-parallel load cannot do; ``device=`` becomes ``device_map=`` (one device per rank)."""
    device = kwargs.pop("device", None)
    if device is not None:
        if kwargs.get("device_map") is not None:
            raise ValueError("pass either device or device_map, not both")
        kwargs["device_map"] = device
    device_map = kwargs.get("device_map")
    if isinstance(device_map, dict) or device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise ValueError(
            f"expert-parallel loading places every tensor on one device per rank; got device_map={device_map!r}"
        )
    if kwargs.get("low_cpu_mem_usage", True) is False:
        raise ValueError(
            "expert-parallel loading is always low-memory (meta init); low_cpu_mem_usage=False is not supported"
        )
    for unsupported in ("parallel_config", "quantization_config", "use_flashpack"):
        if kwargs.get(unsupported):
            raise ValueError(f"from_pretrained(expert_parallel=...) does not support {unsupported}")


def _check_local_shards(pretrained_model_name_or_path: Union[str, os.PathLike], kwargs: dict) -> None:
    """Name a missing, truncated or corrupt shard of a local checkpoint before any model is built (a Hub id is
    left to diffusers' download)."""
    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, _add_variant

    folder = Path(pretrained_model_name_or_path) / (kwargs.get("subfolder") or "")
    index_name = _add_variant(SAFE_WEIGHTS_INDEX_NAME, kwargs.get("variant"))
    single_name = _add_variant(SAFETENSORS_WEIGHTS_NAME, kwargs.get("variant"))
    if not ((folder / index_name).is_file() or (folder / single_name).is_file()):
        return  # a Hub id, or a folder without safetensors weights: diffusers says which
    weight_map = read_index(folder, index_name, single_name)
    if weight_map is None:
        check_safetensors_file(folder / single_name)
    for name in sorted(set((weight_map or {}).values())):
        check_safetensors_file(folder / name, index=folder / index_name)


class ExpertParallelLoaderMixin:
    """Adds ``expert_parallel=`` to ``from_pretrained`` and ``enable_expert_parallel`` (list it before ``ModelMixin``)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs: Any):
        """``ModelMixin.from_pretrained``, plus ``expert_parallel``.

        Args:
            expert_parallel (:class:`~diffusers_magi2.Magi2ExpertParallelConfig`, *optional*): load only this
                rank's routed experts (all ranks pass the same checkpoint and config); ``device_map`` names one device.
            **kwargs: as ``ModelMixin.from_pretrained``.

        Raises:
            ValueError: EP set-up errors, ranks disagreeing, missing keys, an EP tensor without
                ``num_heads * num_experts`` rows, a missing/truncated/corrupt shard (named, before the model is
                built; so too with quantized experts), an unsupported loading option, the checks of
                ``plan_quantized_expert_loading`` and ``check_quantized_expert_arguments``.
        """
        quantized = check_quantized_expert_arguments(pretrained_model_name_or_path, kwargs)
        expert_parallel = kwargs.pop("expert_parallel", None)
        if expert_parallel is not None:
            _check_load_kwargs(kwargs)
        if expert_parallel is not None or quantized:  # (diffusers reads a single-file checkpoint before any hook)
            _check_local_shards(pretrained_model_name_or_path, kwargs)
        if expert_parallel is None:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        token = _LOADING_EP_GROUP.set(resolve_expert_parallel(expert_parallel))
        try:
            with moe_tensors_on_meta():  # the full-size MoE layers diffusers builds are never allocated
                return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        finally:
            _LOADING_EP_GROUP.reset(token)

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, resolved_model_file, *args, **kwargs):
        # diffusers 0.42's per-shard loading step: the hook point (the model is built on meta, the files resolved).
        # Expert parallelism cuts the shards to this rank's rows first; quantized experts then take their tensors
        # out of each (already cut) shard (:mod:`diffusers_magi2.loaders.quantized_experts`).
        record_loaded_files(model, resolved_model_file)  # before the wrappers below (weight streaming's disk mode)
        ep = _LOADING_EP_GROUP.get()
        if ep is not None:
            fingerprint = {
                "config": _public_config(model),
                "files": sorted((os.path.basename(f), os.path.getsize(f)) for f in resolved_model_file),
                "dtype": str(kwargs.get("dtype")),
            }
            check_same_on_all_ranks(fingerprint, ep, "checkpoint or config")
        _, filled = plan_quantized_expert_loading(model, state_dict, resolved_model_file)  # headers only
        if ep is not None and ep.size > 1:
            _swap_in_local_moes(model, ep)
            plan = ep_row_plan(model)
            # read from the files even where diffusers already mapped a single one (state_dict), so the banks are
            # read as rows and never sliced out of a map that the other loaded tensors keep alive
            files = [str(f) for f in resolved_model_file]
            use_files = state_dict is None or all(f.endswith(".safetensors") for f in files)
            resolved_model_file = RowShardedShards(files if use_files else [state_dict], plan)
            state_dict = None
            kwargs["is_parallel_loading_enabled"] = False  # one shard at a time, this rank's rows only
        if any(m.expert_scale_names for _, m in _moe_modules(model)):
            shards = [state_dict] if state_dict is not None else resolved_model_file
            resolved_model_file, state_dict = QuantizedExpertShards(shards, model, kwargs.get("device_map"), ep), None
            kwargs["is_parallel_loading_enabled"] = False  # tensors are placed by this loader, one shard at a time
            if filled:  # scales computed while reading count as loaded (no "newly initialized" warning)
                if "loaded_keys" in kwargs:
                    kwargs["loaded_keys"] = list(kwargs["loaded_keys"]) + sorted(filled)
                else:
                    args = (args[0], list(args[1]) + sorted(filled), *args[2:])
        result = super()._load_pretrained_model(model, state_dict, resolved_model_file, *args, **kwargs)
        missing = sorted(result[1])
        if ep is not None and missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} model keys, e.g. {missing[:5]}")
        return result

    def enable_expert_parallel(self, config: Magi2ExpertParallelConfig):
        """Shard the routed experts of this in-memory model over ``config``'s EP group (:func:`apply_expert_parallel`);
        returns self."""
        return apply_expert_parallel(self, config)
