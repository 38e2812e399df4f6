"""Transformer and refiner conversion: config -> meta model -> validated key plan -> streamed shards.

Steps for one component (``transformer`` = preview DiT, ``refiner`` = 1080p refiner):

1. Read the SandAI JSON config (``extends`` resolved by ``sandai_config.load_sandai_config``),
   defaulting to the released config the package ships.
2. Turn it into the diffusers model's ``register_to_config`` kwargs and build the model on the
   meta device; its ``state_dict()`` gives every expected key and shape exactly (no guessing).
   Expected source dtypes are ``F32`` for the fp32 islands and the config's ``params_dtype``
   otherwise.
3. Read the source index and shard headers and validate them against those expectations
   (:func:`key_plan.build_key_plan`, every problem listed before anything is written).
4. Stream: one source shard at a time (``safe_open``), each tensor in row chunks straight into
   its pre-sized output shard (:class:`safetensors_io.ShardWriter`), then ``config.json`` and the
   index.

:func:`load_original_checkpoint` runs steps 1–3 and loads the same plan in memory; it backs
``Magi2Transformer3DModel.from_original_checkpoint``.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..utils.fp32_islands import is_fp32_island
from . import sandai_config, sandai_config_refiner
from .key_plan import (
    KeyPlan,
    TensorSpec,
    build_key_plan,
    read_source_checkpoint,
)
from .safetensors_io import (
    TORCH_TO_DTYPE,
    ShardLayout,
    ShardWriter,
    plan_shards,
    read_safetensors_header,
    write_index,
)

__all__ = [
    "TRANSFORMER_TARGETS",
    "TransformerTarget",
    "PreparedTransformer",
    "expected_specs_from_model",
    "load_original_checkpoint",
    "prepare_transformer_conversion",
    "write_transformer",
]

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
_PARAMS_DTYPES = {"bfloat16": "BF16", "bf16": "BF16", "float32": "F32", "fp32": "F32", "float16": "F16", "fp16": "F16"}


@dataclass(frozen=True)
class TransformerTarget:
    """Where a transformer-like component's diffusers class and config translator live.

    Attributes:
        component: ``model_index.json`` name (``"transformer"`` or ``"refiner"``).
        module: defining module of the model class (public format, never moves).
        class_name: the model class.
        config_function: name of the SandAI-config -> kwargs function (in
            ``diffusers_magi2.conversion.sandai_config`` or ``sandai_config_refiner``).
        arch_section: SandAI config section holding the architecture (for ``params_dtype``).
        released_config: file name of the released SandAI config that describes it.
    """

    component: str
    module: str
    class_name: str
    config_function: str
    arch_section: str
    released_config: str


TRANSFORMER_TARGETS: dict[str, TransformerTarget] = {
    "transformer": TransformerTarget(
        "transformer", "diffusers_magi2.models.transformer_magi2", "Magi2Transformer3DModel",
        "preview_config_from_sandai", "arch_config", "magi2_preview.json",
    ),
    "refiner": TransformerTarget(
        "refiner", "diffusers_magi2.models.transformer_magi2_refiner", "Magi2RefinerTransformer3DModel",
        "refiner_config_from_sandai", "magi2_refiner_arch_config", "magi2_refiner.json",
    ),
}


def model_class(target: TransformerTarget):
    """The diffusers model class of ``target`` (imported on use: the model modules import this package)."""
    return getattr(importlib.import_module(target.module), target.class_name)


def released_config_path(target: TransformerTarget) -> Path:
    """Path of the released SandAI config shipped as package data for ``target``
    (:func:`sandai_config.released_config_path`).

    Raises:
        ValueError: the package does not ship it.
    """
    return sandai_config.released_config_path(target.released_config)


def resolve_sandai_config(target: TransformerTarget, config: str | Path | dict | None) -> tuple[dict, str]:
    """Load the SandAI config for ``target`` (``extends`` resolved) and describe where it came from.

    Args:
        config: a path to a SandAI JSON, an already-loaded dict, or ``None`` for the released one.

    Returns:
        ``(merged_config, label)``.

    Raises:
        ValueError: the config has no ``target.arch_section`` section.
    """
    if isinstance(config, dict):
        cfg, label = config, "config passed in memory"
    else:
        path = Path(config) if config is not None else released_config_path(target)
        cfg, label = sandai_config.load_sandai_config(path), f"config {path}" + (" (released)" if config is None else "")
    if target.arch_section not in cfg:
        raise ValueError(
            f"{label} has no '{target.arch_section}' section, so it does not describe the {target.component}; "
            + ("pass the refiner JSON (it extends the preview JSON)" if target.component == "refiner" else "pass a SandAI preview JSON")
        )
    return cfg, label


def model_kwargs_from_sandai(target: TransformerTarget, cfg: dict) -> dict[str, Any]:
    """``register_to_config`` kwargs of ``target``'s model from a merged SandAI config."""
    fn = getattr(sandai_config, target.config_function, None) or getattr(sandai_config_refiner, target.config_function)
    return dict(fn(cfg))


