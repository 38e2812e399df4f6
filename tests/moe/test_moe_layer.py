"""`Magi2MultiHeadMoE` / `Magi2MultiHeadMoEConfig`: tensors and keys, EP bookkeeping without a distributed
runtime, backend choice, bad input, and no per-forward repack of the expert bank."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.moe_cases import AllocationRecorder, build_module, load_case, tiny_config

from diffusers_magi2.moe import experts, experts_triton
from diffusers_magi2.moe.experts import torch_mh_moe_forward
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.moe.routing import global_sort_routes


BANKS = ("W_gate", "W_up", "W_down")


def test_tensors_keys_shapes_and_dtypes() -> None:
    module = Magi2MultiHeadMoE(
        tiny_config(num_heads=3, num_experts=4, head_dim=16, expert_dim=32, dtype=torch.bfloat16)
    )
    state = module.state_dict()
    assert set(state) == {"gate", "W_gate", "W_up", "W_down", "router.expert_bias", "router.expert_bias_ema"}
    params = dict(module.named_parameters())
    assert set(params) == set(state)  # the router biases are (frozen) parameters, as in the seed
    assert [n for n, p in params.items() if not p.requires_grad] == ["router.expert_bias", "router.expert_bias_ema"]
    assert state["gate"].shape == (12, 16) and state["gate"].dtype == torch.float32
    assert state["W_gate"].shape == (12, 16, 32) and state["W_gate"].dtype == torch.bfloat16
    assert state["W_up"].shape == (12, 16, 32) and state["W_up"].dtype == torch.bfloat16
    assert state["W_down"].shape == (12, 32, 16) and state["W_down"].dtype == torch.bfloat16
    for key in ("router.expert_bias", "router.expert_bias_ema"):
        assert state[key].shape == (12,) and state[key].dtype == torch.float32


def expected_layout(num_heads: int, size: int, rank: int) -> dict:
    """Independent arithmetic of SandAI's EP head padding (``CoreMultiHeadMoE``)."""
    padded = math.ceil(num_heads / size) * size
    local = padded // size
    start = rank * local
    real = [h for h in range(start, start + local) if h < num_heads]
    return {"padded": padded, "local": local, "start": start, "real": len(real), "pad": padded - num_heads}


@pytest.mark.parametrize("num_heads", [12, 3])
@pytest.mark.parametrize("ep_size", range(1, 9))
def test_ep_bookkeeping_and_ep_slice(num_heads: int, ep_size: int) -> None:
    experts, dh, de = 2, 16, 16
    cfg = tiny_config(num_heads=num_heads, num_experts=experts, head_dim=dh, expert_dim=de)
    full = {
        "gate": torch.arange(num_heads * experts * dh, dtype=torch.float32).view(-1, dh) + 1,
        "W_down": torch.arange(num_heads * experts * de * dh, dtype=torch.float32).view(-1, de, dh) + 1,
        "router.expert_bias": torch.arange(num_heads * experts, dtype=torch.float32) + 1,
    }
    covered = torch.zeros(num_heads * experts, dtype=torch.int64)
    idle_ranks = []
    for rank in range(ep_size):
        module = Magi2MultiHeadMoE(cfg, ep_rank=rank, ep_size=ep_size)
        exp = expected_layout(num_heads, ep_size, rank)
        assert module.padded_num_heads == exp["padded"]
        assert module.local_num_heads == exp["local"]
        assert module.local_head_start == exp["start"]
        assert module.ep_pad_heads == exp["pad"]
        assert module.local_real_num_heads == exp["real"]
        assert module.has_real_moe_heads == (exp["start"] < num_heads)
        assert module.local_flatten_num_experts == exp["local"] * experts
        assert module.gate.shape == (exp["local"] * experts, dh)
        assert module.W_gate.shape == (exp["local"] * experts, dh, de)
        assert module.router.expert_bias.shape == (exp["local"] * experts,)
        if not module.has_real_moe_heads:
            idle_ranks.append(rank)
        # padded heads are initialised to zero
        assert (module.W_down[exp["real"] * experts :] == 0).all()
        for name, tensor in full.items():
            local = module.ep_slice(tensor)
            assert local.shape == (exp["local"] * experts, *tensor.shape[1:])
            for j in range(exp["local"]):
                head = exp["start"] + j
                rows = local[j * experts : (j + 1) * experts]
                if head < num_heads:
                    assert torch.equal(rows, tensor[head * experts : (head + 1) * experts])
                    if name == "router.expert_bias":
                        covered[head * experts : (head + 1) * experts] += 1
                else:
                    assert (rows == 0).all()
            if exp["real"] == exp["local"]:
                assert local.data_ptr() == tensor[exp["start"] * experts :].data_ptr()  # zero-copy view
    assert (covered == 1).all()  # every real head owned by exactly one rank
    assert idle_ranks == [r for r in range(ep_size) if r * (math.ceil(num_heads / ep_size)) >= num_heads]
    if ep_size == 1:
        module = Magi2MultiHeadMoE(cfg)
        assert module.ep_slice(full["gate"]).data_ptr() == full["gate"].data_ptr()
    if (num_heads, ep_size) == (12, 8):
        assert idle_ranks == [6, 7]


