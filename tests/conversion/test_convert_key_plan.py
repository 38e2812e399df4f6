"""Key plan: renames, fp32 islands, exhaustive validation (without building a model).

Expected specs here are taken from the fixture checkpoint's own headers, so these tests check the
plan logic alone; ``test_convert_transformer.py`` checks it against the real models.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.convert_testing_utils import (
    checkpoint_dir,
    copy_checkpoint,
    mutate_tensor,
    read_index,
    read_tsv,
    rewrite_shard,
    shard_of,
    write_index,
)

from diffusers_magi2.loaders.key_plan import (
    CheckpointValidationError,
    TensorSpec,
    build_key_plan,
    read_source_checkpoint,
    source_to_target_key,
    target_dtype_for,
    target_to_source_key,
)
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from diffusers_magi2.utils.fp32_islands import is_fp32_island


BIAS = "block.layers.1.mlp.moe_mlp.router.expert_bias"


def _expected_from(ckpt):
    """Specs from the fixture's own headers; its F32 tensors are exactly its fp32 islands (bf16 checkpoint)."""
    src = read_source_checkpoint(ckpt)
    return {
        source_to_target_key(k): TensorSpec(src.tensor(k).shape, src.tensor(k).dtype, src.tensor(k).dtype == "F32")
        for k in src.weight_map
    }


def test_rename_rule_only_touches_the_block_prefix_and_the_mhc_sites():
    assert (
        source_to_target_key("block.layers.12.attention.linear_qkv.weight")
        == "transformer_blocks.12.attention.linear_qkv.weight"
    )
    assert source_to_target_key("pre_adapter.rope.bands") == "pre_adapter.rope.bands"
    assert source_to_target_key("post_adapter.block.layers.1.x") == "post_adapter.block.layers.1.x"
    # a layer's flat mHC tensors belong to its two sites; the shared norm keeps its name
    assert source_to_target_key("block.layers.3.mhc_bias_res_attn") == "transformer_blocks.3.mhc_attn.bias_res"
    assert source_to_target_key("block.layers.3.mhc_phi_fused_mlp") == "transformer_blocks.3.mhc_mlp.phi_fused"
    assert source_to_target_key("block.layers.3.mhc_norm.weight") == "transformer_blocks.3.mhc_norm.weight"
    assert source_to_target_key("block.layers.3.attention.mhc_alpha_pre_attn").endswith("attention.mhc_alpha_pre_attn")
    keys = read_tsv("sandai_preview_state_dict.tsv")
    assert len({source_to_target_key(k) for k in keys}) == len(keys)
    assert sum(".mhc_attn." in source_to_target_key(k) for k in keys) == 40 * 7
    for key in keys:
        assert target_to_source_key(source_to_target_key(key)) == key


@pytest.mark.parametrize(
    "table, model_cls",
    [
        ("sandai_preview_state_dict.tsv", Magi2Transformer3DModel),
        ("sandai_refiner_state_dict.tsv", Magi2RefinerTransformer3DModel),
    ],
)
def test_fp32_island_rule_matches_the_released_dtypes(table, model_cls):
    """The class's ``_keep_in_fp32_modules`` names exactly the F32 tensors of the released checkpoint, under their
    diffusers names (the modules it lists, ``mhc_attn`` / ``mhc_mlp`` included, exist only after the renames)."""
    rows = read_tsv(table)
    keep = model_cls._keep_in_fp32_modules
    wrong = [k for k, (_, dt) in rows.items() if (dt == "F32") != is_fp32_island(source_to_target_key(k), keep)]
    assert wrong == []
    if "preview" in table:  # 118,754,352 fp32 *parameters* at FULL size (SandAI's released config) ...
        buffers = ("router.expert_bias", "rope.bands")  # ... plus the fp32 buffers (36*2*3072 + 16)
        fp32 = sum(
            torch.Size(s).numel() for k, (s, dt) in rows.items() if dt == "F32" and not any(b in k for b in buffers)
        )
        assert fp32 == 118_754_352
        assert sum(torch.Size(s).numel() for k, (s, _) in rows.items() if any(b in k for b in buffers)) == 221_200


