"""``Magi2Pipeline.enable_weight_streaming`` on the CPU ring: the two-stage call equals the resident one bit for bit;
budgets and moves refused before any weight moves."""

from __future__ import annotations

import pytest
import torch
from helpers.modular_testing_utils import tiny_pipelines
from helpers.streaming_calls import TWO_STAGE_CALL, two_stage_call

from diffusers_magi2.pipelines.weight_streaming_pipeline import STREAMED_REFINER_CHUNK_SIZE


def _encode(pipe):
    with torch.no_grad():
        return pipe.encode_prompt(TWO_STAGE_CALL["prompt"], negative_prompt="blurry", device="cpu")


def test_two_stage_call_streamed_equals_resident_bit_for_bit():
    pipe, _ = tiny_pipelines(with_refiner=True)
    resident, resident_text = two_stage_call(pipe), _encode(pipe)
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")
    # built in memory: nothing to re-read, so every streamed model stays held
    assert pipe._weight_streaming_stages.parts == {}
    assert {b.chunk_size for b in pipe.refiner.transformer_blocks} == {STREAMED_REFINER_CHUNK_SIZE}  # the plan's
    released = {"text_encoder": 0, "transformer": 0, "refiner": 0}
    for name in released:
        streamer = getattr(pipe, name)._weight_streamer

        def poison(slot, name=name):
            slot.fill_(0xFF)  # NaN bytes into each slot as it is released
            released[name] += 1

        streamer.on_release = poison
    for a, b in zip(_encode(pipe), resident_text):
        assert torch.equal(a, b)
    layers = len(pipe.text_encoder.layers)
    assert released["text_encoder"] == 2 * layers  # the prompt and the negative prompt, every layer from the ring
    for a, b in zip(two_stage_call(pipe), resident):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert released["text_encoder"] % layers == 0 and released["text_encoder"] > 2 * layers
    # every block of both models ran from the ring: (cond + uncond) x steps x blocks releases
    assert released["transformer"] % len(pipe.transformer.transformer_blocks) == 0 < released["transformer"]
    assert released["refiner"] % len(pipe.refiner.transformer_blocks) == 0 < released["refiner"]
    # refused before any component moves or is cast; the pipeline's disable then lets it move
    dtypes = {n: c.dtype for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    with pytest.raises(RuntimeError, match=r"block weights are streamed .* call pipe.disable_weight_streaming\(\)"):
        pipe.to(torch.float16)
    assert {n: c.dtype for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)} == dtypes
    pipe.disable_weight_streaming()
    assert all(getattr(pipe, n)._weight_streamer is None for n in released)
    pipe.to("cpu")


def _device_bytes(pipe, name, ring_size=2):
    """A component's weights on the device under streaming: all of it, or outside its blocks + ``ring_size`` blocks."""
    model = getattr(pipe, name, None)
    if not isinstance(model, torch.nn.Module):
        return 0
    nbytes = lambda m: sum(t.nbytes for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    if name not in ("text_encoder", "transformer", "refiner"):
        return nbytes(model)
    blocks = model.layers if name == "text_encoder" else model.transformer_blocks
    return nbytes(model) - sum(nbytes(b) for b in blocks) + ring_size * max(nbytes(b) for b in blocks)


def test_budgets_and_arguments_are_refused_before_any_weight_moves():
    pipe, _ = tiny_pipelines(with_refiner=True)
    before = [t.data_ptr() for t in pipe.transformer.parameters()]
    largest = max(
        ("text_encoder", "transformer", "refiner", "audio_vae", "vae", "video_decoder"),
        key=lambda n: _device_bytes(pipe, n),
    )
    with pytest.raises(ValueError, match=rf"vram_gb=0.001: the device would hold .* the largest is {largest} at"):
        pipe.enable_weight_streaming(vram_gb=0.001, device="cpu")
    with pytest.raises(ValueError, match=r"vram_gb must be a positive number of GB \(e.g. 24 or 32\), got 0"):
        pipe.enable_weight_streaming(vram_gb=0, device="cpu")
    with pytest.raises(ValueError, match=r"release_between_stages must be True, False or None, got 'yes'"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages="yes")
    with pytest.raises(ValueError, match=r"release_between_stages=True: text_encoder was not loaded from a folder"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages=True)
    with pytest.raises(NotImplementedError, match=r'host_memory="disk"'):
        pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu")
    if not torch.cuda.is_available():  # the default device is CUDA: a clear error, not torch's assertion
        with pytest.raises(ValueError, match=r"sees no CUDA device; pass device='cpu'"):
            pipe.enable_weight_streaming(vram_gb=24)
    assert [t.data_ptr() for t in pipe.transformer.parameters()] == before
    assert all(getattr(getattr(pipe, n), "_weight_streamer", None) is None for n in ("text_encoder", "transformer"))
