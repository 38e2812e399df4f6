"""The router inside ``torch.autocast``: routing stays fp32, so expert selection equals the fp32 router's."""

from __future__ import annotations

import pytest
import torch
from helpers.fixtures import golden_path
from helpers.moe_cases import build_module, load_case, rel_l2
from safetensors.torch import load_file

from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel


BF16_END_TO_END_REL_L2 = 0.15  # fixtures README: loose end-to-end bound for a bf16 run against fp32/


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_routing_under_cpu_autocast_equals_fp32_router(params_dtype, autocast_dtype) -> None:
    case = load_case("preview_h4", "fp32", 1)
    module = build_module("preview_h4", 1, params_dtype)
    x = case["core.x"].view(-1, module.num_heads, module.head_dim)
    with torch.no_grad():
        probs, indices = module.route(x)
        logits = module.compute_router_logits(x)
        with torch.autocast("cpu", dtype=autocast_dtype):
            ac_logits = module.compute_router_logits(x)
            ac_probs, ac_indices = module.route(x)
            module(case["core.x"])  # the whole MoE core runs inside autocast
    assert ac_logits.dtype == torch.float32 and torch.equal(ac_logits, logits)
    assert ac_probs.dtype == torch.float32
    assert torch.equal(ac_indices, indices) and torch.equal(ac_probs, probs)
    assert torch.equal(indices, case["core.topk_indices"])  # and the fp32 router is the reference's


def test_tiny_model_forward_under_cpu_bf16_autocast() -> None:
    root = golden_path("magi2_tiny/preview_h4")
    model = Magi2Transformer3DModel.from_original_checkpoint(str(root / "sandai_checkpoint"), dtype=torch.float32)
    case = load_file(str(root / "fp32" / "transformer_case.safetensors"))
    names = ("x", "coords_mapping", "modality_mapping", "cu_seqlens_q", "time_token_sequence")
    args = [case["model." + name] for name in names]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.forward_packed(*args)
    ref = case["model.out"]
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = rel_l2(out, ref)
    print(f"bf16 autocast forward vs fp32 fixture: rel-L2 {err:.3e}")
    assert err <= BF16_END_TO_END_REL_L2, err
