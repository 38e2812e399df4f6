"""Per-rank checkpoint loading for expert parallelism: each rank reads only its rows of the routed-expert tensors.

The six EP-sharded tensors of every MoE layer (``gate``, ``W_gate``, ``W_up``, ``W_down``, ``router.expert_bias``,
``router.expert_bias_ema``) are head-major on dim 0 (row ``h·E + e``). Rank ``r`` reads rows
``[local_head_start·E, (local_head_start + local_num_heads)·E)`` with ``safe_open(...).get_slice``; rows past the end
(padded heads) are zero. This is the SandAI loader's rule (spec §6.2 step 2), written against diffusers-format
folders (``config.json`` + ``diffusion_pytorch_model*.safetensors``). The model is built with every parameter on the
``meta`` device and the MoE layers at their local size, so the other ranks' experts are never allocated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn as nn

from ..utils.safetensors_io import DTYPE_TO_TORCH
from ..moe.layer import Magi2MultiHeadMoE
from ..utils.fp32_islands import fp32_island_dtype
from .expert_parallel import (
    Magi2ExpertParallelConfig,
    Magi2ExpertParallelGroup,
    check_same_on_all_ranks,
    resolve_expert_parallel,
    warn_if_idle,
)

__all__ = [
    "EP_SHARDED_SUFFIXES",
    "apply_expert_parallel",
    "checkpoint_key_files",
    "load_expert_parallel_from_pretrained",
    "load_pipeline_with_expert_parallel",
    "read_expert_rows",
]

# names (relative to a Magi2MultiHeadMoE module) of the tensors split across EP ranks along dim 0
EP_SHARDED_SUFFIXES = Magi2MultiHeadMoE._EP_SHARDED_KEYS


def read_expert_rows(handle: Any, key: str, row_start: int, num_rows: int) -> torch.Tensor:
    """Read rows ``[row_start, row_start + num_rows)`` of ``key`` from an open ``safe_open`` handle.

    Only those rows are read from the file. Rows at or past the tensor's dim 0 (padded heads of the last ranks) are
    zero; a rank whose whole range lies past the end gets an all-zero tensor and never calls ``get_slice`` with an
    out-of-range start.

    Returns:
        ``[num_rows, *shape[1:]]`` in the file's dtype, on CPU. When every row exists this is safetensors' zero-copy
        view of the file's memory map (``.clone()`` it to own the memory, as the EP loader does); otherwise a new
        tensor.
    Raises:
        ValueError: negative ``row_start``/``num_rows``.
    """
    if row_start < 0 or num_rows < 0:
        raise ValueError(f"row_start and num_rows must be >= 0, got {row_start}, {num_rows} for {key!r}")
    sl = handle.get_slice(key)
    shape = list(sl.get_shape())
    total = shape[0]
    stop = min(total, row_start + num_rows)
    if row_start >= total:
        return torch.zeros([num_rows, *shape[1:]], dtype=DTYPE_TO_TORCH[sl.get_dtype()])
    part = sl[row_start:stop]
    if stop - row_start == num_rows:
        return part
    out = torch.zeros([num_rows, *shape[1:]], dtype=part.dtype)
    out[: stop - row_start] = part
    return out


def _check_shard(path: Path, index: Optional[Path] = None) -> None:
    """Raise a ``ValueError`` naming ``path`` when it is missing or safetensors cannot open it (truncated, corrupt)."""
    from safetensors import SafetensorError, safe_open

    named_by = "" if index is None else f", named by {index.name}"
    if not path.is_file():
        raise ValueError(f"checkpoint shard {path} does not exist{named_by}")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as err:
        raise ValueError(
            f"checkpoint shard {path} ({path.stat().st_size} bytes{named_by}) is not a complete safetensors file "
            f"(truncated by an interrupted download or copy?): {err}"
        ) from err


def checkpoint_key_files(folder: Union[str, os.PathLike], variant: Optional[str] = None) -> dict[str, Path]:
    """Map every tensor key of a safetensors checkpoint folder to its file.

    Looks for, in order: the diffusers index ``diffusion_pytorch_model.safetensors.index[.variant].json``, the single
    file ``diffusion_pytorch_model[.variant].safetensors``, then (no variant) SandAI's ``model.safetensors.index.json``
    / ``model.safetensors``.

    Every file is opened once here (header only), so a missing, truncated or corrupt shard is reported by name
    before any model is built.

    Raises:
        ValueError: none of those files exists, or a file the index names is missing or is not a complete
            safetensors file (the message names it).
    """
    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, _add_variant
    from safetensors import safe_open

    folder = Path(folder)
    candidates = [
        (_add_variant(SAFE_WEIGHTS_INDEX_NAME, variant), True),
        (_add_variant(SAFETENSORS_WEIGHTS_NAME, variant), False),
    ]
    if variant is None:
        candidates += [("model.safetensors.index.json", True), ("model.safetensors", False)]
    for name, is_index in candidates:
        path = folder / name
        if not path.is_file():
            continue
        if is_index:
            weight_map = json.loads(path.read_text())["weight_map"]
            key_files = {k: folder / v for k, v in weight_map.items()}
            for shard in sorted(set(key_files.values())):
                _check_shard(shard, index=path)
            return key_files
        _check_shard(path)
        with safe_open(str(path), framework="pt") as h:
            return {k: path for k in h.keys()}
    raise ValueError(f"{folder} holds none of {[n for n, _ in candidates]} (variant={variant!r})")


def _moe_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Magi2MultiHeadMoE)]


def _build_local_moe(moe: nn.Module, ep: Magi2ExpertParallelGroup) -> nn.Module:
    """A Magi2MultiHeadMoE with the same config holding only this rank's heads (parameters on ``meta``)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        local = type(moe)(moe.config, ep_group=ep.group, ep_rank=ep.rank, ep_size=ep.size)
    return local


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def _swap_in_local_moes(model: nn.Module, ep: Magi2ExpertParallelGroup) -> dict[str, nn.Module]:
    """Replace every MoE layer by its local-size twin; returns ``{path: old module}``."""
    old = {}
    for name, moe in _moe_modules(model):
        local = _build_local_moe(moe, ep)
        local.train(moe.training)
        _set_submodule(model, name, local)
        old[name] = moe
    if old:
        warn_if_idle(model.get_submodule(next(iter(old))).ep_layout)  # the first layer's head layout
    return old


