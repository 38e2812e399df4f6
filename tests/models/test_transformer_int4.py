"""int4 routed experts at the model level: the config keys, the released size on meta, dtype moves, layerwise
casting and offload hooks, loading (quantize-at-load, an int4 repo, the save/load round trip) and bad int4 repos."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.file_mappings import file_mapped
from helpers.int4_models import BANKS, int4_transformer
from helpers.tiny_transformer import TINY, tiny_inputs, tiny_model
from safetensors.torch import load_file, save_file

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES
from diffusers_magi2.utils.safetensors_io import read_safetensors_header


INT4_TENSORS = BANKS + INT4_SCALE_NAMES


def _int4_state(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in model.state_dict().items() if n.rsplit(".", 1)[-1] in INT4_TENSORS}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


@pytest.fixture
def int4_model():
    """TINY (MoE heads of width 32, experts 32 wide) in bf16 with int4 experts at group 16."""
    return int4_transformer(tiny_model().to(torch.bfloat16), 16)


def test_int4_config_keys_are_recorded_and_threaded_into_every_moe_layer(int4_model):
    config = int4_model.config
    assert (config.expert_dtype, config.expert_int4_group_size, config.expert_int4_packing) == (
        "int4",
        16,
        "nf4_pairs_along_n",
    )
    moes = [m for m in int4_model.modules() if isinstance(m, Magi2MultiHeadMoE)]
    assert moes and all(m.int4_experts and m.int4_group_size == 16 for m in moes)
    assert all(int4_model.get_parameter(f"transformer_blocks.1.mlp.moe_mlp.{b}").dtype == torch.uint8 for b in BANKS)
    with pytest.raises(ValueError, match=r"expert_int4_packing must be 'nf4_pairs_along_n'"):
        Magi2Transformer3DModel(**TINY, expert_dtype="int4", expert_int4_group_size=16, expert_int4_packing="nf4_k")
    with pytest.raises(ValueError, match=r"W_gate/W_up \[R, K=32, N=32\]: the int4 group size expert_int4_group_size"):
        Magi2Transformer3DModel(**TINY, expert_dtype="int4")  # the default 128 does not divide the tiny Dh = 32


def test_released_size_with_int4_experts_builds_on_meta_within_70_gb():
    with torch.device("meta"):
        model = Magi2Transformer3DModel(params_dtype=torch.bfloat16, expert_dtype="int4")
    parts = {"int4 codes": 0, "bf16 group scales": 0, "bf16": 0, "fp32": 0}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.is_meta, name
        if t.dtype == torch.uint8:
            kind = "int4 codes"
        elif name.rsplit(".", 1)[-1] in INT4_SCALE_NAMES:
            kind = "bf16 group scales"
        else:
            kind = "bf16" if t.dtype == torch.bfloat16 else "fp32"
        parts[kind] += t.numel() * t.element_size()
    total = sum(parts.values())
    experts = parts["int4 codes"] + parts["bf16 group scales"]
    bf16_experts = 36 * 3 * 12 * 256 * 256 * 1280 * 2  # 36 MoE layers, 3 banks, H*E rows of Dh*De
    print(
        "\nreleased transformer, int4 experts (NF4 g128), on meta: "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items())
        + f"; total {total / 1e9:.2f} GB ({total / 2**30:.2f} GiB); experts {experts / bf16_experts:.4f} of bf16"
    )
    assert parts["int4 codes"] == bf16_experts // 4
    assert experts / bf16_experts <= 0.30
    assert total <= 70e9


def test_dtype_moves_leave_an_int4_model_bit_identical(int4_model):
    inputs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in tiny_inputs().items()}
    before = _int4_state(int4_model)
    with torch.no_grad():
        reference = int4_model(**inputs).sample
        assert int4_model.to(torch.bfloat16) is int4_model
        assert torch.equal(int4_model(**inputs).sample, reference)
        int4_model.to(torch.float32)  # the codes and their bf16 scales stay as they are (they are no fp32 islands)
        assert _same(_int4_state(int4_model), before)
        assert not any(int4_model.is_fp32_island(n) for n in before)
        int4_model.half()
        assert _same(_int4_state(int4_model), before)
        int4_model.to(torch.bfloat16)
        assert torch.equal(int4_model(**inputs).sample, reference)


def test_layerwise_casting_and_group_offload_leave_int4_experts_untouched(int4_model):
    inputs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in tiny_inputs().items()}
    before = _int4_state(int4_model)
    int4_model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert _same(_int4_state(int4_model), before)
    assert any(t.dtype == torch.float8_e4m3fn for t in int4_model.state_dict().values())  # dense weights in FP8
    with torch.no_grad():
        reference = int4_model(**inputs).sample
    int4_model.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    with torch.no_grad():
        out = int4_model(**inputs).sample
    assert _same(_int4_state(int4_model), before)
    assert torch.isfinite(reference).all() and torch.equal(out, reference)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """``{"bf16": sharded bf16 repo of tiny_model, "int4": sharded int4 repo saved after quantize-at-load (group 16),
    "int4_single": the same in one file}``."""
    root = tmp_path_factory.mktemp("int4_repos")
    tiny_model().to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size="100KB")
    at_load = Magi2Transformer3DModel.from_pretrained(
        root / "bf16", expert_dtype="int4", expert_int4_group_size=16, dtype=torch.bfloat16
    )
    at_load.save_pretrained(root / "int4", max_shard_size="100KB")  # a bank and its scales may sit in two shards
    at_load.save_pretrained(root / "int4_single")
    return {name: root / name for name in ("bf16", "int4", "int4_single")}


def test_quantize_at_load_equals_quantize_int4_and_an_int4_repo_reloads_bit_for_bit(repos):
    """Quantize-at-load (shard by shard) equals ``quantize_int4`` of the bf16 weights in memory; the saved int4 repo
    (sharded or one file) loads as int4 with no argument, bit for bit, in any load dtype."""
    bf16 = Magi2Transformer3DModel.from_pretrained(repos["bf16"], dtype=torch.bfloat16)
    want = int4_transformer(bf16, 16)
    at_load = Magi2Transformer3DModel.from_pretrained(
        repos["bf16"], expert_dtype="int4", expert_int4_group_size=16, dtype=torch.bfloat16
    )
    assert _same(want.state_dict(), at_load.state_dict())
    for repo, dtype in (("int4", torch.bfloat16), ("int4_single", torch.bfloat16), ("int4", None)):
        loaded = Magi2Transformer3DModel.from_pretrained(repos[repo], dtype=dtype)
        config = loaded.config
        assert (config.expert_dtype, config.expert_int4_group_size, config.expert_int4_packing) == (
            "int4",
            16,
            "nf4_pairs_along_n",
        )
        assert _same(_int4_state(loaded), _int4_state(want)), (repo, dtype)
        moe = loaded.transformer_blocks[1].mlp.moe_mlp
        assert not moe.W_down.requires_grad and moe.W_down_group_scale.dtype == torch.bfloat16
    inputs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in tiny_inputs().items()}
    loaded = Magi2Transformer3DModel.from_pretrained(repos["int4"], dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).sample, want(**inputs).sample)
    # an int4 repo loaded in its stored dtypes is views of its files (file-backed pages, no anonymous copy); a bf16
    # repo quantized at load keeps none of the map whose bank pages it read (its other tensors copied)
    saved = load_file(str(repos["int4_single"] / "diffusion_pytorch_model.safetensors"))
    single = Magi2Transformer3DModel.from_pretrained(repos["int4_single"], dtype=torch.bfloat16).state_dict()
    assert all(file_mapped({k: t for k, t in single.items() if t.dtype == saved[k].dtype}).values())
    index = json.loads((repos["bf16"] / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    bank_shards = {index[k] for k in index if k.split(".")[-1] in BANKS}
    mapped = file_mapped(at_load.state_dict())
    assert not any(mapped[k] for k in mapped if index.get(k) in bank_shards)


def _config_edited(repo, folder, **changes):
    shutil.copytree(repo, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


GROUP_SCALE = "transformer_blocks.1.mlp.moe_mlp.W_up_group_scale"


def test_an_int4_repo_read_at_another_group_size_or_packing_is_refused_naming_the_config_key(repos, tmp_path):
    with pytest.raises(ValueError, match=r"expert_int4_group_size=32: the routed experts of .* were written as int4 "):
        Magi2Transformer3DModel.from_pretrained(repos["int4"], expert_int4_group_size=32)
    with pytest.raises(
        ValueError, match=r"expert_int4_packing='nf4_k': the routed experts of .* were written as int4 "
    ):
        Magi2Transformer3DModel.from_pretrained(repos["int4"], expert_int4_packing="nf4_k")
    edited = _config_edited(repos["int4"], tmp_path / "group32", expert_int4_group_size=32)
    match = r"moe_mlp.W_gate_group_scale \[8, 2, 32\] was written with expert_int4_group_size=16 .* built with expert_int4_group_size=32"
    with pytest.raises(ValueError, match=match):
        Magi2Transformer3DModel.from_pretrained(edited)
    edited = _config_edited(repos["int4"], tmp_path / "packing", expert_int4_packing="nf4_k")
    with pytest.raises(ValueError, match=r"expert_int4_packing must be 'nf4_pairs_along_n' .* got 'nf4_k'"):
        Magi2Transformer3DModel.from_pretrained(edited)
    with pytest.raises(ValueError, match=r"expert_dtype must be one of \(None, 'float8_e4m3fn', 'int4'\); got 'int8'"):
        Magi2Transformer3DModel.from_pretrained(repos["bf16"], expert_dtype="int8")


def test_a_quantized_repo_asked_for_another_expert_dtype_is_refused_naming_the_config_key(repos, tmp_path):
    """An int4 or FP8 repo loads only as stored: another ``expert_dtype`` (or ``None``) is refused from its config.json
    before any tensor is read, and from the headers when the config does not say (a Hub repo's, or an edited one);
    a bf16 repo takes either (quantize-at-load)."""
    fp8 = tmp_path / "fp8"
    Magi2Transformer3DModel.from_pretrained(repos["bf16"], expert_dtype="float8_e4m3fn").save_pretrained(fp8)
    for repo, stored, asked in (
        (repos["int4"], "int4", "float8_e4m3fn"),
        (repos["int4"], "int4", None),
        (fp8, "float8_e4m3fn", "int4"),
        (fp8, "float8_e4m3fn", None),
    ):
        match = (
            rf"expert_dtype={asked!r}: the routed experts of .* are stored as {stored} \(its config.json has "
            rf"expert_dtype='{stored}'\), and a quantized repo loads only as stored; drop the argument"
        )
        with pytest.raises(ValueError, match=match):
            Magi2Transformer3DModel.from_pretrained(repo, expert_dtype=asked)
    assert Magi2Transformer3DModel.from_pretrained(fp8, expert_dtype=torch.float8_e4m3fn).config.expert_dtype == (
        "float8_e4m3fn"
    )
    edited = _config_edited(repos["int4_single"], tmp_path / "int4_says_fp8", expert_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match=r"W_gate is stored as int4 codes .* but the model's routed experts are FP8"):
        Magi2Transformer3DModel.from_pretrained(edited)
    edited = _config_edited(fp8, tmp_path / "fp8_says_int4", expert_dtype="int4", expert_int4_group_size=16)
    with pytest.raises(ValueError, match=r"W_gate is stored in FP8 .* but the model's routed experts are int4"):
        Magi2Transformer3DModel.from_pretrained(edited)
    edited = _config_edited(repos["int4_single"], tmp_path / "int4_says_bf16", expert_dtype=None)
    with pytest.raises(ValueError, match=r"W_gate is stored as int4 codes .* load it with expert_dtype='int4'"):
        Magi2Transformer3DModel.from_pretrained(edited)


def _truncate_inside(folder, name: str) -> None:
    """Cut the one shard of ``folder`` in the middle of tensor ``name``'s bytes."""
    path = folder / "diffusion_pytorch_model.safetensors"
    header = read_safetensors_header(path)
    begin, end = header.tensors[name].data_offsets
    with open(path, "r+b") as fh:
        fh.truncate(header.data_start + (begin + end) // 2)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s: s.pop(GROUP_SCALE), rf"W_up holds int4 codes but the checkpoint has no {GROUP_SCALE}"),
        (
            lambda s: s.update({GROUP_SCALE: s[GROUP_SCALE][:, :, :-1].contiguous()}),
            rf"{GROUP_SCALE}: checkpoint has bfloat16\[8, 2, 31\], expected bfloat16\[8, 2, 32\]",
        ),
        (
            lambda s: s.update({GROUP_SCALE: s[GROUP_SCALE][:-4].contiguous()}),
            rf"{GROUP_SCALE}: checkpoint has bfloat16\[4, 2, 32\]",
        ),
        (
            lambda s: s.update({GROUP_SCALE: s[GROUP_SCALE].float()}),
            rf"{GROUP_SCALE}: checkpoint has float32\[8, 2, 32\]",
        ),
        (None, rf"is not a complete safetensors file .*the data of .*{GROUP_SCALE}.* is cut off"),
    ],
    ids=["missing", "narrow", "short", "fp32", "truncated_file"],
)
def test_a_missing_misshaped_or_truncated_group_scale_is_refused_naming_it(repos, tmp_path, mutate, match):
    bad = tmp_path / "bad"
    shutil.copytree(repos["int4_single"], bad)
    path = bad / "diffusion_pytorch_model.safetensors"
    if mutate is None:
        _truncate_inside(bad, GROUP_SCALE)
    else:
        state = load_file(path)
        mutate(state)
        save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        Magi2Transformer3DModel.from_pretrained(bad)
