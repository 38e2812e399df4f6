"""The fused Triton kernel (interpreted on CPU via ``TRITON_INTERPRET=1`` from conftest) against the torch twin.

Shapes stay tiny: the interpreter costs ~5-8 ms per program (tile).
"""

from __future__ import annotations

import pytest
import torch
from helpers.moe_cases import LAYERS, MODELS, build_module, load_case, random_case, rel_l2, unit_swiglu_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton.runtime.errors import OutOfResources

from diffusers_magi2.moe import experts_triton
from diffusers_magi2.moe.experts import torch_mh_moe_forward
from diffusers_magi2.moe.experts_triton import triton_mh_moe_forward
from diffusers_magi2.moe.routing import compute_topk_probs_and_indices, global_sort_routes


pytestmark = [
    pytest.mark.skipif(
        not experts_triton.INTERPRET and not torch.cuda.is_available(),
        reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)",
    ),
    # numpy's exp overflows to inf inside the interpreted sigmoid of very negative gates; the result (0) is right.
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

OUT_FP32_ATOL = 2e-4  # required: core.out <= 2e-4 abs in fp32
TRITON_VS_TORCH_FP32_REL = 1e-5  # required: Triton vs torch path, fp32 <= 1e-5 relative (to max |ref|)
OUT_BF16_REL_L2 = 2e-2  # required: bf16 teacher-forced <= 2e-2 rel-L2 (measured 8.0e-5 worst case, h3 layer 2)
BF16_INTERPRETER_REL = 5e-2  # bf16 in the Triton interpreter: max |Triton - torch| <= 5e-2 * max |ref|


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = max(ref.abs().max().item(), 1e-6) if ref.numel() else 1.0
    err = (out.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    assert err <= rel * scale, (err, scale)


def fixture_args(model: str, variant: str, layer: int):
    case = load_case(model, variant, layer)
    module = build_module(model, layer, torch.float32 if variant == "fp32" else torch.bfloat16)
    x = case["core.x"].view(-1, module.num_heads, module.head_dim)
    routes = (case["core.gather_ids"], case["core.probs_sorted"], case["core.expert_offsets"])
    return case, (x, *routes, module.W_gate.detach(), module.W_up.detach(), module.W_down.detach())


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("model", MODELS)
def test_triton_fp32_reproduces_core_out(model: str, layer: int) -> None:
    case, args = fixture_args(model, "fp32", layer)
    ref = torch_mh_moe_forward(*args)
    for deterministic in (False, True):
        out = triton_mh_moe_forward(*args, deterministic=deterministic)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.view_as(case["core.out"]), case["core.out"], atol=OUT_FP32_ATOL, rtol=0)
        assert_rel_close(out, ref, TRITON_VS_TORCH_FP32_REL)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("model", MODELS)
def test_triton_bf16_teacher_forced(model: str, layer: int) -> None:
    case, args = fixture_args(model, "bf16", layer)
    out = triton_mh_moe_forward(*args, deterministic=True)
    assert out.dtype == torch.bfloat16
    assert rel_l2(out.view_as(case["core.out"]), case["core.out"]) <= OUT_BF16_REL_L2


