"""Expert-parallel collectives, group set-up and errors, on gloo ranks (``torch.multiprocessing.spawn``).

The per-head computation here is an independent stand-in (a per-head ``tanh(x_h @ W_h)``), so these tests pin the
head layout and the collectives alone; the real MoE layer is covered in ``test_ep_moe_layer.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from ep_spawn_utils import run_on_ranks

from diffusers_magi2.parallel.expert_parallel import (
    Magi2ExpertParallelConfig,
    check_same_on_all_ranks,
    ep_head_layout,
    expert_parallel_heads_forward,
    resolve_expert_parallel,
    warn_if_idle,
)

DH = 8
# per-rank token counts for layout (b): uneven, with one rank holding zero tokens (C07)
TOKEN_COUNTS = {2: [5, 0], 3: [4, 0, 7], 4: [3, 6, 0, 1]}


def _weights(num_heads: int) -> torch.Tensor:
    return torch.randn(num_heads, DH, DH, generator=torch.Generator().manual_seed(100 + num_heads))


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.einsum("shd,hde->she", x, w))


def _local_heads_fn(w: torch.Tensor, layout):
    def compute(local_x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(local_x)
        n = layout.num_real_local_heads
        if n:
            ws = w[layout.local_head_start : layout.local_head_start + n]
            out[:, :n] = _reference(local_x[:, :n].float(), ws).to(local_x.dtype)
        return out

    return compute


def _collectives_worker(rank: int, world: int) -> dict:
    ep = resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world))
    assert ep.size == world and ep.rank == rank
    results = {}
    for num_heads in (4, 3):
        w = _weights(num_heads)
        layout = ep_head_layout(num_heads, ep.size, ep.rank)
        fn = _local_heads_fn(w, layout)
        x_all = torch.randn(12, num_heads, DH, generator=torch.Generator().manual_seed(7))
        results[("a", num_heads)] = expert_parallel_heads_forward(x_all, fn, layout, ep.group)
        counts = TOKEN_COUNTS[world]
        x_tok = torch.randn(sum(counts), num_heads, DH, generator=torch.Generator().manual_seed(8))
        start = sum(counts[:rank])
        mine = x_tok[start : start + counts[rank]]
        results[("b", num_heads)] = expert_parallel_heads_forward(mine, fn, layout, ep.group, token_counts=counts)
        results[("b_bf16", num_heads)] = expert_parallel_heads_forward(
            mine.bfloat16(), fn, layout, ep.group, token_counts=counts
        )
    # under autograd (grad mode, inputs requiring grad): the functional collectives carry gradients back
    xg = mine.detach().clone().requires_grad_(True)
    coeff = torch.linspace(-1, 1, DH)
    yg = expert_parallel_heads_forward(xg, fn, layout, ep.group, token_counts=counts)
    (yg * coeff).sum().backward()
    results["grad_b"] = xg.grad
    results["grad_a_out"] = expert_parallel_heads_forward(x_all.clone().requires_grad_(True), fn, layout, ep.group)
    # errors raised before any collective
    errors = {}
    try:
        expert_parallel_heads_forward(
            x_tok[:2], fn, layout, ep.group, token_counts=[2] * (world - 1)
        )
    except ValueError as e:
        errors["wrong_len"] = str(e)
    try:
        resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world + 1))
    except ValueError as e:
        errors["degree"] = str(e)
    try:  # ranks loading different configs
        check_same_on_all_ranks({"num_heads": 4 + (rank == world - 1)}, ep, "transformer config")
    except ValueError as e:
        errors["mismatch"] = str(e)
    check_same_on_all_ranks({"num_heads": 4}, ep, "transformer config")  # identical: no error
    results["errors"] = errors
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_collectives_match_single_device(world):
    per_rank = run_on_ranks(_collectives_worker, world)
    counts = TOKEN_COUNTS[world]
    for num_heads in (4, 3):
        w = _weights(num_heads)
        x_all = torch.randn(12, num_heads, DH, generator=torch.Generator().manual_seed(7))
        ref_a = _reference(x_all, w)
        x_tok = torch.randn(sum(counts), num_heads, DH, generator=torch.Generator().manual_seed(8))
        ref_b = _reference(x_tok, w)
        ref_b16 = _reference(x_tok.bfloat16().float(), w)
        for rank, res in enumerate(per_rank):
            out_a = res[("a", num_heads)]
            assert out_a.shape == (12, num_heads, DH)
            torch.testing.assert_close(out_a, ref_a, atol=2e-6, rtol=0)
            start = sum(counts[:rank])
            out_b = res[("b", num_heads)]
            assert out_b.shape == (counts[rank], num_heads, DH)  # zero rows on the empty rank
            torch.testing.assert_close(out_b, ref_b[start : start + counts[rank]], atol=2e-6, rtol=0)
            b16 = res[("b_bf16", num_heads)]
            assert b16.dtype == torch.bfloat16  # collectives move the caller's dtype
            torch.testing.assert_close(b16.float(), ref_b16[start : start + counts[rank]], atol=2e-2, rtol=0)
        if num_heads == 3:  # the last loop iteration in the worker
            xg = x_tok.clone().requires_grad_(True)
            (_reference(xg, w) * torch.linspace(-1, 1, DH)).sum().backward()
            for rank, res in enumerate(per_rank):
                start = sum(counts[:rank])
                torch.testing.assert_close(res["grad_b"], xg.grad[start : start + counts[rank]], atol=2e-6, rtol=0)
                torch.testing.assert_close(res["grad_a_out"].detach(), ref_a, atol=2e-6, rtol=0)
    for res in per_rank:
        errs = res["errors"]
        assert f"ep_token_counts must be {world}" in errs["wrong_len"]
        assert f"ep_degree={world + 1} must equal the world size ({world})" in errs["degree"]
        assert f"ranks [{world - 1}] differ from rank 0" in errs["mismatch"]


def test_ep_head_layout_padding_and_idle_rank():
    # H = 12 on 8 ranks: padded to 16, 2 heads per rank, ranks 6 and 7 idle (spec §2.1 per-rank EP shapes)
    layouts = [ep_head_layout(12, 8, r) for r in range(8)]
    assert {lay.padded_num_heads for lay in layouts} == {16}
    assert [lay.local_head_start for lay in layouts] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [lay.num_real_local_heads for lay in layouts] == [2, 2, 2, 2, 2, 2, 0, 0]
    assert layouts[5].expert_rows(256) == (2560, 3072)
    # H = 3 on 2 ranks: rank 1 holds one real and one padding head
    lay = ep_head_layout(3, 2, 1)
    assert (lay.padded_num_heads, lay.local_num_heads, lay.local_head_start, lay.num_real_local_heads) == (4, 2, 2, 1)
    with pytest.warns(UserWarning, match="EP rank 2 of 3 owns only padding heads"):
        warn_if_idle(ep_head_layout(4, 3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_idle(ep_head_layout(4, 3, 1))
    with pytest.raises(ValueError, match="ep_rank must be in"):
        ep_head_layout(4, 2, 2)


def test_ep_config_errors_without_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="ep_degree must be an int >= 1"):
        Magi2ExpertParallelConfig(ep_degree=0)
    # C08 core: EP asked for, but this process runs alone -> error, never a silent single-process run
    with pytest.raises(ValueError, match=r"ep_degree=2 needs an initialised torch.distributed process group"):
        resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=2))
    single = resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=1))
    assert (single.group, single.rank, single.size) == (None, 0, 1)
