"""Converters for MAGI-2's non-transformer components (SandAI release layout -> diffusers folders).

Each ``convert_*`` validates one component completely, then writes a ``save_pretrained`` folder (refusing a
non-empty ``out_dir`` and removing what it wrote on failure).

=====================  =============================  ==========================================
function               source                         output
=====================  =============================  ==========================================
convert_wan22_vae      ``vae/Wan2.2_VAE.pth``         ``AutoencoderKLWan`` (Wan2.2 form)
convert_turbo_vae      ``turbo_vae/`` (JSON + .ckpt)  :class:`~diffusers_magi2.models.turbo_vae.Magi2TurboVAEDecoder`
convert_stable_audio_  ``stable-audio-open-1.0/``     ``AutoencoderOobleck``
vae
convert_text_encoder   ``text_encoder/``              ``Qwen3_5TextModel`` folder + tokenizer
=====================  =============================  ==========================================

``dtype`` is ``"keep"``, ``"bf16"`` or ``"fp32"``; pickles are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import pickle
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch

from ..models.turbo_vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, Magi2TurboVAEDecoder
from ..utils.dtype_utils import convert_dtype
from .components_text import _output_dir, convert_text_encoder, key_problems


__all__ = [
    "convert_stable_audio_vae",
    "convert_text_encoder",
    "convert_turbo_vae",
    "convert_wan22_vae",
    "load_pickle_state",
    "oobleck_config_from_sao",
    "stable_audio_to_oobleck_key_map",
    "turbo_vae_config_from_json",
    "turbo_vae_state_dict_from_checkpoint",
    "wan22_config_from_state_dict",
    "wan22_to_diffusers_key_map",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]


def load_pickle_state(path: PathLike) -> object:
    """``torch.load(path, map_location="cpu", weights_only=True, mmap=True)``.

    Raises:
        ValueError: missing file, or a pickle the safe loader refuses.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{path}: torch.load(weights_only=True, mmap=True) refused the file ({type(err).__name__}: {first}); "
            "only plain tensor/dict/int/str pickles saved with torch.save's zip format are accepted"
        ) from err


