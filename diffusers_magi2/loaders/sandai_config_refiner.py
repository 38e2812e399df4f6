"""Map SandAI's refiner config (``configs/magi2_refiner.json``) to ``Magi2RefinerTransformer3DModel`` kwargs.

The architecture is ``magi2_refiner_arch_config``; the window geometry, from the data proxy's
``evaluation_config.magi2_refiner_data_proxy_config.attn_config``, becomes diffusers config too.
"""

from __future__ import annotations

from typing import Any, Mapping


__all__ = ["refiner_config_from_sandai", "refiner_sampling_from_sandai"]


def _arch(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    if "extends" in cfg:
        raise ValueError(
            "SandAI config still has an unresolved 'extends'; load it with "
            "diffusers_magi2.loaders.sandai_config.load_sandai_config(path) first"
        )
    arch = cfg.get("magi2_refiner_arch_config")
    if not isinstance(arch, Mapping):
        raise ValueError("SandAI config has no 'magi2_refiner_arch_config' section (is this the refiner JSON?)")
    return arch


def _proxy(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    ev = cfg.get("evaluation_config")
    if not isinstance(ev, Mapping) or not isinstance(ev.get("magi2_refiner_data_proxy_config"), Mapping):
        raise ValueError("SandAI config has no 'evaluation_config.magi2_refiner_data_proxy_config' section")
    return ev["magi2_refiner_data_proxy_config"]


def refiner_config_from_sandai(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``register_to_config`` kwargs of :class:`Magi2RefinerTransformer3DModel` from a merged SandAI config.

    Args:
        cfg: merged SandAI config dict (``extends`` resolved) with ``magi2_refiner_arch_config`` and
            ``evaluation_config.magi2_refiner_data_proxy_config``.

    Returns:
        the kwargs; ``window_attention_layers = local_attn_layers`` (``None`` for all layers), ``window_block_size
        = (block_t_size, block_size, block_size)``, ``window_radius = (block_t/h/w_radius)``.

    Raises:
        ValueError: unresolved ``extends``, missing sections, or a feature the port does not implement (named).
    """
    arch = _arch(cfg)
    proxy = _proxy(cfg)
    hidden = int(arch["hidden_size"])
    head_dim = int(arch["head_dim"])
    if hidden % head_dim:
        raise ValueError(f"hidden_size {hidden} is not a multiple of head_dim {head_dim}")
    num_layers = int(arch["num_layers"])
    if list(arch.get("post_norm_layers", [])):
        raise ValueError(
            f"post_norm_layers {arch['post_norm_layers']} are not supported (the released refiner has none)"
        )
    if str(arch.get("activation_type", "swiglu7")) != "swiglu7" or arch.get("layer_activation_types"):
        raise ValueError("only the swiglu7 activation is supported")
    if int(proxy.get("patch_size", 1)) != 1 or int(proxy.get("t_patch_size", 1)) != 1:
        raise ValueError("only patch_size = t_patch_size = 1 is supported (released refiner)")
    if str(proxy.get("spatial_rope_interpolation", "extra")) != "extra":
        raise ValueError("only spatial_rope_interpolation='extra' is supported (released refiner)")

    local_layers = sorted(int(i) for i in arch.get("local_attn_layers", []))
    attn = dict(proxy.get("attn_config") or {})
    mode = str(attn.get("mode", "dense")).lower()
    mode = "window" if mode == "local" else mode
    window = {**attn, **dict(attn.get("window") or {})}
    if local_layers:
        if mode != "window":
            raise ValueError(f"local_attn_layers are set but attn_config.mode is {mode!r}; only 'window' is supported")
        if (
            str(window.get("level", "block")).lower() != "block"
            or str(window.get("block_mode", "scan")).lower() != "grid"
        ):
            raise ValueError("only window attention with level='block' and block_mode='grid' is supported")
        if list(window.get("full_attn_layers", []) or []):
            raise ValueError("attn_config.window.full_attn_layers is not supported")
    block_t = int(window.get("block_t_size", 1))
    block_hw = int(window.get("block_size", 1))
    radius = (
        int(window.get("block_t_radius", 1)),
        int(window.get("block_h_radius", 1)),
        int(window.get("block_w_radius", 1)),
    )
    return {
        "num_layers": num_layers,
        "num_attention_heads": hidden // head_dim,
        "attention_head_dim": head_dim,
        "num_key_value_heads": int(arch["num_query_groups"]),
        "in_channels": int(arch["video_in_channels"]),
        "audio_in_channels": int(arch["audio_in_channels"]),
        "text_in_channels": int(arch["text_in_channels"]),
        "multimodal_layers": [int(i) for i in arch.get("mm_layers", [])],
        "window_attention_layers": None if local_layers == list(range(num_layers)) else local_layers,
        "window_block_size": [block_t, block_hw, block_hw],
        "window_radius": list(radius),
        "attention_gating": bool(arch.get("enable_attn_gating", True)),
    }


def refiner_sampling_from_sandai(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Refiner-stage sampling settings from a merged SandAI config's ``evaluation_config``.

    Returns ``num_inference_steps``, ``shift``, ``guidance_scale``, ``noise_value``, ``audio_noise_scale`` and ``vae_stride``.

    Raises:
        ValueError: no ``evaluation_config`` section.
    """
    ev = cfg.get("evaluation_config")
    if not isinstance(ev, Mapping):
        raise ValueError("SandAI config has no 'evaluation_config' section")
    return {
        "num_inference_steps": int(ev.get("magi2_refiner_num_inference_steps", 5)),
        "shift": float(ev.get("magi2_refiner_shift", 5.0)),
        "guidance_scale": float(ev.get("magi2_refiner_video_txt_guidance_scale", 2.0)),
        "noise_value": int(ev.get("magi2_refiner_noise_value", 220)),
        "audio_noise_scale": float(ev.get("magi2_refiner_audio_noise_scale", -1.0)),
        "vae_stride": [int(v) for v in ev.get("magi2_refiner_vae_stride", [4, 16, 16])],
    }
