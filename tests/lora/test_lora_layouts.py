"""LoRA files in seruva19/mirai's three layouts (native ``adapter.pt``, Kohya, its "diffusers" export) and
ComfyUI's, built here from the key formats, load into the tiny SandAI preview and refiner and act exactly like the
same deltas merged by hand: on every ``linear_qkv``/``linear_proj`` (grouped in the multimodal layers) and every
router gate."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers.lora_testing_utils import (
    assert_untouched,
    clone_state,
    fused_deltas,
    has_tuner_layers,
    merged_by_hand,
    mirai_state_dict,
    random_factors,
    rel_l2,
    state_within_fp32_rounding,
    tiny_sandai_model,
    write_mirai_file,
)
from safetensors.torch import load_file

from diffusers_magi2 import Magi2RefinerTransformer3DModel  # noqa: E402
from diffusers_magi2.loaders.lora_conversion_magi2 import detect_lora_layout  # noqa: E402


LAYOUTS = ["mirai_native", "mirai_kohya", "mirai_diffusers"]
_base = tiny_sandai_model


@functools.lru_cache(maxsize=None)
def _case(fixtures_root: str, case: str) -> dict:
    return load_file(f"{fixtures_root}/magi2_tiny/{case}/fp32/transformer_case.safetensors")


def _forward(model, d, scale=None):
    kwargs = {} if scale is None else {"attention_kwargs": {"scale": scale}}
    with torch.no_grad():
        if isinstance(model, Magi2RefinerTransformer3DModel):
            g = lambda k: d["noaudio.model." + k]  # noqa: E731
            return model.forward_packed(
                g("x"),
                g("coords_mapping"),
                g("modality_mapping"),
                q_ranges=g("local_attn.q_ranges"),
                k_ranges=g("local_attn.k_ranges"),
                **kwargs,
            )
        g = lambda k: d["model." + k]  # noqa: E731
        return model.forward_packed(
            g("x"), g("coords_mapping"), g("modality_mapping"), g("cu_seqlens_q"), g("time_token_sequence"), **kwargs
        )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["preview_h4", "refiner"])
def test_mirai_layout_equals_its_deltas_merged_by_hand(fixtures_dir, tmp_path, case, layout):
    base = _base(str(fixtures_dir), case)
    d = _case(str(fixtures_dir), case)
    model = copy.deepcopy(base)
    before = clone_state(model)
    factors = random_factors(model, rank=3, seed=1)
    kinds = {"grouped": 0, "linear": 0, "router": 0}
    for name in factors:
        layer = int(name.split(".")[1])
        kinds[
            "router" if name.endswith("gate") else "grouped" if layer in model.config.multimodal_layers else "linear"
        ] += 1
    assert kinds["grouped"] and kinds["linear"] and (kinds["router"] > 0) == (case != "refiner")

    path = write_mirai_file(factors, layout, tmp_path)
    assert detect_lora_layout(mirai_state_dict(factors, layout)) == layout
    model.load_lora_adapter(path, prefix=None, adapter_name="mirai")

    out = _forward(model, d)
    plain = _forward(base, d)
    merged = _forward(merged_by_hand(base, factors), d)
    err = rel_l2(out, merged)
    print(f"\n{case} {layout}: {kinds}; LoRA vs merged by hand rel-L2 {err:.2e}, vs no LoRA {rel_l2(out, plain):.3f}")
    assert rel_l2(out, plain) > 1e-2
    assert err <= 1e-6

    # the LoRA scale of one call: half the delta, and the adapter is unchanged afterwards
    half = _forward(model, d, scale=0.5)
    assert rel_l2(half, _forward(merged_by_hand(base, factors, 0.5), d)) <= 1e-6
    assert torch.equal(_forward(model, d), out)

    # fuse = merged; unfuse restores every weight up to fp32 rounding, and unload leaves no layer behind
    model.fuse_lora()
    assert rel_l2(_forward(model, d), merged) <= 1e-6
    model.unfuse_lora()
    assert rel_l2(_forward(model, d), out) <= 1e-6
    model.unload_lora()
    assert not has_tuner_layers(model)
    assert state_within_fp32_rounding(model, before, fused_deltas(factors))


def _loaded_deltas(model, adapter: str) -> dict:
    """``{module path: scaling * B @ A}`` (fp64) of a loaded adapter, read from its PEFT layers."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and adapter in m.lora_A:
            a, b = m.lora_A[adapter].weight.double(), m.lora_B[adapter].weight.double()
            out[name] = m.scaling[adapter] * (b @ a)
    return out


