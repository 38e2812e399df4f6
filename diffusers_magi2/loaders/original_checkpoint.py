"""SandAI checkpoint folders -> diffusers models: ``from_original_checkpoint`` for both MAGI-2 transformers.

As diffusers' ``FromOriginalModelMixin``, a table keyed by class name (:data:`ORIGINAL_CHECKPOINT_FORMATS`)
gives each model its SandAI config section, translator and released config. Loading runs the converter's steps
in memory: config -> the model on the meta device (expected keys, shapes; ``F32`` for islands, ``params_dtype``
otherwise) -> :func:`~.key_plan.build_key_plan` -> each tensor read, renamed, cast -> a strict ``assign`` load.
With ``expert_parallel`` the MoE layers are built on meta at this rank's size and each expert tensor is read as
this rank's rows only (:func:`~diffusers_magi2.utils.safetensors_io.read_rows`; the key plan renames, never
reshapes, so the rows of a SandAI tensor are the rows of its diffusers name).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from ..moe.layer import moe_tensors_on_meta
from ..utils.dtype_utils import parse_dtype
from ..utils.fp32_islands import is_fp32_island
from ..utils.safetensors_io import TORCH_TO_DTYPE, read_rows, read_safetensors_header
from . import sandai_config
from .expert_parallel_loading import local_experts_for_loading
from .key_plan import TensorSpec, build_key_plan, read_source_checkpoint
from .sandai_config_refiner import refiner_config_from_sandai


__all__ = [
    "ORIGINAL_CHECKPOINT_FORMATS",
    "FromOriginalCheckpointMixin",
    "OriginalCheckpointFormat",
    "build_meta_model",
    "expected_specs_from_model",
    "load_original_checkpoint",
    "original_format",
]

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class OriginalCheckpointFormat:
    """How one model class reads SandAI's layout.

    Attributes:
        component: the ``model_index.json`` component name.
        config_function: merged SandAI config -> ``register_to_config`` kwargs.
        arch_section: the SandAI config section holding the architecture and ``params_dtype``.
        released_config: file name of the bundled released SandAI config.
    """

    component: str
    config_function: Callable[[dict], dict]
    arch_section: str
    released_config: str

    def resolve_config(self, config: Union[PathLike, dict, None]) -> tuple[dict, str]:
        """The merged SandAI config (``None``: the released one) and a label saying where it came from.

        Raises:
            ValueError: the config has no :attr:`arch_section` section.
        """
        if isinstance(config, dict):
            cfg, label = config, "config passed in memory"
        else:
            path = Path(config) if config is not None else sandai_config.released_config_path(self.released_config)
            cfg = sandai_config.load_sandai_config(path)
            label = f"config {path}" + (" (released)" if config is None else "")
        if self.arch_section not in cfg:
            raise ValueError(
                f"{label} has no '{self.arch_section}' section, so it does not describe the {self.component}; "
                + (
                    "pass the refiner JSON (it extends the preview JSON)"
                    if self.component == "refiner"
                    else "pass a SandAI preview JSON"
                )
            )
        return cfg, label

    def model_kwargs(self, cfg: dict) -> dict[str, Any]:
        """``register_to_config`` kwargs from a merged SandAI config."""
        return dict(self.config_function(cfg))

    def params_dtype(self, cfg: dict) -> torch.dtype:
        """The dtype of the non-fp32 tensors (``arch_section.params_dtype``, default bf16).

        Raises:
            ValueError: an unknown dtype name.
        """
        return parse_dtype(str(cfg[self.arch_section].get("params_dtype", "bfloat16")), "params_dtype")


#: model class name -> its SandAI checkpoint format.
ORIGINAL_CHECKPOINT_FORMATS: dict[str, OriginalCheckpointFormat] = {
    "Magi2Transformer3DModel": OriginalCheckpointFormat(
        "transformer", sandai_config.preview_config_from_sandai, "arch_config", "magi2_preview.json"
    ),
    "Magi2RefinerTransformer3DModel": OriginalCheckpointFormat(
        "refiner", refiner_config_from_sandai, "magi2_refiner_arch_config", "magi2_refiner.json"
    ),
}


def original_format(cls: type) -> OriginalCheckpointFormat:
    """The :class:`OriginalCheckpointFormat` of a model class (looked up by class name, base classes included).

    Raises:
        ValueError: ``cls`` is not a MAGI-2 model class.
    """
    for klass in cls.__mro__:
        if klass.__name__ in ORIGINAL_CHECKPOINT_FORMATS:
            return ORIGINAL_CHECKPOINT_FORMATS[klass.__name__]
    raise ValueError(f"{cls.__name__} has no SandAI checkpoint format; known: {sorted(ORIGINAL_CHECKPOINT_FORMATS)}")


def build_meta_model(cls: type, kwargs: dict[str, Any]) -> nn.Module:
    """``cls(**kwargs)`` with its parameters on the meta device (accelerate ``init_empty_weights``; buffers real)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls(**kwargs)


