"""Transformer / refiner conversion end to end against the golden fixtures.

Round trips: SandAI ``sandai_checkpoint`` -> ``magi2-convert`` -> ``from_pretrained(OUT,
subfolder=...)`` reproduces the reference ``model.out`` of ``fp32/transformer_case`` (atol 1e-4,
the fixture README's fp32 tolerance). Also: the in-memory ``from_original_checkpoint`` path, the
EMA router bias (fixture README item 1), fp32 islands, stale shards and variants,
and the full-size key tables planned from header-only stubs.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.convert_testing_utils import (
    checkpoint_dir,
    config_path,
    copy_checkpoint,
    load_case,
    mutate_tensor,
    preview_forward,
    read_index,
    read_tsv,
    rewrite_shard,
    run_cli,
    write_header_only_checkpoint,
    write_index,
)
from safetensors import safe_open
from safetensors.torch import load_file

from diffusers_magi2.conversion.convert_transformer import TRANSFORMER_TARGETS
from diffusers_magi2.loaders.key_plan import source_to_target_key
from diffusers_magi2.loaders.original_checkpoint import (
    build_meta_model,
    expected_specs_from_model,
    load_original_checkpoint,
    original_format,
)
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.utils.fp32_islands import is_fp32_island
from diffusers_magi2.utils.safetensors_io import TORCH_TO_DTYPE


ATOL = 1e-4  # fixture README, "Suggested tolerance, fp32/"
ISLANDS = Magi2Transformer3DModel._keep_in_fp32_modules
BIASES = [f"block.layers.{i}.mlp.moe_mlp.router.expert_bias" for i in (1, 2)]


def _convert(src, out, config, *extra):
    rc, stdout, stderr = run_cli(
        ["--preview_dir", src, "--config", config, "--output_path", out, "--components", "transformer", *extra]
    )
    assert rc == 0, stderr
    return out


def _all_tensors(folder):
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


@pytest.fixture(scope="module")
def converted_h4(tmp_path_factory):
    out = tmp_path_factory.mktemp("h4") / "repo"
    return _convert(checkpoint_dir("preview_h4"), out, config_path("preview_h4"), "--max_shard_size", "1MB")


@pytest.mark.parametrize("variant", ["preview_h4", "preview_h3"])
def test_converted_repo_reproduces_fixture(tmp_path, converted_h4, variant):
    if variant == "preview_h4":  # --dtype keep, 4 shards
        out = converted_h4
    else:  # --dtype fp32: every bf16 tensor goes through the chunked cast path
        out = _convert(checkpoint_dir(variant), tmp_path / "repo", config_path(variant), "--dtype", "fp32")
        src = _all_tensors(checkpoint_dir(variant))
        got = _all_tensors(out / "transformer")
        assert {t.dtype for t in got.values()} == {torch.float32}
        bias = {k: k + "_ema" if k.endswith("router.expert_bias") else k for k in src}
        assert all(torch.equal(got[source_to_target_key(k)], src[bias[k]].float()) for k in src)
    model = Magi2Transformer3DModel.from_pretrained(out, subfolder="transformer")
    case = load_case(variant)
    err = (preview_forward(model, case) - case["model.out"]).abs().max().item()
    assert err <= ATOL, err
    if variant == "preview_h4":  # image-to-video case, same weights
        err = (preview_forward(model, case, "i2v.model.") - case["i2v.model.out"]).abs().max().item()
        assert err <= ATOL, err


def test_converted_tensors_equal_source_after_documented_transform(converted_h4):
    """Every converted tensor equals its source; expert_bias == source expert_bias_ema."""
    src = _all_tensors(checkpoint_dir("preview_h4"))
    folder = converted_h4 / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) >= 2 and {p.name for p in shards} == set(index["weight_map"].values())
    out = _all_tensors(folder)
    assert set(out) == {source_to_target_key(k) for k in src}
    for key, value in src.items():
        want = src[key + "_ema"] if key in BIASES else value
        got = out[source_to_target_key(key)]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    for key in BIASES:
        assert not torch.equal(src[key], src[key + "_ema"])  # the fixture makes the choice matter


def test_load_reports_nothing_missing_and_nothing_on_meta(converted_h4):
    model, info = Magi2Transformer3DModel.from_pretrained(
        converted_h4, subfolder="transformer", output_loading_info=True
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert on_meta == []


@pytest.mark.parametrize("variant", ["preview_h4", "preview_h3"])
def test_from_original_checkpoint_uses_the_same_plan(variant):
    case = load_case(variant)
    model = Magi2Transformer3DModel.from_original_checkpoint(
        checkpoint_dir(variant), config_path(variant), dtype=torch.float32
    )
    assert (preview_forward(model, case) - case["model.out"]).abs().max().item() <= ATOL
    direct = load_original_checkpoint(
        Magi2Transformer3DModel, checkpoint_dir(variant), config_path(variant), dtype=torch.float32
    )
    assert (preview_forward(direct, case) - case["model.out"]).abs().max().item() <= ATOL


def test_router_bias_perturbation_leaves_outputs_unchanged(tmp_path, converted_h4):
    """The loader routes with expert_bias_ema: perturbing the source expert_bias changes nothing,
    perturbing expert_bias_ema does (so the check can fail)."""
    case = load_case("preview_h4")
    base = preview_forward(Magi2Transformer3DModel.from_pretrained(converted_h4, subfolder="transformer"), case)
    g = torch.Generator().manual_seed(1)

    def perturbed(suffix, name):
        ckpt = copy_checkpoint("preview_h4", tmp_path / name)
        for key in BIASES:
            mutate_tensor(ckpt, key + suffix, lambda t: t + 3.0 * torch.randn(t.shape, generator=g))
        out = _convert(ckpt, tmp_path / f"{name}_out", config_path("preview_h4"))
        return preview_forward(Magi2Transformer3DModel.from_pretrained(out, subfolder="transformer"), case)

    assert torch.equal(perturbed("", "bias"), base)
    assert (perturbed("_ema", "ema") - base).abs().max().item() > 1e-2


def test_fp32_islands_survive_bf16_conversion_load_and_save(tmp_path):
    """--dtype bf16 output, bf16 load, save_pretrained: islands stay F32, the rest BF16."""
    out = _convert(checkpoint_dir("preview_h4"), tmp_path / "repo", config_path("preview_h4"), "--dtype", "bf16")
    with safe_open(str(out / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        for k in f.keys():
            assert f.get_slice(k).get_dtype() == ("F32" if is_fp32_island(k, ISLANDS) else "BF16"), k
    model = Magi2Transformer3DModel.from_pretrained(out, subfolder="transformer", dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        assert t.dtype == (torch.float32 if is_fp32_island(name, ISLANDS) else torch.bfloat16), name
    model.save_pretrained(tmp_path / "resaved")
    seen = 0
    for shard in (tmp_path / "resaved").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                seen += 1
                assert f.get_slice(k).get_dtype() == ("F32" if is_fp32_island(k, ISLANDS) else "BF16"), k
    assert seen == 131


@pytest.mark.parametrize(
    "case, needle",
    [
        ("extra", "block.layers.0.attention.unknown_extra: unexpected key"),
        ("no_ema", "block.layers.1.mlp.moe_mlp.router.expert_bias_ema: missing key"),
    ],
)
def test_unknown_or_missing_router_key_fails_by_name(tmp_path, case, needle):
    """An unknown key and a deleted expert_bias_ema stop the converter, named."""
    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    index = read_index(ckpt)
    if case == "extra":
        fname = index["weight_map"]["pre_adapter.rope.bands"]
        rewrite_shard(ckpt, fname, lambda t: {**t, "block.layers.0.attention.unknown_extra": torch.zeros(3)})
        index["weight_map"]["block.layers.0.attention.unknown_extra"] = fname
    else:
        key = "block.layers.1.mlp.moe_mlp.router.expert_bias_ema"
        fname = index["weight_map"].pop(key)
        rewrite_shard(ckpt, fname, lambda t: {k: v for k, v in t.items() if k != key})
    write_index(ckpt, index)
    out = tmp_path / "out"
    rc, _, err = run_cli(
        [
            "--preview_dir",
            ckpt,
            "--config",
            config_path("preview_h4"),
            "--output_path",
            out,
            "--components",
            "transformer",
        ]
    )
    assert rc != 0 and needle in err
    assert not out.exists() and list(tmp_path.glob(".out.tmp-*")) == []


def test_reconversion_leaves_no_stale_shards(tmp_path):
    """A with 3+ shards, then B (= A + 1) with fewer, larger shards into the same OUT."""
    out = tmp_path / "out"
    _convert(checkpoint_dir("preview_h4"), out, config_path("preview_h4"), "--max_shard_size", "1MB")
    assert len(list((out / "transformer").glob("*.safetensors"))) >= 3
    ckpt_b = copy_checkpoint("preview_h4", tmp_path / "b")
    for fname in sorted(set(read_index(ckpt_b)["weight_map"].values())):
        rewrite_shard(ckpt_b, fname, lambda t: {k: (v.float() + 1).to(v.dtype) for k, v in t.items()})
    _convert(ckpt_b, out, config_path("preview_h4"), "--max_shard_size", "2MB", "--overwrite")
    folder = out / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert {p.name for p in folder.glob("*.safetensors")} == set(index["weight_map"].values())
    assert len(set(index["weight_map"].values())) == 2
    model = Magi2Transformer3DModel.from_pretrained(out, subfolder="transformer")
    src_b = load_original_checkpoint(Magi2Transformer3DModel, ckpt_b, config_path("preview_h4"), dtype=torch.float32)
    sd, ref = model.state_dict(), src_b.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd)


def test_default_and_bf16_variant_coexist(tmp_path, converted_h4):
    """A default and a ``bf16`` variant in one folder; both load, re-saving keeps the variant.

    Plain diffusers 0.42.1 ``ModelMixin.save_pretrained`` deletes the other variant's shards (checked
    below, so the work-around is known to be needed); the model's own ``save_pretrained`` keeps them.
    """
    from diffusers import ModelMixin

    model = Magi2Transformer3DModel.from_pretrained(converted_h4, subfolder="transformer")
    bf16 = Magi2Transformer3DModel.from_pretrained(converted_h4, subfolder="transformer", dtype=torch.bfloat16)
    folder = tmp_path / "both"
    model.save_pretrained(folder, max_shard_size="1MB")
    bf16.save_pretrained(folder, variant="bf16", max_shard_size="1MB")
    variant_files = sorted(p.name for p in folder.glob("*.bf16*.safetensors"))
    assert len(variant_files) >= 2
    loaded = Magi2Transformer3DModel.from_pretrained(folder, variant="bf16", dtype=torch.bfloat16)
    assert loaded.transformer_blocks[1].mlp.moe_mlp.W_up.dtype == torch.bfloat16
    assert loaded.pre_adapter.video_embedder.weight.dtype == torch.float32

    model.save_pretrained(folder, max_shard_size="1MB")
    assert sorted(p.name for p in folder.glob("*.bf16*.safetensors")) == variant_files
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
    default = Magi2Transformer3DModel.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), model.state_dict().values()))
    again = Magi2Transformer3DModel.from_pretrained(folder, variant="bf16", dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), bf16.state_dict().values()))

    ModelMixin.save_pretrained(model, folder, max_shard_size="1MB")  # the upstream behaviour
    assert sorted(p.name for p in folder.glob("*.bf16*.safetensors")) == []


@pytest.mark.parametrize(
    "component, table, num_shards",
    [("transformer", "sandai_preview_state_dict.tsv", 56), ("refiner", "sandai_refiner_state_dict.tsv", 3)],
)
def test_full_size_model_matches_released_key_table(component, table, num_shards):
    """The meta-built model of the released config expects exactly the reference's tensors."""
    cls = TRANSFORMER_TARGETS[component].model_class()
    fmt = original_format(cls)
    cfg, _ = fmt.resolve_config(None)
    model = build_meta_model(cls, fmt.model_kwargs(cfg))
    specs = expected_specs_from_model(model, TORCH_TO_DTYPE[fmt.params_dtype(cfg)])
    rows = read_tsv(table)
    assert {source_to_target_key(k): v for k, v in rows.items()} == {k: (s.shape, s.dtype) for k, s in specs.items()}


