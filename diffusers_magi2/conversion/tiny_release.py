"""Write a tiny, random, self-consistent MAGI-2 release in SandAI's layout, to try ``magi2-convert`` and then
``examples/generate.py --model`` end to end on a CPU::

    python -m diffusers_magi2.conversion.tiny_release OUT

``OUT`` receives what ``magi2-convert --checkpoint_root OUT`` reads (:data:`~diffusers_magi2.conversion.repo.RELEASE_LAYOUT`)
plus the two SandAI JSON configs:

* ``preview/``, ``refiner/``: SandAI checkpoints (``block.layers.{i}.*`` keys, one safetensors shard and its index,
  the config beside them); the router's ``expert_bias_ema`` holds the bias the model uses (SandAI's
  ``_apply_router_bias_ema``) and a raw ``expert_bias`` is stored beside it, as in the release;
* ``vae/Wan2.2_VAE.pth``: a ``WanVAE_`` state dict (Wan2.2's original key names);
* ``turbo_vae/``: the TurboVAED JSON and a ``checkpoint.ckpt`` holding ``{"state_dict": ...}``;
* ``stable-audio-open-1.0/``: Stable Audio's ``model_config.json`` and ``model.safetensors``
  (``pretransform.model.*``), with an encoder diffusers' ``AutoencoderOobleck`` can hold, as the real one;
* ``text_encoder/``: a text-only Qwen3.5 folder (transformers format) with the tiny byte-level BPE tokenizer;
* ``configs/magi2_preview.json`` and ``configs/magi2_refiner.json`` (which ``extends`` the first): pass the
  latter as ``magi2-convert --config``.

The components are those of the tiny random model (:func:`~diffusers_magi2.pipelines.tiny_default.build_tiny_random_pipeline`,
not the trained tiny default) with a tiny refiner added; every file is written with the inverse of the converter's own key
map and checked against that map before anything is written. The folder is built under a temporary name beside
``OUT`` and renamed into place, so a failed run leaves nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, Mapping

import torch


__all__ = ["TINY_REFINER_CONFIG", "main", "oobleck_to_stable_audio_keys", "wan22_from_diffusers_keys",
           "write_tiny_release"]  # fmt: skip

#: The tiny refiner (``Magi2RefinerTransformer3DModel`` kwargs); channels match the tiny default's transformer.
TINY_REFINER_CONFIG = {
    "num_layers": 2,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "num_key_value_heads": 2,
    "in_channels": 48,
    "audio_in_channels": 64,
    "text_in_channels": 64,
    "multimodal_layers": [0, 1],
}
# ----------------------------------------------------------------------------------------------- key maps


def wan22_from_diffusers_keys(keys, num_res_blocks: int) -> Dict[str, str]:
    """``AutoencoderKLWan`` key -> original Wan2.2 ``WanVAE_`` key: the inverse of
    :func:`~diffusers_magi2.conversion.components.wan22_to_diffusers_key_map` (checked against it by the caller).

    Raises:
        ValueError: a key no rule covers.
    """
    from .components import _WAN_RESNET_PARTS, _WAN_TOP

    top = {v: k for k, v in _WAN_TOP.items()}
    resnet = {v: k for k, v in _WAN_RESNET_PARTS.items()}
    out, unknown = {}, []
    for key in keys:
        if key in top:
            out[key] = top[key]
            continue
        m = re.match(
            r"^(encoder\.down_blocks|decoder\.up_blocks)\.(\d+)\.(resnets\.(\d+)|downsampler|upsampler)\.(.+)$", key
        )
        if m:
            side = "encoder" if m.group(1).startswith("encoder") else "decoder"
            stage_list = "downsamples" if side == "encoder" else "upsamples"
            if m.group(4) is not None and m.group(5) in resnet:
                out[key] = f"{side}.{stage_list}.{m.group(2)}.{stage_list}.{m.group(4)}.{resnet[m.group(5)]}"
                continue
            if m.group(4) is None:
                j = num_res_blocks if side == "encoder" else num_res_blocks + 1
                out[key] = f"{side}.{stage_list}.{m.group(2)}.{stage_list}.{j}.{m.group(5)}"
                continue
        m = re.match(r"^(encoder|decoder)\.mid_block\.(resnets\.(\d+)|attentions\.0)\.(.+)$", key)
        if m:
            if m.group(3) is not None and m.group(4) in resnet:
                out[key] = f"{m.group(1)}.middle.{2 * int(m.group(3))}.{resnet[m.group(4)]}"
                continue
            if m.group(3) is None:
                out[key] = f"{m.group(1)}.middle.1.{m.group(4)}"
                continue
        unknown.append(key)
    if unknown:
        raise ValueError(f"no Wan2.2 name for {unknown[:5]}")
    return out


def oobleck_to_stable_audio_keys(keys, num_blocks: int) -> Dict[str, str]:
    """``AutoencoderOobleck`` key -> Stable Audio key (without ``pretransform.model.``): the inverse of
    :func:`~diffusers_magi2.conversion.components.stable_audio_to_oobleck_key_map` (checked by the caller).

    Raises:
        ValueError: a key no rule covers.
    """
    unit = {"snake1": "layers.0", "conv1": "layers.1", "snake2": "layers.2", "conv2": "layers.3"}
    out, unknown = {}, []
    for key in keys:
        side, _, rest = key.partition(".")
        name = None
        m = re.match(r"^(conv1|snake1|conv2)\.(\w+)$", rest)
        if m:
            idx = {"conv1": 0, "snake1": num_blocks + 1, "conv2": num_blocks + 2}[m.group(1)]
            name = f"{side}.layers.{idx}.{m.group(2)}"
        m = re.match(r"^block\.(\d+)\.(.+)$", rest)
        if m:
            block, tail = int(m.group(1)), m.group(2)
            first_unit, snake, conv = (0, 3, 4) if side == "encoder" else (2, 0, 1)
            um = re.match(r"^res_unit(\d)\.(snake1|conv1|snake2|conv2)\.(\w+)$", tail)
            sm = re.match(r"^(snake1|conv1|conv_t1)\.(\w+)$", tail)
            if um:
                sub = first_unit + int(um.group(1)) - 1
                name = f"{side}.layers.{block + 1}.layers.{sub}.{unit[um.group(2)]}.{um.group(3)}"
            elif sm:
                sub = snake if sm.group(1) == "snake1" else conv
                name = f"{side}.layers.{block + 1}.layers.{sub}.{sm.group(2)}"
        if name is None:
            unknown.append(key)
        else:
            out[key] = name
    if unknown:
        raise ValueError(f"no Stable Audio name for {unknown[:5]}")
    return out


def _checked_inverse(inverse: Mapping[str, str], forward: Mapping[str, str], unknown, what: str) -> None:
    """``forward`` (source -> target, from the converter's map) must undo ``inverse`` key for key."""
    bad = [t for t, s in inverse.items() if forward.get(s) != t]
    if unknown or bad:
        raise RuntimeError(f"{what}: the written names do not convert back ({(list(unknown) + bad)[:5]})")


# ----------------------------------------------------------------------------------------------- configs


def _preview_sandai_config(model) -> dict:
    """The released preview config with ``arch_config`` (and the time width) set to ``model``'s."""
    from ..loaders.sandai_config import load_sandai_config, preview_config_from_sandai, released_config_path

    c = model.config
    cfg = load_sandai_config(released_config_path("magi2_preview.json"))
    arch = cfg["arch_config"]
    arch.update(_shared_arch(c), intermediate_factor=c.intermediate_factor)
    arch["mhc_config"]["num_stream"] = c.num_streams
    arch["attn_sinks"]["sink_token_num"] = c.num_sink_tokens
    arch["moe_config"].update(
        moe_layers=list(c.moe_layers),
        num_heads=c.moe_num_heads,
        num_experts=c.moe_num_experts,
        top_k=c.moe_top_k,
        expert_intermediate_size=c.moe_expert_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        modality_specific_expert_intermediate_size=c.modality_specific_expert_intermediate_size,
        score_func=c.moe_score_func,
        route_norm=c.moe_route_norm,
        route_scale=c.moe_route_scale,
        split_merge_intermediate_size=c.split_merge_intermediate_size,
    )
    cfg["evaluation_config"]["data_proxy_config"]["time_channel_dim"] = c.time_embed_dim
    _check_maps_back(preview_config_from_sandai(cfg), c, "preview")
    return cfg


def _refiner_sandai_config(model) -> dict:
    """The released refiner config's own sections with ``magi2_refiner_arch_config`` set to ``model``'s."""
    from ..loaders.sandai_config_refiner import refiner_config_from_sandai

    c = model.config
    path = Path(__file__).resolve().parents[1] / "loaders" / "released_configs" / "magi2_refiner.json"
    cfg = json.loads(path.read_text())
    arch = cfg["magi2_refiner_arch_config"]
    arch.update(_shared_arch(c), local_attn_layers=list(range(c.num_layers)))
    merged = {k: v for k, v in cfg.items() if k != "extends"}
    _check_maps_back(refiner_config_from_sandai(merged), c, "refiner")
    return cfg


def _shared_arch(c) -> dict:
    """The SandAI ``arch_config`` entries both transformers share, from our config ``c``."""
    return {
        "num_layers": c.num_layers,
        "hidden_size": c.num_attention_heads * c.attention_head_dim,
        "head_dim": c.attention_head_dim,
        "num_query_groups": c.num_key_value_heads,
        "video_in_channels": c.in_channels,
        "audio_in_channels": c.audio_in_channels,
        "text_in_channels": c.text_in_channels,
        "mm_layers": list(c.multimodal_layers),
    }


def _plain(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def _check_maps_back(mapped: dict, c, what: str) -> None:
    """The converter's mapping of the written SandAI config must give back ``c`` (the tiny model's config)."""
    differ = {k: (v, c[k]) for k, v in mapped.items() if k in c and _plain(c[k]) != _plain(v)}
    if differ:
        raise RuntimeError(f"tiny {what} config does not map back: {differ}")


def _stable_audio_model_config(vae) -> dict:
    """Stable Audio's ``model_config.json`` for ``vae`` (the inverse of ``oobleck_config_from_sao``)."""
    c = vae.config
    common = {"c_mults": list(c.channel_multiples), "strides": list(c.downsampling_ratios), "use_snake": True}
    encoder = {"in_channels": c.audio_channels, "channels": c.encoder_hidden_size,
               "latent_dim": 2 * c.decoder_input_channels, **common}  # fmt: skip
    decoder = {"out_channels": c.audio_channels, "channels": c.decoder_channels,
               "latent_dim": c.decoder_input_channels, "final_tanh": False, **common}  # fmt: skip
    return {
        "model_type": "diffusion_cond",
        "sample_rate": c.sampling_rate,
        "audio_channels": c.audio_channels,
        "model": {
            "pretransform": {
                "type": "autoencoder",
                "config": {
                    "encoder": {"type": "oobleck", "config": encoder},
                    "decoder": {"type": "oobleck", "config": decoder},
                    "bottleneck": {"type": "vae"},
                    "latent_dim": c.decoder_input_channels,
                },
            }
        },
    }


# ----------------------------------------------------------------------------------------------- writers


def _write_sandai_checkpoint(model, folder: Path, config: dict, config_name: str) -> None:
    """``model``'s weights under SandAI names (one shard + index), in the release's dtypes (bf16, fp32 islands
    fp32), and its SandAI config beside them."""
    import copy

    from safetensors.torch import save_file

    from ..loaders.key_plan import target_to_source_key

    folder.mkdir(parents=True)
    state = {}
    for key, tensor in copy.deepcopy(model).to(torch.bfloat16).state_dict().items():
        source = target_to_source_key(key)
        if key.endswith(".router.expert_bias"):
            state[source + "_ema"] = tensor.detach().clone().contiguous()  # what SandAI's loader applies
            source_raw = torch.linspace(-0.1, 0.1, tensor.numel(), dtype=tensor.dtype).view_as(tensor)
            state[source] = source_raw.contiguous()  # the raw bias: present in the release, unused
            continue
        state[source] = tensor.detach().contiguous()
    shard = "model-00001-of-00001.safetensors"
    save_file(state, str(folder / shard), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": size}, "weight_map": dict.fromkeys(sorted(state), shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / config_name).write_text(json.dumps(config, indent=2))


def _write_wan_vae(vae, path: Path) -> None:
    from .components import wan22_to_diffusers_key_map

    state = vae.state_dict()
    names = wan22_from_diffusers_keys(state, vae.config.num_res_blocks)
    forward, unknown = wan22_to_diffusers_key_map(names.values(), vae.config.num_res_blocks)
    _checked_inverse(names, forward, unknown, "Wan2.2 VAE")
    path.parent.mkdir(parents=True)
    torch.save({names[k]: v.detach().clone() for k, v in state.items()}, path)


def _write_turbo_vae(decoder, folder: Path) -> None:
    import inspect

    folder.mkdir(parents=True)
    params = inspect.signature(type(decoder).__init__).parameters
    config = {k: _plain(v) for k, v in decoder.config.items() if k in params and not k.startswith("latents_")}
    (folder / "TurboV3-Wan22-tiny.json").write_text(json.dumps(config, indent=2))
    torch.save({"state_dict": {k: v.detach().clone() for k, v in decoder.state_dict().items()}},
               folder / "checkpoint.ckpt")  # fmt: skip


def _write_stable_audio(vae, folder: Path) -> None:
    from safetensors.torch import save_file

    from .components import SAO_PREFIX, stable_audio_to_oobleck_key_map

    folder.mkdir(parents=True)
    num_blocks = len(vae.config.channel_multiples)
    state = vae.state_dict()
    names = oobleck_to_stable_audio_keys(state, num_blocks)
    forward, unknown = stable_audio_to_oobleck_key_map(names.values(), num_blocks)
    _checked_inverse(names, forward, unknown, "Stable Audio VAE")
    tensors = {}
    for key, value in state.items():
        value = value.detach().clone()
        tensors[SAO_PREFIX + names[key]] = value.reshape(-1) if key.endswith((".alpha", ".beta")) else value
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps(_stable_audio_model_config(vae), indent=2))


def write_tiny_release(out_dir, seed: int = 0) -> Path:
    """Write the tiny SandAI-layout release of the module docstring to ``out_dir``.

    Args:
        out_dir: folder to create; it must not exist yet (or be an empty folder).
        seed: seed of the random weights.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: ``out_dir`` exists and is not an empty folder.
    """
    from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
    from ..pipelines.tiny_default import build_tiny_random_pipeline, init_tiny_weights

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; pass a new path")
    pipe = build_tiny_random_pipeline(config={"seed": seed})
    generator = torch.Generator().manual_seed(seed + 7)
    refiner = init_tiny_weights(Magi2RefinerTransformer3DModel(**TINY_REFINER_CONFIG), generator).eval()
    audio_vae = pipe.audio_vae
    preview_cfg = _preview_sandai_config(pipe.transformer)
    refiner_cfg = _refiner_sandai_config(refiner)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "configs").mkdir()
        (tmp / "configs" / "magi2_preview.json").write_text(json.dumps(preview_cfg, indent=2))
        (tmp / "configs" / "magi2_refiner.json").write_text(json.dumps(refiner_cfg, indent=2))
        _write_sandai_checkpoint(pipe.transformer, tmp / "preview", preview_cfg, "magi2_preview.json")
        merged_refiner = {**preview_cfg, **{k: v for k, v in refiner_cfg.items() if k != "extends"}}
        merged_refiner["evaluation_config"] = {**preview_cfg["evaluation_config"], **refiner_cfg["evaluation_config"]}
        _write_sandai_checkpoint(refiner, tmp / "refiner", merged_refiner, "magi2_refiner.json")
        _write_wan_vae(pipe.vae, tmp / "vae" / "Wan2.2_VAE.pth")
        _write_turbo_vae(pipe.video_decoder, tmp / "turbo_vae")
        _write_stable_audio(audio_vae, tmp / "stable-audio-open-1.0")
        pipe.text_encoder.save_pretrained(tmp / "text_encoder")
        pipe.tokenizer.save_pretrained(tmp / "text_encoder")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv=None) -> int:
    """``python -m diffusers_magi2.conversion.tiny_release OUT``: exit 0, or 2 after one ``error:`` line."""
    parser = argparse.ArgumentParser(
        prog="python -m diffusers_magi2.conversion.tiny_release", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", type=Path, help="folder to create (must not exist, or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    try:
        out = write_tiny_release(args.out_dir, seed=args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote a tiny SandAI-layout release to {out}; convert it with:")
    print(
        f"  magi2-convert --checkpoint_root {out} --config {out / 'configs' / 'magi2_refiner.json'} --output_path OUT"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