def expected_specs_from_model(model: nn.Module, params_dtype: str = "BF16") -> dict[str, TensorSpec]:
    """Expected source tensors for ``model``: its ``state_dict()`` keys and shapes, ``F32`` for islands, else ``params_dtype``."""
    specs = {}
    for name, t in model.state_dict().items():
        island = t.is_floating_point() and is_fp32_island(name, model._keep_in_fp32_modules)
        if t.is_floating_point():
            code = "F32" if island else params_dtype
        else:
            code = TORCH_TO_DTYPE[t.dtype]
        specs[name] = TensorSpec(tuple(t.shape), code, island)
    return specs


def config_hint(source_dir: PathLike, config: object) -> str:
    """What to try when weights checked against the released config (``config is None``) do not match it."""
    if config is not None:
        return ""
    local = sorted(p.name for p in Path(source_dir).glob("magi2_*.json"))
    if local:
        return f"a SandAI config sits beside the weights ({', '.join(local)}): pass it with --config (Python: config=) if it describes them"
    return "no --config was given, so the released config was used; for another checkpoint pass its SandAI JSON with --config (Python: config=)"


def load_original_checkpoint(
    cls: type,
    source_dir: PathLike,
    config: Union[PathLike, dict, None] = None,
    *,
    dtype: Optional[torch.dtype] = None,
    expert_parallel: Optional[Any] = None,
) -> nn.Module:
    """Build ``cls`` from a SandAI checkpoint folder with the converter's validated key plan, in memory.

    Args:
        cls: a model class listed in :data:`ORIGINAL_CHECKPOINT_FORMATS`.
        source_dir: folder with ``model.safetensors.index.json`` and its shards (or ``model.safetensors``).
        config: SandAI config dict or JSON path; ``None``: the bundled released config.
        dtype: dtype of the non-fp32 tensors; ``None``: the config's ``params_dtype``. fp32 islands load as fp32.
        expert_parallel: a :class:`~diffusers_magi2.Magi2ExpertParallelConfig`: read only this rank's routed
            experts (every rank passes the same folder and config).

    Returns:
        the model in eval mode, every tensor on CPU with its own storage.

    Raises:
        CheckpointValidationError: every checkpoint problem, before any tensor is read.
        ValueError: ``cls`` is not a MAGI-2 model class, the config lacks its architecture section, or an
            expert-parallel set-up error (ranks disagreeing on the checkpoint or config).
    """
    from safetensors import safe_open

    fmt = original_format(cls)
    cfg, label = fmt.resolve_config(config)
    params_dtype = fmt.params_dtype(cfg)
    dtype = params_dtype if dtype is None else parse_dtype(dtype)
    with moe_tensors_on_meta() if expert_parallel is not None else contextlib.nullcontext():
        model = build_meta_model(cls, fmt.model_kwargs(cfg))
    expected = expected_specs_from_model(model, TORCH_TO_DTYPE[params_dtype])
    source = read_source_checkpoint(source_dir)
    plan = build_key_plan(
        source, expected, dtype="keep", context=f"checked against {label}", hint=config_hint(source_dir, config)
    )
    rows = {}
    if expert_parallel is not None:
        fingerprint = {"config": cfg, "dtype": str(dtype), "files": sorted(plan.entries_by_file())}
        rows = local_experts_for_loading(model, expert_parallel, fingerprint)
    state: dict[str, torch.Tensor] = {}
    for fname, entries in plan.entries_by_file().items():
        path = plan.source_dir / fname
        header = read_safetensors_header(path) if any(e.target_key in rows for e in entries) else None
        with safe_open(str(path), framework="pt") as handle:
            for e in entries:
                if e.target_key in rows:  # this rank's rows only, read into their own buffer
                    t = read_rows(header, e.source_key, rows[e.target_key].row_start, rows[e.target_key].num_rows)
                else:
                    t = handle.get_tensor(e.source_key)
                state[e.target_key] = t.to(torch.float32 if expected[e.target_key].fp32_island else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    # expert_bias and expert_bias_ema come from the same file bytes; safetensors refuses to save shared storages
    _own_storages(model)
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:  # never hand back a model with unloaded (meta) tensors
        raise ValueError(f"{len(on_meta)} tensors were left on the meta device after loading, e.g. {on_meta[:5]}")
    return model.eval()


def _own_storages(model: nn.Module) -> None:
    """Give every parameter/buffer that shares a storage with an earlier one its own copy."""
    seen: set = set()
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or tensor.is_meta:
                    continue
                ptr = tensor.untyped_storage().data_ptr()
                if ptr in seen:
                    cloned = tensor.detach().clone()
                    store[name] = (
                        nn.Parameter(cloned, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else cloned
                    )
                    ptr = cloned.untyped_storage().data_ptr()
                seen.add(ptr)


def _default_config(fmt: OriginalCheckpointFormat, checkpoint_dir: Path) -> dict:
    """The SandAI config beside the shards (``magi2_*.json``), else the bundled released one."""
    if any(checkpoint_dir.glob("magi2_*.json")):
        return sandai_config.load_sandai_config(checkpoint_dir)
    return sandai_config.load_sandai_config(sandai_config.released_config_path(fmt.released_config))


class FromOriginalCheckpointMixin:
    """Gives a MAGI-2 model class ``from_original_checkpoint``: load SandAI's own checkpoint folder directly."""

    @classmethod
    def from_original_checkpoint(
        cls,
        checkpoint_dir: PathLike,
        config: Union[PathLike, dict, None] = None,
        *,
        torch_dtype: Optional[torch.dtype] = None,
        dtype: Optional[torch.dtype] = None,
        device: Union[str, torch.device] = "cpu",
        expert_parallel: Optional[Any] = None,
    ):
        """Build the model from a SandAI checkpoint folder (``preview/`` or ``refiner/``: safetensors shards + index).

        The same validation and renames as ``magi2-convert`` (:mod:`~diffusers_magi2.loaders.key_plan`), then a
        strict load.

        Args:
            checkpoint_dir: folder with ``model.safetensors.index.json`` and its shards (or ``model.safetensors``).
            config: SandAI config dict or JSON path; default: the ``magi2_*.json`` beside the shards, else the
                bundled released config.
            torch_dtype / dtype (aliases): dtype of the non-fp32 weights; default: the config's ``params_dtype``.
            device: where the weights are placed.
            expert_parallel (:class:`~diffusers_magi2.Magi2ExpertParallelConfig`, *optional*): load only this rank's
                routed experts; no rank reads or allocates another rank's (all ranks pass the same folder and config).

        Returns:
            the model in eval mode.

        Raises:
            ValueError: ``torch_dtype`` and ``dtype`` disagree; a ``CheckpointValidationError`` with every
                checkpoint problem; a config without the model's architecture section.
        """
        if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
            raise ValueError(f"torch_dtype={torch_dtype} and dtype={dtype} disagree; pass one of them")
        dtype = torch_dtype if torch_dtype is not None else dtype
        checkpoint_dir = Path(checkpoint_dir)
        cfg = config if config is not None else _default_config(original_format(cls), checkpoint_dir)
        if not isinstance(cfg, dict):
            cfg = sandai_config.load_sandai_config(cfg)
        model = load_original_checkpoint(cls, checkpoint_dir, cfg, dtype=dtype, expert_parallel=expert_parallel)
        return model.to(device)
