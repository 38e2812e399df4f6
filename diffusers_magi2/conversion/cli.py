"""``magi2-convert``: command line of the SandAI MAGI-2 -> diffusers converter.

Examples::

    # whole release, bf16 output, 5 GB shards
    magi2-convert --checkpoint_root /ckpt --output_path MAGI-2-preview-diffusers --dtype bf16

    # the same with FP8 routed experts (one-GPU repo), or 4-bit ones (one 80 GB GPU)
    magi2-convert --checkpoint_root /ckpt --output_path MAGI-2-preview-fp8 --dtype bf16 --expert_dtype fp8_e4m3
    magi2-convert --checkpoint_root /ckpt --output_path MAGI-2-preview-int4 --dtype bf16 --expert_dtype int4

    # the 80 GB recipe's repo: int4 experts, dense projections in FP8 with per-channel scales
    magi2-convert --checkpoint_root /ckpt --output_path MAGI-2-preview-int4-fp8 --dtype bf16 --expert_dtype int4 \
        --dense_storage_dtype fp8_e4m3

    # only the transformer, from its own folder and config; plan only
    magi2-convert --preview_dir /ckpt/preview --config magi2_preview.json \\
        --output_path out --components transformer --dry_run

This module and ``conversion/convert_magi2_to_diffusers.py`` are the only converter code that read
argv; everything else takes explicit arguments (:mod:`diffusers_magi2.conversion.repo`). The flags are parsed
and checked against each other and the file system (:func:`~.request.request_problems`) before torch, diffusers or
the converter is imported, so bad usage is one ``magi2-convert: error: ...`` line on stderr at once.
Exit status: 0 on success, 1 on any error found in the checkpoints or while writing (the message names the
problem), 2 on bad usage (unknown or conflicting flags, a missing input, ``--config`` or ``--checkpoint_root``, a
non-empty ``--output_path`` without ``--overwrite``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..utils.byte_sizes import parse_size
from ..utils.dtype_names import DENSE_STORAGE_DTYPE_CHOICES, DTYPE_CHOICES, EXPERT_DTYPE_CHOICES
from .release_layout import ALL_COMPONENTS, RELEASE_LAYOUT
from .request import ConversionRequest, ConversionRequestError, request_problems


__all__ = ["build_parser", "main", "request_from_args"]

_PART_FLAGS = {
    "transformer": "preview_dir",
    "refiner": "refiner_dir",
    "vae": "vae_path",
    "video_decoder": "turbo_vae_dir",
    "audio_vae": "audio_vae_dir",
    "text_encoder": "text_encoder_dir",
}


class _OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``magi2-convert: error: ...`` line on stderr and exit status 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _positive_int(text: str) -> int:
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``magi2-convert`` (imports neither torch nor the converter)."""
    p = _OneLineArgumentParser(
        prog="magi2-convert",
        description="Convert SandAI's MAGI-2 Preview release into a Hub-loadable diffusers repository.",
    )
    src = p.add_argument_group("inputs (each per-part flag works alone, without --checkpoint_root)")
    src.add_argument(
        "--checkpoint_root",
        type=Path,
        help="SandAI release root: preview/, refiner/, vae/Wan2.2_VAE.pth, turbo_vae/, stable-audio-open-1.0/, text_encoder/",
    )
    src.add_argument("--preview_dir", type=Path, help="preview transformer shards + model.safetensors.index.json")
    src.add_argument("--refiner_dir", type=Path, help="refiner shards + index")
    src.add_argument("--vae_path", type=Path, help="Wan2.2_VAE.pth")
    src.add_argument("--turbo_vae_dir", type=Path, help="TurboVAE folder (JSON config + checkpoint.ckpt)")
    src.add_argument(
        "--audio_vae_dir", type=Path, help="stable-audio-open-1.0 folder (model_config.json + model.safetensors)"
    )
    src.add_argument("--text_encoder_dir", type=Path, help="Qwen3.5 text encoder folder (transformers format)")
    src.add_argument(
        "--config",
        type=Path,
        help="SandAI JSON (preview or refiner; 'extends' resolved) for transformer/refiner; default: the released configs",
    )
    src.add_argument(
        "--sandai_code_dir",
        type=Path,
        help="SandAI's code folder (a clone of SandAI-org/MAGI-2-preview): its prompt-enhancement templates "
        "(prompts/t2v.md, i2v.md) and endpoint defaults become the repo's prompt_enhancer/, which "
        "Magi2Pipeline.from_pretrained loads (the API key from OPENAI_API_KEY at use)",
    )
    p.add_argument("--output_path", type=Path, required=True, help="repository folder to create")
    p.add_argument(
        "--components",
        help=f"comma list of {','.join(ALL_COMPONENTS)} (default: all whose inputs are given, plus scheduler)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="keep",
        help="output dtype; the fp32 islands, the Wan2.2 VAE and the audio VAE (vae, audio_vae: they run in fp32) are "
        "always stored in fp32 (default: keep)",
    )
    p.add_argument(
        "--expert_dtype",
        choices=tuple(EXPERT_DTYPE_CHOICES),
        default=None,
        help="store the transformer's routed experts in FP8 e4m3 with fp32 scales, or as int4 (NF4 codes with bf16 "
        "scales per group of --expert_int4_group_size rows) (default: as --dtype)",
    )
    p.add_argument(
        "--expert_int4_group_size",
        type=_positive_int,
        default=None,
        help="with --expert_dtype int4: rows of each expert matrix's contraction dim per scale (default: 128)",
    )
    p.add_argument(
        "--dense_storage_dtype",
        choices=tuple(DENSE_STORAGE_DTYPE_CHOICES),
        default=None,
        help="store the transformer's and the refiner's dense projections in FP8 e4m3 with fp32 scales per output "
        "channel (what enable_fp8_storage keeps; default: as --dtype)",
    )
    p.add_argument("--max_shard_size", default="5GB", help="output shard size limit, e.g. 5GB, 500MB (default: 5GB)")
    p.add_argument(
        "--dry_run", action="store_true", help="read headers only, print the key plan and shard layout, write nothing"
    )
    p.add_argument(
        "--audio_vae_encoder",
        choices=("strict", "zeros"),
        default="strict",
        help="Stable Audio encoder not representable in AutoencoderOobleck: 'strict' fails, 'zeros' writes a zero "
        "encoder (MAGI-2 only decodes audio); default strict",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output_path")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="on a checkpoint that does not match its config, list every problem (default: a summary)",
    )
    p.add_argument(
        "--push_to_hub", action="store_true", help="upload the result with huggingface_hub (needs --repo_id)"
    )
    p.add_argument("--repo_id", help="Hub repository id, e.g. org/MAGI-2-preview-diffusers")
    p.add_argument("--private", action="store_true", help="create the Hub repository as private")
    return p