def _ep_rows(moe: nn.Module) -> tuple[int, int]:
    """``(row_start, num_rows)`` of this rank's flattened experts for a local-size MoE module."""
    return int(moe.local_head_start) * int(moe.config.num_experts), int(moe.local_flatten_num_experts)


def _model_config_dict(model: nn.Module) -> dict:
    """The model's public config (diffusers' private ``_*`` entries, e.g. the load path, left out)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {"class": type(model).__name__}
    return {k: v for k, v in dict(cfg).items() if not k.startswith("_")}


def apply_expert_parallel(model: nn.Module, config: Magi2ExpertParallelConfig) -> nn.Module:
    """Shard an in-memory model's routed experts over the EP group (``transformer.enable_expert_parallel``).

    Every ``Magi2MultiHeadMoE`` is replaced by a twin that owns only this rank's heads; its tensors are copied from
    this rank's rows of the full ones (zero rows for padded heads), and the full tensors are released. All ranks must
    call it with the same model config (checked with one ``all_gather_object``).

    Raises:
        ValueError: see :func:`resolve_expert_parallel` and :func:`check_same_on_all_ranks`; or the model has no MoE
            layer, or was already sharded.
    """
    ep = resolve_expert_parallel(config)
    moes = _moe_modules(model)
    if not moes:
        raise ValueError(f"{type(model).__name__} has no Magi2MultiHeadMoE layer to shard")
    if any(getattr(m, "ep_size", 1) != 1 for _, m in moes):
        raise ValueError("expert parallelism is already enabled on this model")
    check_same_on_all_ranks(_model_config_dict(model), ep, "transformer config")
    if ep.size == 1:
        return model
    old = _swap_in_local_moes(model, ep)
    for name, full in old.items():
        local = model.get_submodule(name)
        full_sd = full.state_dict()
        new_sd = {}
        for key, t in local.state_dict(keep_vars=True).items():
            src = full_sd[key]
            if key in EP_SHARDED_SUFFIXES:
                src = local.ep_slice(src)  # this rank's rows, zeros for padded heads
            new_sd[key] = src.detach().clone().to(t.dtype)
        local.load_state_dict(new_sd, strict=True, assign=True)
        _set_requires_grad_like(local, full)
    return model


def _set_requires_grad_like(dst: nn.Module, src: nn.Module) -> None:
    src_flags = {n: p.requires_grad for n, p in src.named_parameters()}
    for n, p in dst.named_parameters():
        p.requires_grad_(src_flags.get(n, False))


def _resolve_folder(pretrained: Union[str, os.PathLike], subfolder: Optional[str], **hub_kwargs: Any) -> Path:
    """Local folder of the checkpoint; a Hub repo id is downloaded (its ``subfolder`` only) to the HF cache."""
    folder = Path(pretrained)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        hub_kwargs = {k: v for k, v in hub_kwargs.items() if v is not None}
        pattern = f"{subfolder}/*" if subfolder else "*"
        folder = Path(snapshot_download(str(pretrained), allow_patterns=[pattern], **hub_kwargs))
    folder = folder / subfolder if subfolder else folder
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    return folder


def _target_dtype(name: str, t: torch.Tensor, default: torch.dtype, torch_dtype, keep_fp32: Iterable[str]):
    """Load dtype of checkpoint tensor ``name``: its own if not floating, ``default`` without ``torch_dtype``."""
    if not t.is_floating_point():
        return t.dtype
    if torch_dtype is None:
        return default
    return fp32_island_dtype(name, torch_dtype, keep_fp32)


def load_expert_parallel_from_pretrained(
    cls: type,
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    expert_parallel: Magi2ExpertParallelConfig,
    subfolder: Optional[str] = None,
    torch_dtype: Optional[torch.dtype] = None,
    dtype: Optional[torch.dtype] = None,
    variant: Optional[str] = None,
    device: Union[str, torch.device, int, None] = None,
    device_map: Union[str, torch.device, int, None] = None,
    **hub_kwargs: Any,
) -> nn.Module:
    """Build ``cls`` from a diffusers-format folder with its routed experts sharded over the EP group.

    The model is built with parameters on ``meta``, its MoE layers replaced by local-size twins, then every tensor is
    read from the safetensors files: the six EP-sharded tensors of each MoE layer through :func:`read_expert_rows`
    (this rank's rows only), everything else whole. dtypes follow diffusers ``from_pretrained``: floating tensors
    become ``torch_dtype`` except those in ``cls._keep_in_fp32_modules`` (kept fp32); with ``torch_dtype=None`` they
    take the dtype the module was built with. Checkpoint keys the model does not have are ignored (SandAI loader
    rule); missing keys raise. Every rank must pass the same checkpoint and config (checked once).

    ``dtype`` is an alias of ``torch_dtype``; ``device`` / ``device_map`` (one device: ``"cuda:1"``, ``1``, ...) place
    the weights (default CPU). ``hub_kwargs`` (``revision``, ``cache_dir``, ``token``, ``local_files_only``) are used
    only when the path is not a local folder.

    Raises:
        ValueError: EP set-up errors (no process group, ``ep_degree`` ≠ world size), ranks disagreeing on the
            checkpoint/config, missing checkpoint keys, an EP tensor whose file shape does not have
            ``num_heads·num_experts`` rows, a ``device_map`` that is not a single device, or an unsupported keyword.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open

    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise ValueError(f"torch_dtype={torch_dtype} and dtype={dtype} disagree")
    torch_dtype = torch_dtype if torch_dtype is not None else dtype
    if device is not None and device_map is not None:
        raise ValueError("pass either device or device_map, not both")
    device = device if device is not None else device_map
    if isinstance(device, dict) or (isinstance(device, str) and device in ("auto", "balanced", "sequential")):
        raise ValueError(
            f"expert-parallel loading places every tensor on one device per rank; got device_map={device!r}"
        )
    device = torch.device("cpu" if device is None else (f"cuda:{device}" if isinstance(device, int) else device))
    if hub_kwargs.pop("low_cpu_mem_usage", True) is False:
        raise ValueError("expert-parallel loading is always low-memory (meta init); low_cpu_mem_usage=False is not supported")
    allowed_hub = {"revision", "cache_dir", "token", "local_files_only", "force_download", "proxies"}
    unknown = sorted(set(hub_kwargs) - allowed_hub)
    if unknown:
        raise ValueError(f"from_pretrained(expert_parallel=...) does not support {unknown}; supported: {sorted(allowed_hub)}")

    ep = resolve_expert_parallel(expert_parallel)
    folder = _resolve_folder(pretrained_model_name_or_path, subfolder, **hub_kwargs)
    config = cls.load_config(folder)
    key_files = checkpoint_key_files(folder, variant)
    fingerprint = {
        "config": {k: v for k, v in config.items() if not k.startswith("_")},
        "files": sorted({(p.name, p.stat().st_size) for p in key_files.values()}),
        "torch_dtype": str(torch_dtype),
    }
    check_same_on_all_ranks(fingerprint, ep, "checkpoint or config")

    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    if ep.size > 1:
        _swap_in_local_moes(model, ep)
    moe_rows = {name: _ep_rows(m) for name, m in _moe_modules(model)} if ep.size > 1 else {}

    keep_fp32 = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in key_files]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} model keys, e.g. {missing[:5]}")

    by_file: dict[Path, list[str]] = {}
    for k in expected:
        by_file.setdefault(key_files[k], []).append(k)
    state = {}
    def ep_owner(key: str) -> Optional[str]:
        return next((n for n in moe_rows if key.startswith(n + ".") and key[len(n) + 1 :] in EP_SHARDED_SUFFIXES), None)

    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as h:
            for k in keys:
                owner = ep_owner(k)
                if owner is None:
                    t = h.get_tensor(k)
                else:
                    row_start, num_rows = moe_rows[owner]
                    moe = model.get_submodule(owner)
                    full_rows = moe.num_heads * moe.num_experts
                    # own handle per EP tensor: the file pages the rows were copied from are unmapped right after,
                    # so the peak holds one tensor's rows twice at most, not a whole shard's
                    with safe_open(path, framework="pt") as h_rows:
                        file_rows = h_rows.get_slice(k).get_shape()[0]
                        if file_rows != full_rows:
                            raise ValueError(
                                f"{k}: checkpoint has {file_rows} rows, expected num_heads·num_experts = {full_rows} "
                                "(EP loading needs the unsharded checkpoint)"
                            )
                        t = read_expert_rows(h_rows, k, row_start, num_rows).clone()
                ref = expected[k]
                if tuple(t.shape) != tuple(ref.shape):
                    raise ValueError(f"{k}: checkpoint shape {tuple(t.shape)} != model shape {tuple(ref.shape)}")
                dtype = _target_dtype(k, t, ref.dtype, torch_dtype, keep_fp32)
                state[k] = t.to(device=device, dtype=dtype)
                del t
    model.load_state_dict(state, strict=True, assign=True)
    # non-persistent buffers were built for real on CPU; follow the parameters
    for mod in model.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != device:
                mod._buffers[bname] = buf.to(device)
    model.eval()
    return model


