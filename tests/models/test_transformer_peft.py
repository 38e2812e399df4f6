"""Both transformers' dense projections as diffusers and PEFT see them: ``nn.Linear`` modules under unchanged
state-dict names, FP8 storage through ``enable_layerwise_casting``, LoRA through ``PeftAdapterMixin``."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from diffusers.loaders.peft import PeftAdapterMixin
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel
from diffusers_magi2.models.modality import Magi2Linear, Magi2ModalityGroupedLinear
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE


CASES = ["preview_h4", "preview_h3", "refiner"]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@functools.lru_cache(maxsize=None)
def _base(fixtures_root: str, case: str, dtype: torch.dtype):
    path = f"{fixtures_root}/magi2_tiny/{case}/sandai_checkpoint"
    if case == "refiner":
        return Magi2RefinerTransformer3DModel.from_original_checkpoint(path, torch_dtype=dtype)
    return Magi2Transformer3DModel.from_original_checkpoint(path, dtype=dtype)


def _model(fixtures_dir, case, dtype):
    return copy.deepcopy(_base(str(fixtures_dir), case, dtype))


@functools.lru_cache(maxsize=None)
def _fp32_case(fixtures_root: str, case: str) -> dict:
    return load_file(f"{fixtures_root}/magi2_tiny/{case}/fp32/transformer_case.safetensors")


def _forward(model, d, prefix=""):
    """``model.out`` of the fixture case ``prefix`` (the reference's packed entry)."""
    g = lambda k: d[prefix + "model." + k]  # noqa: E731
    with torch.no_grad():
        if isinstance(model, Magi2RefinerTransformer3DModel):
            return model.forward_packed(
                g("x"),
                g("coords_mapping"),
                g("modality_mapping"),
                q_ranges=g("local_attn.q_ranges"),
                k_ranges=g("local_attn.k_ranges"),
            )
        return model.forward_packed(
            g("x"), g("coords_mapping"), g("modality_mapping"), g("cu_seqlens_q"), g("time_token_sequence")
        )


def _dense(model):
    """``{name: module}`` of every dense projection inside ``transformer_blocks`` (PEFT wrappers looked through)."""
    out = {}
    for name, module in model.transformer_blocks.named_modules():
        if isinstance(module, (torch.nn.Linear, Magi2ModalityGroupedLinear)) and not isinstance(
            module, BaseTunerLayer
        ):
            if ".lora_" in name:
                continue
            out["transformer_blocks." + name.removesuffix(".base_layer")] = module
    return out


# ------------------------------------------------------------------------------------------------ structure


@pytest.mark.parametrize("case", CASES)
def test_single_modality_projections_are_nn_linear_and_multimodal_ones_grouped(fixtures_dir, case):
    model = _base(str(fixtures_dir), case, torch.float32)
    assert isinstance(model, PeftAdapterMixin)
    mm = set(model.config.multimodal_layers)
    dense = _dense(model)
    assert len(dense) > 0
    for name, module in dense.items():
        layer = int(name.split(".")[1])
        moe_grouped = "modality_specific_shared_expert" in name  # 3 blocks in every MoE layer
        grouped = layer in mm or moe_grouped
        assert isinstance(module, Magi2ModalityGroupedLinear if grouped else Magi2Linear), name
        assert isinstance(module, torch.nn.Linear) != grouped, name
    # the checkpoint's names did not change: the converted keys load strictly (from_original_checkpoint) and the
    # state dict holds exactly the ``weight`` (and ``bias``) of every projection under its module name
    keys = set(model.state_dict())
    for name, module in dense.items():
        assert f"{name}.weight" in keys
        assert (f"{name}.bias" in keys) == (module.bias is not None)


def test_single_modality_linear_checks_its_input_width():
    with pytest.raises(ValueError, match="input width 8"):
        Magi2Linear(8, 4)(torch.zeros(2, 5))


# ------------------------------------------------------------------------------------------------ layerwise casting


@pytest.mark.parametrize("case", CASES)
def test_layerwise_casting_stores_dense_projections_in_fp8_and_runs_in_the_compute_dtype(fixtures_dir, case):
    model = _model(fixtures_dir, case, torch.bfloat16)
    islands = {
        n: t.clone() for n, t in model.state_dict().items() if t.is_floating_point() and model.is_fp32_island(n)
    }
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)

    dense = _dense(model)
    in_fp8 = [n for n, m in dense.items() if m.weight.dtype == torch.float8_e4m3fn]
    share = len(in_fp8) / len(dense)
    fp8_bytes = sum(dense[n].weight.numel() for n in in_fp8) / sum(m.weight.numel() for m in dense.values())
    print(f"\n{case}: {len(in_fp8)}/{len(dense)} dense projections stored in FP8 ({fp8_bytes:.1%} of their elements)")
    assert share >= 0.9
    state = model.state_dict()
    assert islands and all(state[n].dtype == torch.float32 and torch.equal(state[n], t) for n, t in islands.items())
    experts = [m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]
    assert all(m.W_gate.dtype == torch.bfloat16 for m in experts)  # the routed experts are not a layer it casts

    # activations run in the compute dtype (the stored weights are FP8 outside each call)
    assert model.transformer_blocks[0].attention.compute_dtype == torch.bfloat16
    seen = []
    hooks = [
        b.attention.register_forward_hook(lambda m, a, out: seen.append(out.dtype)) for b in model.transformer_blocks
    ]
    d = _fp32_case(str(fixtures_dir), case)
    try:
        for prefix in [p for p in ("", "i2v.", "noaudio.") if p + "model.x" in d]:
            out = _forward(model, d, prefix)
            err = rel_l2(out, d[prefix + "model.out"])
            print(
                f"{case} {prefix or 't2v.'}model.out rel-L2 vs fp32 fixture, FP8-stored dense projections: {err:.4f}"
            )
            assert torch.isfinite(out).all()
            assert err <= 0.5
    finally:
        for h in hooks:
            h.remove()
    assert seen and set(seen) == {torch.bfloat16}
    # and the weights are back in storage after the forward
    assert all(dense[n].weight.dtype == torch.float8_e4m3fn for n in in_fp8)


