"""What a model's ``load_lora_adapter`` does with the files users bring: ComfyUI's ``diffusion_model.`` keys, a
DoRA adapter the model saved itself, and bad input (a missing or truncated file, NaN/inf factors, an adapter config
with fields PEFT does not know, options MAGI-2 does not support), each refused with a ``ValueError`` that names
the file, key or field, before any weight changes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.lora_testing_utils import (
    assert_untouched,
    clone_state,
    has_tuner_layers,
    merged_by_hand,
    mirai_state_dict,
    random_factors,
    rel_l2,
    tiny_sandai_model,
)
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _model(fixtures_dir):
    return copy.deepcopy(tiny_sandai_model(str(fixtures_dir), "preview_h4"))


def _forward(model, d):
    g = lambda k: d["model." + k]  # noqa: E731
    with torch.no_grad():
        return model.forward_packed(
            g("x"), g("coords_mapping"), g("modality_mapping"), g("cu_seqlens_q"), g("time_token_sequence")
        )


@pytest.fixture(scope="module")
def case(fixtures_dir):
    return load_file(f"{fixtures_dir}/magi2_tiny/preview_h4/fp32/transformer_case.safetensors")


def test_comfyui_diffusion_model_keys_load_with_their_kohya_alpha(fixtures_dir, tmp_path, case):
    """``diffusion_model.<SandAI path>.lora_down/lora_up.weight`` with ``.alpha = 2`` at rank 4 act as
    ``0.5 * B @ A`` merged by hand (the alpha folded into the factors; PEFT's scaling is 1)."""
    base = tiny_sandai_model(str(fixtures_dir), "preview_h4")
    model = _model(fixtures_dir)
    factors = random_factors(model, rank=4, seed=11)
    sd = {}
    for native, a, b in factors.values():
        sd[f"diffusion_model.{native}.lora_down.weight"] = a
        sd[f"diffusion_model.{native}.lora_up.weight"] = b
        sd[f"diffusion_model.{native}.alpha"] = torch.tensor(2.0)
    save_file(sd, str(tmp_path / "comfy.safetensors"))
    model.load_lora_adapter(str(tmp_path / "comfy.safetensors"), prefix=None, adapter_name="comfy")
    assert {m.scaling["comfy"] for m in model.modules() if hasattr(m, "scaling")} == {1.0}
    out = _forward(model, case)
    assert rel_l2(out, _forward(base, case)) > 1e-2
    assert rel_l2(out, _forward(merged_by_hand(base, factors, 0.5), case)) <= 1e-6


def test_dora_adapter_saved_by_the_model_loads_back(fixtures_dir, tmp_path, case):
    """A DoRA adapter on the single-modality projections, saved with ``save_lora_adapter``, reloads into a fresh
    model with its magnitudes and gives the same output bit for bit."""
    model = _model(fixtures_dir)
    grouped = model.modality_grouped_linear_names()
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["linear_qkv", "linear_proj"], use_dora=True)
    config.exclude_modules = grouped
    model.add_adapter(config, "dora")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    out = _forward(model, case)
    model.save_lora_adapter(str(tmp_path), adapter_name="dora")
    with safe_open(str(tmp_path / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert any(k.endswith(".lora_magnitude_vector") for k in f.keys())
    reloaded = _model(fixtures_dir)
    reloaded.load_lora_adapter(str(tmp_path), prefix=None, adapter_name="dora")
    assert reloaded.peft_config["dora"].use_dora
    assert torch.equal(_forward(reloaded, case), out)


def test_missing_lora_file_is_one_value_error_naming_the_path(fixtures_dir, tmp_path, monkeypatch):
    model = _model(fixtures_dir)
    before = clone_state(model)
    monkeypatch.chdir(tmp_path)
    for path in ("my_magi2_lora/adapter.safetensors", str(tmp_path / "nowhere.pt")):
        with pytest.raises(ValueError, match=rf"LoRA file or folder '{path}' does not exist") as error:
            model.load_lora_adapter(path, prefix=None)
        assert "Repo id" not in str(error.value)
    # a name that could be a Hub repo: the Hub's answer comes wrapped, naming what was asked for
    with pytest.raises(ValueError, match=r"'lora_out' is no local file or folder.*pytorch_lora_weights"):
        model.load_lora_adapter("lora_out", prefix=None, local_files_only=True)
    assert_untouched(model, before)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_truncated_lora_file_is_one_value_error_naming_the_path(fixtures_dir, tmp_path, suffix):
    model = _model(fixtures_dir)
    before = clone_state(model)
    sd = mirai_state_dict(random_factors(model, seed=12), "mirai_native")
    path = tmp_path / f"adapter{suffix}"
    torch.save(sd, path) if suffix == ".pt" else save_file(sd, str(path))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"LoRA file '{path}' is truncated or not a"):
        model.load_lora_adapter(str(path), prefix=None)
    assert_untouched(model, before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_lora_factors_are_refused_at_load_naming_the_key(fixtures_dir, bad):
    """A NaN or inf in the last target (after the last router, where nothing downstream would notice) is refused
    with the key named, and nothing is applied."""
    model = _model(fixtures_dir)
    before = clone_state(model)
    sd = mirai_state_dict(random_factors(model, seed=13), "mirai_native")
    last = max((k for k in sd if k.endswith(".lora_b")), key=lambda k: int(k.split(".")[2]))
    sd[last][3, 1] = bad
    layer = last.split(".")[2]
    with pytest.raises(ValueError, match=rf"NaN or inf values .*'transformer_blocks\.{layer}\..*\.lora_B\.weight'"):
        model.load_lora_adapter(sd, prefix=None)
    assert_untouched(model, before)


def test_adapter_config_with_unknown_fields_is_refused(fixtures_dir, tmp_path):
    """A saved adapter whose config has a field this PEFT's ``LoraConfig`` lacks raises, naming the field (diffusers
    raises on it too), and loads nothing."""
    source = _model(fixtures_dir)
    source.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["linear_proj"]), "a")
    source.save_lora_adapter(str(tmp_path), adapter_name="a")
    file = str(tmp_path / "pytorch_lora_weights.safetensors")
    with safe_open(file, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    config = json.loads(metadata["lora_adapter_metadata"])
    save_file(tensors, file, metadata={**metadata, "lora_adapter_metadata": json.dumps({**config, "lora_zeta": 1})})
    model = _model(fixtures_dir)
    before = clone_state(model)
    with pytest.raises(ValueError, match=r"fields that peft .* LoraConfig does not know: \['lora_zeta'\]"):
        model.load_lora_adapter(str(tmp_path), prefix=None)
    assert_untouched(model, before)


def test_options_magi2_lora_does_not_support_raise_saying_what_is(fixtures_dir):
    model = _model(fixtures_dir)
    before = clone_state(model)
    sd = mirai_state_dict(random_factors(model, seed=14, router=False), "mirai_native")
    for kwargs, error, match in (
        ({"low_cpu_mem_usage": True}, ValueError, r"low_cpu_mem_usage=True is not supported.*low_cpu_mem_usage=False"),
        ({"hotswap": True}, ValueError, r"hotswap=True is not supported.*another adapter_name"),
        ({"network_alphas": {"x": 1.0}}, ValueError, r"network_alphas is not supported.*<module>\.alpha"),
        ({"lora_scale": 0.5}, TypeError, r"unexpected LoRA load option\(s\) \['lora_scale'\]; supported: prefix"),
    ):
        with pytest.raises(error, match=match):
            model.load_lora_adapter(sd, prefix=None, **kwargs)
    with pytest.raises(ValueError, match="hotswapping is not supported"):
        model.enable_lora_hotswap(target_rank=8)
    assert_untouched(model, before)
    model.load_lora_adapter(sd, prefix=None, low_cpu_mem_usage=False, adapter_name="ok")  # the default is fine
    assert has_tuner_layers(model)