def load_pipeline_with_expert_parallel(
    pipeline_cls: type,
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    expert_parallel: Magi2ExpertParallelConfig,
    **kwargs: Any,
):
    """``Magi2Pipeline.from_pretrained(..., expert_parallel=...)``: load the transformer EP-sharded, the rest as usual.

    The transformer (subfolder ``transformer``) goes through :func:`load_expert_parallel_from_pretrained` with the
    same ``torch_dtype``/``dtype`` (a per-component dict gives its ``"transformer"`` entry, else ``"default"``,
    else fp32), ``variant`` and Hub arguments, onto this rank's device (``ep_device``: its GPU under
    nccl, else CPU); it is then handed to ``pipeline_cls.from_pretrained`` as a ready component, so no rank ever
    builds the full expert bank.

    Raises:
        ValueError: a ``transformer`` component was passed too (shard it with ``enable_expert_parallel`` instead),
            or any error of the transformer loader.
    """
    from ..models.transformer_magi2 import Magi2Transformer3DModel

    if kwargs.get("transformer") is not None:
        raise ValueError(
            "pass either transformer=... or expert_parallel=..., not both (call transformer.enable_expert_parallel)"
        )
    from .expert_parallel import ep_device

    shared = ("torch_dtype", "dtype", "variant", "revision", "cache_dir", "token", "local_files_only")
    transformer_kwargs = {k: kwargs[k] for k in shared if kwargs.get(k) is not None}
    for key in ("torch_dtype", "dtype"):
        # a per-component dict (diffusers: {"default": ..., "<component>": ...}) -> the transformer's entry
        if isinstance(transformer_kwargs.get(key), dict):
            table = transformer_kwargs[key]
            transformer_kwargs[key] = table.get("transformer", table.get("default", torch.float32))
    transformer = Magi2Transformer3DModel.from_pretrained(
        pretrained_model_name_or_path,
        subfolder="transformer",
        expert_parallel=expert_parallel,
        device=ep_device(expert_parallel),  # straight to this rank's GPU (tensor by tensor); CPU without CUDA
        **transformer_kwargs,
    )
    return pipeline_cls.from_pretrained(pretrained_model_name_or_path, transformer=transformer, **kwargs)