def params_dtype_code(target: TransformerTarget, cfg: dict) -> str:
    """Safetensors dtype code of the non-fp32 tensors (``arch_section.params_dtype``, default bf16)."""
    name = str(cfg[target.arch_section].get("params_dtype", "bfloat16")).replace("torch.", "")
    if name not in _PARAMS_DTYPES:
        raise ValueError(f"params_dtype {name!r} in the SandAI config is not one of {sorted(_PARAMS_DTYPES)}")
    return _PARAMS_DTYPES[name]


def build_meta_model(cls, kwargs: dict[str, Any]) -> torch.nn.Module:
    """Instantiate ``cls(**kwargs)`` without allocating weights (accelerate ``init_empty_weights``).

    Parameters land on the meta device; buffers are real (they are small, e.g. ``rope.bands``).
    """
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls(**kwargs)


def expected_specs_from_model(model: torch.nn.Module, params_dtype: str = "BF16") -> dict[str, TensorSpec]:
    """Expected source tensors of a SandAI checkpoint for ``model``: key, shape and dtype code.

    Keys and shapes are the model's ``state_dict()`` (works on the meta device); the dtype is
    ``F32`` for the model's fp32 islands (``_keep_in_fp32_modules``), ``params_dtype`` for the other
    floating tensors, and the model's own dtype for integer buffers.
    """
    specs = {}
    for name, t in model.state_dict().items():
        island = t.is_floating_point() and is_fp32_island(name, model._keep_in_fp32_modules)
        if t.is_floating_point():
            code = "F32" if island else params_dtype
        else:
            code = TORCH_TO_DTYPE[t.dtype]
        specs[name] = TensorSpec(tuple(t.shape), code, island)
    return specs


@dataclass
class PreparedTransformer:
    """Everything needed to write one converted transformer, computed from headers only.

    Attributes:
        target: which component.
        plan: the validated key plan.
        model: the model built on the meta device (for ``save_config``).
        layouts: the output shard layouts (headers included).
        config_label: where the SandAI config came from.
    """

    target: TransformerTarget
    plan: KeyPlan
    model: torch.nn.Module
    layouts: list[ShardLayout]
    config_label: str

    def describe(self) -> str:
        """Key plan plus output shard layout (the ``--dry_run`` report for this component)."""
        lines = [f"[{self.target.component}] {self.target.class_name} from {self.plan.source_dir} ({self.config_label})"]
        lines.append(self.plan.describe())
        total = sum(lay.data_size for lay in self.layouts)
        lines.append(f"output {self.target.component}/: {len(self.layouts)} shard(s), {total} bytes of tensor data")
        for lay in self.layouts:
            lines.append(f"  {lay.filename}: {len(lay.offsets)} tensors, {lay.file_size} bytes")
        return "\n".join(lines)


def _hint_local_config(source_dir: Path, config: object) -> str:
    """What to try when weights checked against the released config (``config is None``) do not match it."""
    if config is not None:
        return ""
    local = sorted(p.name for p in Path(source_dir).glob("magi2_*.json"))
    if local:
        return f"a SandAI config sits beside the weights ({', '.join(local)}): pass it with --config (Python: config=) if it describes them"
    return "no --config was given, so the released config was used; for another checkpoint pass its SandAI JSON with --config (Python: config=)"


def prepare_transformer_conversion(
    component: str,
    source_dir: str | Path,
    config: str | Path | dict | None = None,
    *,
    dtype: str = "keep",
    max_shard_size: int = 5 * 10**9,
    check_data: bool = True,
) -> PreparedTransformer:
    """Validate a SandAI transformer/refiner checkpoint and lay out its output (headers only).

    Args:
        component: ``"transformer"`` or ``"refiner"``.
        source_dir: SandAI checkpoint folder (index + shards).
        config: SandAI JSON path / dict, ``None`` for the released config.
        dtype: ``"keep"``, ``"bf16"`` or ``"fp32"`` (fp32 islands always stay fp32).
        max_shard_size: output shard data size limit in bytes.
        check_data: also require each shard's data section to be present (``False`` for dry runs
            on header-only stubs).

    Raises:
        key_plan.CheckpointValidationError: every problem found, listed together.
        ValueError: bad arguments or a config without the needed section.
    """
    if component not in TRANSFORMER_TARGETS:
        raise ValueError(f"component must be one of {sorted(TRANSFORMER_TARGETS)}, got {component!r}")
    target = TRANSFORMER_TARGETS[component]
    cls = model_class(target)
    cfg, label = resolve_sandai_config(target, config)
    model = build_meta_model(cls, model_kwargs_from_sandai(target, cfg))
    expected = expected_specs_from_model(model, params_dtype_code(target, cfg))
    source = read_source_checkpoint(source_dir, check_data=check_data)
    plan = build_key_plan(source, expected, dtype=dtype, context=f"checked against {label}",
                          hint=_hint_local_config(Path(source_dir), config))
    layouts = plan_shards(plan.output_tensors(), max_shard_size, WEIGHTS_NAME)
    return PreparedTransformer(target, plan, model, layouts, label)


