"""Transformer and refiner conversion: config -> meta model -> validated key plan -> streamed shards.

Config, meta model and key plan are the loader's (:mod:`diffusers_magi2.loaders.original_checkpoint`); this
module adds the output layout and the streaming write, one source shard at a time into pre-sized output shards
(:class:`~diffusers_magi2.utils.safetensors_io.ShardWriter`). With ``expert_dtype="float8_e4m3fn"`` or ``"int4"``
the routed experts are cast, quantized a chunk of rows at a time (:func:`~diffusers_magi2.moe.quantize.quantize_fp8`,
:func:`~diffusers_magi2.moe.quantize_int4.quantize_int4`) and written with their scales, and ``config.json`` records
``expert_dtype`` (with int4 also ``expert_int4_group_size`` and ``expert_int4_packing``): bit for bit what
quantize-at-load gives.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..loaders.key_plan import KeyPlan, build_key_plan, read_source_checkpoint
from ..loaders.original_checkpoint import (
    build_meta_model,
    config_hint,
    expected_specs_from_model,
    original_format,
)
from ..loaders.quantized_experts import expert_bank_names
from ..moe.expert_formats import expert_storage
from ..moe.expert_storage import BANKS
from ..moe.quantize_int4 import INT4_GROUP_SIZE
from ..utils.safetensors_io import (
    DTYPE_ITEMSIZE,
    DTYPE_TO_TORCH,
    TORCH_TO_DTYPE,
    OutputTensor,
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
    "prepare_transformer_conversion",
    "write_transformer",
]

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class TransformerTarget:
    """Where a transformer-like component's diffusers class lives.

    Attributes:
        component: ``model_index.json`` name.
        module: defining module of the model class (public format, never moves).
        class_name: the model class.
    """

    component: str
    module: str
    class_name: str

    def model_class(self) -> type:
        """The diffusers model class (imported on use)."""
        return getattr(importlib.import_module(self.module), self.class_name)


TRANSFORMER_TARGETS: dict[str, TransformerTarget] = {
    "transformer": TransformerTarget(
        "transformer", "diffusers_magi2.models.transformer_magi2", "Magi2Transformer3DModel"
    ),
    "refiner": TransformerTarget(
        "refiner", "diffusers_magi2.models.transformer_magi2_refiner", "Magi2RefinerTransformer3DModel"
    ),
}


@dataclass
class PreparedTransformer:
    """Everything needed to write one converted transformer, computed from headers only.

    Attributes:
        target: which component.
        plan: the validated key plan.
        model: the meta model (for ``save_config``).
        layouts: the output shard layouts.
        config_label: where the SandAI config came from.
        quantized_banks: the banks written quantized, each with its scale (``expert_dtype``).
        expert_dtype: ``None``, ``"float8_e4m3fn"`` or ``"int4"``.
        int4_group_size: int4 experts: rows of the contraction dim per scale.
    """

    target: TransformerTarget
    plan: KeyPlan
    model: torch.nn.Module
    layouts: list[ShardLayout]
    config_label: str
    quantized_banks: frozenset = frozenset()
    expert_dtype: str | None = None
    int4_group_size: int = INT4_GROUP_SIZE

    def storage(self):
        """The :class:`~diffusers_magi2.moe.expert_storage.ExpertStorage` the routed experts are written in."""
        return expert_storage(self.expert_dtype, int4_group_size=self.int4_group_size)

    def describe(self) -> str:
        """Key plan plus output shard layout (the ``--dry_run`` report for this component)."""
        lines = [
            f"[{self.target.component}] {self.target.class_name} from {self.plan.source_dir} ({self.config_label})"
        ]
        lines.append(self.plan.describe())
        if self.quantized_banks:
            lines.append(self.storage().describe_banks(len(self.quantized_banks)))
        total = sum(lay.data_size for lay in self.layouts)
        lines.append(f"output {self.target.component}/: {len(self.layouts)} shard(s), {total} bytes of tensor data")
        for lay in self.layouts:
            lines.append(f"  {lay.filename}: {len(lay.offsets)} tensors, {lay.file_size} bytes")
        return "\n".join(lines)


def prepare_transformer_conversion(
    component: str,
    source_dir: str | Path,
    config: str | Path | dict | None = None,
    *,
    dtype: str = "keep",
    max_shard_size: int = 5 * 10**9,
    check_data: bool = True,
    expert_dtype: str | None = None,
    expert_int4_group_size: int = INT4_GROUP_SIZE,
) -> PreparedTransformer:
    """Validate a SandAI transformer/refiner checkpoint and lay out its output (headers only).

    Args:
        component: ``"transformer"`` or ``"refiner"``.
        source_dir: SandAI checkpoint folder (index + shards).
        config: SandAI JSON path / dict, ``None`` for the released config.
        dtype: ``"keep"``, ``"bf16"`` or ``"fp32"`` (fp32 islands always stay fp32).
        max_shard_size: output shard data size limit in bytes.
        check_data: require each shard's data (``False`` for dry runs on header-only stubs).
        expert_dtype: ``None`` (experts as ``dtype``), ``"float8_e4m3fn"`` (FP8 routed experts + fp32 scales) or
            ``"int4"`` (NF4 codes + bf16 group scales, :mod:`diffusers_magi2.moe.quantize_int4`).
        expert_int4_group_size: int4 experts: rows of each expert matrix's contraction dim per scale.

    Raises:
        CheckpointValidationError: every problem found, listed together.
        ValueError: bad arguments (``expert_dtype`` outside ``(None, "float8_e4m3fn", "int4")``, quantized experts
            for a model without routed experts, an int4 group size that does not divide the MoE head width or the
            expert width, naming ``expert_int4_group_size``) or a config without the needed section; all before
            any weight is read.
    """
    if component not in TRANSFORMER_TARGETS:
        raise ValueError(f"component must be one of {sorted(TRANSFORMER_TARGETS)}, got {component!r}")
    storage = expert_storage(expert_dtype, int4_group_size=expert_int4_group_size)
    target = TRANSFORMER_TARGETS[component]
    cls = target.model_class()
    fmt = original_format(cls)
    cfg, label = fmt.resolve_config(config)
    model = build_meta_model(cls, fmt.model_kwargs(cfg))
    banks = expert_bank_names(model) if storage.scale_names else {}
    if storage.scale_names and not banks:
        raise ValueError(f"expert_dtype applies to routed experts; the {component} ({cls.__name__}) has none")
    if banks:
        moe = next(iter(banks.values()))[0]
        storage.check_banks(moe.head_dim, moe.expert_intermediate_size, "expert_int4_group_size")
    expected = expected_specs_from_model(model, TORCH_TO_DTYPE[fmt.params_dtype(cfg)])
    source = read_source_checkpoint(source_dir, check_data=check_data)
    plan = build_key_plan(
        source, expected, dtype=dtype, context=f"checked against {label}", hint=config_hint(source_dir, config)
    )
    outputs = []
    for t in plan.output_tensors():
        if t.name not in banks:
            outputs.append(t)
        else:
            bank_shape, bank_dtype, scale_shape, scale_dtype = storage.stored_layout(tuple(t.shape))
            outputs += [
                OutputTensor(t.name, TORCH_TO_DTYPE[bank_dtype], bank_shape),
                OutputTensor(_scale_key(t.name, storage), TORCH_TO_DTYPE[scale_dtype], scale_shape),
            ]
    layouts = plan_shards(outputs, max_shard_size, WEIGHTS_NAME)
    stored_as = storage.config_name  # the config's name (None: experts as dtype)
    if stored_as is not None:  # saved with the config: the repo loads with these experts
        model.register_to_config(expert_dtype=stored_as, **storage.config_entries())
    return PreparedTransformer(
        target, plan, model, layouts, label, frozenset(banks), stored_as, expert_int4_group_size
    )


def _scale_key(bank_name: str, storage) -> str:
    """The state-dict name of a quantized bank's scale (``W_gate`` -> ``W_gate_scale`` or ``W_gate_group_scale``)."""
    prefix, bank = bank_name.rsplit(".", 1)
    return f"{prefix}.{storage.scale_names[BANKS.index(bank)]}"


