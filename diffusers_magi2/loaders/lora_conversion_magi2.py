"""MAGI-2 LoRA files: the layouts they come in, detected from the keys, and their conversion to diffusers keys.

Every layout stores, per target, ``A [r, in]`` and ``B [rows, r]`` with ``W' = W + s * B @ A``. Output (diffusers)
keys are ``<component>.<path>.lora_A.weight`` / ``.lora_B.weight`` / ``.alpha``, where ``path`` is the model's
module name (SandAI's with ``block.layers.{i}.`` -> ``transformer_blocks.{i}.``, :mod:`.key_plan`) and PEFT's
scale is ``alpha / r``. The router gate's ``path`` is its ``mlp.moe_mlp`` module (PEFT's ``ParamWrapper`` key).

Layouts (seruva19/mirai writes the last three for MAGI-2):

* ``diffusers``: ``transformer.`` / ``refiner.`` prefixed PEFT keys (``save_lora_weights``); scale from the saved
  adapter config, else ``.alpha``, else 1;
* ``peft``: the same keys without a component prefix (``save_lora_adapter``);
* ``mirai_native`` (``adapter.pt``): ``block.layers.{i}.<module>.parametrizations.weight.0.lora_a`` / ``.lora_b``,
  and ``...mlp.moe_mlp.parametrizations.gate.0.lora_a`` / ``.lora_b`` for the router; no alpha;
* ``mirai_kohya``: ``lora_unet.<native path>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``;
* ``mirai_diffusers``: ``unet.<native path>.lora_A.weight`` / ``.lora_B.weight`` / ``.alpha``.

``<native path>`` is the module (``block.layers.3.attention.linear_qkv``), optionally followed by
``.parametrizations.weight.0``; the router's is ``...mlp.moe_mlp`` followed by ``.gate`` or
``.parametrizations.gate.0``.

The alpha trap: mirai writes every ``.alpha`` as 1.0 (and ``alpha="1.0"`` in the metadata) while training at scale
1.0, not ``alpha / rank``. Its layouts therefore load at ``mirai_scale`` (default :data:`MIRAI_SCALE` = 1.0) times
``B @ A``, whatever the file's alpha; ``mirai_scale=None`` reads the alpha the Kohya way (scale ``alpha / rank``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Optional

import torch

from .key_plan import source_to_target_key


__all__ = [
    "LORA_LAYOUTS",
    "MIRAI_SCALE",
    "convert_lora_state_dict",
    "detect_lora_layout",
    "read_lora_file",
    "read_lora_state_dict",
]

LORA_LAYOUTS = ("diffusers", "peft", "mirai_native", "mirai_kohya", "mirai_diffusers")
#: The scale mirai trains its adapters at (``W + 1.0 * B @ A``), used for its layouts whatever their ``.alpha``.
MIRAI_SCALE = 1.0
COMPONENTS = ("transformer", "refiner")
#: diffusers' names: the file ``save_lora_weights`` writes and its safetensors metadata key.
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"

_NATIVE = re.compile(r"^(?P<path>.+)\.parametrizations\.(?P<param>weight|gate)\.0\.(?P<factor>lora_a|lora_b)$")
_KOHYA = re.compile(r"^lora_unet\.(?P<stem>.+)\.(?:(?P<factor>lora_down|lora_up)\.weight|(?P<alpha>alpha))$")
_MIRAI_DIFFUSERS = re.compile(r"^unet\.(?P<stem>.+)\.(?:(?P<factor>lora_A|lora_B)\.weight|(?P<alpha>alpha))$")
_FACTOR = {"lora_a": "A", "lora_b": "B", "lora_down": "A", "lora_up": "B", "lora_A": "A", "lora_B": "B"}


def read_lora_file(path: str | os.PathLike) -> tuple[dict, Optional[dict]]:
    """``(state_dict, safetensors metadata or None)`` of a ``.safetensors`` file or a ``.pt`` / ``.pth`` / ``.bin``
    pickle, read with ``torch.load(weights_only=True)`` on CPU.

    Raises:
        ValueError: a missing file, a pickle holding objects other than tensors (or not a flat ``{name: tensor}``
            dict), or a suffix that is neither.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"LoRA file {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            state_dict, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        if LORA_ADAPTER_METADATA_KEY not in metadata:
            return state_dict, None
        try:
            return state_dict, json.loads(metadata[LORA_ADAPTER_METADATA_KEY])
        except json.JSONDecodeError as error:
            raise ValueError(f"LoRA file {str(path)!r}: unreadable {LORA_ADAPTER_METADATA_KEY}: {error}") from None
    if path.suffix not in (".pt", ".pth", ".bin"):
        raise ValueError(f"LoRA file {str(path)!r}: expected .safetensors, .pt, .pth or .bin")
    try:
        state_dict = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as error:
        raise ValueError(
            f"LoRA file {str(path)!r} holds objects other than tensors (read with torch.load(weights_only=True)): "
            f"{str(error).splitlines()[0]}"
        ) from None
    check_tensor_dict(state_dict, str(path))
    return state_dict, None


