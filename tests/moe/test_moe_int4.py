"""int4 (NF4, group-wise) routed experts in ``Magi2MultiHeadMoE``: the tensors (on meta too), the torch paths
against the reference with the dequantized weights, one head's bank dequantized at a time, gradients, the Triton
path against the torch path (one head at a time on reused buffers; refused below sm_80), expert-parallel slicing of
codes and group scales, dtype moves, bytes, bad config."""

from __future__ import annotations

import pytest
import torch
from helpers.int4_models import BANKS, int4_copy
from helpers.moe_cases import AllocationRecorder, assert_ep_ranks_match, rel_l2, tiny_config

from diffusers_magi2.moe import experts, experts_triton
from diffusers_magi2.moe.dequantize import dequantize_bank
from diffusers_magi2.moe.experts import torch_mh_moe_forward
from diffusers_magi2.moe.experts_triton import (
    check_int4_capability,
    check_int4_device,
    launch_specs,
    triton_mh_moe_forward,
)
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig, moe_tensors_on_meta
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES
from diffusers_magi2.moe.reference import reference_mh_moe_forward
from diffusers_magi2.moe.routing import global_sort_routes
from diffusers_magi2.utils.backends import resolve_backend


GROUP = 16


def _module(dtype=torch.bfloat16, **kw) -> Magi2MultiHeadMoE:
    """TINY layer (2 heads x 8 experts, Dh 64, De 64) with int4 experts at group 16."""
    torch.manual_seed(0)
    return int4_copy(Magi2MultiHeadMoE(tiny_config(dtype=dtype, **kw)), GROUP)


def _dequantized(module: Magi2MultiHeadMoE) -> list[torch.Tensor]:
    return [dequantize_bank(module.get_parameter(b), module.get_buffer(s)) for b, s in zip(BANKS, INT4_SCALE_NAMES)]


def _routes_and_banks(module, x):
    routes = global_sort_routes(*module.route(x), module.num_experts)
    return routes, [module.get_parameter(n) for n in BANKS], [module.get_buffer(n) for n in INT4_SCALE_NAMES]


def test_int4_module_tensors_names_shapes_dtypes_and_init() -> None:
    config = tiny_config(dtype=torch.bfloat16, expert_dtype="int4", int4_group_size=GROUP)
    module = Magi2MultiHeadMoE(config)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in module.state_dict().items() if n.startswith("W_")}
    assert shapes == {
        "W_gate": ((16, 64, 32), torch.uint8),
        "W_up": ((16, 64, 32), torch.uint8),
        "W_down": ((16, 64, 32), torch.uint8),
        "W_gate_group_scale": ((16, 4, 64), torch.bfloat16),
        "W_up_group_scale": ((16, 4, 64), torch.bfloat16),
        "W_down_group_scale": ((16, 4, 64), torch.bfloat16),
    }
    assert all(not module.get_parameter(n).requires_grad for n in BANKS)
    # random init drawn normal (std 1/sqrt(fan_in)) and quantized: the dequantized banks keep that spread
    for bank, fan_in in zip(_dequantized(module), (64, 64, 64)):
        assert abs(bank.std().item() * fan_in**0.5 - 1.0) < 0.1
    with moe_tensors_on_meta():
        meta = Magi2MultiHeadMoE(config)
    assert all(t.is_meta for t in meta.state_dict().values())
    assert {n: (tuple(t.shape), t.dtype) for n, t in meta.state_dict().items() if n.startswith("W_")} == shapes


@pytest.mark.parametrize("backend", ["torch", "torch_grouped"])
def test_int4_torch_paths_equal_the_reference_on_the_dequantized_weights(backend) -> None:
    module = _module()
    module.set_backend(backend)
    hidden = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    x = hidden.view(16, 2, 64)
    with torch.no_grad():
        out = module(hidden).view_as(x)
        routes, banks, scales = _routes_and_banks(module, x)
        ref = reference_mh_moe_forward(x, *routes, *banks, scales=scales)
        # fp32 activations: the same as the dense path on the fp32 dequantized banks (no rounding point differs)
        fp32 = torch_mh_moe_forward(x.float(), *routes, *banks, scales=scales)
        dense = torch_mh_moe_forward(x.float(), *routes, *_dequantized(module))
    if backend == "torch":
        assert torch.equal(out, ref)
        assert torch.equal(fp32, dense)
    else:  # grouped GEMMs: the per-expert swiglu7 may differ in the last fp32 bit
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_int4_torch_path_dequantizes_one_heads_bank_at_a_time() -> None:
    module = _module()
    x = torch.randn(16, 2, 64).bfloat16()
    with torch.no_grad():
        routes, banks, scales = _routes_and_banks(module, x)
        recorder = AllocationRecorder()
        with recorder:
            experts._torch_experts(x, routes, banks, scales)
    per_head = module.num_experts * 64 * 64  # one head's bank [E, K, N] in fp32
    assert recorder.allocations and max(n for _, n in recorder.allocations) <= per_head
    assert 2 * per_head == module.num_heads * module.num_experts * 64 * 64  # the layer's bank is larger


