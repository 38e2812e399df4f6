"""The device ring (on the CPU): poisoned slots between uses, a forward that raised inside a block, what the ring and
the host hold while each block computes, and the pinned arenas handed back when the ring is freed."""

from __future__ import annotations

import pytest
import torch
from helpers.int4_models import int4_transformer
from helpers.tiny_transformer import tiny_inputs
from helpers.weight_streaming_testing import assert_bitwise, bf16_model, block_tensors, run_model, with_lora


def test_poisoned_slots_between_uses_give_the_same_output():
    model = int4_transformer(bf16_model(), 16)
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    streamer = model.enable_weight_streaming("cpu")
    poisoned = []

    def poison(slot: torch.Tensor) -> None:
        slot.fill_(0xFF)  # NaN in every float dtype here, out-of-range codes in the int4 banks
        poisoned.append(slot.data_ptr())

    streamer.on_release = poison
    assert_bitwise(run_model(model, inputs), resident)
    assert len(poisoned) == len(model.transformer_blocks) and len(set(poisoned)) == len(streamer.slots) == 2


def test_a_forward_that_raised_inside_a_streamed_block_leaves_the_next_call_exact():
    model = bf16_model()
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    streamer = model.enable_weight_streaming("cpu")
    inner = next(m for m in model.transformer_blocks[2].modules() if isinstance(m, torch.nn.Linear))

    def raise_once(module, args, kwargs):  # e.g. an out-of-memory error inside the block
        handle.remove()
        raise RuntimeError("out of memory")

    handle = inner.register_forward_pre_hook(raise_once, with_kwargs=True)  # inside the block, its slot taken
    with pytest.raises(RuntimeError, match="out of memory"):
        run_model(model, inputs)
    assert any(s.in_use for s in streamer.slots)  # block 2's slot was left taken
    assert_bitwise(run_model(model, inputs), resident)
    assert not any(s.in_use for s in streamer.slots)
    streamer.free()  # a stage release after an aborted call frees the buffers too
    assert all(t.numel() == 0 for t in block_tensors(model))


def test_ring_holds_at_most_ring_size_blocks_and_the_host_holds_the_weights_once():
    model = with_lora(int4_transformer(bf16_model(), 16))
    inputs = tiny_inputs(dtype=torch.bfloat16)
    lora = {id(p) for n, p in model.named_parameters() if ".lora_" in n}

    def frozen(block):  # what streams: every tensor but the LoRA factors, which stay resident
        return [t for t in [*block.parameters(), *block.buffers()] if id(t) not in lora]

    weights = {t.data_ptr(): t.nbytes for t in block_tensors(model) if id(t) not in lora}
    streamer = model.enable_weight_streaming("cpu", ring_size=3)
    blocks = list(model.transformer_blocks)
    sizes = [sum(t.nbytes for t in frozen(b)) for b in blocks]
    slots = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.nbytes) for s in streamer.slots]
    # the ring: ring_size slots of the largest block (tensors at 256-byte offsets), and nothing else
    assert streamer.ring_nbytes == sum(s.buffer.nbytes for s in streamer.slots) == 3 * streamer.slots[0].buffer.nbytes
    assert max(sizes) <= streamer.slots[0].buffer.nbytes <= max(sizes) + 256 * len(list(blocks[0].parameters())) * 2
    # the host: one buffer per block, every block tensor a view into it, the weights once (plus alignment)
    assert streamer.host_nbytes == streamer.host_reserved_nbytes == sum(b.host.nbytes for b in streamer.blocks)
    assert sum(weights.values()) <= streamer.host_nbytes <= sum(weights.values()) + 256 * len(weights)
    hosts = {b.host.untyped_storage().data_ptr() for b in streamer.blocks}
    for b in streamer.blocks:
        ptrs = {t.untyped_storage().data_ptr() for t in frozen(b.module) if t.numel()}
        assert ptrs == {b.host.untyped_storage().data_ptr()}
        assert not hosts & {p.untyped_storage().data_ptr() for p in b.module.parameters() if id(p) in lora}
    seen = []

    def inside_block(module, args):
        in_ring = [
            sum(t.nbytes for t in frozen(b) if any(lo <= t.data_ptr() < hi for lo, hi in slots)) for b in blocks
        ]
        seen.append(in_ring)

    for b in blocks:
        b.attention.register_forward_pre_hook(inside_block)
    run_model(model, inputs)
    # while block i computes, exactly its own weights point into the ring; the others stay on the host
    assert seen == [[sizes[i] if j == i else 0 for j in range(len(blocks))] for i in range(len(blocks))]


@pytest.mark.parametrize("pinned, cuda", [(True, True), (False, True), (True, False)])
def test_freeing_or_restoring_returns_the_pinned_arenas_exactly_when_cuda_pinned_them(monkeypatch, pinned, cuda):
    # torch's pinned host allocator caches a freed block; only its host empty-cache hands it back to the OS. On the
    # CPU nothing is pinned, so the streamer is told it was (as on CUDA) and CUDA's presence is faked
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append(1), raising=False)
    for release in ("free", "disable"):  # a stage's release (release_between_stages), disable_weight_streaming
        model = bf16_model()
        streamer = model.enable_weight_streaming("cpu")
        streamer.pinned = pinned
        assert calls == []
        streamer.free() if release == "free" else model.disable_weight_streaming()
        assert calls == [1] * (pinned and cuda), release
        calls.clear()