def read_lora_state_dict(
    source, weight_name: Optional[str] = None, subfolder: Optional[str] = None, **hub_kwargs
) -> tuple[dict, Optional[dict]]:
    """``(state_dict, adapter metadata or None)`` from a dict, a LoRA file, a folder or a Hub repo.

    Args:
        source: a ``{name: tensor}`` dict, a file (:func:`read_lora_file`), or a folder / Hub repo id holding
            ``weight_name`` (default: its only ``.safetensors``/``.pt`` file, else ``pytorch_lora_weights.safetensors``).
        weight_name, subfolder: the file inside a folder or repo.
        hub_kwargs: ``huggingface_hub.hf_hub_download`` options (``revision``, ``token``, ``cache_dir``, ...).

    Raises:
        ValueError: non-tensor values, a missing file, or a folder with several candidate files and no
            ``weight_name``.
    """
    if isinstance(source, dict):
        check_tensor_dict(source)
        return dict(source), None
    folder = Path(source) / (subfolder or "")
    if Path(source).is_file():
        return read_lora_file(source)
    if Path(source).is_dir():
        if weight_name is not None:
            return read_lora_file(folder / weight_name)
        found = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".pt", ".pth", ".bin"))
        if len(found) == 1:
            return read_lora_file(found[0])
        if (folder / DEFAULT_WEIGHT_NAME).is_file():
            return read_lora_file(folder / DEFAULT_WEIGHT_NAME)
        raise ValueError(
            f"{str(folder)!r} holds {len(found)} LoRA candidate files {[p.name for p in found][:6]}; pass weight_name"
        )
    from huggingface_hub import hf_hub_download

    allowed = ("revision", "token", "cache_dir", "force_download", "proxies", "local_files_only")
    kwargs = {k: v for k, v in hub_kwargs.items() if k in allowed and v is not None}
    file = hf_hub_download(str(source), weight_name or DEFAULT_WEIGHT_NAME, subfolder=subfolder, **kwargs)
    return read_lora_file(file)