def write_transformer(
    prepared: PreparedTransformer,
    out_folder: str | Path,
    chunk_bytes: int = 16 * 1024 * 1024,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Stream the planned tensors into ``out_folder`` (created; must not exist yet).

    Kept tensors are copied byte for byte, cast ones ``chunk_bytes`` at a time; then ``config.json`` and the index.

    Args:
        log: called once per source shard with a progress line (``None``: silent).

    Returns:
        ``out_folder``.
    """
    from safetensors import safe_open

    out_folder = Path(out_folder)
    out_folder.mkdir(parents=True, exist_ok=False)
    plan = prepared.plan
    experts = expert_bank_names(prepared.model)
    with ShardWriter(out_folder, prepared.layouts) as writer:
        groups = plan.entries_by_file()
        for i, (fname, entries) in enumerate(groups.items()):
            path = plan.source_dir / fname
            if log is not None:
                log(
                    f"[{prepared.target.component}] source shard {i + 1}/{len(groups)}: {fname} ({len(entries)} tensors)"
                )
            header = read_safetensors_header(path)
            with safe_open(str(path), framework="pt") as handle:  # the library's own check of the shard
                keys = set(handle.keys())
            fd = os.open(path, os.O_RDONLY)
            try:
                for e in entries:
                    info = header.tensors.get(e.source_key)
                    if (
                        e.source_key not in keys
                        or info is None
                        or info.dtype != e.source_dtype
                        or tuple(info.shape) != e.shape
                    ):
                        raise ValueError(f"{path}: {e.source_key} changed since it was validated")
                    start = header.data_start + info.data_offsets[0]
                    if e.target_key in prepared.quantized_banks:
                        quantize = _bank_quantizer(prepared, e, experts[e.target_key][0].num_experts)
                        _write_quantized_bank(writer, e, fd, start, chunk_bytes, quantize, prepared.storage())
                    elif e.source_dtype == e.target_dtype:  # stored bytes are the output bytes
                        writer.copy_bytes(e.target_key, fd, start, info.nbytes)
                    else:
                        writer.cast_bytes(e.target_key, fd, start, info.nbytes, e.source_dtype, chunk_bytes)
            finally:
                os.close(fd)
    write_index(out_folder, prepared.layouts, WEIGHTS_NAME)
    prepared.model.save_config(out_folder)
    return out_folder


def _bank_quantizer(prepared: PreparedTransformer, entry, num_experts: int) -> Callable:
    """``rows [n, K, N], first -> (stored rows, their scales)`` for one bank (messages name the source tensor)."""
    name, storage = f"{entry.source_file}: {entry.source_key}", prepared.storage()
    return lambda rows, first: storage.quantize(rows, name=name, first_row=first, num_experts=num_experts)


def _write_quantized_bank(
    writer: ShardWriter, entry, fd: int, start: int, chunk_bytes: int, quantize, storage
) -> None:
    """Quantize one expert bank ``[R, K, N]`` chunk of rows by chunk of rows: the stored rows, then their scales
    (``ValueError`` naming the source tensor, expert and column of a non-finite weight)."""
    rows, row_elems = entry.shape[0], entry.shape[1] * entry.shape[2]
    row_bytes = row_elems * DTYPE_ITEMSIZE[entry.source_dtype]
    step = max(1, min(rows, chunk_bytes // row_bytes))
    buf = bytearray(step * row_bytes)
    source = torch.frombuffer(buf, dtype=DTYPE_TO_TORCH[entry.source_dtype]).view(step, *entry.shape[1:])
    scale_key = _scale_key(entry.target_key, storage)
    for first in range(0, rows, step):
        n = min(step, rows - first)
        view, got = memoryview(buf)[: n * row_bytes], 0
        while got < len(view):
            read = os.preadv(fd, [view[got:]], start + first * row_bytes + got)
            if read == 0:
                raise ValueError(f"{entry.source_key}: source ended early")
            got += read
        stored, scale = quantize(source[:n].to(DTYPE_TO_TORCH[entry.target_dtype]), first)
        writer.write_chunk(entry.target_key, stored)
        writer.write_chunk(scale_key, scale)