def ep_module_from_full(full: Magi2MultiHeadMoE, rank: int, size: int) -> Magi2MultiHeadMoE:
    local = Magi2MultiHeadMoE(full.config, ep_rank=rank, ep_size=size)
    local.load_state_dict({k: local.ep_slice(v) for k, v in full.state_dict().items()})
    return local


@pytest.mark.parametrize(("num_heads", "ep_size"), [(3, 2), (4, 3), (3, 4)])
def test_forward_local_heads_reassembles_single_device_result(num_heads: int, ep_size: int) -> None:
    """Each rank's heads, computed from ep_slice'd weights, equal the single-device output (EP-ready forward)."""
    torch.manual_seed(0)
    full = Magi2MultiHeadMoE(tiny_config(num_heads=num_heads, num_experts=4, head_dim=16, expert_dim=16))
    with torch.no_grad():
        full.router.expert_bias.normal_(0, 0.1)
    hidden = torch.randn(7, num_heads * 16)
    ref = full(hidden).view(7, num_heads, 16)
    x = hidden.view(7, num_heads, 16)
    for rank in range(ep_size):
        local = ep_module_from_full(full, rank, ep_size)
        start, n = local.local_head_start, local.local_num_heads
        x_local = torch.zeros(7, n, 16)
        real = local.local_real_num_heads
        x_local[:, :real] = x[:, start : start + real]
        out = local.forward_local_heads(x_local)
        assert out.shape == (7, n, 16)
        torch.testing.assert_close(out[:, :real], ref[:, start : start + real], atol=1e-6, rtol=1e-6)
        assert (out[:, real:] == 0).all()


