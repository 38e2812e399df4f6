"""FP8 routed experts under expert parallelism (2 gloo ranks): each rank loads its FP8 rows and their scales (from an
FP8 repo, or quantizing a bf16 repo at load) and the output equals the single-process FP8 model."""

from __future__ import annotations

import pytest
import torch
from helpers.ep_spawn_utils import run_on_ranks
from helpers.ep_workers import fp8_worker, packed_forward, sandai_ckpt, transformer_case

from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE


pytestmark = pytest.mark.distributed


EP_FP8_REL_L2 = 1e-6


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_fp8")
    bf16 = Magi2Transformer3DModel.from_original_checkpoint(sandai_ckpt("preview_h4"), dtype=torch.bfloat16)
    bf16.save_pretrained(root / "bf16", max_shard_size="300KB")
    fp8 = Magi2Transformer3DModel.from_pretrained(root / "bf16", expert_dtype="float8_e4m3fn", dtype=torch.bfloat16)
    fp8.save_pretrained(root / "fp8", max_shard_size="300KB")
    return {"bf16": str(root / "bf16"), "fp8": str(root / "fp8")}


def test_ep2_fp8_experts_match_the_single_process_fp8_model(folders):
    single = Magi2Transformer3DModel.from_pretrained(folders["fp8"], torch_dtype=torch.float32)
    ref = packed_forward(single, transformer_case("preview_h4"))
    full = {n: m.state_dict() for n, m in single.named_modules() if isinstance(m, Magi2MultiHeadMoE)}
    per_rank = run_on_ranks(fp8_worker, 2, folders, deadline_s=150)
    for name in ("fp8_repo", "quantize_at_load"):
        for rank, res in enumerate(per_rank):
            out = res[name, "out"]
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            print(
                f"\nEP 2, rank {rank}, {name}: rel-L2 {err:.2e}, max abs {(out - ref).abs().max().item():.2e} against one process"
            )
            assert err <= EP_FP8_REL_L2
            for moe_name, local in res[name, "moe"].items():
                start, heads = res[name, "rows"][moe_name]
                experts = single.get_submodule(moe_name).num_experts
                for key, t in local.items():
                    if key in ("W_gate", "W_up", "W_down", "W_gate_scale", "W_up_scale", "W_down_scale"):
                        expected = full[moe_name][key][start * experts : (start + heads) * experts]
                        assert t.dtype == expected.dtype and torch.equal(_bits(t), _bits(expected)), (moe_name, key)