def test_layerwise_casting_matches_island_names_as_components(fixtures_dir):
    # "gate" (the router weight) is an island; ``up_gate_proj`` is not and is cast
    model = _model(fixtures_dir, "preview_h4", torch.bfloat16)
    assert "gate" in model._keep_in_fp32_modules
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert model.transformer_blocks[0].mlp.up_gate_proj.weight.dtype == torch.float8_e4m3fn
    assert model.transformer_blocks[1].mlp.moe_mlp.gate.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ LoRA

SINGLE_TARGETS = [
    "linear_g",
    "linear_qkv",
    "linear_proj",
    "up_gate_proj",
    "down_proj",
    "split_linear",
    "merge_linear",
    "shared_expert_fc1",
    "shared_expert_fc2",
]


def _lora_config(model, rank=4, alpha=8):
    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=SINGLE_TARGETS, exclude_modules=model.modality_grouped_linear_names()
    )


def _fill_lora(model, seed=0):
    """Non-zero random LoRA factors (PEFT initialises ``lora_B`` to zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _merged_by_hand(base, lora_model, scaling):
    """A copy of ``base`` whose wrapped weights carry ``scaling * B @ A`` (independent of PEFT's merge)."""
    merged = copy.deepcopy(base)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for name, module in lora_model.named_modules():
            if isinstance(module, BaseTunerLayer):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                modules[name].weight += scaling * (b.double() @ a.double()).float()
    return merged


@pytest.mark.parametrize("case", ["preview_h4", "refiner"])
def test_lora_adapter_equals_its_weights_merged_and_survives_save_and_load(fixtures_dir, tmp_path, case):
    base = _model(fixtures_dir, case, torch.float32)
    model = copy.deepcopy(base)
    config = _lora_config(model)
    model.add_adapter(config)
    _fill_lora(model)

    # every nn.Linear inside transformer_blocks took an adapter
    linears = [n for n, m in base.transformer_blocks.named_modules() if isinstance(m, torch.nn.Linear)]
    wrapped = [n for n, m in model.transformer_blocks.named_modules() if isinstance(m, BaseTunerLayer)]
    assert linears and sorted(wrapped) == sorted(linears)

    d = _fp32_case(str(fixtures_dir), case)
    prefix = "noaudio." if case == "refiner" else ""
    out = _forward(model, d, prefix)
    plain = _forward(base, d, prefix)
    assert rel_l2(out, plain) > 1e-3  # the adapter changes the output
    merged = _forward(_merged_by_hand(base, model, config.lora_alpha / config.r), d, prefix)
    err = rel_l2(out, merged)
    print(f"\n{case}: LoRA vs merged rel-L2 {err:.2e}, max abs {(out - merged).abs().max().item():.2e}")
    assert err <= 1e-5

    model.save_lora_adapter(str(tmp_path))
    reloaded = copy.deepcopy(base)
    reloaded.load_lora_adapter(str(tmp_path), prefix=None, use_safetensors=True)
    assert torch.equal(_forward(reloaded, d, prefix), out)

    # diffusers' fuse_lora gives the merged model too
    model.fuse_lora()
    assert rel_l2(_forward(model, d, prefix), merged) <= 1e-5


def test_lora_on_modality_grouped_projections_equals_its_weights_merged(fixtures_dir):
    """The grouped projections take a LoRA too (one ``A`` for the three modalities, ``B`` stacking their row
    blocks): the adapted model equals ``W + s * B @ A`` merged by hand."""
    base = _model(fixtures_dir, "preview_h4", torch.float32)
    model = copy.deepcopy(base)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["linear_qkv"])
    model.add_adapter(config)
    _fill_lora(model, seed=1)
    grouped = model.transformer_blocks[0].attention.linear_qkv
    assert type(grouped).__name__ == "Magi2GroupedLoraLinear"
    assert isinstance(grouped.get_base_layer(), Magi2ModalityGroupedLinear)
    assert grouped.lora_A["default"].weight.shape == (2, 128) and grouped.lora_B["default"].weight.shape == (1152, 2)
    d = _fp32_case(str(fixtures_dir), "preview_h4")
    out = _forward(model, d)
    merged = _forward(_merged_by_hand(base, model, config.lora_alpha / config.r), d)
    assert rel_l2(out, _forward(base, d)) > 1e-3
    assert rel_l2(out, merged) <= 1e-5