def request_from_args(args: argparse.Namespace, log=print):
    """Turn parsed flags into a :class:`~.request.ConversionRequest` (per-part flags override the root layout),
    checked without torch: every problem found from the flags and the file system alone.

    Raises:
        ConversionRequestError: a ``ValueError`` listing every problem: a ``--checkpoint_root`` that is no folder,
            unknown component names, ``--push_to_hub`` without ``--repo_id``, a ``--max_shard_size`` that is no size, and those of
            :func:`~.request.request_problems` (flags that conflict, inputs or ``--config`` missing, a non-empty
            ``--output_path`` without ``--overwrite``).
    """
    problems = []
    inputs: dict[str, Path] = {}
    if args.checkpoint_root is not None:
        root = Path(args.checkpoint_root)
        if not root.is_dir():
            problems.append(f"--checkpoint_root {root} is not a directory")
        else:
            for comp, rel in RELEASE_LAYOUT.items():
                if (root / rel).exists():
                    inputs[comp] = root / rel
    for comp, flag in _PART_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            inputs[comp] = Path(value)
    if args.components:
        components = [c.strip() for c in args.components.split(",") if c.strip()]
    else:
        components = [c for c in ALL_COMPONENTS if c in inputs]
        if components:
            components.append("scheduler")
        if args.checkpoint_root is not None and not problems:
            for comp, rel in RELEASE_LAYOUT.items():
                if comp not in inputs:
                    log(f"[{comp}] not converted: {Path(args.checkpoint_root) / rel} does not exist")
    if args.push_to_hub and not args.repo_id:
        problems.append("--push_to_hub needs --repo_id")
    try:
        max_shard_size = parse_size(args.max_shard_size)
    except ValueError as err:
        problems.append(f"--{err}")  # the message starts with the flag's name
        max_shard_size = 1
    req = ConversionRequest(
        output_path=Path(args.output_path),
        components=components,
        inputs={c: p for c, p in inputs.items() if c in components},
        config=args.config,
        dtype=args.dtype,
        expert_dtype=args.expert_dtype,
        expert_int4_group_size=args.expert_int4_group_size,
        dense_storage_dtype=args.dense_storage_dtype,
        max_shard_size=max_shard_size,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        repo_id=args.repo_id,
        sandai_code_dir=args.sandai_code_dir,
        component_options={"audio_vae": {"audio_encoder": args.audio_vae_encoder}}
        if "audio_vae" in components
        else {},
    )
    problems += request_problems(req)
    if problems:
        raise ConversionRequestError(problems)
    return req


def main(argv: list[str] | None = None) -> int:
    """Run the converter; returns the process exit status (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        req = request_from_args(args)
    except ConversionRequestError as err:  # bad usage, found before torch is imported: argparse's one line, status 2
        print(f"{parser.prog}: error: {'; '.join(err.problems)} (see --help)", file=sys.stderr)
        return 2
    from ..loaders.key_plan import CheckpointValidationError
    from .repo import ConversionValidationError, convert_checkpoint, push_folder_to_hub

    try:
        out = convert_checkpoint(req)
        if args.push_to_hub:
            if out is None:
                print("--dry_run: nothing uploaded")
            else:
                push_folder_to_hub(out, args.repo_id, private=args.private)
    except Exception as err:  # noqa: BLE001 - every failure becomes a message and a non-zero exit
        kind = "" if isinstance(err, ValueError) else f"{type(err).__name__}: "
        text = (
            err.report(verbose=args.verbose)
            if isinstance(err, (ConversionValidationError, CheckpointValidationError))
            else err
        )
        print(f"magi2-convert: error: {kind}{text}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
