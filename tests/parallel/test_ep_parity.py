"""Expert parallelism on N = 2, 3, 4 gloo ranks equals the single-process model.

One call on N gloo ranks per N (cached across the tests below) runs ``ep_workers.ep_worker``.
Fixtures: ``magi2_tiny/preview_h4`` (4 MoE heads: N = 3 leaves rank 2 idle) and ``preview_h3`` (3 heads: padded).
Tolerances: EP vs single process ≤ 2e-5 abs (fp32); transformer vs SandAI fixture ≤ 1e-4 abs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from helpers.ep_spawn_utils import run_on_ranks
from helpers.ep_workers import (
    DH,
    MODELS,
    MOE_LAYER,
    TOKEN_COUNTS,
    ep_worker,
    load_moe,
    moe_case,
    moe_config,
    packed_forward,
    sandai_ckpt,
    split_tokens,
    standin_inputs,
    standin_reference,
    standin_weights,
    transformer_case,
)

from diffusers_magi2.loaders.key_plan import read_source_checkpoint
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE


pytestmark = pytest.mark.distributed


EP_ATOL = 2e-5
FIXTURE_ATOL = 1e-4
MOE_FIXTURE_ATOL = 2e-4  # MoE fixture bound for core.out in fp32 (values reach ~14)
WORLDS = [2, 3, 4]


@pytest.fixture(scope="module")
def diffusers_folders(tmp_path_factory):
    """Diffusers-format copies of the SandAI tiny checkpoints (bf16 files like the converter's, sharded + index)."""
    out = {}
    for model in MODELS:
        folder = tmp_path_factory.mktemp(f"ep_{model}")
        Magi2Transformer3DModel.from_original_checkpoint(sandai_ckpt(model), dtype=torch.bfloat16).save_pretrained(
            folder, max_shard_size="300KB"
        )
        assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
        out[model] = str(folder)
    return out


_RESULTS: dict = {}


def _results(world: int, folders: dict) -> list:
    if world not in _RESULTS:
        _RESULTS[world] = run_on_ranks(ep_worker, world, folders, deadline_s=150)
    return _RESULTS[world]


@functools.lru_cache(maxsize=None)
def _single_process_transformer(folder: str) -> Magi2Transformer3DModel:
    return Magi2Transformer3DModel.from_pretrained(folder, torch_dtype=torch.float32)


@pytest.mark.parametrize("world", WORLDS)
def test_ep_collectives_match_single_device(world, diffusers_folders):
    per_rank = [r["collectives"] for r in _results(world, diffusers_folders)]
    counts = TOKEN_COUNTS[world]
    for num_heads in (4, 3):
        w = standin_weights(num_heads)
        x_all, x_tok = standin_inputs(num_heads, world)
        ref_a, ref_b = standin_reference(x_all, w), standin_reference(x_tok, w)
        ref_b16 = standin_reference(x_tok.bfloat16().float(), w)
        xg = x_tok.clone().requires_grad_(True)
        (standin_reference(xg, w) * torch.linspace(-1, 1, DH)).sum().backward()
        for rank, res in enumerate(per_rank):
            sl = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
            torch.testing.assert_close(res["a", num_heads], ref_a, atol=2e-6, rtol=0)
            torch.testing.assert_close(res["grad_mode_a", num_heads], ref_a, atol=2e-6, rtol=0)
            assert res["b", num_heads].shape == (counts[rank], num_heads, DH)  # 0 rows on the empty rank
            torch.testing.assert_close(res["b", num_heads], ref_b[sl], atol=2e-6, rtol=0)
            assert res["b_bf16", num_heads].dtype == torch.bfloat16  # the caller's dtype travels
            torch.testing.assert_close(res["b_bf16", num_heads].float(), ref_b16[sl], atol=2e-2, rtol=0)
            torch.testing.assert_close(res["grad_b", num_heads], xg.grad[sl], atol=2e-6, rtol=0)
    for res in per_rank:
        errs = res["errors"]
        assert f"ep_token_counts must be {world}" in errs["wrong_len"]
        assert f"ep_degree={world + 1} must divide the world size ({world})" in errs["degree"]
        assert f"ranks [{world - 1}] differ from rank 0" in errs["mismatch"]


@pytest.mark.parametrize("world", WORLDS)
def test_ep_moe_layer_layouts_match_single_process(world, diffusers_folders):
    per_rank = [r["moe"] for r in _results(world, diffusers_folders)]
    for model, dims in MODELS.items():
        single = Magi2MultiHeadMoE(moe_config(model)).eval()
        load_moe(single, model, sharded=False)
        case = moe_case(model)
        with torch.no_grad():
            ref = single(case["core.x"])
        torch.testing.assert_close(ref, case["core.out"], atol=MOE_FIXTURE_ATOL, rtol=0)
        counts = split_tokens(ref.shape[0], world)
        assert 0 in counts and len(set(counts)) > 1 and sum(counts) == ref.shape[0]
        # rank order == head order; real rows are the file's, padded-head rows are zero
        full_w = torch.cat([r[model, "W_gate"] for r in per_rank])
        key = f"block.layers.{MOE_LAYER}.mlp.moe_mlp.W_gate"
        from safetensors import safe_open

        source = read_source_checkpoint(sandai_ckpt(model))
        with safe_open(str(source.directory / source.weight_map[key]), "pt") as h:
            file_w = h.get_tensor(key).float()
        real = dims["num_heads"] * 8
        assert torch.equal(full_w[:real], file_w) and not full_w[real:].any()
        assert full_w.shape[0] == -(-dims["num_heads"] // world) * world * 8
        for rank, res in enumerate(per_rank):
            torch.testing.assert_close(res[model, "a"], ref, atol=EP_ATOL, rtol=0)
            torch.testing.assert_close(res[model, "a_from_full_state_dict"], ref, atol=EP_ATOL, rtol=0)
            assert "W_up: expert-parallel rank" in res[model, "bad_rows_error"]
            assert "got shape (3, " in res[model, "bad_rows_error"]
            sl = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
            assert res[model, "b"].shape == (counts[rank], dims["hidden_size"])
            torch.testing.assert_close(res[model, "b"], ref[sl], atol=EP_ATOL, rtol=0)


@pytest.mark.parametrize("world", [2])
def test_ep_config_with_caller_mesh(world, diffusers_folders):
    for rank, res in enumerate(r["moe"] for r in _results(world, diffusers_folders)):
        assert res["mesh_group"] == (world, rank, world)
        assert f"has size {world} but ep_degree={world + 1}" in res["mesh_error"]


@pytest.mark.parametrize("world", WORLDS)
def test_ep_transformer_layout_a_matches_single_process_and_fixture(world, diffusers_folders):
    per_rank = [r["transformer"] for r in _results(world, diffusers_folders)]
    for model, dims in MODELS.items():
        single = _single_process_transformer(diffusers_folders[model])
        d = transformer_case(model)
        ref = packed_forward(single, d)
        assert (ref - d["model.out"]).abs().max() <= FIXTURE_ATOL
        full_sd = single.state_dict()
        full_params = sum(p.numel() for p in single.parameters())
        heads, padded = dims["num_heads"], -(-dims["num_heads"] // world) * world
        for rank, res in enumerate(per_rank):
            out = res[model, "out"]
            assert (out - ref).abs().max() <= EP_ATOL, (model, rank, (out - ref).abs().max())
            assert (out - d["model.out"]).abs().max() <= FIXTURE_ATOL
            if model == "preview_h4":
                assert (res[model, "enable_out"] - ref).abs().max() <= EP_ATOL
                assert (res[model, "out_after_full_state_dict"] - ref).abs().max() <= EP_ATOL
                assert "this model is expert-parallel" in res["save_error"]
                assert not (Path(diffusers_folders[model]).parent / f"never_written_{rank}").exists()
            assert res[model, "num_params"] < full_params  # only local experts exist on the rank
            assert res[model, "dtypes"] == {  # same dtypes as diffusers' from_pretrained, EP keys aside
                k: str(v.dtype) for k, v in full_sd.items()
            }
            idle = rank * (padded // world) >= heads
            assert len(res[model, "warnings"]) == (1 if idle else 0), (model, rank, res[model, "warnings"])
        for name in per_rank[0][model, "moe_rows"]:  # row slicing at model level, every MoE layer and the router bias
            w = torch.cat([r[model, "moe_rows"][name][0] for r in per_rank])
            b = torch.cat([r[model, "moe_rows"][name][1] for r in per_rank])
            real = heads * 8
            assert torch.equal(w[:real], full_sd[f"{name}.W_gate"]) and not w[real:].any()
            assert torch.equal(b[:real], full_sd[f"{name}.router.expert_bias"]) and not b[real:].any()
    if world == 2:
        for res in per_rank:
            assert "ranks disagree on the checkpoint or config" in res["mismatch_error"]
            assert "ranks [1] differ from rank 0" in res["mismatch_error"]