def test_int4_backward_gives_the_gradients_of_the_dequantized_layer() -> None:
    """With frozen int4 experts the input and router gradients equal fp32 autograd of the same layer written with
    the reference on the dequantized weights."""
    module = _module(dtype=torch.float32)
    hidden = torch.randn(6, 128, generator=torch.Generator().manual_seed(2), requires_grad=True)
    weight = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    (module(hidden) * weight).sum().backward()
    grads = hidden.grad, module.gate.grad.clone()
    module.gate.grad = None
    x = hidden.detach().view(6, 2, 64).requires_grad_(True)
    routes = global_sort_routes(*module.route(x), module.num_experts)  # probs carry the router's gradient
    oracle = reference_mh_moe_forward(x, *routes, *_dequantized(module))
    (oracle.reshape(6, 128) * weight).sum().backward()
    torch.testing.assert_close(grads[0], x.grad.reshape(6, 128), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], module.gate.grad, atol=1e-5, rtol=1e-5)
    assert all(module.get_parameter(n).grad is None for n in BANKS)


TRITON_VS_TORCH_INT4_REL_L2 = 2e-2  # required: Triton int4 vs torch int4 (the kernel's banks are rounded to bf16)
TRITON_VS_TORCH_INT4_FP32 = 1e-5  # fp32 activations: fp32 banks, the same products up to summation order


@pytest.mark.skipif(not experts_triton.INTERPRET, reason="the interpreter (conftest) runs the kernel on CPU")
def test_int4_triton_path_matches_the_torch_path() -> None:
    """``set_backend("triton")`` runs int4 experts (one head's banks dequantized to the activation dtype, then the
    fused kernel), deterministic and atomic, within 2e-2 rel-L2 of the torch path's fp32 dequantized weights (bf16);
    with fp32 activations the banks stay fp32 and the paths agree to fp32 rounding."""
    module = _module(num_experts=4, head_dim=32, expert_dim=32)
    hidden = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    x = hidden.view(8, 2, 32)
    with torch.no_grad():
        routes, banks, scales = _routes_and_banks(module, x)
        ref = torch_mh_moe_forward(x, *routes, *banks, scales=scales)
        module.set_backend("triton", deterministic=True)
        outs = [module(hidden).view_as(x), triton_mh_moe_forward(x, *routes, *banks, scales=scales)]
        fp32 = triton_mh_moe_forward(x.float(), *routes, *banks, scales=scales)
        fp32_ref = torch_mh_moe_forward(x.float(), *routes, *banks, scales=scales)
    for out in outs:
        assert out.dtype == torch.bfloat16
        assert 0 < rel_l2(out, ref) <= TRITON_VS_TORCH_INT4_REL_L2  # > 0: the bf16 banks do round
    assert rel_l2(fp32, fp32_ref) <= TRITON_VS_TORCH_INT4_FP32
    # T = S*H*k but head 0 holds one route more than S*k: any CSR computes as the torch path does; declared
    # top-k routes (the layer's) take the per-head grids' layout, and offsets that break it give NaN
    offsets = routes[2].clone()
    offsets[module.num_experts] += 1
    with torch.no_grad():
        other = triton_mh_moe_forward(x.float(), routes[0], routes[1], offsets, *banks, scales=scales)
        other_ref = torch_mh_moe_forward(x.float(), routes[0], routes[1], offsets, *banks, scales=scales)
        bad = triton_mh_moe_forward(x.float(), routes[0], routes[1], offsets, *banks, scales=scales, top_k_routes=True)
    assert rel_l2(other, other_ref) <= TRITON_VS_TORCH_INT4_FP32
    assert torch.isnan(bad).all()


