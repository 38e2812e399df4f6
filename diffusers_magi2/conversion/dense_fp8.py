"""``magi2-convert --dense_storage_dtype fp8_e4m3``: a written transformer or refiner folder's dense projections
rewritten as e4m3 ``weight`` codes beside fp32 ``weight_scale`` rows (``amax / 448`` per output channel), the
layout ``enable_fp8_storage`` keeps in memory (:mod:`diffusers_magi2.models.fp8_storage_magi2`), so a reader of the
files (``from_pretrained``, a weight streamer) gets FP8 without quantizing.

The projections are those the model itself stores (built from the folder's ``config.json`` on the meta device);
each shard is rewritten on its own (one shard in memory), under a temporary name and renamed; the index gains the
scales and ``config.json`` records ``dense_storage_dtype``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..models.fp8_storage_magi2 import quantize_rows_fp8
from ..utils.dtype_names import DENSE_STORAGE_DTYPE_CHOICES
from ..utils.safetensors_io import read_index


__all__ = ["dense_projection_weights", "store_dense_weights_fp8"]

_WEIGHTS = "diffusion_pytorch_model.safetensors"
_INDEX = _WEIGHTS + ".index.json"


def dense_projection_weights(config: dict) -> set[str]:
    """State-dict names of the weights ``enable_fp8_storage`` stores in the model of ``config`` (its
    ``config.json``: the preview or the refiner)."""
    from ..models.transformer_magi2 import Magi2Transformer3DModel
    from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel

    cls = {c.__name__: c for c in (Magi2Transformer3DModel, Magi2RefinerTransformer3DModel)}[config["_class_name"]]
    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if k != "dense_storage_dtype"})
    return {f"{name}.weight" for name, module in model._dense_projections() if module.weight.numel()}


def store_dense_weights_fp8(folder: Path, log: Callable[[str], None] = print) -> None:
    """Rewrite the model folder ``folder`` (``config.json`` + diffusers safetensors shards) with FP8-stored dense
    projections (module docstring).

    Raises:
        ValueError: a dense weight holds a NaN or inf (naming it), or the folder holds no diffusers weights.
    """
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    dense = dense_projection_weights(config)
    weight_map = read_index(folder, _INDEX, _WEIGHTS) or {}
    shards = sorted(set(weight_map.values())) or [_WEIGHTS]
    stored = total = 0
    for shard in shards:
        tensors = load_file(str(folder / shard))
        out = {}
        for name, tensor in tensors.items():
            if name in dense:
                out[name], out[name + "_scale"] = quantize_rows_fp8(tensor, name)
                weight_map[name + "_scale"] = shard
                stored += 1
            else:
                out[name] = tensor
        total += sum(t.numel() * t.element_size() for t in out.values())
        tmp = folder / f".{shard}.tmp"
        save_file(out, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / shard)
    if (folder / _INDEX).is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config["dense_storage_dtype"] = DENSE_STORAGE_DTYPE_CHOICES["fp8_e4m3"]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    log(f"[{folder.name}] {stored} dense projections stored in FP8 e4m3 with per-channel scales")
