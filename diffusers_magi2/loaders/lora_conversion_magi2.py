"""MAGI-2 LoRA files: reading them, the layouts they come in (detected from the keys), and their conversion to
plain PEFT keys.

Every layout stores, per target, ``A [r, in]`` and ``B [rows, r]`` with ``W' = W + s * B @ A``. The output of
:func:`convert_lora_state_dict` is ``<component>.<path>.lora_A.weight`` / ``.lora_B.weight`` (PEFT's other keys,
``.lora_magnitude_vector`` of DoRA and ``.lora_B.bias``, pass through), where ``path`` is the model's module name
(SandAI's with ``block.layers.{i}.`` -> ``transformer_blocks.{i}.``, :mod:`.key_plan`); a router gate's ``path`` is
its ``mlp.moe_mlp`` module (PEFT's ``ParamWrapper`` key).

Scales are folded into the factors, as diffusers' converters do: a target of scale ``s`` is written as
``A' = a * A`` and ``B' = b * B`` with ``a * b = s`` (``b`` a power of two that keeps both factors of similar size),
so no ``.alpha`` key leaves this module and every converted adapter loads at PEFT scale 1 (``lora_alpha = r``).

Layouts (seruva19/mirai writes the three ``mirai_*`` ones for MAGI-2):

* ``diffusers``: ``transformer.`` / ``refiner.`` prefixed PEFT keys (``save_lora_weights``); the saved adapter
  config (the file's metadata) keeps its scale;
* ``peft``: the same keys without a component prefix (``save_lora_adapter``);
* ``comfyui``: ``diffusion_model.<path>.lora_down.weight`` / ``.lora_up.weight`` (or ``.lora_A`` / ``.lora_B``)
  and an optional ``.alpha`` (Kohya's scale ``alpha / r``), ``<path>`` SandAI's or ours;
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
import math
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
    "check_lora_load_options",
    "convert_lora_state_dict",
    "detect_lora_layout",
    "fold_scale",
    "read_lora_file",
    "read_lora_state_dict",
    "split_component",
]

LORA_LAYOUTS = ("diffusers", "peft", "comfyui", "mirai_native", "mirai_kohya", "mirai_diffusers")
#: The scale mirai trains its adapters at (``W + 1.0 * B @ A``), used for its layouts whatever their ``.alpha``.
MIRAI_SCALE = 1.0
COMPONENTS = ("transformer", "refiner")
#: diffusers' names: the file ``save_lora_weights`` writes and its safetensors metadata key.
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"
LORA_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
#: ``huggingface_hub.hf_hub_download`` options a LoRA load passes on.
HUB_OPTIONS = ("revision", "token", "cache_dir", "force_download", "proxies", "local_files_only")

_NATIVE = re.compile(r"^(?P<stem>.+)\.parametrizations\.(?:weight|gate)\.0\.(?P<factor>lora_a|lora_b)$")
_KOHYA = re.compile(r"^(?P<stem>.+)\.(?:(?P<factor>lora_down|lora_up|lora_A|lora_B)\.weight|(?P<alpha>alpha))$")
_PEFT = re.compile(
    r"^(?P<stem>.+)\.(?P<factor>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector|alpha)$"
)
_FACTOR = {
    "lora_a": "A",
    "lora_b": "B",
    "lora_down": "A",
    "lora_up": "B",
    "lora_A": "A",
    "lora_B": "B",
    "lora_A.weight": "A",
    "lora_B.weight": "B",
}
#: PEFT key suffix of each part of a target.
_PEFT_SUFFIX = {
    "A": "lora_A.weight",
    "B": "lora_B.weight",
    "lora_B.bias": "lora_B.bias",
    "lora_magnitude_vector": "lora_magnitude_vector",
}
#: the key prefix of each layout that has one (the rest of the key follows it).
_PREFIX = {"comfyui": "diffusion_model.", "mirai_kohya": "lora_unet.", "mirai_diffusers": "unet."}


def check_lora_load_options(hotswap: bool, options: dict, own: tuple = ()) -> dict:
    """The file-lookup options among diffusers' LoRA load keyword arguments ``options`` (``weight_name``,
    ``subfolder``, ``use_safetensors`` and :data:`HUB_OPTIONS`); ``own`` names the caller's other arguments, for
    the message.

    Raises:
        ValueError: ``hotswap=True``, ``low_cpu_mem_usage=True`` or ``network_alphas``, which MAGI-2 LoRA loading
            does not support (the message says what is).
        TypeError: an option diffusers' loaders do not have either.
    """
    if hotswap:
        raise ValueError(
            "hotswap=True is not supported for MAGI-2 LoRA adapters: load the new one under another adapter_name "
            "(then set_adapters / delete_adapters), or unload_lora_weights first"
        )
    if options.pop("low_cpu_mem_usage", False):
        raise ValueError(
            "low_cpu_mem_usage=True is not supported for MAGI-2 LoRA adapters: they are built at full size on the "
            "model's device (the default, low_cpu_mem_usage=False)"
        )
    if options.pop("network_alphas", None) is not None:
        raise ValueError(
            "network_alphas is not supported for MAGI-2 LoRA adapters: put each alpha in the state dict as "
            "<module>.alpha (Kohya's layout; it is folded into the factors) or pass the adapter config as metadata"
        )
    lookup = ("weight_name", "subfolder", "use_safetensors", *HUB_OPTIONS)
    unknown = sorted(set(options) - set(lookup))
    if unknown:
        raise TypeError(f"unexpected LoRA load option(s) {unknown}; supported: {', '.join((*own, *lookup))}")
    return options


def read_lora_file(path: str | os.PathLike) -> tuple[dict, Optional[dict]]:
    """``(state_dict, adapter metadata or None)`` of a ``.safetensors`` file or a ``.pt`` / ``.pth`` / ``.bin``
    pickle, read with ``torch.load(weights_only=True)`` on CPU.

    Raises:
        ValueError: naming the path: a missing file, a truncated or corrupt file, unreadable adapter metadata, a
            pickle holding objects other than tensors (or not a flat ``{name: tensor}`` dict), another suffix.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"LoRA file {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                state_dict, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        except (SafetensorError, OSError) as error:
            raise ValueError(f"LoRA file {str(path)!r} is truncated or not a safetensors file: {error}") from None
        if LORA_ADAPTER_METADATA_KEY not in metadata:
            return state_dict, None
        try:
            return state_dict, json.loads(metadata[LORA_ADAPTER_METADATA_KEY])
        except json.JSONDecodeError as error:
            raise ValueError(f"LoRA file {str(path)!r}: unreadable {LORA_ADAPTER_METADATA_KEY}: {error}") from None
    if path.suffix not in LORA_SUFFIXES:
        raise ValueError(f"LoRA file {str(path)!r}: expected one of {', '.join(LORA_SUFFIXES)}")
    try:
        state_dict = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, AttributeError, TypeError) as error:
        raise ValueError(
            f"LoRA file {str(path)!r} holds objects other than tensors (read with torch.load(weights_only=True)): "
            f"{str(error).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        raise ValueError(f"LoRA file {str(path)!r} is truncated or not a torch file: {error}") from None
    check_tensor_dict(state_dict, str(path))
    return state_dict, None


def _is_repo_id(source: str) -> bool:
    """Whether ``source`` can only be a Hub repo id (not a file path): a valid id without a LoRA file suffix."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if source.endswith(LORA_SUFFIXES) or os.path.isabs(source) or source.startswith("."):
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def read_lora_state_dict(
    source,
    weight_name: Optional[str] = None,
    subfolder: Optional[str] = None,
    use_safetensors: Optional[bool] = None,
    **hub_options,
) -> tuple[dict, Optional[dict]]:
    """``(state_dict, adapter metadata or None)`` from a dict, a LoRA file, a folder or a Hub repo.

    Args:
        source: a ``{name: tensor}`` dict, a file (:func:`read_lora_file`), or a folder / Hub repo id holding
            ``weight_name`` (default: its only LoRA file, else ``pytorch_lora_weights.safetensors``).
        weight_name, subfolder: the file inside a folder or repo.
        use_safetensors: ``True`` reads only ``.safetensors`` files, ``False`` only pickles, ``None`` either.
        hub_options: :data:`HUB_OPTIONS` for ``huggingface_hub.hf_hub_download``.

    Raises:
        ValueError: non-tensor values; naming the path: a missing or unreadable file, a folder with several LoRA
            files and no ``weight_name``, a Hub repo or file that cannot be fetched.
    """
    if isinstance(source, dict):
        check_tensor_dict(source)
        return dict(source), None
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"a LoRA is a state dict, a file, a folder or a Hub repo id; got {type(source).__name__}")
    suffixes = {None: LORA_SUFFIXES, True: (".safetensors",), False: LORA_SUFFIXES[1:]}[use_safetensors]
    path = Path(source)
    if path.is_file():
        if path.suffix not in suffixes:
            raise ValueError(f"LoRA file {str(path)!r}: use_safetensors={use_safetensors} reads {suffixes} files")
        return read_lora_file(path)
    if path.is_dir():
        folder = path / (subfolder or "")
        if not folder.is_dir():
            raise ValueError(f"LoRA folder {str(folder)!r} does not exist")
        if weight_name is not None:
            return read_lora_file(folder / weight_name)
        found = sorted(p for p in folder.iterdir() if p.suffix in suffixes)
        if len(found) == 1:
            return read_lora_file(found[0])
        if (folder / DEFAULT_WEIGHT_NAME).is_file() and DEFAULT_WEIGHT_NAME.endswith(suffixes):
            return read_lora_file(folder / DEFAULT_WEIGHT_NAME)
        raise ValueError(
            f"LoRA folder {str(folder)!r} holds {len(found)} LoRA files {[p.name for p in found][:6]}; pass "
            "weight_name"
        )
    if not _is_repo_id(str(source)):
        raise ValueError(f"LoRA file or folder {str(source)!r} does not exist")
    from huggingface_hub import hf_hub_download

    name = weight_name or DEFAULT_WEIGHT_NAME
    options = {k: v for k, v in hub_options.items() if v is not None}
    try:
        file = hf_hub_download(str(source), name, subfolder=subfolder, **options)
    except Exception as error:  # noqa: BLE001  (huggingface_hub raises many types: not found, offline, auth ...)
        raise ValueError(
            f"LoRA {str(source)!r} is no local file or folder, and {name!r} could not be fetched from the Hub repo "
            f"of that name: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from error
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
        prefixed = [layout for layout, prefix in _PREFIX.items() if key.startswith(prefix)]
        if prefixed:
            found.add(prefixed[0])
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
    """A SandAI or our module path -> ours (a router's trailing ``.gate`` dropped)."""
    return source_to_target_key(re.sub(r"(\.moe_mlp)\.gate$", r"\1", stem))


def fold_scale(a: torch.Tensor, b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A', B')`` with ``B' @ A' = scale * B @ A`` (module docstring), in the factors' dtypes; ``scale = 1``
    returns them unchanged."""
    if scale == 1.0:
        return a, b
    halvings = max(0, math.floor(-math.log2(abs(scale)))) // 2 if scale != 0 else 0
    b_scale = 2.0**-halvings
    return (a.float() * (scale / b_scale)).to(a.dtype), (b.float() * b_scale).to(b.dtype)


def _split_key(layout: str, key: str) -> tuple[Optional[str], Optional[str]]:
    """``(stem, part)`` of a key of ``layout``: ``part`` is ``"A"``, ``"B"``, ``"alpha"`` or a PEFT suffix;
    ``(None, None)`` for a key the layout does not explain."""
    if layout == "mirai_native":
        m = _NATIVE.match(key)
        return (m["stem"], _FACTOR[m["factor"]]) if m else (None, None)
    if layout in _PREFIX:
        m = _KOHYA.match(key[len(_PREFIX[layout]) :]) if key.startswith(_PREFIX[layout]) else None
        if m is None:
            return None, None
        stem = re.sub(r"\.parametrizations\.(weight|gate)\.0$", "", m["stem"])
        return stem, ("alpha" if m["alpha"] else _FACTOR[m["factor"]])
    m = _PEFT.match(key)
    if m is None:
        return None, None
    return m["stem"], _FACTOR.get(m["factor"], m["factor"])


def convert_lora_state_dict(
    state_dict: dict,
    layout: Optional[str] = None,
    component: str = "transformer",
    mirai_scale: Optional[float] = MIRAI_SCALE,
) -> dict:
    """``state_dict`` in plain PEFT keys with the scales folded in (module docstring), the layouts without a
    component prefix put under ``component``.

    Args:
        state_dict: ``{name: tensor}`` in any of :data:`LORA_LAYOUTS`.
        layout: the layout (``None``: :func:`detect_lora_layout`).
        component: ``"transformer"`` or ``"refiner"``, for the layouts that do not name one.
        mirai_scale: scale of a mirai layout's ``B @ A`` whatever its ``.alpha``; ``None`` reads the ``.alpha``
            (scale ``alpha / rank``, 1 without one), as every other layout does.

    Raises:
        ValueError: non-tensor values, an unknown component or layout, keys the layout does not explain (the
            layout and the first such keys are named), an ``.alpha`` that is not one finite number or has no
            ``lora_A``.
    """
    check_tensor_dict(state_dict)
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {list(COMPONENTS)}, got {component!r}")
    layout = layout or detect_lora_layout(state_dict)
    if layout not in LORA_LAYOUTS:
        raise ValueError(f"layout must be one of {list(LORA_LAYOUTS)}, got {layout!r}")
    targets: dict[str, dict[str, torch.Tensor]] = {}
    unmatched = []
    for key, value in state_dict.items():
        stem, part = _split_key(layout, key)
        if stem is None:
            unmatched.append(key)
            continue
        if layout == "diffusers":
            name = stem  # already ``<component>.<path>``
        elif layout == "peft":
            name = f"{component}.{stem}"
        else:
            name = f"{component}.{_module_path(stem)}"
        targets.setdefault(name, {})[part] = value
    if unmatched:
        raise ValueError(
            f"LoRA ({layout} layout): {len(unmatched)} keys do not fit the layout, e.g. {sorted(unmatched)[:5]}"
        )
    out = {}
    for name, parts in targets.items():
        alpha = parts.pop("alpha", None)
        a, b = parts.get("A"), parts.get("B")
        scale = 1.0
        if layout.startswith("mirai_") and mirai_scale is not None:
            scale = float(mirai_scale)
        elif alpha is not None:
            if alpha.numel() != 1 or not torch.isfinite(alpha).all():
                raise ValueError(f"LoRA ({layout} layout): the alpha of {name} must be one finite number")
            if a is None or a.dim() != 2:
                raise ValueError(f"LoRA ({layout} layout): {name} has an alpha but no 2-D lora_A to scale")
            scale = float(alpha.reshape(())) / a.shape[0]
        if scale != 1.0 and a is not None and b is not None:
            parts["A"], parts["B"] = fold_scale(a, b, scale)
        for part, value in parts.items():
            out[f"{name}.{_PEFT_SUFFIX[part]}"] = value
    return out


def split_component(state_dict: dict, metadata: Optional[dict], component: str) -> tuple[dict, Optional[dict]]:
    """The keys of ``component`` in a converted state dict, prefix dropped, and its adapter metadata (diffusers
    files prefix each component's config fields; a ``save_lora_adapter`` file's unprefixed config is kept)."""
    head = f"{component}."
    part = {k[len(head) :]: v for k, v in state_dict.items() if k.startswith(head)}
    if metadata and any(k.startswith(head) for k in metadata):
        metadata = {k[len(head) :]: v for k, v in metadata.items() if k.startswith(head)}
    elif metadata and any(k.split(".", 1)[0] in COMPONENTS for k in metadata):
        metadata = None  # another component's config only
    return part, metadata or None