def _cast_state(state: Mapping[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    if dtype is None:
        return dict(state)
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


def _check_against_model(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], what: str, problems: List[str]
) -> None:
    """Append every missing / unexpected key and shape mismatch of ``state`` vs ``model.state_dict()``."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems += key_problems(expected, {k: tuple(v.shape) for k, v in state.items()}, what)


def _load_and_save(model: torch.nn.Module, state: Dict[str, torch.Tensor], out_dir: PathLike, what: str) -> Path:
    """Strict-load ``state`` (tensors assigned, so their dtypes are kept) and ``save_pretrained`` it."""
    problems: List[str] = []
    _check_against_model(model, state, what, problems)
    if problems:
        raise ValueError("cannot convert " + what + ":\n  " + "\n  ".join(problems))
    # assign=True keeps each tensor's dtype ("keep"); clone so mmap-backed storage is not shared.
    model.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True, assign=True)
    with _output_dir(out_dir) as out:
        model.save_pretrained(out, safe_serialization=True)
    return Path(out_dir)


_WAN_RESNET_PARTS = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
_WAN_SAMPLER_PARTS = ("resample.1.weight", "resample.1.bias", "time_conv.weight", "time_conv.bias")
_WAN_ATTN_PARTS = ("norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias")
_WAN_TOP = {
    "conv1.weight": "quant_conv.weight",
    "conv1.bias": "quant_conv.bias",
    "conv2.weight": "post_quant_conv.weight",
    "conv2.bias": "post_quant_conv.bias",
    "encoder.conv1.weight": "encoder.conv_in.weight",
    "encoder.conv1.bias": "encoder.conv_in.bias",
    "decoder.conv1.weight": "decoder.conv_in.weight",
    "decoder.conv1.bias": "decoder.conv_in.bias",
    "encoder.head.0.gamma": "encoder.norm_out.gamma",
    "encoder.head.2.weight": "encoder.conv_out.weight",
    "encoder.head.2.bias": "encoder.conv_out.bias",
    "decoder.head.0.gamma": "decoder.norm_out.gamma",
    "decoder.head.2.weight": "decoder.conv_out.weight",
    "decoder.head.2.bias": "decoder.conv_out.bias",
}
_WAN_STAGE = re.compile(r"^(encoder|decoder)\.(downsamples|upsamples)\.(\d+)\.(downsamples|upsamples)\.(\d+)\.(.+)$")
_WAN_MIDDLE = re.compile(r"^(encoder|decoder)\.middle\.(\d+)\.(.+)$")


def _wan_num_res_blocks(keys) -> int:
    """Res-blocks per encoder stage = the number of ``encoder.downsamples.0.downsamples.{j}`` with residuals."""
    found = set()
    for key in keys:
        m = re.match(r"^encoder\.downsamples\.0\.downsamples\.(\d+)\.residual\.", key)
        if m:
            found.add(int(m.group(1)))
    if not found or found != set(range(len(found))):
        raise ValueError(
            "not a Wan2.2 VAE state dict: expected nested 'encoder.downsamples.{i}.downsamples.{j}.residual.*' keys "
            "(Wan2.1 checkpoints use a flat 'encoder.downsamples.{k}' layout; convert those with diffusers' "
            "single-file loader)"
        )
    return len(found)


def wan22_to_diffusers_key_map(keys, num_res_blocks: Optional[int] = None) -> Tuple[Dict[str, str], List[str]]:
    """Map original Wan2.2 ``WanVAE_`` keys to diffusers ``AutoencoderKLWan`` keys (rename only).

    Rules (``R = num_res_blocks``): ``encoder.downsamples.{i}.downsamples.{j}`` is resnet ``j`` of
    ``encoder.down_blocks.{i}`` for ``j < R`` and its ``downsampler`` for ``j == R``;
    ``decoder.upsamples.{i}.upsamples.{j}`` is resnet ``j`` of ``decoder.up_blocks.{i}`` for
    ``j <= R`` (the decoder has ``R + 1``) and its ``upsampler`` for ``j == R + 1``;
    ``middle.{0,1,2}`` -> ``mid_block.resnets.0`` / ``attentions.0`` / ``resnets.1``; ``head.{0,2}`` ->
    ``norm_out`` / ``conv_out``; ``conv1``/``conv2`` -> ``quant_conv``/``post_quant_conv``;
    inside resnets ``residual.{0,2,3,6}`` -> ``norm1, conv1, norm2, conv2``, ``shortcut`` -> ``conv_shortcut``.

    Returns:
        ``(mapping, unknown)``: source -> target for every recognised key, and the unrecognised keys.
    """
    keys = list(keys)
    if num_res_blocks is None:
        num_res_blocks = _wan_num_res_blocks(keys)
    mapping: Dict[str, str] = {}
    unknown: List[str] = []
    for key in keys:
        if key in _WAN_TOP:
            mapping[key] = _WAN_TOP[key]
            continue
        m = _WAN_STAGE.match(key)
        if m and m.group(2) == m.group(4):
            side, _, stage, _, j, rest = m.groups()
            j = int(j)
            n_resnets = num_res_blocks if side == "encoder" else num_res_blocks + 1
            block = f"{side}.{'down_blocks' if side == 'encoder' else 'up_blocks'}.{stage}"
            if j < n_resnets and rest in _WAN_RESNET_PARTS:
                mapping[key] = f"{block}.resnets.{j}.{_WAN_RESNET_PARTS[rest]}"
                continue
            if j == n_resnets and rest in _WAN_SAMPLER_PARTS:
                sampler = "downsampler" if side == "encoder" else "upsampler"
                mapping[key] = f"{block}.{sampler}.{rest}"
                continue
        m = _WAN_MIDDLE.match(key)
        if m:
            side, idx, rest = m.group(1), int(m.group(2)), m.group(3)
            if idx in (0, 2) and rest in _WAN_RESNET_PARTS:
                mapping[key] = f"{side}.mid_block.resnets.{idx // 2}.{_WAN_RESNET_PARTS[rest]}"
                continue
            if idx == 1 and rest in _WAN_ATTN_PARTS:
                mapping[key] = f"{side}.mid_block.attentions.0.{rest}"
                continue
        unknown.append(key)
    return mapping, unknown


def wan22_config_from_state_dict(state: Mapping[str, torch.Tensor]) -> dict:
    """Derive the ``AutoencoderKLWan`` (Wan2.2 form) config from tensor shapes alone.

    * ``in_channels`` = ``3 * patch_size**2`` from ``encoder.conv1`` (patch 2 -> 12), ``out_channels`` from
      ``decoder.head.2``; ``base_dim`` = ``encoder.conv1`` out; ``z_dim`` = ``conv2`` out;
    * ``dim_mult[i]`` = width of encoder stage ``i`` / ``base_dim``; ``decoder_base_dim`` = decoder
      ``conv1`` out / ``dim_mult[-1]``; ``num_res_blocks`` from the key layout;
    * ``temperal_downsample[i]`` = encoder stage ``i`` has a ``time_conv``;
    * ``scale_factor_spatial = 2**(stages-1) * patch_size``, ``scale_factor_temporal = 2**sum(temporal)``;
    * ``latents_mean``/``latents_std``: the 48-value Wan2.2 tables (the release ships no config).

    Raises:
        ValueError: missing anchor tensors, non-integral ratios, a z_dim without known tables,
            attention inside down/up blocks (``attn_scales``; Wan2.2 has none).
    """
    num_res_blocks = _wan_num_res_blocks(state)
    need = ["encoder.conv1.weight", "conv2.weight", "decoder.conv1.weight", "decoder.head.2.weight"]
    missing = [k for k in need if k not in state]
    if missing:
        raise ValueError(f"Wan2.2 VAE state dict lacks {missing}; cannot derive its config")
    enc_in = state["encoder.conv1.weight"]
    base_dim, in_channels = int(enc_in.shape[0]), int(enc_in.shape[1])
    patch = math.isqrt(in_channels // 3)
    if patch * patch * 3 != in_channels:
        raise ValueError(f"encoder.conv1 takes {in_channels} channels, not 3 * patch_size**2")
    z_dim = int(state["conv2.weight"].shape[0])
    stages = sorted({int(m.group(1)) for k in state for m in [re.match(r"^encoder\.downsamples\.(\d+)\.", k)] if m})
    dim_mult, temporal = [], []
    for i in stages:
        width = int(state[f"encoder.downsamples.{i}.downsamples.0.residual.6.weight"].shape[0])
        if width % base_dim:
            raise ValueError(f"encoder stage {i} width {width} is not a multiple of base_dim {base_dim}")
        dim_mult.append(width // base_dim)
        if i < len(stages) - 1:
            temporal.append(f"encoder.downsamples.{i}.downsamples.{num_res_blocks}.time_conv.weight" in state)
    dec_width = int(state["decoder.conv1.weight"].shape[0])
    if dec_width % dim_mult[-1]:
        raise ValueError(f"decoder width {dec_width} is not a multiple of dim_mult[-1] {dim_mult[-1]}")
    if any(".attentions." in k or re.search(r"samples\.\d+\.(to_qkv|proj|norm)\.", k) for k in state):
        raise ValueError("attention inside Wan VAE down/up blocks (attn_scales) is not supported; Wan2.2 has none")
    if z_dim != len(WAN22_LATENTS_MEAN):
        raise ValueError(f"z_dim {z_dim}: only the 48-channel Wan2.2 latent statistics are known")
    return {
        "base_dim": base_dim,
        "decoder_base_dim": dec_width // dim_mult[-1],
        "z_dim": z_dim,
        "dim_mult": dim_mult,
        "num_res_blocks": num_res_blocks,
        "attn_scales": [],
        "temperal_downsample": temporal,
        "dropout": 0.0,
        "latents_mean": list(WAN22_LATENTS_MEAN),
        "latents_std": list(WAN22_LATENTS_STD),
        "is_residual": True,
        "in_channels": in_channels,
        "out_channels": int(state["decoder.head.2.weight"].shape[0]),
        "patch_size": patch,
        "scale_factor_temporal": 2 ** sum(temporal),
        "scale_factor_spatial": 2 ** (len(dim_mult) - 1) * patch,
    }


def _tensor_items(obj: object, path: Path) -> Dict[str, torch.Tensor]:
    """The tensor entries of a loaded pickle (a flat ``{name: tensor}``; ints/strings ignored)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a state dict (mapping), got {type(obj).__name__}")
    tensors, others = {}, []
    for key, value in obj.items():
        if isinstance(value, torch.Tensor):
            tensors[str(key)] = value
        elif isinstance(value, (int, float, str, bool)) or value is None:
            continue
        else:
            others.append(f"{key} ({type(value).__name__})")
    if others:
        raise ValueError(f"{path}: unexpected non-tensor entries {others[:5]}")
    return tensors


def convert_wan22_vae(vae_path: PathLike, out_dir: PathLike, dtype: str = "keep") -> Path:
    """Convert SandAI's ``vae/Wan2.2_VAE.pth`` (a ``WanVAE_`` state dict) into an ``AutoencoderKLWan`` folder,
    every model key filled with the source shape.

    Args:
        vae_path: the ``.pth`` file (a folder holding exactly one ``.pth`` is accepted too).
        out_dir: folder to create (absent or empty).
        dtype: ``"keep"``, ``"bf16"`` or ``"fp32"``.

    Returns:
        ``out_dir`` (``config.json`` + ``diffusion_pytorch_model.safetensors``).

    Raises:
        ValueError: unsafe/unreadable pickle, unknown or missing keys, shape mismatches, bad dtype.
    """
    from diffusers import AutoencoderKLWan

    torch_dtype = convert_dtype(dtype)
    path = Path(vae_path)
    if path.is_dir():
        pths = sorted(path.glob("*.pth"))
        if len(pths) != 1:
            raise ValueError(f"{path}: expected exactly one .pth file, found {[p.name for p in pths]}")
        path = pths[0]
    state = _tensor_items(load_pickle_state(path), path)
    config = wan22_config_from_state_dict(state)
    mapping, unknown = wan22_to_diffusers_key_map(state, config["num_res_blocks"])
    if unknown:
        raise ValueError(f"{path}: {len(unknown)} keys with no Wan2.2 -> diffusers mapping, e.g. {unknown[:5]}")
    target = _cast_state({mapping[k]: v for k, v in state.items()}, torch_dtype)
    with torch.device("meta"):
        model = AutoencoderKLWan(**config)
    return _load_and_save(model, target, out_dir, f"Wan2.2 VAE {path}")


#: keys of the SandAI TurboVAED JSON that the decoder does not use (training-only / compatibility).
TURBO_IGNORED_CONFIG_KEYS = (
    "_class_name",
    "_diffusers_version",
    "in_channels",
    "patch_size_t",
    "scaling_factor",
    "encoder_block_out_channels",
    "aligned_feature_dims",
)
#: state-dict prefixes of training-only heads that the converter drops.
TURBO_TRAINING_ONLY_PREFIXES = ("aligned_feature_projection_heads.", "encoder.")


def turbo_vae_config_from_json(turbo_dir: PathLike) -> Tuple[dict, Path]:
    """The ``Magi2TurboVAEDecoder`` config (unused keys dropped, Wan2.2 tables added) from the one JSON in
    ``turbo_dir``, and its path.

    Raises:
        ValueError: no / several candidate JSON files, unreadable JSON, unknown keys.
    """
    folder = Path(turbo_dir)
    if not folder.is_dir():
        raise ValueError(f"TurboVAE folder {folder} does not exist")
    candidates = []
    for p in sorted(folder.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{p}: not readable JSON ({err})") from err
        if isinstance(data, dict) and "decoder_block_out_channels" in data:
            candidates.append((p, data))
    if len(candidates) != 1:
        raise ValueError(
            f"{folder}: expected exactly one TurboVAED JSON config (with 'decoder_block_out_channels'), "
            f"found {[p.name for p, _ in candidates]}"
        )
    path, data = candidates[0]
    params = inspect.signature(Magi2TurboVAEDecoder.__init__).parameters
    known = {name for name, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD} - {"self"}
    unknown = sorted(set(data) - known - set(TURBO_IGNORED_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown TurboVAED config keys {unknown}")
    config = {k: v for k, v in data.items() if k in known}
    config.setdefault("latents_mean", list(WAN22_LATENTS_MEAN))
    config.setdefault("latents_std", list(WAN22_LATENTS_STD))
    return config, path


def turbo_vae_state_dict_from_checkpoint(
    ckpt: object, path: PathLike = "checkpoint"
) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """The decoder weights of a TurboVAE training checkpoint, as SandAI ``get_turbo_vaed`` picks them (EMA first,
    ``module.`` stripped, training-only tensors dropped and reported).

    Returns:
        ``(decoder_state, dropped_keys)``.

    Raises:
        ValueError: not a mapping, the chosen entry is not a mapping, or keys outside ``decoder.*``
            that are not known training-only heads.
    """
    if not isinstance(ckpt, Mapping):
        raise ValueError(f"{path}: expected a dict checkpoint, got {type(ckpt).__name__}")
    for name in ("ema_state_dict", "state_dict"):
        if name in ckpt:
            chosen = ckpt[name]
            if not isinstance(chosen, Mapping):
                raise ValueError(f"{path}: '{name}' is a {type(chosen).__name__}, not a state dict")
            break
    else:
        chosen = ckpt
    tensors = _tensor_items(chosen, Path(str(path)))
    state, dropped, unknown = {}, [], []
    for key, value in tensors.items():
        name = key[len("module.") :] if key.startswith("module.") else key
        if name.startswith("decoder."):
            state[name] = value
        elif name.startswith(TURBO_TRAINING_ONLY_PREFIXES):
            dropped.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"{path}: keys outside 'decoder.*' that are not training-only heads: {unknown[:5]}")
    return state, dropped


def convert_turbo_vae(turbo_dir: PathLike, out_dir: PathLike, dtype: str = "keep") -> Path:
    """Convert SandAI's ``turbo_vae/`` folder (JSON + one checkpoint file) into a :class:`Magi2TurboVAEDecoder` folder.

    Raises:
        ValueError: config or checkpoint problems (see the helpers), missing/unexpected decoder keys,
            shape mismatches, bad dtype.
    """
    torch_dtype = convert_dtype(dtype)
    folder = Path(turbo_dir)
    config, _ = turbo_vae_config_from_json(folder)
    ckpts = sorted(p for ext in ("*.ckpt", "*.pt", "*.pth") for p in folder.glob(ext))
    if len(ckpts) != 1:
        raise ValueError(
            f"{folder}: expected exactly one checkpoint (*.ckpt/*.pt/*.pth), found {[p.name for p in ckpts]}"
        )
    state, dropped = turbo_vae_state_dict_from_checkpoint(load_pickle_state(ckpts[0]), ckpts[0])
    if dropped:
        logger.info("TurboVAE: dropped %d training-only tensors (%s...)", len(dropped), dropped[0])
    try:
        with torch.device("meta"):
            model = Magi2TurboVAEDecoder(**config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{folder}: invalid TurboVAED config: {err}") from err
    return _load_and_save(model, _cast_state(state, torch_dtype), out_dir, f"TurboVAE {ckpts[0]}")


SAO_PREFIX = "pretransform.model."
_SAO_RES_UNIT = {"layers.0.alpha": "snake1.alpha", "layers.0.beta": "snake1.beta", "layers.2.alpha": "snake2.alpha",
                 "layers.2.beta": "snake2.beta"}  # fmt: skip
_WN = ("weight_g", "weight_v", "bias")


def oobleck_config_from_sao(model_config: Mapping) -> Tuple[dict, bool]:
    """``AutoencoderOobleck`` config from a Stable Audio ``model_config.json`` (its ``pretransform``).

    Returns ``(config, encoder_representable)``: diffusers' encoder has one width for its first and last conv,
    so the encoder is representable only when its ``latent_dim`` equals its ``channels``.

    Raises:
        ValueError: a pretransform diffusers' ``AutoencoderOobleck`` cannot hold (the fault named).
    """
    try:
        pre = model_config["model"]["pretransform"]
        cfg = pre["config"]
        enc, dec = cfg["encoder"], cfg["decoder"]
        enc_c, dec_c = enc["config"], dec["config"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"model_config.json lacks model.pretransform.config.{{encoder,decoder}} ({err})") from err
    problems = []
    if pre.get("type") != "autoencoder":
        problems.append(f"pretransform type {pre.get('type')!r} (need 'autoencoder')")
    if enc.get("type") != "oobleck" or dec.get("type") != "oobleck":
        problems.append(f"encoder/decoder types {enc.get('type')!r}/{dec.get('type')!r} (need 'oobleck')")
    if (cfg.get("bottleneck") or {}).get("type") != "vae":
        problems.append(f"bottleneck {(cfg.get('bottleneck') or {}).get('type')!r} (need 'vae')")
    if not enc_c.get("use_snake", False) or not dec_c.get("use_snake", False):
        problems.append("use_snake must be true for encoder and decoder")
    if dec_c.get("final_tanh", True):
        problems.append("decoder final_tanh=true is not representable (AutoencoderOobleck has no tanh)")
    if list(enc_c.get("c_mults", [])) != list(dec_c.get("c_mults", [])) or list(enc_c.get("strides", [])) != list(
        dec_c.get("strides", [])
    ):
        problems.append("encoder and decoder c_mults/strides differ")
    audio_channels = enc_c.get("in_channels", 2)
    if dec_c.get("out_channels", 2) != audio_channels:
        problems.append(f"encoder in_channels {audio_channels} != decoder out_channels {dec_c.get('out_channels')}")
    if 2 * int(dec_c.get("latent_dim", 0)) != int(enc_c.get("latent_dim", -1)):
        problems.append(
            f"encoder latent_dim {enc_c.get('latent_dim')} != 2 x decoder latent_dim {dec_c.get('latent_dim')}"
        )
    if problems:
        raise ValueError("Stable Audio VAE not representable as AutoencoderOobleck: " + "; ".join(problems))
    config = {
        "encoder_hidden_size": int(enc_c["channels"]),
        "downsampling_ratios": [int(s) for s in enc_c["strides"]],
        "channel_multiples": [int(c) for c in enc_c["c_mults"]],
        "decoder_channels": int(dec_c["channels"]),
        "decoder_input_channels": int(dec_c["latent_dim"]),
        "audio_channels": int(audio_channels),
        "sampling_rate": int(model_config.get("sample_rate", 44100)),
    }
    return config, int(enc_c["latent_dim"]) == int(enc_c["channels"])


def _sao_res_unit(rest: str) -> Optional[str]:
    if rest in _SAO_RES_UNIT:
        return _SAO_RES_UNIT[rest]
    m = re.match(r"^layers\.([13])\.(weight_g|weight_v|bias)$", rest)
    if m:
        return f"conv{(int(m.group(1)) + 1) // 2}.{m.group(2)}"
    return None


def stable_audio_to_oobleck_key_map(keys, num_blocks: int) -> Tuple[Dict[str, str], List[str]]:
    """Map Stable Audio Oobleck keys (prefix already stripped) to ``AutoencoderOobleck`` keys.

    Encoder ``layers``: ``0`` conv -> ``conv1``; ``1..n`` blocks -> ``block.{i-1}`` whose ``layers``
    ``0..2`` are residual units (``res_unit1..3``), ``3`` snake (``snake1``), ``4`` strided conv
    (``conv1``); ``n+1`` snake -> ``snake1``; ``n+2`` conv -> ``conv2``. Decoder ``layers``: ``0`` conv ->
    ``conv1``; blocks with ``0`` snake, ``1`` transposed conv (``conv_t1``), ``2..4`` residual units;
    then ``snake1`` and ``conv2``. Residual unit ``layers`` ``0..3`` -> ``snake1, conv1, snake2, conv2``.
    Snake ``alpha``/``beta`` keep their log-scale values (reshaped ``[C] -> [1, C, 1]`` by the caller).

    Returns:
        ``(mapping, unknown)``.
    """
    n = num_blocks
    mapping, unknown = {}, []
    for key in keys:
        side, _, rest = key.partition(".")
        m = re.match(r"^layers\.(\d+)\.(.+)$", rest) if side in ("encoder", "decoder") else None
        target = None
        if m:
            idx, tail = int(m.group(1)), m.group(2)
            if idx == 0 and tail in _WN:
                target = f"{side}.conv1.{tail}"
            elif idx == n + 1 and tail in ("alpha", "beta"):
                target = f"{side}.snake1.{tail}"
            elif idx == n + 2 and tail in _WN:
                target = f"{side}.conv2.{tail}"
            elif 1 <= idx <= n:
                block = f"{side}.block.{idx - 1}"
                bm = re.match(r"^layers\.(\d+)\.(.+)$", tail)
                if bm:
                    sub, sub_tail = int(bm.group(1)), bm.group(2)
                    res_range = range(0, 3) if side == "encoder" else range(2, 5)
                    snake_idx, conv_idx = (3, 4) if side == "encoder" else (0, 1)
                    conv_name = "conv1" if side == "encoder" else "conv_t1"
                    if sub in res_range:
                        unit = _sao_res_unit(sub_tail)
                        if unit is not None:
                            target = f"{block}.res_unit{sub - res_range.start + 1}.{unit}"
                    elif sub == snake_idx and sub_tail in ("alpha", "beta"):
                        target = f"{block}.snake1.{sub_tail}"
                    elif sub == conv_idx and sub_tail in _WN:
                        target = f"{block}.{conv_name}.{sub_tail}"
        if target is None:
            unknown.append(key)
        else:
            mapping[key] = target
    return mapping, unknown


#: how a caller asks for a zero audio encoder, named in the errors (CLI flag, then the Python spelling)
_ZEROS_SPELLING = (
    "magi2-convert --audio_vae_encoder zeros; in Python convert_stable_audio_vae(..., audio_encoder='zeros') or "
    "ConversionRequest(component_options={'audio_vae': {'audio_encoder': 'zeros'}})"
)


def check_stable_audio_vae(sao_dir: PathLike, audio_encoder: str = "strict") -> Tuple[dict, bool]:
    """Check a Stable Audio Open folder's config (no weights) as :func:`convert_stable_audio_vae` will, up front.

    Returns:
        ``(AutoencoderOobleck config, encoder representable)``.

    Raises:
        ValueError: missing files, bad JSON, a config not representable, ``audio_encoder`` not allowed, an
            unrepresentable encoder with ``"strict"`` or a representable one with ``"zeros"``.
    """
    if audio_encoder not in ("strict", "zeros"):
        raise ValueError(f"audio_encoder must be 'strict' or 'zeros', got {audio_encoder!r}")
    folder = Path(sao_dir)
    cfg_path = folder / "model_config.json"
    for p in (cfg_path, folder / "model.safetensors"):
        if not p.is_file():
            raise ValueError(f"Stable Audio folder {folder} lacks {p.name}")
    try:
        model_config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_path}: not valid JSON ({err})") from err
    config, encoder_ok = oobleck_config_from_sao(model_config)
    if not encoder_ok and audio_encoder == "strict":
        enc_c = model_config["model"]["pretransform"]["config"]["encoder"]["config"]
        raise ValueError(
            f"{folder}: the audio encoder (channels {enc_c['channels']}, latent_dim {enc_c['latent_dim']}) is not "
            "representable in AutoencoderOobleck, which needs latent_dim == channels; the decoder is fine. "
            f"To write a zero encoder instead (MAGI-2 inference only decodes audio), pass: {_ZEROS_SPELLING}."
        )
    if encoder_ok and audio_encoder == "zeros":
        raise ValueError(
            f"{folder}: a zero audio encoder (--audio_vae_encoder zeros / audio_encoder='zeros') is only for "
            "unrepresentable encoders; this one converts exactly, so leave the option at its default 'strict'"
        )
    return config, encoder_ok


def convert_stable_audio_vae(
    sao_dir: PathLike, out_dir: PathLike, dtype: str = "keep", *, audio_encoder: str = "strict"
) -> Path:
    """Convert a Stable Audio Open folder (``model_config.json`` + ``model.safetensors``) to ``AutoencoderOobleck``.

    Every ``pretransform.model.*`` tensor must map (SandAI loads them strictly); the rest is skipped.

    Args:
        sao_dir: the Stable Audio folder.
        out_dir: folder to create (absent or empty).
        dtype: ``"keep"``, ``"bf16"`` or ``"fp32"``.
        audio_encoder: ``"strict"``: the encoder must be representable; ``"zeros"`` (only when it is not): zero
            encoder weights, with a warning (MAGI-2 never encodes audio).

    Raises:
        ValueError: missing files, an unrepresentable config or encoder, unknown/missing keys, shape mismatches.
    """
    from diffusers import AutoencoderOobleck
    from safetensors import safe_open

    torch_dtype = convert_dtype(dtype)
    config, encoder_ok = check_stable_audio_vae(sao_dir, audio_encoder)
    folder = Path(sao_dir)
    weights = folder / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        source = {k[len(SAO_PREFIX) :]: f.get_tensor(k) for k in f.keys() if k.startswith(SAO_PREFIX)}
    if not source:
        raise ValueError(f"{weights}: no '{SAO_PREFIX}*' tensors")
    num_blocks = len(config["channel_multiples"])
    mapping, unknown = stable_audio_to_oobleck_key_map(source, num_blocks)
    if unknown:
        raise ValueError(f"{weights}: {len(unknown)} '{SAO_PREFIX}' keys with no Oobleck mapping, e.g. {unknown[:5]}")
    target = {}
    for key, value in source.items():
        name = mapping[key]
        target[name] = value.reshape(1, -1, 1) if name.endswith((".alpha", ".beta")) else value
    with torch.device("meta"):
        model = AutoencoderOobleck(**config)
    if not encoder_ok:
        expected = model.state_dict()
        enc_keys = [k for k in expected if k.startswith("encoder.")]
        provided = [k for k in target if k.startswith("encoder.")]
        logger.warning(
            "Stable Audio encoder not representable in AutoencoderOobleck: its %d tensors are replaced by zeros "
            "(decoder converted exactly)",
            len(provided),
        )
        target = {k: v for k, v in target.items() if not k.startswith("encoder.")}
        ref_dtype = next(iter(target.values())).dtype
        for k in enc_keys:
            # weight_v = 1 (not 0) so the weight-norm direction v/|v| stays finite; weight_g = 0 zeroes it.
            fill = torch.ones if k.endswith("weight_v") else torch.zeros
            target[k] = fill(expected[k].shape, dtype=ref_dtype)
    return _load_and_save(model, _cast_state(target, torch_dtype), out_dir, f"Stable Audio VAE {folder}")
