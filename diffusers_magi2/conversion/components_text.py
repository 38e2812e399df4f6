"""Text-encoder conversion: SandAI's ``text_encoder/`` (Qwen3.5, transformers format) -> ``Qwen3_5TextModel``.

A text-only source is copied file by file (with ``dtype="keep"``) or rewritten shard by shard; a multimodal
one (``model.language_model.*``) is rewritten to its ``text_config`` with ``model.language_model.X -> X`` and the
vision, LM-head and MTP tensors dropped. Tokenizer files are copied verbatim.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from ..utils.dtype_utils import convert_dtype
from ..utils.safetensors_io import read_index, read_safetensors_header


__all__ = ["TOKENIZER_FILES", "convert_text_encoder", "text_encoder_layout"]

logger = logging.getLogger(__name__)
PathLike = Union[str, Path]

#: files copied to the tokenizer folder when present (at least one of the first two is required).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
MULTIMODAL_PREFIX = "model.language_model."
#: tensors of the multimodal checkpoint that a text-only encoder drops.
MULTIMODAL_DROPPED_PREFIXES = ("model.visual.", "lm_head.", "mtp.")


def key_problems(expected: Dict[str, tuple], found: Dict[str, tuple], what: str) -> List[str]:
    """Missing and unexpected keys and shape mismatches of ``found`` against ``expected`` (name -> shape)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"{what}: {len(missing)} model keys missing from the checkpoint, e.g. {missing[:5]}")
    if unexpected:
        problems.append(f"{what}: {len(unexpected)} checkpoint keys the model does not have, e.g. {unexpected[:5]}")
    for key in sorted(set(expected) & set(found)):
        if tuple(expected[key]) != tuple(found[key]):
            problems.append(f"{what}: {key} has shape {tuple(found[key])}, the model expects {tuple(expected[key])}")
    return problems


def _weight_files(src: Path) -> Tuple[Dict[str, str], Optional[Path]]:
    """``({tensor name: shard file}, index path or None)`` of a text-encoder folder (ValueError if unusable)."""
    pickles = sorted(p.name for p in src.glob("*.bin"))
    if pickles and not any(src.glob("model.safetensors*")):
        raise ValueError(f"{src}: pickled weights {pickles} are not accepted; convert them to safetensors")
    weight_map = read_index(src, "model.safetensors.index.json", "model.safetensors")
    if weight_map is None:
        single = src / "model.safetensors"
        return dict.fromkeys(read_safetensors_header(single).tensors, single.name), None
    missing = sorted({f for f in weight_map.values() if not (src / f).is_file()})
    if missing:
        raise ValueError(f"{src}: shards named in the index are missing: {missing}")
    return weight_map, src / "model.safetensors.index.json"


def text_encoder_layout(src_dir: PathLike) -> str:
    """``"multimodal"`` if any tensor is under ``model.language_model.``, else ``"text"``.

    Raises:
        ValueError: no safetensors weights in ``src_dir``.
    """
    weight_map, _ = _weight_files(Path(src_dir))
    return "multimodal" if any(k.startswith(MULTIMODAL_PREFIX) for k in weight_map) else "text"


def _read_shapes(src: Path, weight_map: Dict[str, str]) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    from safetensors import safe_open

    shapes = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(src / shard), framework="pt") as f:
            present = set(f.keys())
            for key in [k for k, s in weight_map.items() if s == shard]:
                if key not in present:
                    raise ValueError(f"{src / shard}: tensor {key} named in the index is not in the shard")
                sl = f.get_slice(key)
                shapes[key] = (tuple(sl.get_shape()), sl.get_dtype())
    return shapes


def _expected_shapes(text_config: dict) -> Dict[str, Tuple[int, ...]]:
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    config = Qwen3_5TextConfig.from_dict(text_config)
    with torch.device("meta"):
        model = Qwen3_5TextModel(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _plan(src: Path, config: dict, weight_map: Dict[str, str]) -> Tuple[dict, Dict[str, str], List[str]]:
    """Text config, ``{source key: target key}`` and the dropped keys; every check before writing."""
    multimodal = any(k.startswith(MULTIMODAL_PREFIX) for k in weight_map)
    if multimodal:
        text_config = config.get("text_config")
        if not isinstance(text_config, dict):
            raise ValueError(f"{src}/config.json: multimodal checkpoint without a 'text_config' section")
        text_config = dict(text_config)
        for key in ("dtype", "torch_dtype"):
            if key not in text_config and key in config:
                text_config[key] = config[key]
        prefix = MULTIMODAL_PREFIX
    else:
        text_config = dict(config)
        prefix = "model." if any(k.startswith("model.") for k in weight_map) else ""
    if text_config.get("model_type") not in (None, "qwen3_5_text"):
        raise ValueError(
            f"{src}: text config model_type is {text_config.get('model_type')!r}, expected 'qwen3_5_text'"
        )
    text_config["model_type"] = "qwen3_5_text"
    text_config["architectures"] = ["Qwen3_5TextModel"]

    mapping, dropped, unknown = {}, [], []
    for key in weight_map:
        if prefix and key.startswith(prefix):
            mapping[key] = key[len(prefix) :]
        elif not prefix and not key.startswith(MULTIMODAL_DROPPED_PREFIXES):
            mapping[key] = key
        elif key.startswith(MULTIMODAL_DROPPED_PREFIXES):
            dropped.append(key)
        else:
            unknown.append(key)
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} tensors outside '{prefix}' that are not vision/LM-head/MTP, e.g. {unknown[:5]}"
        )
    expected = _expected_shapes(text_config)
    shapes = _read_shapes(src, {k: weight_map[k] for k in mapping})
    problems += key_problems(expected, {t: shapes[s][0] for s, t in mapping.items()}, "Qwen3_5TextModel")
    if problems:
        raise ValueError(f"cannot convert text encoder {src}:\n  " + "\n  ".join(problems))
    return text_config, mapping, dropped


