"""Read SandAI MAGI-2 JSON configs and map the Preview architecture to ``Magi2Transformer3DModel`` kwargs.

The released configs are bundled under ``loaders/released_configs/``. ``"extends": "<base>.json"`` names a base
looked up beside the file, then among the bundled ones; the child is merged over it recursively (dicts key by key).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union


__all__ = [
    "RELEASED_CONFIG_DIR",
    "released_config_path",
    "load_sandai_config",
    "merge_sandai_configs",
    "preview_config_from_sandai",
]

RELEASED_CONFIG_DIR = Path(__file__).resolve().parent / "released_configs"


def released_config_path(name: str = "magi2_preview.json") -> Path:
    """Path of a bundled released SandAI config (``magi2_preview.json`` or ``magi2_refiner.json``).

    Raises:
        ValueError: if no bundled config has that name.
    """
    path = RELEASED_CONFIG_DIR / name
    if not path.is_file():
        available = sorted(p.name for p in RELEASED_CONFIG_DIR.glob("*.json"))
        raise ValueError(f"no bundled SandAI config named {name!r}; available: {available}")
    return path


def merge_sandai_configs(base: Mapping[str, Any], child: Mapping[str, Any]) -> dict:
    """Recursive merge: ``child`` wins; nested dicts merge key by key. Returns a new dict."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in child.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_sandai_configs(out[key], value)
        else:
            out[key] = value
    return out


def load_sandai_config(path: Union[str, os.PathLike], _seen: Optional[tuple] = None) -> dict:
    """Load a SandAI JSON config, resolving ``extends`` (see module docstring).

    Args:
        path: a JSON file, or a directory holding exactly one ``magi2_*.json`` / ``*.json`` config.

    Raises:
        ValueError: missing file, ambiguous directory, unreadable JSON, missing ``extends`` base, or a cycle.
    """
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("magi2_*.json")) or sorted(
            p for p in path.glob("*.json") if p.name not in ("model.safetensors.index.json", "config.json")
        )
        if len(candidates) != 1:
            raise ValueError(
                f"expected exactly one SandAI config (magi2_*.json) in {path}, found {[c.name for c in candidates]}"
            )
        path = candidates[0]
    if not path.is_file():
        raise ValueError(f"SandAI config not found: {path}")
    seen = _seen or ()
    resolved = path.resolve()
    if resolved in seen:
        raise ValueError(f"cyclic 'extends' chain in SandAI configs: {[str(s) for s in seen + (resolved,)]}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    base_name = cfg.pop("extends", None)
    if base_name is None:
        return cfg
    base_path = path.parent / base_name
    if not base_path.is_file():
        bundled = RELEASED_CONFIG_DIR / base_name
        if not bundled.is_file():
            raise ValueError(f"{path}: 'extends' names {base_name!r}, found neither beside it nor bundled")
        base_path = bundled
    base = load_sandai_config(base_path, seen + (resolved,))
    return merge_sandai_configs(base, cfg)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def preview_config_from_sandai(cfg: Mapping[str, Any]) -> dict:
    """Map a SandAI preview config dict (with ``arch_config``) to ``Magi2Transformer3DModel`` kwargs.

    Accepts the whole config or its ``arch_config``; ``num_attention_heads = hidden_size // head_dim``,
    ``num_key_value_heads = num_query_groups``, ``in_channels = video_in_channels``, ``multimodal_layers = mm_layers``.

    Raises:
        ValueError: missing fields, or a setting the model does not implement (mHC, gating and sinks off, an
            activation other than swiglu7, a softcap).
    """
    arch = cfg.get("arch_config", cfg)
    _require(isinstance(arch, Mapping) and "hidden_size" in arch, "SandAI config has no arch_config.hidden_size")
    mhc = arch.get("mhc_config", {})
    _require(bool(mhc.get("enable", False)), "MAGI-2 Preview needs mhc_config.enable = true")
    _require(bool(arch.get("attn_gating", {}).get("enable", False)), "MAGI-2 Preview needs attn_gating.enable = true")
    sinks = arch.get("attn_sinks", {})
    _require(bool(sinks.get("enable", False)), "MAGI-2 Preview needs attn_sinks.enable = true")
    act = arch.get("activation_type", "swiglu7")
    _require(act == "swiglu7", f"activation_type must be 'swiglu7', got {act!r}")
    _require(not arch.get("layer_activation_types"), "per-layer activation types are not supported")
    softcap = float(arch.get("attn_softcap", -1.0))
    _require(softcap <= 0, f"attention softcap {softcap} > 0 is not supported (the release disables it)")
    moe = arch.get("moe_config", {})
    hidden = int(arch["hidden_size"])
    head_dim = int(arch["head_dim"])
    _require(hidden % head_dim == 0, f"hidden_size {hidden} is not a multiple of head_dim {head_dim}")
    out = {
        "num_layers": int(arch["num_layers"]),
        "num_attention_heads": hidden // head_dim,
        "attention_head_dim": head_dim,
        "num_key_value_heads": int(arch.get("num_query_groups") or hidden // head_dim),
        "in_channels": int(arch["video_in_channels"]),
        "audio_in_channels": int(arch["audio_in_channels"]),
        "text_in_channels": int(arch["text_in_channels"]),
        "intermediate_factor": float(arch.get("intermediate_factor", 4)),
        "multimodal_layers": [int(i) for i in arch.get("mm_layers", [])],
        "num_streams": int(mhc.get("num_stream", 4)),
        "num_sink_tokens": int(sinks.get("sink_token_num", 1)),
        "moe_layers": [int(i) for i in moe.get("moe_layers", [])],
        "moe_num_heads": int(moe.get("num_heads", 1)),
        "moe_num_experts": int(moe.get("num_experts", 1)),
        "moe_top_k": int(moe.get("top_k", 1)),
        "moe_expert_intermediate_size": int(moe.get("expert_intermediate_size", 0)),
        "shared_expert_intermediate_size": int(moe.get("shared_expert_intermediate_size", 0)),
        "modality_specific_expert_intermediate_size": int(moe.get("modality_specific_expert_intermediate_size", 0)),
        "moe_score_func": str(moe.get("score_func", "sigmoid")),
        "moe_route_norm": bool(moe.get("route_norm", True)),
        "moe_route_scale": float(moe.get("route_scale", 1.0)),
        "split_merge_intermediate_size": moe.get("split_merge_intermediate_size"),
    }
    if out["intermediate_factor"] == int(out["intermediate_factor"]):
        out["intermediate_factor"] = int(out["intermediate_factor"])
    dp = cfg.get("evaluation_config", {}).get("data_proxy_config", {}) if "arch_config" in cfg else {}
    if dp:
        out["time_embed_dim"] = int(dp.get("time_channel_dim", 64))
        _require(
            int(dp.get("patch_size", 1)) == 1 and int(dp.get("t_patch_size", 1)) == 1,
            "only patch sizes of 1 are supported (the released setting)",
        )
        _require(
            dp.get("spatial_rope_interpolation", "extra") == "extra",
            "only spatial_rope_interpolation='extra' is supported (the released setting)",
        )
        _require(not dp.get("add_time_token", False), "add_time_token=true is not supported (the release disables it)")
    return out
