"""The storage objects (:mod:`diffusers_magi2.moe.expert_storage`), one per routed-expert format, against values
computed here: the tensors each creates, quantization and dequantization, the per-expert and per-head banks the
backends read, the kernel dtypes, the dtype-move rule, and the banks each refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusers_magi2.moe.expert_formats import expert_storage
from diffusers_magi2.moe.expert_storage import BANKS
from diffusers_magi2.moe.quantize_int4 import NF4_LEVELS


ROWS, DH, DE = 6, 32, 16  # 2 heads x 3 experts
FORMATS = ["bf16", "fp32", "fp8", "int4"]


def storage(name: str):
    return {
        "bf16": lambda: expert_storage(None, torch.bfloat16),
        "fp32": lambda: expert_storage(None, torch.float32),
        "fp8": lambda: expert_storage("float8_e4m3fn"),
        "int4": lambda: expert_storage("int4", int4_group_size=8),
    }[name]()


#: (bank dtype, scale dtype, (bank shape, scale shape) of W_gate [R, Dh, De] and W_down [R, De, Dh]) per format
EXPECTED = {
    "bf16": (torch.bfloat16, None, (((6, 32, 16), None), ((6, 16, 32), None))),
    "fp32": (torch.float32, None, (((6, 32, 16), None), ((6, 16, 32), None))),
    "fp8": (torch.float8_e4m3fn, torch.float32, (((6, 32, 16), (6, 16)), ((6, 16, 32), (6, 32)))),
    "int4": (torch.uint8, torch.bfloat16, (((6, 32, 8), (6, 4, 16)), ((6, 16, 16), (6, 2, 32)))),
}


def _bank(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * shape[1] ** -0.5


def _int4_values(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``NF4[c] * s[k // G]`` unpacked nibble by nibble (even column in the low nibble)."""
    rows, k, half = codes.shape
    levels = torch.tensor(NF4_LEVELS)
    out = torch.empty(rows, k, 2 * half)
    out[..., 0::2] = levels[(codes & 15).long()]
    out[..., 1::2] = levels[(codes >> 4).long()]
    return out * scale.float().repeat_interleave(group, dim=1)


@pytest.mark.parametrize("name", FORMATS)
def test_each_storage_creates_todays_tensors_on_meta_under_todays_names(name) -> None:
    module, store = nn.Module(), storage(name)
    store.create_banks(module, ROWS, DH, DE, device="meta")
    bank_dtype, scale_dtype, shapes = EXPECTED[name]
    for bank, (bank_shape, scale_shape) in zip(("W_gate", "W_down"), shapes):
        param = module.get_parameter(bank)
        assert (param.shape, param.dtype, param.is_meta) == (bank_shape, bank_dtype, True)
        assert param.requires_grad is (scale_dtype is None)  # quantized banks are frozen
    assert module.get_parameter("W_up").shape == shapes[0][0]
    scales = dict(module.named_buffers())
    assert list(scales) == list(store.scale_names)
    for scale_name, (_, scale_shape) in zip(store.scale_names[::2], shapes):
        assert (scales[scale_name].shape, scales[scale_name].dtype) == (scale_shape, scale_dtype)


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_and_dequantize_against_the_format_rule(name) -> None:
    store, weight = storage(name), _bank((ROWS, DH, DE))
    stored, scale = store.quantize(weight)
    if name in ("bf16", "fp32"):
        assert scale is None and torch.equal(stored, weight.to(stored.dtype))
        assert torch.equal(store.dequantize(stored, None), stored.float())
        return
    if name == "fp8":
        s = weight.abs().amax(dim=1) / 448.0  # one scale per (expert, output channel)
        assert torch.equal(scale, s)
        assert torch.equal(stored, (weight / s.unsqueeze(1)).to(torch.float8_e4m3fn))
        want = stored.float() * s.unsqueeze(1)
    else:
        want = _int4_values(stored, scale, 8)
        err = (want - weight).norm() / weight.norm()
        assert err < 0.15, err  # NF4 at G=8: a coarse but faithful copy
    assert torch.equal(store.dequantize(stored, scale), want)


@pytest.mark.parametrize("name", FORMATS)
def test_the_banks_a_backend_reads_are_the_dequantized_rows(name) -> None:
    """Per expert (:meth:`expert_matrices`, a head loaded first) and per head (:meth:`head_banks`, into reused
    buffers where the format writes them): each the fp32 (or ``dtype``) values of those rows."""
    store = storage(name)
    full = [_bank(shape, i) for i, shape in enumerate(((ROWS, DH, DE), (ROWS, DH, DE), (ROWS, DE, DH)))]
    quantized = [store.quantize(w) for w in full]
    weights, scales = [q for q, _ in quantized], [s for _, s in quantized]
    scales = None if scales[0] is None else scales
    dense = [store.dequantize(w, None if scales is None else s) for w, s in zip(weights, scales or (None,) * 3)]
    matrices, scratch = store.expert_matrices(weights, scales), [None] * 3
    for head in range(2):
        experts = slice(3 * head, 3 * head + 3)
        matrices.load_head(experts)
        for g in range(experts.start, experts.stop):
            assert all(torch.equal(m[g], d[g]) for m, d in zip(matrices, dense))
        banks = store.head_banks(weights, scales, experts, torch.float32, scratch)
        assert all(torch.equal(b, d[experts]) for b, d in zip(banks, dense))
        half = store.head_banks(weights, scales, experts, torch.bfloat16, [None] * 3)
        assert all(b.dtype == torch.bfloat16 and torch.equal(b, d[experts].bfloat16()) for b, d in zip(half, dense))
    if name == "int4":  # the second head reused the first head's buffers
        assert scratch[0] is not None and scratch[0].shape == (3, DH, DE)


