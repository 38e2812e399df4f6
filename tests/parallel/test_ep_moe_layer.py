"""Expert parallelism at the MoE layer, on the golden tiny checkpoints (``preview_h4``: 4 heads, ``preview_h3``: 3).

Every EP rank reads only its rows of the SandAI checkpoint with :func:`read_expert_rows` (C06: padded heads zero,
no slice past the end) and runs ``Magi2MultiHeadMoE.forward`` in layout (a) (replicated tokens) and layout (b)
(sharded tokens, uneven counts, one rank with zero tokens: C07). Reference: the single-process layer holding all
heads (fp32, ≤ 2e-5 abs) and SandAI's captured ``core.out`` (``moe_layer_cases``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import FIXTURES
from ep_spawn_utils import run_on_ranks
from safetensors import safe_open

from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.parallel.ep_loading import EP_SHARDED_SUFFIXES, checkpoint_key_files, read_expert_rows
from diffusers_magi2.parallel.expert_parallel import Magi2ExpertParallelConfig, resolve_expert_parallel

MODELS = {"preview_h4": dict(hidden_size=128, num_heads=4), "preview_h3": dict(hidden_size=96, num_heads=3)}
LAYER = 1
EP_ATOL = 2e-5  # issue 6: EP output == single-process output, fp32
FIXTURE_ATOL = 2e-4  # issue 2's bound for core.out in fp32 (values reach ~14)


def _split(num_tokens: int, world: int) -> list[int]:
    """Uneven per-rank token counts with rank 1 holding none (C07)."""
    if world == 2:
        return [num_tokens, 0]
    base = [num_tokens // 3, 0] + [0] * (world - 2)
    rest = num_tokens - base[0]
    for r in range(2, world):
        base[r] = rest // (world - 2) + (1 if r == 2 else 0) * (rest % (world - 2))
    return base


def _config(model: str) -> Magi2MultiHeadMoEConfig:
    return Magi2MultiHeadMoEConfig(
        **MODELS[model], num_experts=8, top_k=2, expert_intermediate_size=64,
        params_dtype=torch.float32, route_scale=4.9,
    )


def _ckpt(model: str):
    return FIXTURES / "magi2_tiny" / model / "sandai_checkpoint"


def _case(model: str) -> dict[str, torch.Tensor]:
    path = FIXTURES / "magi2_tiny" / model / "fp32" / "moe_layer_cases.safetensors"
    with safe_open(str(path), "pt") as f:
        return {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(f"layer{LAYER}.")}


def _load_moe(moe: Magi2MultiHeadMoE, model: str, sharded: bool) -> None:
    """Fill ``moe`` from the SandAI checkpoint: EP tensors by rows (this rank's only) or whole; EMA router bias."""
    files = checkpoint_key_files(_ckpt(model))
    prefix = f"block.layers.{LAYER}.mlp.moe_mlp."
    rows = moe.local_head_start * moe.num_experts
    sd = {}
    for suffix in EP_SHARDED_SUFFIXES:
        with safe_open(str(files[prefix + suffix]), "pt") as h:
            if sharded:
                t = read_expert_rows(h, prefix + suffix, rows, moe.local_flatten_num_experts)
            else:
                t = h.get_tensor(prefix + suffix)
        sd[suffix] = t.float()
    sd["router.expert_bias"] = sd["router.expert_bias_ema"]  # SandAI loader rule (spec §6.2 step 4)
    moe.load_state_dict(sd, strict=True)


def _single_process(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    moe = Magi2MultiHeadMoE(_config(model)).eval()
    _load_moe(moe, model, sharded=False)
    case = _case(model)
    with torch.no_grad():
        return moe(case["core.x"]), case["core.out"]


def _moe_worker(rank: int, world: int) -> dict:
    ep = resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world))
    out = {}
    for model in MODELS:
        moe = Magi2MultiHeadMoE(_config(model), ep.group).eval()
        _load_moe(moe, model, sharded=True)
        out[model, "W_gate"] = moe.W_gate.detach().clone()
        x = _case(model)["core.x"]
        counts = _split(x.shape[0], world)
        start = sum(counts[:rank])
        with torch.no_grad():
            out[model, "a"] = moe(x)
            out[model, "b"] = moe(x[start : start + counts[rank]], ep_token_counts=counts)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_moe_layer_matches_single_process(world):
    per_rank = run_on_ranks(_moe_worker, world)
    for model, dims in MODELS.items():
        ref, fixture = _single_process(model)
        torch.testing.assert_close(ref, fixture, atol=FIXTURE_ATOL, rtol=0)
        counts = _split(ref.shape[0], world)
        assert 0 in counts and len(set(counts)) > 1
        full_w = torch.cat([r[model, "W_gate"] for r in per_rank])  # rank order == head order, padding last
        num_real_rows = dims["num_heads"] * 8
        with safe_open(str(checkpoint_key_files(_ckpt(model))[f"block.layers.{LAYER}.mlp.moe_mlp.W_gate"]), "pt") as h:
            file_w = h.get_tensor(f"block.layers.{LAYER}.mlp.moe_mlp.W_gate").float()
        torch.testing.assert_close(full_w[:num_real_rows], file_w, atol=0, rtol=0)
        assert torch.count_nonzero(full_w[num_real_rows:]) == 0  # padded heads are zero rows
        for rank, res in enumerate(per_rank):
            torch.testing.assert_close(res[model, "a"], ref, atol=EP_ATOL, rtol=0)
            start = sum(counts[:rank])
            b = res[model, "b"]
            assert b.shape == (counts[rank], dims["hidden_size"])
            torch.testing.assert_close(b, ref[start : start + counts[rank]], atol=EP_ATOL, rtol=0)


def test_ep_read_expert_rows_padded_heads(tmp_path):
    """C06 with explicit ranks: H=3, E=4 saved to safetensors, ep=2 (padded to 4 heads) and ep=4 (rank 3 empty)."""
    from safetensors.torch import save_file

    w = torch.randn(12, 64, 64)
    save_file({"W_gate": w, "bias": torch.arange(12.0)}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as h:
        r0 = read_expert_rows(h, "W_gate", 0, 8)
        r1 = read_expert_rows(h, "W_gate", 8, 8)
        assert r0.shape == r1.shape == (8, 64, 64)
        assert torch.equal(r0, w[:8]) and torch.equal(r1[:4], w[8:]) and not r1[4:].any()
        r3 = read_expert_rows(h, "W_gate", 12, 4)  # start == dim 0: no get_slice past the end
        assert r3.shape == (4, 64, 64) and not r3.any()
        assert read_expert_rows(h, "bias", 12, 4).tolist() == [0.0] * 4
        assert read_expert_rows(h, "bias", 4, 4).tolist() == [4.0, 5.0, 6.0, 7.0]
        with pytest.raises(ValueError, match="row_start and num_rows must be >= 0"):
            read_expert_rows(h, "bias", -1, 4)
