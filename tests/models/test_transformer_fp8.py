"""FP8 routed experts at the model level: the ``expert_dtype`` config field, the released size on meta, loading
(a saved FP8 repo as FP8, quantize-at-load from a bf16 repo, bad FP8 repos), dtype moves."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.moe.quantize import FP8_DTYPE, quantize_fp8


FP8 = "float8_e4m3fn"
BANKS = ("W_gate", "W_up", "W_down")
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(_bits(sa[k]), _bits(sb[k])), k


def _moes(model) -> list[tuple[str, Magi2MultiHeadMoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Magi2MultiHeadMoE)]


@functools.lru_cache(maxsize=None)
def _bf16_model(fixtures_root: str) -> Magi2Transformer3DModel:
    path = f"{fixtures_root}/magi2_tiny/preview_h4/sandai_checkpoint"
    return Magi2Transformer3DModel.from_original_checkpoint(path, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def repos(fixtures_dir, tmp_path_factory):
    """``{"bf16": sharded bf16 repo, "bf16_single": one-file bf16 repo, "fp8": sharded FP8 repo saved after quantize-at-load}``."""
    root = tmp_path_factory.mktemp("fp8_repos")
    model = _bf16_model(str(fixtures_dir))
    model.save_pretrained(root / "bf16", max_shard_size="200KB")
    model.save_pretrained(root / "bf16_single")
    quantized = Magi2Transformer3DModel.from_pretrained(root / "bf16", expert_dtype=FP8, dtype=torch.bfloat16)
    quantized.save_pretrained(root / "fp8", max_shard_size="200KB")  # a bank and its scale may sit in two shards
    return {"bf16": root / "bf16", "bf16_single": root / "bf16_single", "fp8": root / "fp8"}


# ------------------------------------------------------------------------------------------------ config


def test_expert_dtype_is_a_config_field_threaded_into_every_moe_layer():
    kwargs = {
        "num_layers": 3,
        "num_attention_heads": 2,
        "attention_head_dim": 32,
        "num_key_value_heads": 2,
        "in_channels": 8,
        "audio_in_channels": 8,
        "text_in_channels": 16,
        "multimodal_layers": (0,),
        "moe_layers": (1, 2),
        "moe_num_heads": 2,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_expert_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "modality_specific_expert_intermediate_size": 32,
    }
    for spelling in (FP8, torch.float8_e4m3fn):
        model = Magi2Transformer3DModel(**kwargs, expert_dtype=spelling)
        assert model.config.expert_dtype == FP8  # JSON-safe, whatever the spelling
        moes = _moes(model)
        assert len(moes) == 2
        for _, moe in moes:
            assert all(moe.get_parameter(b).dtype == FP8_DTYPE for b in BANKS)
            assert all(moe.get_buffer(f"{b}_scale").dtype == torch.float32 for b in BANKS)
    plain = Magi2Transformer3DModel(**kwargs)
    assert plain.config.expert_dtype is None
    assert all(m.W_up.dtype == torch.get_default_dtype() for _, m in _moes(plain))
    for bad in ("fp8", "float8_e5m2", "bfloat16", torch.bfloat16, 8):
        with pytest.raises(ValueError, match=r"expert_dtype must be one of \(None, 'float8_e4m3fn', 'int4'\)"):
            Magi2Transformer3DModel(**kwargs, expert_dtype=bad)


def test_released_size_with_fp8_experts_builds_on_meta_within_125_gb():
    with torch.device("meta"):
        model = Magi2Transformer3DModel(params_dtype=torch.bfloat16, expert_dtype=FP8)
    parts = {"FP8 experts": 0, "fp32 scales": 0, "bf16": 0, "fp32": 0}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.is_meta, name
        if t.dtype == FP8_DTYPE:
            kind = "FP8 experts"
        elif name.endswith("_scale"):
            kind = "fp32 scales"
        else:
            kind = "bf16" if t.dtype == torch.bfloat16 else "fp32"
        parts[kind] += t.numel() * t.element_size()
    total = sum(parts.values())
    print(
        "\nreleased transformer, FP8 experts, on meta: "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items())
        + f"; total {total / 1e9:.2f} GB ({total / 2**30:.2f} GiB)"
    )
    assert parts["FP8 experts"] == 36 * 3 * 12 * 256 * 256 * 1280  # 36 MoE layers, 3 banks, H*E rows of Dh*De
    assert parts["fp32 scales"] == 36 * 12 * 256 * (1280 + 1280 + 256) * 4
    assert total <= 125e9


# ------------------------------------------------------------------------------------------------ loading


def test_quantize_at_load_equals_quantize_fp8_of_the_bf16_weights(fixtures_dir, repos):
    bf16 = _bf16_model(str(fixtures_dir))
    for repo in ("bf16", "bf16_single"):  # sharded, and one file (diffusers hands over a state dict)
        model = Magi2Transformer3DModel.from_pretrained(repos[repo], expert_dtype=FP8, dtype=torch.bfloat16)
        assert model.config.expert_dtype == FP8
        ref = bf16.state_dict()
        for name, t in model.state_dict().items():
            base = name.removesuffix("_scale")
            if name.split(".")[-1] in BANKS or name.endswith("_scale"):
                q, scale = quantize_fp8(ref[base])
                expected = scale if name.endswith("_scale") else q
                assert t.dtype == expected.dtype and torch.equal(_bits(t), _bits(expected)), name
            else:
                assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_saved_fp8_repo_loads_as_fp8_with_plain_from_pretrained(repos, dtype):
    config = json.loads((repos["fp8"] / "config.json").read_text())
    assert config["expert_dtype"] == FP8
    stored = {}
    for shard in sorted(repos["fp8"].glob("*.safetensors")):
        stored.update(load_file(shard))
    model = Magi2Transformer3DModel.from_pretrained(repos["fp8"], dtype=dtype)
    state = model.state_dict()
    assert state.keys() == stored.keys()
    for name, t in state.items():
        kept = stored[name].dtype in (FP8_DTYPE, torch.float32) or not stored[name].is_floating_point()
        # FP8 experts, their scales and the other islands as stored; dense weights in the load dtype (None: fp32)
        assert t.dtype == (stored[name].dtype if kept else dtype or torch.float32), name
        assert torch.equal(_bits(t), _bits(stored[name].to(t.dtype))), name
        if model.is_fp32_island(name) and t.is_floating_point():
            assert t.dtype == torch.float32, name
    moe = model.transformer_blocks[1].mlp.moe_mlp
    assert moe.W_down.dtype == FP8_DTYPE and not moe.W_down.requires_grad and moe.W_down_scale.dtype == torch.float32


def test_dtype_moves_keep_fp8_experts_and_fp32_scales(repos):
    model = Magi2Transformer3DModel.from_pretrained(repos["fp8"], dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for move in (lambda m: m.to(torch.float32), lambda m: m.half(), lambda m: m.to("cpu", torch.bfloat16)):
        move(model)
        for name, t in model.state_dict().items():
            if t.dtype == FP8_DTYPE or before[name].dtype == FP8_DTYPE or model.is_fp32_island(name):
                assert t.dtype == before[name].dtype and torch.equal(_bits(t), _bits(before[name])), name
    assert model.transformer_blocks[1].mlp.moe_mlp.W_gate_scale.dtype == torch.float32
    assert model.transformer_blocks[1].mlp.split_linear.weight.dtype == torch.bfloat16  # the last move's dtype


def _rewrite(repo, mutate) -> None:
    """Apply ``mutate(state)`` to the one shard of a single-file repo."""
    path = repo / WEIGHTS
    state = load_file(path)
    mutate(state)
    save_file(state, path, metadata={"format": "pt"})


SCALE = "transformer_blocks.2.mlp.moe_mlp.W_up_scale"


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s: s.pop(SCALE), rf"W_up is FP8 but the checkpoint has no {SCALE}"),
        (
            lambda s: s.update({SCALE: s[SCALE][:, :-1].contiguous()}),
            rf"{SCALE}: checkpoint has float32\[32, 63\], expected float32\[32, 64\]",
        ),
        (lambda s: s.update({SCALE: s[SCALE][:-4].contiguous()}), rf"{SCALE}: checkpoint has float32\[28, 64\]"),
    ],
    ids=["missing", "narrow", "short"],
)
def test_fp8_repo_with_missing_or_misshaped_scale_is_refused_naming_it(repos, tmp_path, mutate, match):
    model = Magi2Transformer3DModel.from_pretrained(repos["fp8"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bad")  # one file
    _rewrite(tmp_path / "bad", mutate)
    with pytest.raises(ValueError, match=match):
        Magi2Transformer3DModel.from_pretrained(tmp_path / "bad", dtype=torch.bfloat16)


def test_fp8_repo_into_a_model_without_fp8_experts_is_refused(repos, tmp_path):
    with pytest.raises(ValueError, match=r"expert_dtype=None: the routed experts of .* are stored as float8_e4m3fn"):
        Magi2Transformer3DModel.from_pretrained(repos["fp8"], expert_dtype=None, dtype=torch.bfloat16)
    # a config that does not say (a Hub repo is checked from the headers): the stored FP8 banks name the fix
    shutil.copytree(repos["fp8"], tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**config, "expert_dtype": None}))
    with pytest.raises(ValueError, match=r"W_gate is stored in FP8 .* load it with expert_dtype='float8_e4m3fn'"):
        Magi2Transformer3DModel.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_quantize_at_load_refuses_a_non_finite_expert_weight_naming_tensor_expert_and_column(
    fixtures_dir, tmp_path, bad
):
    model = _bf16_model(str(fixtures_dir))
    experts = model.transformer_blocks[2].mlp.moe_mlp.num_experts
    model.save_pretrained(tmp_path / "bad")  # one file
    key = "transformer_blocks.2.mlp.moe_mlp.W_up"

    def poison(state):
        w = state[key].clone()
        w[experts + 3, 5, 7] = bad  # head 1, expert 3, input row 5, output column 7
        state[key] = w

    _rewrite(tmp_path / "bad", poison)
    match = rf"{key} holds a non-finite weight \({bad}\) in expert 3 of head 1 .*input row 5, column 7"
    with pytest.raises(ValueError, match=match):
        Magi2Transformer3DModel.from_pretrained(tmp_path / "bad", dtype=torch.bfloat16, expert_dtype=FP8)