def check_tensor_dict(state_dict, what: str = "LoRA state dict") -> None:
    """Raise ``ValueError`` unless ``state_dict`` is a non-empty flat ``{str: torch.Tensor}`` dict."""
    if not isinstance(state_dict, dict) or not state_dict:
        raise ValueError(f"{what} must be a non-empty dict of name -> tensor, got {type(state_dict).__name__}")
    bad = [k for k, v in state_dict.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        kinds = sorted({type(state_dict[k]).__name__ for k in bad})
        raise ValueError(
            f"{what} holds values other than tensors ({', '.join(kinds)}) under {[str(k) for k in bad[:5]]}"
        )


def detect_lora_layout(state_dict: dict) -> str:
    """The layout of ``state_dict`` (:data:`LORA_LAYOUTS`), from its keys.

    Raises:
        ValueError: keys of no known layout (the first ones are listed), or of several.
    """
    keys = list(state_dict)
    found = set()
    for key in keys:
        if key.startswith("lora_unet."):
            found.add("mirai_kohya")
        elif key.startswith("unet."):
            found.add("mirai_diffusers")
        elif ".parametrizations." in key and key.endswith((".lora_a", ".lora_b")):
            found.add("mirai_native")
        elif key.split(".", 1)[0] in COMPONENTS:
            found.add("diffusers")
        elif key.startswith("transformer_blocks."):
            found.add("peft")
    if len(found) == 1:
        return found.pop()
    if not found:
        raise ValueError(
            f"unknown LoRA layout; expected one of {list(LORA_LAYOUTS)} (see diffusers_magi2.loaders."
            f"lora_conversion_magi2), got keys {sorted(keys)[:5]}"
        )
    raise ValueError(f"LoRA keys mix the layouts {sorted(found)}; e.g. {sorted(keys)[:5]}")


def _module_path(stem: str) -> str:
    """A mirai ``<native path>`` -> our module path (``...parametrizations.weight.0`` and a router's ``.gate``
    dropped)."""
    stem = re.sub(r"\.parametrizations\.(weight|gate)\.0$", "", stem)
    stem = re.sub(r"(\.moe_mlp)\.gate$", r"\1", stem)
    return source_to_target_key(stem)


def convert_lora_state_dict(
    state_dict: dict,
    layout: Optional[str] = None,
    component: str = "transformer",
    mirai_scale: Optional[float] = MIRAI_SCALE,
) -> dict:
    """``state_dict`` in diffusers keys (module docstring), unprefixed layouts put under ``component``.

    Args:
        state_dict: ``{name: tensor}`` in any of :data:`LORA_LAYOUTS`.
        layout: the layout (``None``: :func:`detect_lora_layout`).
        component: ``"transformer"`` or ``"refiner"``, for the layouts that do not name one.
        mirai_scale: scale of a mirai layout's ``B @ A`` (written as ``.alpha = scale * rank``); ``None`` keeps the
            file's ``.alpha`` (scale ``alpha / rank``, 1 without one).

    Raises:
        ValueError: non-tensor values, an unknown component, keys the layout does not explain (the layout and the
            first such keys are named).
    """
    check_tensor_dict(state_dict)
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {list(COMPONENTS)}, got {component!r}")
    layout = layout or detect_lora_layout(state_dict)
    if layout == "diffusers":
        return dict(state_dict)
    if layout == "peft":
        return {f"{component}.{k}": v for k, v in state_dict.items()}
    if layout not in LORA_LAYOUTS:
        raise ValueError(f"layout must be one of {list(LORA_LAYOUTS)}, got {layout!r}")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    unmatched = []
    for key, value in state_dict.items():
        if layout == "mirai_native":
            m = _NATIVE.match(key)
            stem, part = (m.group("path"), _FACTOR[m.group("factor")]) if m else (None, None)
        else:
            m = (_KOHYA if layout == "mirai_kohya" else _MIRAI_DIFFUSERS).match(key)
            stem = m.group("stem") if m else None
            part = None if m is None else ("alpha" if m.group("alpha") else _FACTOR[m.group("factor")])
        if m is None:
            unmatched.append(key)
            continue
        factors.setdefault(_module_path(stem), {})[part] = value
    if unmatched:
        raise ValueError(
            f"LoRA ({layout} layout): {len(unmatched)} keys do not fit the layout, e.g. {sorted(unmatched)[:5]}"
        )
    out = {}
    for path, parts in factors.items():
        prefix = f"{component}.{path}"
        for part in ("A", "B"):
            if part in parts:
                out[f"{prefix}.lora_{part}.weight"] = parts[part]
        rank = parts["A"].shape[0] if "A" in parts and parts["A"].dim() == 2 else None
        if mirai_scale is not None and rank is not None:
            out[f"{prefix}.alpha"] = torch.tensor(float(mirai_scale) * rank)
        elif "alpha" in parts:
            out[f"{prefix}.alpha"] = parts["alpha"]
    return out