def test_target_dtype_policy_keeps_islands_fp32():
    assert target_dtype_for("BF16", "fp32", fp32_island=False) == "F32"
    assert target_dtype_for("F32", "bf16", fp32_island=False) == "BF16"
    assert target_dtype_for("BF16", "keep", fp32_island=False) == "BF16"
    assert target_dtype_for("F32", "bf16", fp32_island=True) == "F32"
    assert target_dtype_for("BF16", "keep", fp32_island=True) == "F32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        target_dtype_for("F32", "fp16", fp32_island=False)


def test_plan_covers_every_key_with_ema_bias():
    ckpt = checkpoint_dir("preview_h4")
    plan = build_key_plan(read_source_checkpoint(ckpt), _expected_from(ckpt), dtype="bf16")
    targets = [e.target_key for e in plan.entries]
    assert len(targets) == len(set(targets)) == 131
    by_target = {e.target_key: e for e in plan.entries}
    bias = by_target[source_to_target_key(BIAS)]
    assert bias.source_key == BIAS + "_ema"
    assert by_target[source_to_target_key(BIAS + "_ema")].source_key == BIAS + "_ema"
    assert set(plan.read_not_written) == {BIAS, BIAS.replace("layers.1", "layers.2")}
    # reading order: shard by shard
    files = [e.source_file for e in plan.entries]
    assert files == sorted(files)
    keep = Magi2Transformer3DModel._keep_in_fp32_modules
    assert all(e.target_dtype == ("F32" if is_fp32_island(e.target_key, keep) else "BF16") for e in plan.entries)


def test_every_problem_is_listed_together(tmp_path):
    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    expected = _expected_from(checkpoint_dir("preview_h4"))
    shape_key = "block.layers.0.attention.linear_qkv.weight"
    dtype_key = "block.layers.0.attention.sinks"
    mutate_tensor(ckpt, shape_key, lambda t: t[:-1])
    mutate_tensor(ckpt, dtype_key, lambda t: t.to(torch.bfloat16))
    # unexpected key, present in the index and its shard
    s1 = shard_of(ckpt, "pre_adapter.rope.bands")
    rewrite_shard(ckpt, s1, lambda t: {**t, "block.layers.0.attention.unknown_extra": torch.zeros(2)})
    index = read_index(ckpt)
    index["weight_map"]["block.layers.0.attention.unknown_extra"] = s1
    # a key missing from the index (still in its shard), and one listed but absent from its shard
    del index["weight_map"]["post_adapter.final_linear_video.weight"]
    index["weight_map"]["block.layers.3.mlp.ghost"] = s1
    write_index(ckpt, index)
    # an unreferenced stale shard
    (ckpt / "model-00003-of-00003.safetensors").write_bytes((ckpt / s1).read_bytes())

    with pytest.raises(CheckpointValidationError) as err:
        build_key_plan(read_source_checkpoint(ckpt), expected, context="checked against test config")
    msg = str(err.value)
    problems = err.value.problems
    assert "checked against test config" in msg and "nothing was written" in msg
    expect = {
        shape_key: "shape [1151, 128]",
        dtype_key: "dtype BF16",
        "block.layers.0.attention.unknown_extra": "unexpected key",
        "post_adapter.final_linear_video.weight": "absent from the index",
        "block.layers.3.mlp.ghost": "has no such tensor",
        "model-00003-of-00003.safetensors": "not referenced by the index",
    }
    for key, text in expect.items():
        assert any(p.startswith(key) and text in p for p in problems), (key, problems)
    # the index problem also makes the final linear a missing key
    assert any("post_adapter.final_linear_video.weight: missing key" in p for p in problems)


def test_missing_and_truncated_shards(tmp_path):
    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    expected = _expected_from(checkpoint_dir("preview_h4"))
    first, second = sorted(set(read_index(ckpt)["weight_map"].values()))
    (ckpt / second).unlink()
    raw = (ckpt / first).read_bytes()
    (ckpt / first).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointValidationError) as err:
        build_key_plan(read_source_checkpoint(ckpt), expected)
    problems = err.value.problems
    assert any(p.startswith(second) and "missing shard file" in p for p in problems)
    assert any(p.startswith(first) and "truncated shard" in p for p in problems)
    # a dry run on header-only data does not flag the truncation
    src = read_source_checkpoint(ckpt, check_data=False)
    assert not any("truncated" in p for p in src.problems)


def test_malformed_index_and_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        read_source_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weights": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        read_source_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        read_source_checkpoint(tmp_path / "nope")
