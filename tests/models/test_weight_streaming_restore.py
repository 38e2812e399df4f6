"""Ending weight streaming: the blocks back in host memory by default; a device without room for them refused before
any weight moves, streaming left as it was (also when a copy fails midway); the pipeline's budget checked likewise."""

from __future__ import annotations

import pytest
import torch
from helpers.modular_testing_utils import tiny_pipelines
from helpers.tiny_transformer import tiny_inputs
from helpers.weight_streaming_testing import assert_bitwise, bf16_model, run_model

import diffusers_magi2.models.weight_streaming_restore as restore
from diffusers_magi2.models.weight_streaming import WEIGHT_STREAMING_HOOK, WeightStreamer
from diffusers_magi2.models.weight_streaming_restore import check_restore


def _nbytes(module):
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def _streamed_with_room_for_the_ring_only():
    """A model streamed on the CPU ring with a ``vram_gb`` between its streamed and its resident weights."""
    model = bf16_model()
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    full, streamed = _nbytes(model), model.weight_streaming_device_nbytes(2)
    assert streamed < full
    model.enable_weight_streaming("cpu", vram_gb=(streamed + full) / 2e9)
    return model, inputs, resident


def _still_streamed(model, inputs, resident):
    hooks = [b._diffusers_hook.get_hook(WEIGHT_STREAMING_HOOK) for b in model.transformer_blocks]
    assert model._weight_streamer is not None and all(hooks)
    assert_bitwise(run_model(model, inputs), resident)


def test_a_device_above_the_budget_is_refused_before_any_weight_moves_and_host_memory_is_the_way_out():
    model, inputs, resident = _streamed_with_room_for_the_ring_only()
    ptrs = [t.data_ptr() for t in model.parameters()]
    with pytest.raises(ValueError, match=r"above vram_gb=.* enabled with; call disable_weight_streaming\(\) without"):
        model.disable_weight_streaming(device="cpu")  # "cpu": the device it streamed to, under its vram_gb
    assert [t.data_ptr() for t in model.parameters()] == ptrs
    _still_streamed(model, inputs, resident)
    streamer = model._weight_streamer
    model.disable_weight_streaming()  # the default: host memory, no device budget
    assert model._weight_streamer is None and not streamer.slots
    assert not any(b._diffusers_hook.get_hook(WEIGHT_STREAMING_HOOK) for b in model.transformer_blocks)
    blocks = [t for b in model.transformer_blocks for t in [*b.parameters(), *b.buffers()]]
    assert all(t.device.type == "cpu" and t.untyped_storage().nbytes() == t.nbytes for t in blocks)
    assert_bitwise(run_model(model, inputs), resident)


def test_a_device_short_of_free_memory_is_refused(monkeypatch):
    model, inputs, resident = _streamed_with_room_for_the_ring_only()
    model._weight_streamer.vram_gb = None
    moved = sum(b.nbytes for b in model._weight_streamer.blocks)
    monkeypatch.setattr(restore, "device_free_bytes", lambda device: moved - 1)  # as CUDA would report
    with pytest.raises(ValueError, match=rf"copy {moved / 1e9:.2f} GB .* which has {(moved - 1) / 1e9:.2f} GB free"):
        model.disable_weight_streaming(device="cpu")
    _still_streamed(model, inputs, resident)
    monkeypatch.setattr(restore, "device_free_bytes", lambda device: moved)
    model.disable_weight_streaming(device="cpu")
    assert_bitwise(run_model(model, inputs), resident)


def test_a_copy_failing_midway_to_a_device_leaves_streaming_as_it_was(monkeypatch):
    model, inputs, resident = _streamed_with_room_for_the_ring_only()
    model._weight_streamer.vram_gb = None
    host_bytes, seen = WeightStreamer._host_bytes, []

    def out_of_memory_at_the_third_block(self, block):
        seen.append(block.index)
        if len(seen) == 3:
            raise torch.OutOfMemoryError("a stand-in for the device running out while copying")
        return host_bytes(self, block)

    monkeypatch.setattr(WeightStreamer, "_host_bytes", out_of_memory_at_the_third_block)
    with pytest.raises(torch.OutOfMemoryError):
        model.disable_weight_streaming(device="cpu")
    monkeypatch.setattr(WeightStreamer, "_host_bytes", host_bytes)
    _still_streamed(model, inputs, resident)


def test_check_restore_resolves_and_refuses():
    cpu = torch.device("cpu")
    assert check_restore(None, 10**15, 10**15, 1, cpu) is None  # host memory: nothing checked here
    assert check_restore("cpu", 10, 10**9, 1, cpu) == cpu  # exactly the budget fits
    with pytest.raises(ValueError, match=r"1.00 GB of weights resident there, above vram_gb=0.5"):
        check_restore("cpu", 10, 10**9, 0.5, cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            check_restore("cuda", 10, 10, None, cpu)


def test_the_pipeline_refuses_a_device_above_its_budget_and_streams_on():
    pipe, _ = tiny_pipelines()
    models = {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    full = sum(_nbytes(m) for m in models.values())
    pipe.enable_weight_streaming(vram_gb=1, device="cpu")
    streamed = {n: models[n]._weight_streamer for n in ("text_encoder", "transformer")}
    ptrs = [t.data_ptr() for t in pipe.transformer.parameters()]
    # the tiny pipeline's rings take more than its blocks, so no vram_gb at enable is short of every weight resident:
    # the recorded budget is set one byte short of them
    pipe._weight_streaming_budget = ((full - 1) / 1e9, *pipe._weight_streaming_budget[1:])
    with pytest.raises(ValueError, match=r"above vram_gb=.* call disable_weight_streaming\(\) without a device"):
        pipe.disable_weight_streaming(device="cpu")
    assert [t.data_ptr() for t in pipe.transformer.parameters()] == ptrs
    assert all(models[n]._weight_streamer is s for n, s in streamed.items())
    pipe.disable_weight_streaming()
    assert all(models[n]._weight_streamer is None for n in streamed)
    pipe.to("cpu")