def test_int4_auto_picks_triton_on_cuda_and_a_gpu_below_sm80_is_refused(monkeypatch) -> None:
    """``auto`` takes the Triton kernel on CUDA for int4 experts as for the others; a GPU below compute capability
    8.0 is refused at ``set_backend("triton")`` and per call, naming the backend that runs there."""
    cuda = torch.device("cuda")
    assert resolve_backend("moe_experts", "auto", cuda) == "triton"
    assert resolve_backend("moe_experts", "auto", cuda, sync_free=True) == "triton"
    assert resolve_backend("moe_experts", "auto", torch.device("cpu")) == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    message = r"int4 experts need a GPU with compute capability >= 8.0.*Tesla T4 has 7.5.*set_moe_backend\('torch'\)"
    with pytest.raises(ValueError, match=message):
        check_int4_device(cuda)
    check_int4_device(torch.device("cpu"))  # the interpreter runs int4
    check_int4_capability((8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.0"):
        x, routes, banks, scales = _meta_released_int4_call()
        launch_specs(x, routes, banks, scales=scales, deterministic=False, capability=(7, 5))

    def refuse(storage, device):
        raise ValueError("int4 refused")

    monkeypatch.setattr(experts_triton, "check_storage_device", refuse)
    module = _module()
    with pytest.raises(ValueError, match="int4 refused"):
        module.set_backend("triton")
    x = torch.randn(4, 2, 64).bfloat16()
    routes, banks, scales = _routes_and_banks(module, x)
    with pytest.raises(ValueError, match="int4 refused"):
        triton_mh_moe_forward(x, *routes, *banks, scales=scales)


def _meta_released_int4_call():
    """``(x, routes, weights)`` and ``scales=`` of a released-size int4 call on meta tensors (no memory)."""
    with moe_tensors_on_meta():
        module = Magi2MultiHeadMoE(
            Magi2MultiHeadMoEConfig(3072, 12, 256, 6, 1280, torch.bfloat16, expert_dtype="int4", route_scale=4.9)
        )
    x = torch.empty(16, 12, 256, dtype=torch.bfloat16, device="meta")
    routes = [torch.empty(16 * 72, dtype=torch.int32, device="meta"), torch.empty(16 * 72, device="meta")]
    routes.append(torch.empty(12 * 256 + 1, dtype=torch.int64, device="meta"))
    banks = [module.get_parameter(n) for n in BANKS]
    return x, routes, banks, [module.get_buffer(n) for n in INT4_SCALE_NAMES]


def test_int4_triton_launches_one_head_at_a_time_on_a_reused_bank_buffer() -> None:
    """At the released size (meta tensors): one launch per head, each on the same three ``[E, K, N]`` bf16 buffers
    (0.5 GB: one head's bank, never the layer's), its grid sized by the head's ``S*k`` routes for top-k routes (by
    all ``T`` for a CSR of another form)."""
    x, routes, banks, scales = _meta_released_int4_call()
    any_csr = launch_specs(x, routes, banks, scales=scales, deterministic=False, capability=(9, 0))
    assert {spec.num_routes for spec in any_csr} == {16 * 72}
    specs = launch_specs(x, routes, banks, scales=scales, deterministic=False, capability=(9, 0), top_k_routes=True)
    assert len(specs) == 12 and all(spec.out is specs[0].out for spec in specs)
    buffers = [spec.make_args(routes[2][:257].int())[1:4] for spec in specs]
    assert [tuple(b.shape) for b in buffers[0]] == [(256, 256, 1280), (256, 256, 1280), (256, 1280, 256)]
    assert all(b.dtype == torch.bfloat16 for b in buffers[0])
    assert all(all(a is b for a, b in zip(buffers[0], head)) for head in buffers)
    assert sum(b.numel() * 2 for b in buffers[0]) == 256 * 3 * 256 * 1280 * 2  # 0.50 GB
    assert {spec.num_routes for spec in specs} == {16 * 6} and {spec.offsets.numel() for spec in specs} == {257}
    assert all(spec.prepare is not None for spec in specs)


def test_int4_expert_parallel_slices_codes_and_group_scales() -> None:
    torch.manual_seed(0)
    full = int4_copy(Magi2MultiHeadMoE(tiny_config(num_heads=3, num_experts=4, head_dim=16, expert_dim=16)), 8)
    assert_ep_ranks_match(full, 2, BANKS + INT4_SCALE_NAMES)


def test_int4_codes_and_scales_survive_dtype_moves() -> None:
    module = _module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    for move in (lambda m: m.to(torch.float32), lambda m: m.half(), lambda m: m.to("cpu", torch.bfloat16)):
        move(module)
        for name in BANKS + INT4_SCALE_NAMES:
            t = module.state_dict()[name]
            assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name


def test_int4_released_size_bytes_with_scales_within_0_30_of_bf16() -> None:
    config = {"hidden_size": 3072, "num_heads": 12, "num_experts": 256, "top_k": 6, "expert_intermediate_size": 1280}
    with moe_tensors_on_meta():
        int4 = Magi2MultiHeadMoE(Magi2MultiHeadMoEConfig(**config, params_dtype=torch.bfloat16, expert_dtype="int4"))
        bf16 = Magi2MultiHeadMoE(Magi2MultiHeadMoEConfig(**config, params_dtype=torch.bfloat16))

    def expert_bytes(module, names):
        return sum(t.numel() * t.element_size() for n, t in module.state_dict().items() if n in names)

    ratio = expert_bytes(int4, BANKS + INT4_SCALE_NAMES) / expert_bytes(bf16, BANKS)
    print(f"\nint4 routed experts (NF4 g128, bf16 scales) / bf16, one released layer: {ratio:.4f}")
    assert ratio == (4 + 16 / 128) / 16 and ratio <= 0.30  # 4.125 bits per weight


@pytest.mark.parametrize(
    ("head_dim", "expert_dim", "group", "match"),
    [
        (64, 64, 48, r"W_gate/W_up \[R, K=64, N=64\]: the int4 group size int4_group_size=48 does not divide K=64"),
        (64, 96, 64, r"W_down \[R, K=96, N=64\]: the int4 group size int4_group_size=64 does not divide K=96"),
        (64, 64, 0, "int4_group_size must be a positive int"),
    ],
)
def test_int4_config_refuses_a_group_size_that_does_not_divide_the_banks(head_dim, expert_dim, group, match) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config(head_dim=head_dim, expert_dim=expert_dim, expert_dtype="int4", int4_group_size=group)