def routes_from(logits, top_k, scale=4.9):
    probs, idx = compute_topk_probs_and_indices(logits, top_k)
    return global_sort_routes(probs * scale, idx, logits.shape[-1])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_tokens=st.integers(0, 9),
    num_heads=st.integers(1, 3),
    num_experts=st.integers(1, 5),
    k_frac=st.floats(0.0, 1.0),
    head_dim=st.sampled_from([16, 32, 48]),
    expert_dim=st.sampled_from([16, 32, 48]),
    ties=st.booleans(),
    empty=st.booleans(),
    deterministic=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_torch_property(
    num_tokens, num_heads, num_experts, k_frac, head_dim, expert_dim, ties, empty, deterministic, seed
) -> None:
    """Random shapes incl. S = 0, S = 1, top_k = E, tied router scores and empty experts (fp32, <= 1e-5 rel)."""
    top_k = 1 + round(k_frac * (num_experts - 1))
    x, _, _, w_gate, w_up, w_down = random_case(
        num_tokens, num_heads, num_experts, top_k, head_dim, expert_dim, torch.float32, seed=seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(num_heads, num_tokens, num_experts, generator=gen)
    if ties:
        logits = logits.round()  # many exact ties; both paths consume the same routes
    if empty and num_experts > top_k:
        logits[..., top_k:] = -30.0  # experts past top_k never chosen
    routes, weights = routes_from(logits, top_k), (w_gate, w_up, w_down)
    ref = torch_mh_moe_forward(x, *routes, *weights)
    out = triton_mh_moe_forward(x, *routes, *weights, deterministic=deterministic)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_rel_close(out, ref, TRITON_VS_TORCH_FP32_REL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_deterministic_bit_identical_over_3_runs(dtype: torch.dtype) -> None:
    x, probs, idx, w_gate, w_up, w_down = random_case(12, 2, 4, 3, 32, 32, dtype, seed=3)
    args = (x, *global_sort_routes(probs, idx, 4), w_gate, w_up, w_down)
    runs = [triton_mh_moe_forward(*args, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        assert torch.equal(
            runs[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            other.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )
    assert_rel_close(runs[0], torch_mh_moe_forward(*args), 1e-5 if dtype == torch.float32 else 2e-2)


def test_triton_swiglu7_plus_one() -> None:
    out = triton_mh_moe_forward(*unit_swiglu_layer([1.0, 10.0, -10.0], [0.0, 10.0, -10.0]))[0, 0]
    torch.testing.assert_close(out[:2], torch.tensor([0.845796, 55.99963]), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[2], torch.tensor(2.43e-6), atol=0, rtol=5e-3)
    assert (out[3:] == 0).all()


def bf16_integer_case():
    """TINY MoE layer 1 (2 heads x 8 experts, top-2, Dh 64, De 64), bf16 values exact in bf16."""
    gen = torch.Generator().manual_seed(12)
    heads, experts, dh, de = 2, 8, 64, 64
    x = torch.randint(-2, 3, (16, heads, dh), generator=gen).to(torch.bfloat16)
    w_gate = torch.randint(-2, 3, (heads * experts, dh, de), generator=gen).to(torch.bfloat16)
    w_up = torch.randint(-2, 3, (heads * experts, dh, de), generator=gen).to(torch.bfloat16)
    w_down = torch.randint(-2, 3, (heads * experts, de, dh), generator=gen).to(torch.bfloat16)
    logits = torch.randn(heads, 16, experts, generator=gen)
    probs, idx = compute_topk_probs_and_indices(logits, 2)
    return (x, *global_sort_routes(probs, idx, experts), w_gate, w_up, w_down)


def test_bf16_in_interpreter_is_finite_and_matches_torch() -> None:
    """No InterpreterError, no bit-pattern garbage (|y| < 1e4), matches torch, deterministic bit-identical."""
    args = bf16_integer_case()
    ref = torch_mh_moe_forward(*args)  # fp32 accumulation on the same bf16 inputs
    assert ref.abs().max() < 1e4
    for deterministic in (False, True):
        runs = [triton_mh_moe_forward(*args, deterministic=deterministic) for _ in range(3)]
        for out in runs:
            assert out.dtype == torch.bfloat16
            assert torch.isfinite(out.float()).all() and out.float().abs().max() < 1e4
            assert_rel_close(out, ref, BF16_INTERPRETER_REL)
        if deterministic:
            assert all(torch.equal(runs[0].view(torch.int16), r.view(torch.int16)) for r in runs[1:])


def test_tile_out_of_resources_fallback_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first tile that does not fit falls back (tried once, cached); other errors propagate."""
    monkeypatch.setattr(experts_triton, "_CHOSEN", {})
    real_launch = experts_triton._launch
    attempts: list = []
    fail_next_with_runtime_error = [False]
    args = bf16_integer_case()
    first = experts_triton.tile_candidates(("interpreter",), 64, 64, torch.bfloat16, torch.bfloat16)[0]

    def fake_launch(config, grid, args, constants):
        attempts.append(config)
        if fail_next_with_runtime_error[0]:
            fail_next_with_runtime_error[0] = False
            raise RuntimeError("illegal memory access")
        if config == first:
            raise OutOfResources(131072, 101376, "shared memory")
        return real_launch(config, grid, args, constants)

    monkeypatch.setattr(experts_triton, "_launch", fake_launch)
    ref = torch_mh_moe_forward(*args)
    for _ in range(2):
        assert_rel_close(triton_mh_moe_forward(*args), ref, BF16_INTERPRETER_REL)
    assert attempts.count(first) == 1
    assert attempts[-1] != first

    fail_next_with_runtime_error[0] = True
    with pytest.raises(RuntimeError, match="illegal memory access"):
        triton_mh_moe_forward(*args)
    # Every candidate out of resources: the error is raised, not swallowed into a torch fallback.
    monkeypatch.setattr(experts_triton, "_CHOSEN", {})
    monkeypatch.setattr(
        experts_triton, "_launch", lambda *a: (_ for _ in ()).throw(OutOfResources(1, 0, "shared memory"))
    )
    with pytest.raises(OutOfResources):
        triton_mh_moe_forward(*args)


def test_triton_bad_input() -> None:
    x, probs, idx, w_gate, w_up, w_down = random_case(4, 1, 2, 1, 24, 16, torch.float32)
    args = (x, *global_sort_routes(probs, idx, 2), w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_mh_moe_forward(*args)
    x, probs, idx, w_gate, w_up, w_down = random_case(4, 1, 2, 1, 16, 16, torch.float32)
    args = (x, *global_sort_routes(probs, idx, 2), w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        triton_mh_moe_forward(*args, deterministic=1)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        triton_mh_moe_forward(x.transpose(0, 2).contiguous().transpose(0, 2), *args[1:])


@pytest.mark.parametrize(
    ("act_dtype", "weight_dtype"),
    [
        (torch.float16, torch.float16),  # native low-precision path (the GPU code path: casts, fp16 atomics)
        (torch.float32, torch.bfloat16),  # mixed dtypes: tiles upcast on every device
        (torch.bfloat16, torch.float32),
    ],
)
def test_triton_low_precision_and_mixed_dtypes(act_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    x, probs, idx, w_gate, w_up, w_down = random_case(10, 2, 4, 3, 32, 48, weight_dtype, seed=5)
    args = (x.to(act_dtype), *global_sort_routes(probs, idx, 4), w_gate, w_up, w_down)
    ref = torch_mh_moe_forward(*args)
    # Deterministic mode sums in the activation dtype in the reference's order; atomic mode under the interpreter
    # may sum bf16 contributions in fp32 and round once (at most ~1 ulp of the output apart).
    out = triton_mh_moe_forward(*args, deterministic=True)
    assert out.dtype == act_dtype
    assert_rel_close(out, ref, 1e-5 if act_dtype == torch.float32 else 1e-2)
    assert_rel_close(triton_mh_moe_forward(*args), ref, 1e-5 if act_dtype == torch.float32 else 1e-2)


def test_launch_table_entries_resolve_and_end_with_the_smallest_tile() -> None:
    """Every device entry (after aliases) has a ``"*"`` list; every list ends with the 16-route tile (last resort)
    and has tiles no smaller than ``tl.dot``'s minimum."""
    table = experts_triton._launch_table()
    for key in (k for k in table if not k.startswith("_")):
        shapes = table[experts_triton.resolve_device_entry((key,))]
        assert "*" in shapes, key
        for rows in shapes.values():
            configs = [experts_triton.TileConfig(*row) for row in rows]
            assert all(c.block_t >= 16 and c.block_de >= 16 and c.num_stages >= 1 for c in configs)
            assert configs[-1].block_t == 16


def test_tile_candidates_by_device_name_then_arch_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device-name keys win over the architecture (longest match: "NVIDIA H200" is not "NVIDIA H20"), then
    ``sm_XY``, then ``default``; shapes the entry does not name take its ``"*"`` list; lookups are cached."""
    table = {
        "NVIDIA H20": {"*": [[32, 16, 4, 3], [16, 16, 4, 1]]},
        "NVIDIA H200": "sm_90",
        "sm_90": {"256x1280 bfloat16/float8_e4m3fn": [[64, 16, 8, 3]], "*": [[64, 32, 8, 3], [16, 16, 4, 1]]},
        "default": {"*": [[16, 16, 4, 1]]},
    }
    monkeypatch.setattr(experts_triton, "_launch_table", lambda: table)
    experts_triton.tile_candidates.cache_clear()
    try:
        cands = experts_triton.tile_candidates
        fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
        assert cands(("NVIDIA H200", "sm_90"), 256, 1280, bf16, fp8)[0] == experts_triton.TileConfig(64, 16, 8, 3)
        assert cands(("NVIDIA H200", "sm_90"), 256, 1280, bf16, bf16)[0].block_de == 32  # "*"
        assert cands(("NVIDIA H20", "sm_90"), 256, 1280, bf16, fp8)[0].block_t == 32  # name before arch
        assert cands(("NVIDIA H100 80GB HBM3", "sm_90"), 64, 64, bf16, bf16)[0].block_t == 64
        assert cands(("Some Future GPU", "sm_120"), 64, 64, bf16, bf16)[0].block_t == 16
        assert cands.cache_info().hits == 0
        cands(("Some Future GPU", "sm_120"), 64, 64, bf16, bf16)
        assert cands.cache_info().hits == 1
    finally:
        experts_triton.tile_candidates.cache_clear()
    assert (
        experts_triton.shape_key(256, 1280, torch.bfloat16, torch.float8_e4m3fn) == "256x1280 bfloat16/float8_e4m3fn"
    )