def test_idle_rank_returns_zeros_without_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    module = Magi2MultiHeadMoE(
        tiny_config(num_heads=12, num_experts=2, head_dim=16, expert_dim=16), ep_rank=7, ep_size=8
    )
    assert not module.has_real_moe_heads
    monkeypatch.setattr(module, "route", lambda *_: pytest.fail("idle rank must not route"))
    out = module.forward_local_heads(torch.randn(5, 2, 16))
    assert out.shape == (5, 2, 16) and (out == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_forward_fp32_and_bf16(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    module = Magi2MultiHeadMoE(tiny_config(dtype=dtype))
    hidden = torch.randn(16, 128).to(dtype)
    out = module(hidden)
    assert out.dtype == dtype and out.shape == (16, 128)
    # independent recomputation from the public pieces
    x = hidden.view(16, 2, 64)
    probs, idx = module.route(x)
    torch.testing.assert_close(probs.sum(-1), torch.full((2, 16), 4.9), atol=1e-5, rtol=0)  # route_scale once
    ref = torch_mh_moe_forward(x, *global_sort_routes(probs, idx, 8), module.W_gate, module.W_up, module.W_down)
    assert torch.equal(out.view(16, 2, 64), ref)
    assert module(hidden[:0]).shape == (0, 128)


def test_set_backend_triton_matches_torch_on_fixture() -> None:
    case = load_case("preview_h4", "fp32", 1)
    module = build_module("preview_h4", 1, torch.float32)
    module.set_backend("torch")
    ref = module(case["core.x"])
    module.set_backend("triton", deterministic=True)
    assert module.backend == "triton" and module.deterministic
    out = module(case["core.x"])
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_auto_backend_uses_torch_on_cpu_and_requested_backend_failure_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    module = Magi2MultiHeadMoE(tiny_config(num_heads=2, num_experts=2, head_dim=16, expert_dim=16))
    hidden = torch.randn(4, 32)

    def boom(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(experts_triton, "triton_mh_moe_forward", boom)
    module.set_backend("auto")
    module(hidden)  # CPU tensors: auto = torch, the kernel is not called
    module.set_backend("triton")
    with pytest.raises(RuntimeError, match="kernel failed"):  # no silent fallback to torch
        module(hidden)


def test_set_backend_bad_input() -> None:
    module = Magi2MultiHeadMoE(tiny_config(num_heads=2, num_experts=2, head_dim=16, expert_dim=16))
    with pytest.raises(ValueError, match="backend must be one of"):
        module.set_backend("cuda")
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        module.set_backend("torch", deterministic="yes")
    odd = Magi2MultiHeadMoE(tiny_config(num_heads=2, num_experts=2, head_dim=24, expert_dim=16))
    with pytest.raises(ValueError, match="multiple of 16"):
        odd.set_backend("triton")
    assert odd.backend == "auto"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 100, "num_heads": 3}, "divisible by num_heads"),
        ({"top_k": 9}, r"top_k must be in \[1, num_experts=8\]"),
        ({"top_k": 0}, "top_k must be a positive int"),
        ({"num_experts": 0}, "num_experts must be a positive int"),
        ({"score_func": "relu"}, "score_func"),
        ({"params_dtype": "int8"}, "params_dtype"),
        ({"params_dtype": torch.float64}, "params_dtype"),
        ({"route_scale": float("nan")}, "route_scale"),
    ],
)
def test_config_bad_input(kwargs, match) -> None:
    base = {"hidden_size": 128, "num_heads": 2, "num_experts": 8, "top_k": 2, "expert_intermediate_size": 64}
    base["params_dtype"] = torch.bfloat16
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Magi2MultiHeadMoEConfig(**base)


def test_config_accepts_dtype_strings() -> None:
    cfg = Magi2MultiHeadMoEConfig(128, 2, 8, 2, 64, "bfloat16", route_scale=4.9)
    assert cfg.params_dtype is torch.bfloat16 and cfg.head_dim == 64