def test_kohya_alpha_reading_is_opt_in_and_folded_into_the_factors(fixtures_dir, tmp_path):
    """mirai writes alpha 1.0 but trains at scale 1.0: the default scale is 1.0, ``mirai_scale=None`` reads
    ``alpha / rank``, and any other ``mirai_scale`` is used as given; the scale is in the factors (PEFT's
    scaling is 1), so the delta is ``scale * B @ A`` of the file's factors."""
    factors = random_factors(_base(str(fixtures_dir), "preview_h4"), rank=4, seed=2)
    path = write_mirai_file(factors, "mirai_kohya", tmp_path)
    expected_deltas = {
        name.removesuffix(".weight").removesuffix(".gate"): delta for name, delta in fused_deltas(factors).items()
    }
    for mirai_scale, expected in ((1.0, 1.0), (None, 1.0 / 4), (0.75, 0.75)):
        model = copy.deepcopy(_base(str(fixtures_dir), "preview_h4"))
        kwargs = {} if mirai_scale == 1.0 else {"mirai_scale": mirai_scale}
        model.load_lora_adapter(path, prefix=None, adapter_name="k", **kwargs)
        assert {m.scaling["k"] for m in model.modules() if hasattr(m, "scaling") and "k" in m.scaling} == {1.0}
        assert model.peft_config["k"].lora_alpha == model.peft_config["k"].r == 4
        deltas = _loaded_deltas(model, "k")
        assert sorted(deltas) == sorted(expected_deltas)
        assert all(rel_l2(deltas[p], expected * expected_deltas[p]) <= 1e-6 for p in deltas), mirai_scale


# ------------------------------------------------------------------------------------------------ bad input


def test_refiner_lora_into_the_preview_is_refused_before_any_change(fixtures_dir, tmp_path):
    refiner_factors = random_factors(_base(str(fixtures_dir), "refiner"), seed=3)
    path = write_mirai_file(refiner_factors, "mirai_native", tmp_path)
    model = copy.deepcopy(_base(str(fixtures_dir), "preview_h4"))
    before = clone_state(model)
    with pytest.raises(ValueError, match=r"does not fit Magi2Transformer3DModel.*B @ A would be"):
        model.load_lora_adapter(path, prefix=None)
    assert_untouched(model, before)


def test_rank_mismatch_is_refused_before_any_change(fixtures_dir):
    model = copy.deepcopy(_base(str(fixtures_dir), "preview_h4"))
    before = clone_state(model)
    factors = random_factors(model, rank=3, seed=4)
    sd = mirai_state_dict(factors, "mirai_diffusers")
    key = "unet.block.layers.1.attention.linear_qkv.lora_B.weight"
    sd[key] = sd[key][:, :2].contiguous()
    with pytest.raises(
        ValueError, match=r"transformer_blocks\.1\.attention\.linear_qkv: rank mismatch, lora_A has rank 3"
    ):
        model.load_lora_adapter(sd, prefix=None)
    assert_untouched(model, before)


class _NotATensor:
    pass


def test_pickle_with_objects_other_than_tensors_is_refused(fixtures_dir, tmp_path):
    model = copy.deepcopy(_base(str(fixtures_dir), "preview_h4"))
    before = clone_state(model)
    sd = mirai_state_dict(random_factors(model, seed=5), "mirai_native")
    torch.save({**sd, "extra": _NotATensor()}, tmp_path / "object.pt")
    with pytest.raises(ValueError, match="holds objects other than tensors"):
        model.load_lora_adapter(str(tmp_path / "object.pt"), prefix=None)
    torch.save({**sd, "step": 1200}, tmp_path / "int.pt")  # weights_only reads it; still not a tensor
    with pytest.raises(ValueError, match=r"values other than tensors \(int\) under \['step'\]"):
        model.load_lora_adapter(str(tmp_path / "int.pt"), prefix=None)
    assert_untouched(model, before)


def test_unknown_keys_name_the_layout_and_the_first_keys(fixtures_dir):
    model = copy.deepcopy(_base(str(fixtures_dir), "preview_h4"))
    before = clone_state(model)
    sd = mirai_state_dict(random_factors(model, seed=6), "mirai_native")
    bogus = "block.layers.2.attention.linear_qkv.parametrizations.weight.0.lora_magnitude"
    with pytest.raises(ValueError, match=r"mirai_native layout.*" + bogus.replace(".", r"\.")):
        model.load_lora_adapter({**sd, bogus: torch.zeros(3)}, prefix=None)
    stray = "block.layers.2.attention.linear_kv.parametrizations.weight.0"  # fits the layout, no such module
    with pytest.raises(ValueError, match=r"mirai_native layout.*match no LoRA-able projection.*linear_kv"):
        model.load_lora_adapter(
            {**sd, stray + ".lora_a": torch.zeros(3, 128), stray + ".lora_b": torch.zeros(4, 3)}, prefix=None
        )
    with pytest.raises(ValueError, match=r"unknown LoRA layout.*\['my_lora\.down'\]"):
        model.load_lora_adapter({"my_lora.down": torch.zeros(2, 2)}, prefix=None)
    assert_untouched(model, before)
