"""``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` on both transformers, N = 2, 3, 4 gloo ranks.

One call on N gloo ranks per N (cached) runs ``cp_model_workers.cp_model_worker``: the fp32 tiny fixtures
``magi2_tiny`` preview h4 (t2v and i2v), preview h3 and the refiner (with and without audio), with a balanced split
and an uneven one where rank 1 holds no token; the preview also under CP x EP over the same ranks (EP = N, and
EP 2 x 2 replicas on 4 ranks), EP enabled before CP and after it. Every rank gets the full output; each must be within 1e-5 of the single-process
model and within 1e-4 of the SandAI fixture. Also checked: the collectives and host syncs inside every block, and
the per-rank FLOPs (FlopCounterMode with the CPU SDPA formula).
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.cp_model_workers import (
    PREVIEWS,
    REFINER_CASES,
    REFINER_FORWARD_CASES,
    SYNC_METHODS,
    case_prefixes,
    cp_model_worker,
    load_preview,
    load_refiner,
    preview_bf16_case,
    preview_case,
    preview_forward,
    refiner_batch_forward,
    refiner_case,
    refiner_forward,
)
from helpers.ep_spawn_utils import run_on_ranks
from helpers.flop_counter import count_flops


pytestmark = pytest.mark.distributed


CP_ATOL = 1e-5
FIXTURE_ATOL = 1e-4
#: bf16 CP vs one process: the same bf16 ops on other token counts (rounding only; 1.3e-7 measured)
BF16_CP_REL_L2 = 1e-3
EP_DEGREES = {2: [None, 2], 3: [None, 3], 4: [None, 4, 2]}
WORLDS = [2, 3, 4]

_RESULTS: dict = {}


def _results(world: int) -> list:
    if world not in _RESULTS:
        _RESULTS[world] = run_on_ranks(cp_model_worker, world, EP_DEGREES[world], deadline_s=900.0)
    return _RESULTS[world]


@functools.lru_cache(maxsize=None)
def _preview_reference(name: str) -> dict:
    d = preview_case(name)
    model = load_preview(name).eval()
    out = {p: preview_forward(model, d, p) for p in case_prefixes(d)}
    out["flops"] = count_flops(preview_forward, model, d, "")[1]
    return out


@functools.lru_cache(maxsize=None)
def _refiner_reference() -> dict:
    d = refiner_case()
    model = load_refiner().eval()
    out = {p: refiner_forward(model, d, p) for p in REFINER_CASES}
    out["flops"] = count_flops(refiner_forward, model, d, "")[1]
    return out


def _check(got: torch.Tensor, single: torch.Tensor, fixture: torch.Tensor, what) -> None:
    assert got.shape == single.shape, what
    assert (got - single).abs().max().item() <= CP_ATOL, (what, (got - single).abs().max().item())
    assert (got - fixture).abs().max().item() <= FIXTURE_ATOL, (what, (got - fixture).abs().max().item())


def _preview_cases(world: int):
    """``(rank, its preview results, key (name, ep, prefix, split), one-process output, fixture output)`` of every
    preview case the ranks ran."""
    results = _results(world)
    for name in PREVIEWS:
        d = preview_case(name)
        ref = _preview_reference(name)
        splits = [(prefix, "balanced") for prefix in case_prefixes(d)] + [("", "uneven")]
        for rank in range(world):
            for ep in EP_DEGREES[world]:
                for prefix, split in splits:
                    yield (
                        rank,
                        results[rank]["preview"],
                        (name, ep, prefix, split),
                        ref[prefix],
                        d[prefix + "model.out"],
                    )


@pytest.mark.parametrize("world", WORLDS)
def test_preview_context_parallel_equals_single_process_and_fixture(world):
    for rank, res, key, single, fixture in _preview_cases(world):
        _check(res[key], single, fixture, (*key, rank))


@pytest.mark.parametrize("world", WORLDS)
def test_preview_expert_parallel_after_context_parallel_equals_the_other_order(world):
    """``enable_parallelism`` then ``enable_expert_parallel`` runs the same exchanges as the other order: bit for
    bit the same outputs (so within 1e-5 of one process and 1e-4 of the fixture too), balanced and uneven splits."""
    for rank, res, key, _, _ in _preview_cases(world):
        if key[1] is not None:  # an EP degree
            assert torch.equal(res[(*key, "cp_first")], res[key]), (*key, rank)


def test_bf16_preview_with_a_rank_owning_no_query_head_equals_one_process():
    """4 query heads over 3 ranks: rank 2 computes no head yet sends back the same dtype as the others."""
    model = load_preview("preview_h4", torch.bfloat16).eval()
    single = preview_forward(model, preview_bf16_case(), "")
    for rank, res in enumerate(_results(3)):
        got = res["preview_bf16"]
        assert got.dtype == single.dtype  # the model's output is fp32; its layers ran in bf16
        err = ((got.float() - single.float()).norm() / single.float().norm()).item()
        assert err <= BF16_CP_REL_L2, (rank, err)


@pytest.mark.parametrize("world", WORLDS)
def test_refiner_context_parallel_equals_single_process_and_fixture(world):
    results = _results(world)
    d = refiner_case()
    ref = _refiner_reference()
    for rank in range(world):
        res = results[rank]["refiner"]
        for prefix in REFINER_CASES:
            _check(res[prefix, "balanced"], ref[prefix], d[prefix + "model.out"], (prefix, rank))
        _check(res["", "uneven"], ref[""], d["model.out"], ("uneven", rank))


@pytest.mark.parametrize("world", WORLDS)
def test_refiner_forward_under_context_parallelism_splits_and_equals_one_process(world):
    """``forward`` (what the pipeline's refiner stage calls) shards each sample as ``forward_packed`` does: every
    rank within 1e-5 of one process, 2 samples with audio and 1 without; at N = 2 each rank does <= 0.55 of the
    work and the ranks together >= 0.95."""
    model = load_refiner().eval()
    for audio, batch in REFINER_FORWARD_CASES:
        single = refiner_batch_forward(model, audio, batch)
        assert (single[1] is not None) == audio
        for rank, res in enumerate(_results(world)):
            got = res["refiner"]["forward", audio, batch]
            for g, s in zip(got, single):
                if s is not None:
                    assert g.shape == s.shape
                    assert (g - s).abs().max().item() <= CP_ATOL, (audio, rank, (g - s).abs().max().item())
    if world == 2:
        full = count_flops(refiner_batch_forward, model, *REFINER_FORWARD_CASES[0])[1]
        per_rank = [res["refiner"]["forward_flops"] / full for res in _results(world)]
        assert max(per_rank) <= 0.55 and sum(per_rank) >= 0.95, per_rank


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_per_block(world):
    """Per block: 2 all-to-alls for attention (q, k, v fused) + 2 for an EP MoE layer, all issued with async
    handles; no other collective (no all-gather, no size exchange) and no host read of a tensor (``.item()``,
    ``.tolist()``, ``.cpu()``, ``bool``/``int``/``float``), routed experts included (``"auto"`` picks the
    sync-free ``torch_grouped`` backend under CP on CPU)."""
    results = _results(world)
    model = load_preview("preview_h4")
    num_blocks = len(model.transformer_blocks)
    num_moe = sum(1 for b in model.transformer_blocks if hasattr(b.mlp, "moe_mlp"))
    num_refiner_blocks = len(load_refiner().transformer_blocks)
    for rank in range(world):
        probes = [
            (results[rank]["preview"]["preview_h4", world, "probe"], 2 * num_blocks + 2 * num_moe),
            (results[rank]["preview"]["preview_h4", None, "probe"], 2 * num_blocks),  # CP without EP
            (results[rank]["refiner"]["probe"], 2 * num_refiner_blocks),
        ]
        for probe, all_to_alls in probes:
            assert probe["counts"] == {"all_to_all_single": all_to_alls}, probe  # nothing else was counted
            assert all(probe["counts"].get(name, 0) == 0 for name in SYNC_METHODS)
            assert probe["async"] == all_to_alls
        assert probes[0][0]["blocks"] == num_blocks
    # the probe does see host reads: an explicit "torch" backend reads its expert offsets once per MoE layer on a
    # rank that owns MoE heads (rank 0 always does)
    torch_backend = results[0]["preview"]["preview_h4", world, "probe_torch_backend"]["counts"]
    assert torch_backend.get("tolist", 0) >= num_moe, torch_backend


@pytest.mark.parametrize("world", [2, 4])
def test_work_is_split_between_ranks(world):
    results = _results(world)
    cases = [
        (
            "preview h4, CP x EP",
            _preview_reference("preview_h4")["flops"],
            [r["preview"]["preview_h4", world, "flops"] for r in results],
        ),
        ("refiner", _refiner_reference()["flops"], [r["refiner"]["flops"] for r in results]),
    ]
    if world == 2:
        cases.append(
            (
                "preview h3, CP x EP",
                _preview_reference("preview_h3")["flops"],
                [r["preview"]["preview_h3", 2, "flops"] for r in results],
            )
        )
    bound = 0.65 if world == 2 else 0.4
    for what, single, per_rank in cases:
        if world == 4 and what == "refiner":  # N = 4 bound is for a config with >= 4 attention and MoE heads
            continue
        assert max(per_rank) <= bound * single, (what, [f / single for f in per_rank])
        assert sum(per_rank) >= 0.95 * single, (what, [f / single for f in per_rank])


def test_multi_rank_set_up_errors():
    for rank, res in enumerate(_results(4)):
        errors = res["errors"]
        assert "expert parallelism runs over ranks" in errors["other_ranks"], errors
        assert f"context-parallel rank {rank} needs EP group" in errors["other_ranks"]
        assert errors["other_ranks"].endswith(errors["other_ranks_cp_first"])  # less the layer name
        assert errors["kept_full_layer"]  # refused before the first layer was cut
        assert "this model is expert-parallel" in errors["save"]