@pytest.mark.parametrize(
    "flag, table, num_shards, count",
    [
        ("--preview_dir", "sandai_preview_state_dict.tsv", 56, 1371),
        ("--refiner_dir", "sandai_refiner_state_dict.tsv", 3, 281),
    ],
)
def test_dry_run_on_header_only_full_size_stubs(tmp_path, flag, table, num_shards, count):
    rows = read_tsv(table)
    assert len(rows) == count
    ckpt = write_header_only_checkpoint(rows, tmp_path / "ckpt", num_shards)
    out = tmp_path / "out"
    rc, stdout, err = run_cli([flag, ckpt, "--output_path", out, "--dry_run"])  # released config by default
    assert rc == 0, err
    planned = [line for line in stdout.splitlines() if " -> " in line and line.startswith("  model-")]
    assert len(planned) == count
    assert {line.split(": ", 1)[1].split(" -> ")[0] for line in planned} == set(rows) - {
        k for k in rows if k.endswith("router.expert_bias")
    } | {k + "_ema" for k in rows if k.endswith("router.expert_bias")}
    assert f"{count} output tensors from {num_shards} source shard(s)" in stdout
    assert "diffusion_pytorch_model-00001-of-" in stdout  # the output shard layout (5 GB default)
    assert not out.exists()


