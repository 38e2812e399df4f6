"""Key plan for the MAGI-2 transformer and refiner: SandAI checkpoint keys -> diffusers keys.

Rename-only and shape-preserving: ``block.layers.{i}.`` -> ``transformer_blocks.{i}.``, and in a layer the flat mHC
tensors ``mhc_{param}_{site}`` -> ``mhc_{site}.{param}`` (``param`` one of ``alpha_{pre,post,res}``,
``bias_{pre,post,res}``, ``phi_fused``; ``site`` ``attn`` or ``mlp``: the layer's two ``Magi2HyperConnection``
submodules), other keys kept, every tensor whole (so expert-parallel ranks ``get_slice`` their rows from the
files), and ``router.expert_bias`` written from the source ``router.expert_bias_ema`` (SandAI's
``_apply_router_bias_ema``; the raw bias must be present but is not used). :func:`build_key_plan` checks the
checkpoint against the keys, shapes and dtypes of the model built on the meta device and raises every problem
in one :class:`CheckpointValidationError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..utils.dtype_utils import convert_dtype
from ..utils.safetensors_io import (
    TORCH_TO_DTYPE,
    OutputTensor,
    SafetensorsHeader,
    check_data_present,
    read_index,
    read_safetensors_header,
)


__all__ = [
    "CheckpointValidationError",
    "KeyPlan",
    "PlannedTensor",
    "SourceCheckpoint",
    "TensorSpec",
    "build_key_plan",
    "check_no_flat_mhc_keys",
    "read_source_checkpoint",
    "source_to_target_key",
    "target_dtype_for",
    "target_to_source_key",
]

SOURCE_INDEX_NAME = "model.safetensors.index.json"
SOURCE_SINGLE_FILE = "model.safetensors"
_SOURCE_BLOCK = re.compile(r"^block\.layers\.(\d+)\.")
_TARGET_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.")
_ROUTER_BIAS = "router.expert_bias"
_MHC_PARAM = r"(?P<param>(?:alpha|bias)_(?:pre|post|res)|phi_fused)"
_MHC_SITE = r"(?P<site>attn|mlp)"
_SOURCE_MHC = re.compile(rf"^(?P<layer>block\.layers\.\d+)\.mhc_{_MHC_PARAM}_{_MHC_SITE}$")
_TARGET_MHC = re.compile(rf"^(?P<layer>transformer_blocks\.\d+)\.mhc_{_MHC_SITE}\.{_MHC_PARAM}$")
_FLAT_TARGET_MHC = re.compile(rf"^transformer_blocks\.\d+\.mhc_{_MHC_PARAM}_{_MHC_SITE}$")


def source_to_target_key(key: str) -> str:
    """Map a SandAI key to its diffusers name: ``block.layers.{i}.`` -> ``transformer_blocks.{i}.``, and a layer's
    ``mhc_{param}_{site}`` -> ``mhc_{site}.{param}``."""
    mhc = _SOURCE_MHC.match(key)
    if mhc is not None:
        key = f"{mhc['layer']}.mhc_{mhc['site']}.{mhc['param']}"
    return _SOURCE_BLOCK.sub(r"transformer_blocks.\1.", key, count=1)


def target_to_source_key(key: str) -> str:
    """Inverse of :func:`source_to_target_key`."""
    mhc = _TARGET_MHC.match(key)
    if mhc is not None:
        key = f"{mhc['layer']}.mhc_{mhc['param']}_{mhc['site']}"
    return _TARGET_BLOCK.sub(r"block.layers.\1.", key, count=1)


def check_no_flat_mhc_keys(keys, where: str) -> None:
    """Refuse a diffusers-layout checkpoint whose mHC tensors are named flat (``transformer_blocks.{i}.mhc_{param}_
    {site}``, as written before the ``Magi2HyperConnection`` sites): diffusers would leave those parameters unloaded.

    Args:
        keys: the checkpoint's tensor names.
        where: the checkpoint, for the message.

    Raises:
        ValueError: naming the count, an example and the rename.
    """
    flat = sorted(k for k in keys if _FLAT_TARGET_MHC.match(k))
    if flat:
        raise ValueError(
            f"{where} names {len(flat)} mHC tensors the flat way (e.g. {flat[0]!r}): it was written before each "
            "block's mHC parameters moved into its mhc_attn / mhc_mlp submodules. Convert the SandAI checkpoint "
            "again with magi2-convert, or rename every transformer_blocks.{i}.mhc_{param}_{site} to "
            "transformer_blocks.{i}.mhc_{site}.{param} (the tensors are unchanged)"
        )


def target_dtype_for(source_dtype: str, dtype: str, *, fp32_island: bool) -> str:
    """Output dtype code of a tensor under ``--dtype`` ``"keep"``/``"bf16"``/``"fp32"`` (fp32 islands stay ``F32``).

    Raises:
        ValueError: ``dtype`` is not one of those three.
    """
    torch_dtype = convert_dtype(dtype)
    if fp32_island:
        return "F32"
    return source_dtype if torch_dtype is None else TORCH_TO_DTYPE[torch_dtype]


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape and safetensors dtype code of one tensor, and whether the model keeps it fp32."""

    shape: tuple[int, ...]
    dtype: str
    fp32_island: bool = False


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor of the plan (``target_key`` written from ``source_key`` of ``source_file``)."""

    target_key: str
    source_key: str
    source_file: str
    shape: tuple[int, ...]
    source_dtype: str
    target_dtype: str

    @property
    def transform(self) -> str:
        if source_to_target_key(self.source_key) != self.target_key:
            return "copy of " + self.source_key.rsplit(".", 1)[-1]
        return "rename" if self.source_key != self.target_key else "identity"


@dataclass(frozen=True)
class KeyPlan:
    """A validated, ordered conversion plan for one transformer checkpoint.

    Attributes:
        source_dir: the SandAI checkpoint folder.
        entries: output tensors in write order (source shard by shard, data-offset order).
        source_files: source shards in reading order.
        read_not_written: source keys validated but not written (the raw ``router.expert_bias``).
    """

    source_dir: Path
    entries: tuple[PlannedTensor, ...]
    source_files: tuple[str, ...]
    read_not_written: tuple[str, ...] = ()

    def output_tensors(self) -> list[OutputTensor]:
        """The output tensors (target name, dtype, shape) in write order."""
        return [OutputTensor(e.target_key, e.target_dtype, e.shape) for e in self.entries]

    def entries_by_file(self) -> dict[str, list[PlannedTensor]]:
        """Entries grouped by the source shard they are read from, in reading order."""
        groups: dict[str, list[PlannedTensor]] = {f: [] for f in self.source_files}
        for e in self.entries:
            groups[e.source_file].append(e)
        return groups

    def describe(self) -> str:
        """Human-readable plan: one line per output tensor (used by ``--dry_run``)."""
        lines = [
            f"key plan for {self.source_dir}: {len(self.entries)} output tensors from {len(self.source_files)} source shard(s)"
        ]
        for e in self.entries:
            dt = e.source_dtype if e.source_dtype == e.target_dtype else f"{e.source_dtype}->{e.target_dtype}"
            lines.append(f"  {e.source_file}: {e.source_key} -> {e.target_key} {list(e.shape)} {dt} [{e.transform}]")
        for k in self.read_not_written:
            lines.append(f"  validated, not written (replaced by its EMA): {k}")
        return "\n".join(lines)


#: (text every message of that kind contains, plural label) for the per-kind counts of a summary
_PROBLEM_KINDS = (
    (": unexpected key", "unexpected keys"),
    (": missing key", "missing keys"),
    (": shape ", "shape mismatches"),
    (": dtype ", "dtype mismatches"),
)


class CheckpointValidationError(ValueError):
    """Every problem found in a source checkpoint, raised before anything is written.

    ``str(err)`` summarises (heading, hint, counts, the first :attr:`SUMMARY_LIMIT`); ``report(verbose=True)`` lists all.
    """

    SUMMARY_LIMIT = 5

    def __init__(self, source: str | Path, problems: list[str], context: str = "", hint: str = ""):
        self.source = Path(source)
        self.problems = list(problems)
        self.context = context
        self.hint = hint
        super().__init__(self.report())

    def report(self, verbose: bool = False) -> str:
        """The summary (default) or, with ``verbose``, the heading and hint followed by every problem."""
        head = f"{len(self.problems)} problem(s) in checkpoint {self.source}"
        if self.context:
            head += f" ({self.context})"
        lines = [head + "; nothing was written:"]
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        shown = self.problems if verbose else self.problems[: self.SUMMARY_LIMIT]
        if len(shown) < len(self.problems):
            counts: dict[str, int] = {}
            for problem in self.problems:
                kind = next((label for text, label in _PROBLEM_KINDS if text in problem), "other problems")
                counts[kind] = counts.get(kind, 0) + 1
            lines.append("  by kind: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))
            lines.append(f"  first {len(shown)}:")
        lines += [f"  - {p}" for p in shown]
        if len(shown) < len(self.problems):
            lines.append(
                f"  ... and {len(self.problems) - len(shown)} more (magi2-convert --verbose, or the exception's "
                "problems attribute, lists them all)"
            )
        return "\n".join(lines)


@dataclass
class SourceCheckpoint:
    """A SandAI safetensors checkpoint folder read at the header level.

    Attributes:
        directory: the folder.
        weight_map: key -> shard file name.
        headers: shard file name -> parsed header, for every readable shard.
        problems: index-level faults found while reading.
    """

    directory: Path
    weight_map: dict[str, str]
    headers: dict[str, SafetensorsHeader]
    problems: list[str] = field(default_factory=list)

    def tensor(self, key: str):
        """The header entry of ``key`` in the shard the index names, or ``None``."""
        header = self.headers.get(self.weight_map.get(key, ""))
        return None if header is None else header.tensors.get(key)


def _shard_sort_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def read_source_checkpoint(directory: str | Path, *, check_data: bool = True) -> SourceCheckpoint:
    """Read the index (or a single ``model.safetensors``) and every shard header, recording as problems missing,
    unreadable, truncated (with ``check_data``) or unreferenced shards and keys that disagree with the index.

    Raises:
        ValueError: the folder does not exist, or holds neither an index nor ``model.safetensors``,
            or the index is not valid JSON with a ``weight_map`` object.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint folder {directory} does not exist or is not a directory")
    problems: list[str] = []
    weight_map = read_index(directory, SOURCE_INDEX_NAME, SOURCE_SINGLE_FILE)

    headers: dict[str, SafetensorsHeader] = {}
    files = sorted(set(weight_map.values()), key=_shard_sort_key) if weight_map is not None else [SOURCE_SINGLE_FILE]
    for fname in files:
        path = directory / fname
        if not path.is_file():
            problems.append(
                f"{fname}: missing shard file (named by the index for {sum(v == fname for v in weight_map.values())} keys)"
            )
            continue
        try:
            header = read_safetensors_header(path)
        except ValueError as err:
            problems.append(f"{fname}: unreadable shard: {err}")
            continue
        if check_data:
            msg = check_data_present(header)
            if msg:
                problems.append(msg)
                continue
        headers[fname] = header
    if weight_map is None:
        weight_map = dict.fromkeys(
            headers.get(SOURCE_SINGLE_FILE, SafetensorsHeader(directory, 0, {})).tensors, SOURCE_SINGLE_FILE
        )

    for key, fname in weight_map.items():
        header = headers.get(fname)
        if header is not None and key not in header.tensors:
            problems.append(f"{key}: listed in the index under {fname}, but that shard has no such tensor")
    for fname, header in headers.items():
        for key in header.tensors:
            mapped = weight_map.get(key)
            if mapped is None:
                problems.append(f"{key}: present in shard {fname} but absent from the index")
            elif mapped != fname:
                problems.append(
                    f"{key}: present in shard {fname} but the index maps it to {mapped} (stale or duplicate shard)"
                )
    referenced = set(files)
    for path in sorted(directory.glob("*.safetensors")):
        if path.name not in referenced:
            problems.append(f"{path.name}: shard file not referenced by the index")
    return SourceCheckpoint(directory, dict(weight_map), headers, problems)