@pytest.mark.parametrize(
    ("name", "hidden", "tile", "grad"),
    [
        ("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16),
        ("fp32", torch.float32, torch.float32, torch.float32),
        ("fp8", torch.float16, torch.float8_e4m3fn, torch.float32),
        ("int4", torch.float16, torch.float16, torch.float32),
    ],
)
def test_what_a_kernel_is_told(name, hidden, tile, grad) -> None:
    """For fp16 activations: the swiglu7 rounding dtype (the W_down dtype, or the activations' for quantized
    experts), the fused kernel's weight tiles (int4: its dequantized bank), the gradient dtype, the GPUs."""
    store = storage(name)
    assert (store.hidden_dtype(torch.float16), store.kernel_dtype(torch.float16), store.grad_dtype()) == (
        hidden,
        tile,
        grad,
    )
    assert (store.scaled_kernel, store.per_head_kernel) == (name == "fp8", name == "int4")
    floor = {"fp8": (8, 9), "int4": (8, 0)}.get(name)
    store.check_capability(None)  # the interpreter runs every format
    store.check_capability((9, 0))
    if floor is not None:
        with pytest.raises(ValueError, match=rf"compute capability >= {floor[0]}\.{floor[1]}.*T4 has 7\.5"):
            store.check_capability((7, 5), "T4")


@pytest.mark.parametrize("name", FORMATS)
def test_a_dtype_move_keeps_quantized_storage(name) -> None:
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig

    expert_dtype = {"fp8": "float8_e4m3fn", "int4": "int4"}.get(name)
    config = Magi2MultiHeadMoEConfig(64, 2, 3, 2, DE, torch.float32, expert_dtype=expert_dtype, int4_group_size=8)
    module = Magi2MultiHeadMoE(config)
    before = {n: module.get_parameter(n).dtype for n in BANKS}
    before.update({n: module.get_buffer(n).dtype for n in module.expert_scale_names})
    module.to(torch.float16)
    after = {n: t.dtype for n, t in [*module.named_parameters(), *module.named_buffers()] if n in before}
    assert after == (before if expert_dtype else dict.fromkeys(BANKS, torch.float16))
    assert (expert_dtype is not None) is module.expert_storage.keeps_dtype
    assert module.extra_repr().endswith(
        {"fp8": "expert_dtype=float8_e4m3fn", "int4": "expert_dtype=int4, group_size=8"}.get(name, "local_heads=2")
    )


@pytest.mark.parametrize("name", FORMATS)
def test_a_bank_it_cannot_hold_is_refused_naming_the_tensor_before_anything_is_written(name) -> None:
    store = storage(name)
    with pytest.raises(ValueError, match=r"blocks.1.W_up: checkpoint shape \[6, 32, 8\], the model expects"):
        store.check_bank("blocks.1.W_up", (ROWS, DH, 8), (ROWS, DH, DE))
    weight = _bank((ROWS, DH, DE))
    weight[4, 3, 5] = float("nan")
    kept = weight.clone()
    with pytest.raises(ValueError, match=r"blocks.1.W_up holds a non-finite weight \(nan\) in expert 1 of head 1"):
        store.quantize(weight, name="blocks.1.W_up", num_experts=3)
    assert torch.equal(weight.nan_to_num(), kept.nan_to_num())  # the bank is left as it was


def test_int4_refuses_a_group_size_that_does_not_divide_k_naming_the_tensor() -> None:
    store = expert_storage("int4", int4_group_size=12)
    with pytest.raises(ValueError, match=r"blocks.1.W_down \[R, K=16, N=32\]: the int4 group size .*=12 does not"):
        store.check_bank("blocks.1.W_down", (ROWS, DE, DH), (ROWS, DE, DH), "expert_int4_group_size")
    with pytest.raises(ValueError, match=r"W_gate/W_up \[R, K=32, N=16\]: the int4 group size int4_group_size=12"):
        store.check_banks(DH, DE, "int4_group_size")
    with pytest.raises(ValueError, match=r"W_gate \[R, K=32, N=16\].*does not divide K=32"):
        store.quantize(_bank((ROWS, DH, DE)), name="W_gate")
