"""Refiner config mapping and the full-size (released) refiner built on the meta device (SandAI ``configs/magi2_refiner.json``)."""

from __future__ import annotations

import inspect
import json
import time

import pytest
import torch

from diffusers_magi2.loaders.key_plan import source_to_target_key, target_to_source_key
from diffusers_magi2.loaders.sandai_config_refiner import (
    refiner_config_from_sandai,
    refiner_sampling_from_sandai,
)
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel


def _merge(base, child):
    out = dict(base)
    for k, v in child.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def released_cfg(fixtures_dir):
    d = fixtures_dir / "full_size/released_configs"
    child = json.loads((d / "magi2_refiner.json").read_text())
    base = json.loads((d / child.pop("extends")).read_text())
    return _merge(base, child)


def _defaults():
    sig = inspect.signature(Magi2RefinerTransformer3DModel.__init__)
    return {k: p.default for k, p in sig.parameters.items() if k != "self"}


def test_released_config_maps_to_model_defaults(released_cfg):
    kw = refiner_config_from_sandai(released_cfg)
    defaults = _defaults()
    for k, v in kw.items():
        dv = defaults[k]
        assert (list(dv) if isinstance(dv, tuple) else dv) == v, k
    assert kw["window_block_size"] == [8, 4, 4] and kw["window_radius"] == [2, 2, 2]
    assert refiner_sampling_from_sandai(released_cfg) == {
        "num_inference_steps": 5,
        "shift": 5.0,
        "guidance_scale": 2.0,
        "noise_value": 220,
        "audio_noise_scale": -1.0,
        "vae_stride": [4, 16, 16],
    }


def test_tiny_config_mapping(fixtures_dir):
    cfg = json.loads((fixtures_dir / "magi2_tiny/refiner/sandai_checkpoint/magi2_refiner.json").read_text())
    kw = refiner_config_from_sandai(cfg)
    assert kw == {
        "num_layers": 4,
        "num_attention_heads": 6,
        "attention_head_dim": 16,
        "num_key_value_heads": 2,
        "in_channels": 12,
        "audio_in_channels": 16,
        "text_in_channels": 48,
        "multimodal_layers": [0, 3],
        "window_attention_layers": None,
        "window_block_size": [2, 2, 2],
        "window_radius": [1, 1, 1],
        "attention_gating": True,
    }
    # geometry is configuration: a different radius in the SandAI JSON changes the model config
    cfg["evaluation_config"]["magi2_refiner_data_proxy_config"]["attn_config"]["window"]["block_h_radius"] = 3
    assert refiner_config_from_sandai(cfg)["window_radius"] == [1, 3, 1]


def test_config_errors(released_cfg, fixtures_dir):
    raw = json.loads((fixtures_dir / "full_size/released_configs/magi2_refiner.json").read_text())
    with pytest.raises(ValueError, match="extends"):
        refiner_config_from_sandai(raw)
    bad = json.loads(json.dumps(released_cfg))
    bad["evaluation_config"]["magi2_refiner_data_proxy_config"]["attn_config"]["window"]["block_mode"] = "scan"
    with pytest.raises(ValueError, match="grid"):
        refiner_config_from_sandai(bad)
    bad = json.loads(json.dumps(released_cfg))
    bad["magi2_refiner_arch_config"]["post_norm_layers"] = [3]
    with pytest.raises(ValueError, match="post_norm"):
        refiner_config_from_sandai(bad)
    with pytest.raises(ValueError, match="magi2_refiner_arch_config"):
        refiner_config_from_sandai({"arch_config": {}})


def test_key_rename_is_only_the_layer_prefix():
    assert source_to_target_key("block.layers.12.mlp.down_proj.weight") == "transformer_blocks.12.mlp.down_proj.weight"
    assert source_to_target_key("pre_adapter.rope.bands") == "pre_adapter.rope.bands"
    assert (
        target_to_source_key("transformer_blocks.3.attention.linear_g.weight")
        == "block.layers.3.attention.linear_g.weight"
    )


def test_full_size_meta_build_matches_released_key_table(fixtures_dir, released_cfg):
    rows = []
    for line in (fixtures_dir / "full_size/sandai_refiner_state_dict.tsv").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, shape, dtype = line.split("\t")
        rows.append((name, tuple(json.loads(shape)), dtype))
    assert len(rows) == 281
    t0 = time.time()
    with torch.device("meta"):
        model = Magi2RefinerTransformer3DModel(**refiner_config_from_sandai(released_cfg))
    assert time.time() - t0 < 60
    sd = model.state_dict()
    assert len(sd) == 281
    n_params = 0
    for name, shape, dtype in rows:
        key = source_to_target_key(name)
        assert key in sd, key
        assert tuple(sd[key].shape) == shape, key
        # from_pretrained(torch_dtype=bf16) keeps exactly the _keep_in_fp32_modules paths in fp32
        expect_fp32 = model.is_fp32_island(key)
        assert (dtype == "float32") == expect_fp32, key
        if key != "pre_adapter.rope.bands":
            n_params += sd[key].numel()
    assert n_params == 6_720_075_264
    assert sum(p.numel() for p in model.parameters()) == 6_720_075_264
    blk = model.transformer_blocks[2].attention
    assert (blk.heads, blk.kv_heads, blk.head_dim) == (32, 8, 128)
