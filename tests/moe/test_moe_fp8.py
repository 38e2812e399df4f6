"""FP8 (float8_e4m3fn) weight-only routed experts: quantization, the torch and Triton paths, EP slicing, dtype moves,
bad input."""

from __future__ import annotations

import pytest
import torch
from helpers.moe_cases import AllocationRecorder, assert_ep_ranks_match, build_module, load_case, rel_l2, tiny_config

from diffusers_magi2.moe import experts, experts_triton
from diffusers_magi2.moe.experts import torch_mh_moe_forward
from diffusers_magi2.moe.experts_triton import check_fp8_device, triton_mh_moe_forward
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.moe.quantize import EXPERT_DTYPES, FP8_DTYPE, quantize_fp8
from diffusers_magi2.moe.reference import reference_mh_moe_forward
from diffusers_magi2.moe.routing import global_sort_routes


pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

TRITON_VS_TORCH_REL_L2 = 1e-2  # FP8 layer: Triton (interpreter) against the torch path
BANKS = ("W_gate", "W_up", "W_down")


def fp8_copy(module: Magi2MultiHeadMoE, **kwargs) -> Magi2MultiHeadMoE:
    """The same layer with FP8 experts quantized from ``module``'s banks."""
    config = Magi2MultiHeadMoEConfig(**{**module.config.__dict__, "expert_dtype": "float8_e4m3fn"})
    quantized = Magi2MultiHeadMoE(config, **kwargs)
    state = module.state_dict()
    for name in BANKS:
        state[name], state[f"{name}_scale"] = quantize_fp8(state[name])
    quantized.load_state_dict(state)
    return quantized


def test_quantize_fp8_scales_are_absmax_over_448_per_output_channel() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 16, 24, generator=gen) * torch.logspace(-3, 2, 24)  # channels of very different size
    weight[2, :, 7] = 0.0  # an all-zero column
    q, scale = quantize_fp8(weight, chunk_rows=2)
    assert q.dtype == FP8_DTYPE and q.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (5, 24)
    torch.testing.assert_close(scale, weight.abs().amax(dim=1) / 448.0, atol=0, rtol=0)
    assert scale[2, 7] == 0 and (q[2, :, 7].float() == 0).all()
    assert q.float().abs().amax() == 448.0
    dequantized = q.float() * scale[:, None, :]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, absolute <= 2^-10 * scale below
    bound = torch.maximum(weight.abs() * 2**-4, scale[:, None, :] * 2**-10)
    assert ((dequantized - weight).abs() <= bound).all()
    q1, scale1 = quantize_fp8(weight, chunk_rows=64)
    assert torch.equal(q1.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale1, scale)


def test_fp8_module_tensors_and_dtype_moves() -> None:
    module = fp8_copy(Magi2MultiHeadMoE(tiny_config(dtype=torch.bfloat16)))
    state = module.state_dict()
    for name, width in (("W_gate", 64), ("W_up", 64), ("W_down", 64)):
        param = module.get_parameter(name)
        assert param.dtype == FP8_DTYPE and not param.requires_grad
        assert state[f"{name}_scale"].dtype == torch.float32 and state[f"{name}_scale"].shape == (16, width)
    before = {k: v.clone() for k, v in state.items()}
    for move in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float32)):
        move(module)
        for name in BANKS:
            assert module.get_parameter(name).dtype == FP8_DTYPE
            assert torch.equal(module.get_parameter(name).view(torch.uint8), before[name].view(torch.uint8))
            assert torch.equal(module.get_buffer(f"{name}_scale"), before[f"{name}_scale"])
    assert module.gate.dtype == torch.float32  # the last move was to fp32


@pytest.mark.parametrize("variant", ["fp32", "bf16"])
def test_fp8_torch_path_matches_oracle_and_fixture(variant: str) -> None:
    case = load_case("preview_h4", variant, 1)
    dense = build_module("preview_h4", 1, torch.float32 if variant == "fp32" else torch.bfloat16)
    module = fp8_copy(dense)
    x = case["core.x"].view(-1, module.num_heads, module.head_dim)
    routes = (case["core.gather_ids"], case["core.probs_sorted"], case["core.expert_offsets"])
    weights = [module.get_parameter(n) for n in BANKS]
    scales = tuple(module.get_buffer(f"{n}_scale") for n in BANKS)
    with torch.no_grad():
        out = torch_mh_moe_forward(x, *routes, *weights, scales=scales)
        ref = reference_mh_moe_forward(x, *routes, *weights, scales=scales)
    assert out.dtype == x.dtype
    assert rel_l2(out, ref) <= 1e-6
    err = rel_l2(out, case["core.out"].view_as(out))
    print(f"FP8 experts, teacher-forced, {variant}: rel-L2 {err:.3e} against core.out")
    assert err <= 0.1  # weight-only e4m3 (3 mantissa bits): a few percent


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_triton_matches_torch(act_dtype: torch.dtype) -> None:
    case = load_case("preview_h4", "fp32", 1)
    module = fp8_copy(build_module("preview_h4", 1, torch.bfloat16))
    hidden = case["core.x"][:24].to(act_dtype)  # the interpreter costs milliseconds per tile
    with torch.no_grad():
        module.set_backend("torch")
        ref = module(hidden)
        for deterministic in (False, True):
            module.set_backend("triton", deterministic=deterministic)
            out = module(hidden)
            assert out.dtype == act_dtype
            err = rel_l2(out, ref)
            assert err <= TRITON_VS_TORCH_REL_L2, (deterministic, err)


