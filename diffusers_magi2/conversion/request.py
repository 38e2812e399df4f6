"""What ``magi2-convert`` is asked to do (:class:`ConversionRequest`) and every problem of a request that needs no
checkpoint read (:func:`request_problems`), in a module without torch: the command line refuses bad usage before
torch is imported, and :func:`~diffusers_magi2.conversion.repo.convert_checkpoint` runs the same checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..loaders.sandai_config import load_sandai_config, released_config_path
from ..utils.dtype_names import DENSE_STORAGE_DTYPE_CHOICES, DTYPE_CHOICES, EXPERT_DTYPE_CHOICES
from .release_layout import ALL_COMPONENTS
from .sandai_prompt_enhancer import sandai_code_problems


__all__ = ["ConversionRequest", "ConversionRequestError", "request_problems"]

#: ``--expert_int4_group_size``'s default (``diffusers_magi2.moe.quantize_int4.INT4_GROUP_SIZE``, kept equal by a test).
DEFAULT_INT4_GROUP_SIZE = 128


@dataclass
class ConversionRequest:
    """What to convert and where.

    Attributes:
        output_path: the repository folder to create (``OUT``).
        components: a subset of :data:`ALL_COMPONENTS`.
        inputs: component -> source path (all but ``scheduler``).
        config: SandAI JSON for ``transformer``/``refiner`` (``None``: the released configs).
        dtype: ``"keep"``, ``"bf16"`` or ``"fp32"`` (fp32 islands stay fp32; ``vae`` and ``audio_vae`` are
            always written in fp32, the dtype they run in).
        expert_dtype: ``None``, ``"fp8_e4m3"`` (the routed experts in FP8 with fp32 scales) or ``"int4"`` (NF4
            codes with bf16 group scales).
        expert_int4_group_size: with ``expert_dtype="int4"``: rows of the contraction dim per scale (``None``: 128).
        dense_storage_dtype: ``None`` or ``"fp8_e4m3"`` (the transformer's and the refiner's dense projections in FP8
            with fp32 scales per output channel).
        max_shard_size: output shard size limit in bytes.
        overwrite: replace an existing non-empty ``OUT``.
        dry_run: validate and print the plan only.
        repo_id: Hub id of the model card snippet and ``push_to_hub``.
        sandai_code_dir: SandAI's code folder, whose prompt-enhancement templates and endpoint defaults become the
            repo's ``prompt_enhancer/`` (:mod:`~.sandai_prompt_enhancer`; ``None``: no enhancer).
        component_options: component -> extra keyword arguments of its converter.
    """

    output_path: Path
    components: list[str]
    inputs: dict[str, Path] = field(default_factory=dict)
    config: Path | None = None
    dtype: str = "keep"
    expert_dtype: str | None = None
    expert_int4_group_size: int | None = None
    dense_storage_dtype: str | None = None
    max_shard_size: int = 5 * 10**9
    overwrite: bool = False
    dry_run: bool = False
    repo_id: str | None = None
    sandai_code_dir: Path | None = None
    component_options: dict[str, dict] = field(default_factory=dict)


class ConversionRequestError(ValueError):
    """A request that cannot be converted, found before any checkpoint is read.

    ``str(err)`` lists the problems one per line; ``problems`` holds them.
    """

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("cannot convert:\n" + "\n".join(f"  - {p}" for p in self.problems))


def request_problems(req: ConversionRequest) -> list[str]:
    """Every problem of ``req`` found from its fields and the file system alone (flag names as on the command
    line); empty when it can be converted."""
    problems = []
    unknown = [c for c in req.components if c not in ALL_COMPONENTS]
    if unknown:
        problems.append(f"--components: unknown {unknown}; allowed: {', '.join(ALL_COMPONENTS)}")
    if not req.components:
        problems.append("no components to convert: give --checkpoint_root or a per-part flag, or list --components")
    if req.dtype not in DTYPE_CHOICES:
        problems.append(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {req.dtype!r}")
    if req.expert_dtype is not None and req.expert_dtype not in EXPERT_DTYPE_CHOICES:
        problems.append(f"--expert_dtype must be one of {', '.join(EXPERT_DTYPE_CHOICES)}, got {req.expert_dtype!r}")
    elif req.expert_dtype is not None and "transformer" not in req.components:
        problems.append(
            "--expert_dtype applies to the transformer's routed experts (the refiner has none); the transformer is not converted"
        )
    if req.expert_int4_group_size is not None and req.expert_dtype != "int4":
        problems.append(
            f"--expert_int4_group_size applies to --expert_dtype int4; got --expert_dtype {req.expert_dtype}"
        )
    elif req.expert_dtype == "int4" and "transformer" in req.components:
        problems += int4_group_size_problems(req)
    if req.dense_storage_dtype is not None and req.dense_storage_dtype not in DENSE_STORAGE_DTYPE_CHOICES:
        problems.append(
            f"--dense_storage_dtype must be one of {', '.join(DENSE_STORAGE_DTYPE_CHOICES)}, got {req.dense_storage_dtype!r}"
        )
    elif req.dense_storage_dtype is not None and not {"transformer", "refiner"} & set(req.components):
        problems.append(
            "--dense_storage_dtype applies to the transformer's and the refiner's dense projections; neither is converted"
        )
    for comp in req.components:
        if comp == "scheduler" or comp not in ALL_COMPONENTS:
            continue
        src = req.inputs.get(comp)
        if src is None:
            problems.append(f"component {comp!r} was requested but no input was given for it")
        elif not Path(src).exists():
            problems.append(f"{comp}: input {src} does not exist")
    if req.sandai_code_dir is not None:
        problems += sandai_code_problems(req.sandai_code_dir)
    if req.config is not None and not Path(req.config).exists():
        problems.append(f"--config {req.config} does not exist")
    out = Path(req.output_path)
    if out.exists() and not out.is_dir():
        problems.append(f"--output_path {out} exists and is not a directory")
    elif out.is_dir() and any(out.iterdir()) and not req.overwrite and not req.dry_run:
        problems.append(f"--output_path {out} exists and is not empty; pass --overwrite to replace it")
    return problems


def int4_group_size_problems(req: ConversionRequest) -> list[str]:
    """``--expert_int4_group_size`` (default 128) against the MoE widths of the transformer's SandAI config
    (``--config`` or the released one): the group must divide the MoE head width ``Dh = hidden_size / num_heads``
    and the expert width ``De`` (the contraction dims of ``W_gate``/``W_up`` and ``W_down``). A config that cannot
    be read or lacks these fields gives no problem here (the conversion reports it)."""
    try:
        cfg = load_sandai_config(req.config if req.config is not None else released_config_path())
        arch = cfg["arch_config"]
        moe = arch.get("moe_config", {})
        if not moe.get("moe_layers"):
            return []
        widths = {
            "Dh": int(arch["hidden_size"]) // int(moe.get("num_heads", 1)),
            "De": int(moe["expert_intermediate_size"]),
        }
    except (OSError, ValueError, KeyError, TypeError):
        return []
    group = req.expert_int4_group_size or DEFAULT_INT4_GROUP_SIZE
    if all(w % group == 0 for w in widths.values()):
        return []
    common = math.gcd(*widths.values())
    allowed = [str(g) for g in range(1, common + 1) if common % g == 0]
    given = "" if req.expert_int4_group_size else " (the default)"
    where = f"--config {req.config}" if req.config is not None else "the released config"
    return [
        f"--expert_int4_group_size {group}{given} does not divide the transformer's MoE head width Dh="
        f"{widths['Dh']} and expert width De={widths['De']} ({where}; int4 groups run along each expert matrix's "
        f"contraction dim); pass --expert_int4_group_size with one of {', '.join(allowed)}"
    ]