def write_transformer(
    prepared: PreparedTransformer,
    out_folder: str | Path,
    chunk_bytes: int = 16 * 1024 * 1024,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Stream the planned tensors into ``out_folder`` (created; must not exist yet).

    Source shards are processed one at a time: ``safe_open`` checks the shard, then a plain
    descriptor reads it at the offsets of its (validated) header. A tensor kept in its stored dtype
    is copied byte for byte into its offset in the pre-sized output shard (kernel file-to-file
    copy, no tensor in memory); a tensor whose dtype changes is read in chunks of at most
    ``chunk_bytes`` into a reused buffer, cast and written at its offset. Memory stays at two
    chunk buffers; no source shard is memory-mapped. Then ``config.json`` (the model's ``save_config``) and, when sharded,
    ``diffusion_pytorch_model.safetensors.index.json`` are written.

    Args:
        log: called once per source shard with a progress line (``None``: silent).

    Returns:
        ``out_folder``.
    """
    from safetensors import safe_open

    out_folder = Path(out_folder)
    out_folder.mkdir(parents=True, exist_ok=False)
    plan = prepared.plan
    with ShardWriter(out_folder, prepared.layouts) as writer:
        groups = plan.entries_by_file()
        for i, (fname, entries) in enumerate(groups.items()):
            path = plan.source_dir / fname
            if log is not None:
                log(f"[{prepared.target.component}] source shard {i + 1}/{len(groups)}: {fname} ({len(entries)} tensors)")
            header = read_safetensors_header(path)
            with safe_open(str(path), framework="pt") as handle:  # the library's own check of the shard
                keys = set(handle.keys())
            fd = os.open(path, os.O_RDONLY)
            try:
                for e in entries:
                    info = header.tensors.get(e.source_key)
                    if e.source_key not in keys or info is None or info.dtype != e.source_dtype or tuple(info.shape) != e.shape:
                        raise ValueError(f"{path}: {e.source_key} changed since it was validated")
                    start = header.data_start + info.data_offsets[0]
                    if e.source_dtype == e.target_dtype:  # stored bytes are the output bytes
                        writer.copy_bytes(e.target_key, fd, start, info.nbytes)
                    else:
                        writer.cast_bytes(e.target_key, fd, start, info.nbytes, e.source_dtype, chunk_bytes)
            finally:
                os.close(fd)
    write_index(out_folder, prepared.layouts, WEIGHTS_NAME)
    prepared.model.save_config(out_folder)
    return out_folder


def load_original_checkpoint(
    cls,
    source_dir: str | Path,
    config: str | Path | dict | None = None,
    *,
    component: str | None = None,
    dtype: torch.dtype = torch.float32,
    model_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Build ``cls`` from a SandAI checkpoint folder, using the converter's key plan in memory.

    This is what ``Magi2Transformer3DModel.from_original_checkpoint`` (and the refiner's) run:
    the same validation as the converter (every problem listed before loading), the same renames
    and the EMA router bias, then ``load_state_dict(strict=True, assign=True)`` on a model built
    without allocating weights.

    Args:
        cls: the model class (its ``TRANSFORMER_TARGETS`` entry is found by class name).
        source_dir: SandAI checkpoint folder.
        config: SandAI JSON path / dict; ``None`` for the released config.
        component: ``"transformer"`` or ``"refiner"``; inferred from ``cls`` when ``None``.
        dtype: dtype of the non-island weights (fp32 islands always load as fp32).
        model_kwargs: extra constructor arguments that are not part of the config (e.g.
            ``params_dtype``).

    Returns:
        the model in eval mode, every tensor on CPU.

    Raises:
        key_plan.CheckpointValidationError: the checkpoint does not match the config.
    """
    from safetensors import safe_open

    if component is None:
        matches = [k for k, t in TRANSFORMER_TARGETS.items() if t.class_name == cls.__name__]
        if not matches:
            raise ValueError(f"{cls.__name__} is not a known MAGI-2 transformer class; pass component=")
        component = matches[0]
    target = TRANSFORMER_TARGETS[component]
    cfg, label = resolve_sandai_config(target, config)
    kwargs = {**model_kwargs_from_sandai(target, cfg), **(model_kwargs or {})}
    model = build_meta_model(cls, kwargs)
    expected = expected_specs_from_model(model, params_dtype_code(target, cfg))
    source = read_source_checkpoint(source_dir)
    plan = build_key_plan(source, expected, dtype="keep", context=f"checked against {label}",
                          hint=_hint_local_config(Path(source_dir), config))
    state: dict[str, torch.Tensor] = {}
    for fname, entries in plan.entries_by_file().items():
        with safe_open(str(plan.source_dir / fname), framework="pt") as handle:
            for e in entries:
                t = handle.get_tensor(e.source_key)
                state[e.target_key] = t.to(torch.float32 if expected[e.target_key].fp32_island else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:  # never hand back a model with unloaded (meta) tensors
        raise ValueError(f"{len(on_meta)} tensors were left on the meta device after loading, e.g. {on_meta[:5]}")
    return model.eval()