def test_fp8_torch_path_dequantizes_per_expert_never_the_whole_bank() -> None:
    torch.manual_seed(2)
    module = fp8_copy(Magi2MultiHeadMoE(tiny_config(dtype=torch.bfloat16)))
    module.set_backend("torch")
    hidden = torch.randn(16, 128, dtype=torch.bfloat16)
    x = hidden.view(16, 2, 64)
    with torch.no_grad():
        routes = global_sort_routes(*module.route(x), module.num_experts)
        weights = [module.get_parameter(n) for n in BANKS]
        scales = [module.get_buffer(f"{n}_scale") for n in BANKS]
        recorder = AllocationRecorder()
        with recorder:
            experts._torch_experts(x, routes, weights, scales)
    assert recorder.allocations
    assert max(n for _, n in recorder.allocations) <= 64 * 64  # one expert matrix at a time
    assert module.W_gate.numel() == 16 * 64 * 64


@pytest.mark.parametrize(("num_heads", "ep_size"), [(3, 2), (3, 4)])
def test_fp8_expert_parallel_slices_rows_and_scales(num_heads: int, ep_size: int) -> None:
    torch.manual_seed(0)
    full = fp8_copy(Magi2MultiHeadMoE(tiny_config(num_heads=num_heads, num_experts=4, head_dim=16, expert_dim=16)))
    assert_ep_ranks_match(full, ep_size, BANKS + tuple(f"{name}_scale" for name in BANKS))


def test_fp8_backward_reaches_activations_not_frozen_weights() -> None:
    torch.manual_seed(3)
    module = fp8_copy(Magi2MultiHeadMoE(tiny_config(num_heads=2, num_experts=4, head_dim=16, expert_dim=16)))
    hidden = torch.randn(5, 32, requires_grad=True)
    module(hidden).square().sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert module.gate.grad is not None  # the router still trains
    assert all(module.get_parameter(n).grad is None for n in BANKS)


def test_fp8_released_size_builds_on_meta() -> None:
    config = {"hidden_size": 3072, "num_heads": 12, "num_experts": 256, "top_k": 6, "expert_intermediate_size": 1280}
    with torch.device("meta"):
        fp8 = Magi2MultiHeadMoE(Magi2MultiHeadMoEConfig(**config, params_dtype=torch.bfloat16, expert_dtype=FP8_DTYPE))
        bf16 = Magi2MultiHeadMoE(Magi2MultiHeadMoEConfig(**config, params_dtype=torch.bfloat16))

    def bank_bytes(module):
        return sum(module.get_parameter(n).numel() * module.get_parameter(n).element_size() for n in BANKS)

    assert fp8.W_gate.is_meta and fp8.W_gate_scale.is_meta
    assert bank_bytes(fp8) / bank_bytes(bf16) == 0.5


@pytest.mark.parametrize("bad", ["int8", "fp8", "float8_e5m2", torch.float8_e5m2, torch.bfloat16, 8])
def test_expert_dtype_outside_allowed_set_raises(bad) -> None:
    with pytest.raises(ValueError, match=r"expert_dtype must be one of \(None, 'float8_e4m3fn', 'int4'\)"):
        Magi2MultiHeadMoEConfig(128, 2, 8, 2, 64, torch.bfloat16, expert_dtype=bad)
    assert EXPERT_DTYPES == (None, "float8_e4m3fn", "int4")
    for good in (None, "float8_e4m3fn", "torch.float8_e4m3fn", torch.float8_e4m3fn):
        config = Magi2MultiHeadMoEConfig(128, 2, 8, 2, 64, torch.bfloat16, expert_dtype=good)
        assert config.expert_dtype in (None, FP8_DTYPE)


def test_fp8_scales_checked() -> None:
    module = fp8_copy(Magi2MultiHeadMoE(tiny_config(num_heads=2, num_experts=2, head_dim=16, expert_dim=16)))
    x = torch.randn(3, 2, 16)
    routes = global_sort_routes(*module.route(x), 2)
    weights = [module.get_parameter(n) for n in BANKS]
    scales = [module.get_buffer(f"{n}_scale") for n in BANKS]
    with pytest.raises(ValueError, match="need scales"):
        torch_mh_moe_forward(x, *routes, *weights)
    with pytest.raises(ValueError, match=r"w_down_scale must be a float32 tensor of shape \[4, 16\]"):
        torch_mh_moe_forward(x, *routes, *weights, scales=(scales[0], scales[1], scales[2][:, :8]))
    with pytest.raises(ValueError, match="only used with"):
        dense = [w.float() for w in weights]
        torch_mh_moe_forward(x, *routes, *dense, scales=tuple(scales))


def test_fp8_where_the_kernel_cannot_run_it_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU below compute capability 8.9 is refused (at set_backend and per call): no silent bf16 fallback."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability >= 8.9.*NVIDIA A100"):
        check_fp8_device(torch.device("cuda", 0))
    check_fp8_device(torch.device("cpu"))  # the interpreter runs FP8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 3090")
    with pytest.raises(ValueError, match=r"RTX 3090 has 8\.6.*bf16.*int4"):  # what to load instead
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))  # RTX 5090
    check_fp8_device(torch.device("cuda", 0))

    def refuse(storage, device):
        raise ValueError("FP8 refused")

    monkeypatch.setattr(experts_triton, "check_storage_device", refuse)
    module = fp8_copy(Magi2MultiHeadMoE(tiny_config(num_heads=2, num_experts=2, head_dim=16, expert_dim=16)))
    with pytest.raises(ValueError, match="FP8 refused"):
        module.set_backend("triton")
    x = torch.randn(3, 2, 16)
    routes = global_sort_routes(*module.route(x), 2)
    weights = [module.get_parameter(n) for n in BANKS]
    scales = tuple(module.get_buffer(f"{n}_scale") for n in BANKS)
    with pytest.raises(ValueError, match="FP8 refused"):
        triton_mh_moe_forward(x, *routes, *weights, scales=scales)