@contextlib.contextmanager
def _output_dir(out_dir: PathLike) -> Iterator[Path]:
    """Yield ``out_dir`` (absent or empty, else ValueError), removing what was written on error."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output folder {out} exists and is not empty; refusing to overwrite it")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for child in out.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        raise


def _rewrite(
    src: Path, out: Path, weight_map: Dict[str, str], mapping: Dict[str, str], dtype: Optional[torch.dtype]
) -> None:
    """Write the mapped tensors shard by shard (one source shard resident at a time) + an index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = list(dict.fromkeys(weight_map[k] for k in mapping))  # source order, only useful shards
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    new_map, total = {}, 0
    for shard, name in zip(shards, names):
        tensors = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for key in [k for k in mapping if weight_map[k] == shard]:
                t = f.get_tensor(key)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                tensors[mapping[key]] = t.contiguous()
                new_map[mapping[key]] = name
                total += t.numel() * t.element_size()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_text_encoder(
    src_dir: PathLike, text_encoder_out: PathLike, tokenizer_out: PathLike, dtype: str = "keep"
) -> Tuple[Path, Path]:
    """Convert SandAI's ``text_encoder/`` folder into a ``Qwen3_5TextModel`` folder plus a tokenizer folder.

    Every check (config, index vs shards, keys and shapes on a meta model) runs before anything is written.

    Args:
        src_dir: transformers-format Qwen3.5 folder (``config.json``, safetensors weights, tokenizer files).
        text_encoder_out: folder to create for the model (absent or empty).
        tokenizer_out: folder to create for the tokenizer (absent or empty).
        dtype: ``"keep"`` (verbatim copy for text-only sources), ``"bf16"`` or ``"fp32"``.

    Returns:
        ``(text_encoder_out, tokenizer_out)``.

    Raises:
        ValueError: bad dtype, non-empty output folders, missing config/tokenizer/weights, pickled
            weights, index/shard inconsistencies, unknown or missing keys, shape mismatches.
    """
    torch_dtype = convert_dtype(dtype)
    src = Path(src_dir)
    if not (src / "config.json").is_file():
        raise ValueError(f"text encoder folder {src} lacks config.json")
    tok_files = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not any(name in tok_files for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"text encoder folder {src} has no tokenizer.json / tokenizer_config.json")
    try:
        config = json.loads((src / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{src}/config.json: not valid JSON ({err})") from err
    weight_map, index = _weight_files(src)
    text_config, mapping, dropped = _plan(src, config, weight_map)
    verbatim = torch_dtype is None and all(k == v for k, v in mapping.items()) and not dropped

    outs = [Path(text_encoder_out), Path(tokenizer_out)]
    for out in outs:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"output folder {out} exists and is not empty; refusing to overwrite it")
    with _output_dir(outs[0]) as te_out, _output_dir(outs[1]) as tok_out:  # both removed/emptied on error
        if verbatim:
            copies = ["config.json", *sorted(set(weight_map.values()))]
            if index is not None:
                copies.append(index.name)
            if (src / "generation_config.json").is_file():
                copies.append("generation_config.json")
            for name in copies:
                shutil.copyfile(src / name, te_out / name)
        else:
            from transformers import Qwen3_5TextConfig

            if torch_dtype is not None:
                text_config["dtype"] = str(torch_dtype).removeprefix("torch.")
                text_config.pop("torch_dtype", None)
            Qwen3_5TextConfig.from_dict(text_config).save_pretrained(te_out)
            _rewrite(src, te_out, weight_map, mapping, torch_dtype)
            if dropped:
                logger.info("text encoder: dropped %d vision/LM-head/MTP tensors (%s...)", len(dropped), dropped[0])
        for name in tok_files:
            shutil.copyfile(src / name, tok_out / name)
    return outs[0], outs[1]