def build_key_plan(
    source: SourceCheckpoint,
    expected: Mapping[str, TensorSpec],
    *,
    dtype: str = "keep",
    context: str = "",
    hint: str = "",
) -> KeyPlan:
    """Validate ``source`` against the expected target tensors and return the ordered plan.

    Args:
        source: from :func:`read_source_checkpoint`.
        expected: target key -> expected shape and source dtype code.
        dtype: ``"keep"``, ``"bf16"`` or ``"fp32"``.
        context: appended to the error heading.
        hint: what to try when validation fails.

    Returns:
        a :class:`KeyPlan` covering every expected key exactly once.

    Raises:
        CheckpointValidationError: every index fault, unknown or missing key, shape and dtype mismatch.
        ValueError: ``dtype`` is not allowed.
    """
    convert_dtype(dtype)  # validates the choice before any problem is collected
    problems = list(source.problems)
    needed_sources: dict[str, str] = {}  # source key -> target key it is validated as
    for key in source.weight_map:
        target = source_to_target_key(key)
        if target not in expected:
            problems.append(f"{key}: unexpected key (maps to {target}, which the model does not have)")
        else:
            needed_sources[key] = target
    for target in expected:
        src = target_to_source_key(target)
        if src not in source.weight_map:
            problems.append(f"{src}: missing key (the model needs {target})")

    for src, target in needed_sources.items():
        info = source.tensor(src)
        if info is None:
            continue  # already reported as an index/shard problem
        spec = expected[target]
        if tuple(info.shape) != tuple(spec.shape):
            problems.append(
                f"{src}: shape {list(info.shape)} in {source.weight_map[src]}, the model expects {list(spec.shape)}"
            )
        if info.dtype != spec.dtype:
            problems.append(f"{src}: dtype {info.dtype} in {source.weight_map[src]}, the model expects {spec.dtype}")
    if problems:
        raise CheckpointValidationError(source.directory, problems, context, hint)

    # Order: source shards in natural order, tensors in data-offset order inside each shard.
    order = {}
    for fname in sorted(source.headers, key=_shard_sort_key):
        for key in source.headers[fname].tensors:  # headers are kept in data-offset order
            order[key] = len(order)
    entries: list[PlannedTensor] = []
    read_not_written: list[str] = []
    for src in sorted(needed_sources, key=order.__getitem__):
        target = needed_sources[src]
        read_from = src
        if src.endswith("." + _ROUTER_BIAS):
            read_from = src + "_ema"
            read_not_written.append(src)
        info = source.tensor(read_from)
        entries.append(
            PlannedTensor(
                target_key=target,
                source_key=read_from,
                source_file=source.weight_map[read_from],
                shape=tuple(info.shape),
                source_dtype=info.dtype,
                target_dtype=target_dtype_for(info.dtype, dtype, fp32_island=expected[target].fp32_island),
            )
        )
    files = tuple(f for f in sorted(source.headers, key=_shard_sort_key) if any(e.source_file == f for e in entries))
    return KeyPlan(source.directory, tuple(entries), files, tuple(read_not_written))
