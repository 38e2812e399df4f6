"""int4 routed experts at the model level: the config keys, the released size on meta, dtype moves, layerwise
casting and offload hooks, and loading (refused until the int4 loader exists)."""

from __future__ import annotations

import pytest
import torch
from helpers.int4_models import BANKS, int4_transformer
from helpers.tiny_transformer import TINY, tiny_inputs, tiny_model

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.conversion.convert_transformer import prepare_transformer_conversion
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES


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


def test_loading_and_converting_into_int4_experts_are_refused_until_they_exist(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="expert_dtype='int4': loading 4-bit routed experts from a checkpoint"):
        Magi2Transformer3DModel.from_pretrained(tmp_path, expert_dtype="int4", expert_int4_group_size=16)
    with pytest.raises(ValueError, match="expert_dtype='int4': converting to 4-bit routed experts is not supported"):
        prepare_transformer_conversion("transformer", tmp_path / "nothing-read", expert_dtype="int4")