def test_config_that_disagrees_with_the_weights_prints_the_hint_and_a_summary(tmp_path):
    """The tiny weights checked against the released config (no --config): the hint and a short summary by
    default, every disagreement with --verbose; nothing written either way."""
    out = tmp_path / "out"
    args = ["--preview_dir", checkpoint_dir("preview_h4"), "--output_path", out, "--components", "transformer"]
    rc, _, err = run_cli(args)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) <= 12, err
    assert "checked against config" in lines[0] and "(released)" in lines[0]
    assert "pass it with --config" in lines[1]  # hint: magi2_preview.json sits beside the weights
    total = int(lines[0].split("] ", 1)[1].split(" problem(s)")[0])
    counts = [int(n) for n in re.findall(r"(\d+) (?:unexpected keys|missing keys|shape mismatches)", lines[2])]
    assert "by kind:" in lines[2] and sum(counts) == total > 1000
    assert f"and {total - 5} more" in lines[-1] and "--verbose" in lines[-1]
    rc, _, err = run_cli([*args, "--verbose"])
    assert rc != 0 and len(err.strip().splitlines()) == total + 2  # heading, hint, then one line per problem
    assert "pre_adapter.video_embedder.weight: shape [512, 12]" in err
    assert "block.layers.39.mhc_norm.weight: missing key" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_non_released_weights_without_config_or_local_json_hint_at_config(tmp_path):
    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    (ckpt / "magi2_preview.json").unlink()
    rc, _, err = run_cli(["--preview_dir", ckpt, "--output_path", tmp_path / "out", "--components", "transformer"])
    assert rc != 0 and "hint: no --config was given, so the released config was used" in err


def test_refiner_round_trip(tmp_path):
    from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel

    out = tmp_path / "repo"
    rc, _, err = run_cli(
        [
            "--refiner_dir",
            checkpoint_dir("refiner"),
            "--config",
            config_path("refiner"),
            "--output_path",
            out,
            "--components",
            "refiner",
            "--max_shard_size",
            "500KB",
        ]
    )
    assert rc == 0, err
    assert len(list((out / "refiner").glob("*.safetensors"))) >= 2
    model = Magi2RefinerTransformer3DModel.from_pretrained(out, subfolder="refiner")
    case = load_case("refiner")
    with torch.no_grad():
        got = model.forward_packed(
            case["model.x"],
            case["model.coords_mapping"],
            case["model.modality_mapping"],
            q_ranges=case["model.local_attn.q_ranges"],
            k_ranges=case["model.local_attn.k_ranges"],
        )
    assert (got - case["model.out"]).abs().max().item() <= ATOL
