"""Quantized routed experts under expert parallelism (one group of 2 gloo ranks): each rank loads its FP8 or int4
rows and their scales (from a quantized repo, quantizing a bf16 repo at load, or, for int4, cutting a whole model with
``enable_expert_parallel``), and the output equals the single-process quantized model."""

from __future__ import annotations

import pytest
import torch
from helpers.ep_spawn_utils import run_on_ranks
from helpers.ep_workers import (
    QUANTIZED_LOADS,
    packed_forward,
    quantized_experts_worker,
    sandai_ckpt,
    transformer_case,
)

from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES


pytestmark = pytest.mark.distributed


EP_QUANTIZED_REL_L2 = 1e-6
NON_FINITE_KEY = "transformer_blocks.1.mlp.moe_mlp.W_up"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_quantized")
    bf16 = Magi2Transformer3DModel.from_original_checkpoint(sandai_ckpt("preview_h4"), dtype=torch.bfloat16)
    bf16.save_pretrained(root / "bf16", max_shard_size="300KB")
    for name, kwargs in (
        ("fp8", {"expert_dtype": "float8_e4m3fn"}),
        ("int4", QUANTIZED_LOADS["int4_quantize_at_load"][1]),
    ):
        quantized = Magi2Transformer3DModel.from_pretrained(root / "bf16", dtype=torch.bfloat16, **kwargs)
        quantized.save_pretrained(root / name, max_shard_size="300KB")
    with torch.no_grad():  # a NaN in rank 1's rows only (EP 2: rank 0 holds heads 0-1, rank 1 heads 2-3)
        moe = bf16.get_submodule(NON_FINITE_KEY.rsplit(".", 1)[0])
        moe.W_up[3 * moe.num_experts + 1, 2, 5] = float("nan")
    bf16.save_pretrained(root / "bf16_non_finite", max_shard_size="300KB")
    return {name: str(root / name) for name in ("bf16", "fp8", "int4", "bf16_non_finite")}


@pytest.fixture(scope="module")
def per_rank(folders):
    """One spawned group of 2 gloo ranks for every quantized load (:func:`helpers.ep_workers.quantized_experts_worker`)."""
    return run_on_ranks(quantized_experts_worker, 2, folders, deadline_s=200)


def _check_against_one_process(single, per_rank, names, tensors) -> None:
    """Each rank's output equals the one-process model's, and its MoE tensors ``tensors`` are that model's rows of
    this rank, bit for bit."""
    ref = packed_forward(single, transformer_case("preview_h4"))
    full = {n: m.state_dict() for n, m in single.named_modules() if isinstance(m, Magi2MultiHeadMoE)}
    for name in names:
        for rank, res in enumerate(per_rank):
            out = res[name, "out"]
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            print(
                f"\nEP 2, rank {rank}, {name}: rel-L2 {err:.2e}, max abs {(out - ref).abs().max().item():.2e} against one process"
            )
            assert err <= EP_QUANTIZED_REL_L2
            for moe_name, local in res[name, "moe"].items():
                start, heads = res[name, "rows"][moe_name]
                experts = single.get_submodule(moe_name).num_experts
                assert set(tensors) <= set(local)
                for key in tensors:
                    expected = full[moe_name][key][start * experts : (start + heads) * experts]
                    t = local[key]
                    assert t.dtype == expected.dtype and torch.equal(_bits(t), _bits(expected)), (name, moe_name, key)


def test_ep2_fp8_experts_match_the_single_process_fp8_model(folders, per_rank):
    single = Magi2Transformer3DModel.from_pretrained(folders["fp8"], torch_dtype=torch.float32)
    tensors = ("W_gate", "W_up", "W_down", "W_gate_scale", "W_up_scale", "W_down_scale")
    _check_against_one_process(single, per_rank, ("fp8_repo", "fp8_quantize_at_load"), tensors)


def test_ep2_int4_experts_match_the_single_process_int4_model(folders, per_rank):
    """An int4 repo, a bf16 repo quantized at load and an int4 model cut in memory: each rank holds its rows of the
    packed codes and of the group scales, and computes what one process does."""
    single = Magi2Transformer3DModel.from_pretrained(folders["int4"], torch_dtype=torch.float32)
    assert single.config.expert_dtype == "int4"
    names = ("int4_repo", "int4_quantize_at_load", "int4_enable_expert_parallel")
    _check_against_one_process(single, per_rank, names, ("W_gate", "W_up", "W_down", *INT4_SCALE_NAMES))


def test_ep2_quantize_at_load_refuses_a_non_finite_weight_on_every_rank_and_the_group_serves_on(per_rank):
    """The NaN sits in rank 1's rows: both ranks raise the same error naming the tensor (FP8 and int4), none returns
    a model that would wait at its first collective, and the group then runs a collective and every load above."""
    for name in ("fp8_quantize_at_load", "int4_quantize_at_load"):
        errors = [res[name, "non_finite"] for res in per_rank]
        assert errors[0] is not None and errors == [errors[0]] * len(per_rank), (name, errors)
        assert f"{NON_FINITE_KEY} holds a non-finite weight (nan) in expert 1 of head 3" in errors[0], errors[0]
    assert [res["rank_sum_after_refusals"] for res in per_rank] == [1, 1]
