"""LoRA training under weight streaming on the CPU ring: gradients and an optimizer step equal the resident run bit
for bit (bf16 and int4 experts), also with every slot poisoned between uses; the backward acquires and prefetches
the blocks in reverse order; the LoRA factors stay resident; training without gradient checkpointing, or with a
streamed weight that requires grad, is refused before any block runs."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.int4_models import int4_transformer
from helpers.tiny_transformer import tiny_inputs
from helpers.weight_streaming_testing import bf16_model
from peft import LoraConfig


def _lora_model(experts: str):
    """The four-block tiny model (a two-slot ring is reused within one forward and one backward) frozen, with a
    trainable fp32 LoRA on every block's attention (random factors, so both get gradients) and per-block gradient
    checkpointing, as ``examples/train_lora.py`` sets it up."""
    model = bf16_model()
    if experts == "int4":
        model = int4_transformer(model, 16)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["linear_qkv", "linear_proj"]))
    g = torch.Generator().manual_seed(3)
    for _, p in _lora_params(model):
        p.data = torch.randn(p.shape, generator=g) * 0.05  # fp32, as cast_training_params leaves them
        p.requires_grad_(True)
    model.enable_gradient_checkpointing()
    return model.train()


def _lora_params(model):
    return [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def _train_step(model, inputs):
    """One loss, its backward and one SGD step: ``(loss, {name: grad}, {name: updated factor})``."""
    params = _lora_params(model)
    optimizer = torch.optim.SGD([p for _, p in params], lr=0.5)
    out = model(**inputs)
    loss = out.sample.float().square().mean() + out.audio_sample.float().square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in params}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grads, {n: p.detach().clone() for n, p in params}


def _assert_same_step(streamed, resident):
    assert torch.equal(streamed[0], resident[0])
    for got, want in zip(streamed[1:], resident[1:]):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(
    "experts, poison, early_stop",
    [
        ("bf16", False, True),
        ("bf16", True, True),
        ("int4", False, True),
        ("int4", True, True),
        # the recompute then runs the whole block, the streaming hook's post_forward included
        ("bf16", True, False),
    ],
)
def test_lora_gradients_and_optimizer_steps_equal_the_resident_run_bit_for_bit(experts, poison, early_stop):
    resident = _lora_model(experts)
    model = copy.deepcopy(resident)
    inputs = tiny_inputs(dtype=torch.bfloat16)
    streamer = model.enable_weight_streaming("cpu")
    if poison:
        poisoned = []

        def fill(slot: torch.Tensor) -> None:
            slot.fill_(0xFF)  # NaN in every float dtype here, out-of-range codes in the int4 banks
            poisoned.append(slot.data_ptr())

        streamer.on_release = fill
    for step in range(2):  # the second step's forward streams the blocks with the updated factors
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            want = _train_step(resident, inputs)
            _assert_same_step(_train_step(model, inputs), want)
        assert all(g.abs().sum() > 0 for g in want[1].values())  # every factor of every block got a gradient
    if poison:  # every block released once in each forward and once after its recompute
        n = len(model.transformer_blocks)
        assert len(poisoned) == 2 * 2 * n - 1 and set(poisoned) == {s.buffer.data_ptr() for s in streamer.slots}
    # the inference path still matches after training
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, resident(**inputs).sample)


def test_lora_factors_stay_resident_and_the_frozen_weights_stream():
    model = _lora_model("int4")
    lora = {id(p) for _, p in _lora_params(model)}
    streamer = model.enable_weight_streaming("cpu")
    hosts = [(b.host.data_ptr(), b.host.data_ptr() + b.host.nbytes) for b in streamer.blocks]
    slots = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.nbytes) for s in streamer.slots]

    def where(t):
        ptr = t.data_ptr()
        return (
            "host"
            if any(lo <= ptr < hi for lo, hi in hosts)
            else "ring"
            if any(lo <= ptr < hi for lo, hi in slots)
            else "resident"
        )

    seen = []

    def inside_block(module, args):
        block = next(b for b in model.transformer_blocks if module in b.modules())
        lora_at = {where(p) for p in block.parameters() if id(p) in lora}
        frozen_at = {where(t) for t in [*block.parameters(), *block.buffers()] if id(t) not in lora and t.numel()}
        seen.append((lora_at, frozen_at, torch.is_grad_enabled()))

    for b in model.transformer_blocks:
        b.attention.register_forward_pre_hook(inside_block)
    _train_step(model, tiny_inputs(dtype=torch.bfloat16))
    n = len(model.transformer_blocks)
    # forward and recompute: the frozen weights in the ring, the factors resident, grads on the resident factors
    assert seen == [({"resident"}, {"ring"}, True)] * (2 * n)
    assert streamer.host_nbytes == sum(b.nbytes for b in streamer.blocks)
    frozen = sum(t.nbytes for b in model.transformer_blocks for t in [*b.parameters(), *b.buffers()])
    frozen -= sum(p.nbytes for _, p in _lora_params(model))
    assert frozen <= streamer.host_nbytes <= frozen + 256 * sum(len(b.entries) for b in streamer.blocks)


def test_the_backward_acquires_and_prefetches_the_blocks_in_reverse_order():
    model = _lora_model("bf16")
    streamer = model.enable_weight_streaming("cpu")
    events = []
    acquire, load = streamer.acquire, streamer._load

    def record_acquire(index, step=1, hold=False):
        events.append(("acquire", index, streamer.phase))
        acquire(index, step, hold)

    def record_load(index, window):
        events.append(("copy", index, streamer.phase))
        return load(index, window)

    streamer.acquire, streamer._load = record_acquire, record_load
    _train_step(model, tiny_inputs(dtype=torch.bfloat16))
    a, c, f, r = "acquire", "copy", "forward", "recompute"
    # the forward copies block 0 when it is asked for and prefetches each next one; the backward finds blocks 3 and
    # 2 still in the ring and prefetches 1 while 2 recomputes, 0 while 1 does: no copy waits for its acquire
    assert events == [
        (a, 0, f), (c, 0, f), (c, 1, f), (a, 1, f), (c, 2, f), (a, 2, f), (c, 3, f), (a, 3, f),
        (a, 3, r), (a, 2, r), (c, 1, r), (a, 1, r), (c, 0, r), (a, 0, r),
    ]  # fmt: skip


def test_training_without_gradient_checkpointing_is_refused_before_any_block_runs():
    model = _lora_model("bf16")
    model.disable_gradient_checkpointing()
    model.enable_weight_streaming("cpu")
    ran = []
    for b in model.transformer_blocks:
        b.attention.register_forward_pre_hook(lambda module, args: ran.append(module))
    with pytest.raises(RuntimeError, match=r"grad enabled under weight streaming needs per-block gradient checkpoint"):
        model(**tiny_inputs(dtype=torch.bfloat16))
    assert ran == []
    with torch.no_grad():  # inference needs none
        model(**tiny_inputs(dtype=torch.bfloat16))
    assert len(ran) == len(model.transformer_blocks)


def test_a_streamed_weight_that_requires_grad_is_refused():
    model = _lora_model("bf16")
    model.transformer_blocks[1].attention.linear_proj.base_layer.weight.requires_grad_(True)
    model.enable_weight_streaming("cpu")
    with pytest.raises(RuntimeError, match=r"block 1: 1 streamed weight\(s\) require grad .* only the PEFT adapters"):
        model(**tiny_inputs(dtype=torch.bfloat16))