def test_module_bad_input() -> None:
    cfg = tiny_config()
    with pytest.raises(ValueError, match="config must be"):
        Magi2MultiHeadMoE(dict(cfg.__dict__))
    with pytest.raises(ValueError, match="ep_size must be a positive int"):
        Magi2MultiHeadMoE(cfg, ep_size=0)
    with pytest.raises(ValueError, match=r"ep_rank must be an int in \[0, ep_size=2\)"):
        Magi2MultiHeadMoE(cfg, ep_rank=2, ep_size=2)
    module = Magi2MultiHeadMoE(cfg)
    with pytest.raises(ValueError, match="2-D tensor"):
        module(torch.randn(2, 3, 128))
    with pytest.raises(ValueError, match="hidden_size=128"):
        module(torch.randn(3, 64))
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        module(torch.randn(3, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="first dimension H\\*E = 16"):
        module.ep_slice(torch.randn(8, 64))
    hidden = torch.randn(4, 128)
    assert torch.equal(module(hidden, ep_token_counts=[4]), module(hidden))  # one rank holding every token
    for bad in ([9, 9, 9], [5], [True]):
        with pytest.raises(ValueError, match=r"ep_token_counts must be None or \[4\]"):
            module(hidden, ep_token_counts=bad)


@pytest.mark.parametrize(
    ("backend", "dtype"), [("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.float32)]
)
def test_no_expert_bank_repack_per_forward(backend: str, dtype: torch.dtype) -> None:
    """In the second forward no allocating op produces >= W_gate.numel() elements (TINY layer, 16 tokens); the
    expert op's body (opaque to a dispatch mode around the module) is recorded on its own."""
    torch.manual_seed(2)
    module = Magi2MultiHeadMoE(tiny_config(dtype=dtype))
    module.set_backend(backend)
    hidden = torch.randn(16, 128).to(dtype)
    x = hidden.view(16, 2, 64)
    with torch.no_grad():
        module(hidden)
        routes = global_sort_routes(*module.route(x), module.num_experts)
        body = experts._torch_experts if backend == "torch" else experts_triton.triton_mh_moe_forward
        recorders = [AllocationRecorder(), AllocationRecorder()]
        with recorders[0]:
            module(hidden)
        with recorders[1]:
            if backend == "torch":
                body(x, routes, (module.W_gate, module.W_up, module.W_down))
            else:
                body(x, *routes, module.W_gate, module.W_up, module.W_down)
    limit = module.W_gate.numel()
    assert limit == 65536
    for recorder in recorders:
        assert recorder.allocations, "the recorder saw no ops"
        too_big = [(op, n) for op, n in recorder.allocations if n >= limit]
        assert not too_big, too_big
    # the body's own ops were seen, not the opaque op
    assert len(recorders[1].allocations) > 1 and not any("diffusers_magi2" in op for op, _ in recorders[1].allocations)


@pytest.mark.parametrize("expert_dtype", ["float8_e4m3fn", "int4"])
def test_dtype_moves_of_quantized_experts_convert_no_bank_and_keep_the_output(expert_dtype: str) -> None:
    """``.to(dtype)`` / ``.half()`` on FP8 or int4 experts moves the banks and scales at most, never converts them
    (not even into a copy thrown away): no op allocates more elements than the largest dense tensor holds, the
    stored tensors stay bit for bit, and so does the output after moves that leave the fp32 gate as it is."""
    torch.manual_seed(3)
    int4 = {"int4_group_size": 16} if expert_dtype == "int4" else {}  # int4 scales [16, 4, 64]: more than dense
    module = Magi2MultiHeadMoE(tiny_config(dtype=torch.bfloat16, expert_dtype=expert_dtype, **int4))
    kept = set(BANKS + module.expert_scale_names)
    before = {n: t.clone() for n, t in module.state_dict().items() if n in kept}
    dense = max(t.numel() for n, t in module.state_dict().items() if n not in kept)
    assert all(before[name].numel() > dense for name in BANKS)
    hidden = torch.randn(16, 128).bfloat16()
    with torch.no_grad():
        reference = module(hidden)

    def move_without_converting(*moves) -> None:
        recorder = AllocationRecorder()
        with recorder:
            for move in moves:
                move(module)
        assert recorder.allocations, "the recorder saw no ops"
        too_big = [(op, n) for op, n in recorder.allocations if n > dense]
        assert not too_big, too_big
        for name, t in before.items():
            now = module.state_dict()[name]
            assert now.dtype == t.dtype and torch.equal(now.view(torch.uint8), t.view(torch.uint8)), name

    move_without_converting(lambda m: m.to(torch.float32), lambda m: m.to("cpu", torch.float32))  # gate: fp32
    with torch.no_grad():
        assert torch.equal(module(hidden), reference)
    move_without_converting(lambda m: m.half(), lambda m: m.to("cpu", torch.bfloat16))
