"""The disk mode of weight streaming on the CPU ring: a model loaded with ``from_pretrained`` streams its blocks from
its safetensors files bit for bit as the resident model computes (bf16 and int4 experts, FP8-stored dense weights,
a LoRA, a cast on loading, the refiner), with poisoned slots and staging buffers, also set up inside
``torch.inference_mode()``; the reads on the reader thread, each while the block before it computes (the next
forward's block 0 while the last block does; in reverse order in the backward), a failed read raised at its block,
an interrupted wait waited for again, the thread stopped with the streamer; host memory is the staging ring, not
the model; and the refusals."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import threading
import time

import pytest
import torch
from helpers.fresh_interpreter import RSS_WORKER_PRELUDE
from helpers.int4_models import int4_transformer
from helpers.modular_testing_utils import tiny_refiner
from helpers.tiny_transformer import tiny_inputs, tiny_model
from helpers.weight_streaming_testing import LAYERS, assert_bitwise, block_ptrs, refiner_inputs, run_model, with_lora

from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel
from diffusers_magi2.models.weight_streaming_disk import READER_THREAD_NAME


def _saved(model, tmp_path, cls=Magi2Transformer3DModel, **kwargs):
    model.save_pretrained(tmp_path)
    return cls.from_pretrained(tmp_path, **kwargs).eval()


def _reader_threads(before=()):
    """The disk mode's reader threads alive now, but those in ``before`` (streamers of other tests not yet collected)."""
    return [t for t in threading.enumerate() if t.name.startswith(READER_THREAD_NAME) and t not in before]


def _disk_streamed(tmp_path, inference_mode=False):
    """A bf16 tiny model loaded from ``tmp_path``, its inputs and resident output, then streamed from disk (inside
    ``torch.inference_mode()`` if asked): also the streamer and the reader threads alive before it."""
    model = _saved(tiny_model(**LAYERS).to(torch.bfloat16), tmp_path)
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    others = _reader_threads()
    with torch.inference_mode() if inference_mode else contextlib.nullcontext():
        streamer = model.enable_weight_streaming("cpu", host_memory="disk")
    return model, inputs, resident, streamer, others


def _record_reads(streamer, before=None):
    """Wrap the streamer's file reads: each, after ``before(block)`` returns, reads and records ``(block, thread
    name)``. Returns the records and ``finished(count)``: whether ``count`` reads finished within 5 s."""
    reads, read, done = [], streamer.reader.read, threading.Condition()

    def recorded(index, entries, out):
        if before is not None:
            before(index)
        read(index, entries, out)
        with done:
            reads.append((index, threading.current_thread().name))
            done.notify_all()

    def finished(count):
        with done:
            return done.wait_for(lambda: len(reads) >= count, timeout=5)

    streamer.reader.read = recorded
    return reads, finished


@pytest.mark.parametrize("variant", ["bf16", "int4", "int4+fp8 storage", "bf16+lora", "fp32 file, bf16 model"])
def test_disk_streamed_output_equals_resident_bit_for_bit(variant, tmp_path):
    model = tiny_model(**LAYERS).to(torch.float32 if variant.startswith("fp32") else torch.bfloat16)
    if variant.startswith("int4"):
        model = int4_transformer(model, 16)
    if variant.endswith("fp8 storage"):  # the dense weights stored as FP8 with per-channel scales in the files
        model.enable_fp8_storage(torch.bfloat16)
    model = _saved(model, tmp_path, torch_dtype=torch.bfloat16)
    if variant.endswith("lora"):  # the adapter is not in the files: kept in host memory, streamed with its block
        model = with_lora(model)
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    streamer = model.enable_weight_streaming("cpu", host_memory="disk")
    # between uses no streamed block tensor holds its weights: each is a broadcast placeholder of NaN bytes (the LoRA
    # factors are not streamed: resident on the device)
    streamed = [t for b in model.transformer_blocks for n, t in b.named_parameters() if t.dim() and ".lora_" not in n]
    assert all(t.stride() == (0,) * t.dim() for t in streamed)
    assert_bitwise(run_model(model, inputs), resident)
    assert_bitwise(run_model(model, inputs), resident)  # slots and staging buffers reused across calls
    model.disable_weight_streaming()
    assert not streamer.staging and all(t.stride() != (0,) for b in model.transformer_blocks for t in b.parameters())
    assert_bitwise(run_model(model, inputs), resident)


def test_refiner_disk_streamed_output_equals_resident_bit_for_bit(tmp_path):
    model = _saved(tiny_refiner().to(torch.bfloat16), tmp_path, Magi2RefinerTransformer3DModel)
    inputs = refiner_inputs(model.config)
    resident = run_model(model, inputs)
    model.enable_weight_streaming("cpu", host_memory="disk")
    assert_bitwise(run_model(model, inputs), resident)


def test_poisoned_slots_and_staging_between_uses_give_the_same_output(tmp_path):
    model = with_lora(_saved(int4_transformer(tiny_model(**LAYERS).to(torch.bfloat16), 16), tmp_path))
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    streamer = model.enable_weight_streaming("cpu", host_memory="disk")
    poisoned = []

    def poison(slot: torch.Tensor) -> None:
        # the released slot and its staging buffer (the others may be filling on the reader thread for the next block)
        k = next(k for k, s in enumerate(streamer.slots) if s.buffer is slot)
        for buffer in [slot, streamer.staging[k]]:
            buffer.fill_(0xFF)
        poisoned.append(slot.data_ptr())

    streamer.on_release = poison
    assert_bitwise(run_model(model, inputs), resident)
    assert_bitwise(run_model(model, inputs), resident)  # block 0 read while the first call's last block computed
    assert len(poisoned) == 2 * len(model.transformer_blocks) and len(set(poisoned)) == len(streamer.staging) == 2


def test_each_block_is_read_on_the_reader_thread_while_the_block_before_it_computes(tmp_path):
    model, inputs, resident, streamer, others = _disk_streamed(tmp_path)
    reads, finished = _record_reads(streamer)
    n, call = len(model.transformer_blocks), [0]

    def next_read_finishes(i):  # block i's compute waits for the read after its own: only a concurrent one comes
        assert finished(call[0] * n + i + 2), f"call {call[0]}: block {i} computed without the next block's read"

    hooks = [
        block.attention.register_forward_pre_hook(lambda module, args, i=i: next_read_finishes(i))
        for i, block in enumerate(model.transformer_blocks)
    ]
    for call[0] in range(2):
        assert_bitwise(run_model(model, inputs), resident)
    # the last block computes while the next call's block 0 is read, so only the first call waits for a read
    assert [i for i, _ in reads] == [*range(n), *range(n), 0]
    assert all(name.startswith(READER_THREAD_NAME) for _, name in reads) and len(_reader_threads(others)) == 1
    for hook in hooks:
        hook.remove()
    streamer.free()  # a stage's release: the thread stops with the buffers (the read of block 0 it had done dropped)
    assert _reader_threads(others) == []
    del streamer.reader.read
    streamer.allocate()  # the stage's return
    assert_bitwise(run_model(model, inputs), resident)
    assert len(_reader_threads(others)) == 1
    model.disable_weight_streaming()
    assert _reader_threads(others) == []
    assert_bitwise(run_model(model, inputs), resident)


def test_streaming_set_up_inside_inference_mode_runs_in_and_outside_it(tmp_path):
    """The buffers outlive the call that made them: the reader thread (outside inference mode) and later calls
    write them in place, so they are made as normal tensors."""
    model, inputs, resident, streamer, _ = _disk_streamed(tmp_path, inference_mode=True)
    with torch.inference_mode():
        assert_bitwise(run_model(model, inputs), resident)
    assert_bitwise(run_model(model, inputs), resident)
    streamer.free()
    with torch.inference_mode():
        streamer.allocate()  # a stage's refill inside a pipeline call
        assert_bitwise(run_model(model, inputs), resident)
    model.disable_weight_streaming()  # outside: the blocks read back into a staging buffer
    assert not any(t.is_inference() for t in model.parameters())
    assert_bitwise(run_model(model, inputs), resident)


def test_an_interrupted_wait_for_a_read_waits_for_it_again_at_the_next_call(tmp_path):
    model, inputs, resident, streamer, others = _disk_streamed(tmp_path)
    released = threading.Event()
    reads, _ = _record_reads(streamer, lambda i: i != 1 or released.wait(timeout=10))
    start_copy = streamer._start_copy

    def interrupt_the_wait_for_block_1(slot, block):
        start_copy(slot, block)
        read = streamer._reads[slot]
        if block.index == 1 and not released.is_set():

            def interrupted(timeout=None):  # Ctrl-C while the main thread waits; the next wait is the future's own
                del read.result
                raise KeyboardInterrupt

            read.result = interrupted

    streamer._start_copy = interrupt_the_wait_for_block_1
    with pytest.raises(KeyboardInterrupt):
        run_model(model, inputs)
    del streamer._start_copy
    threading.Timer(0.2, released.set).start()  # block 1's read, blocked until now, finishes during the next call
    model.transformer_blocks[1].attention.register_forward_pre_hook(
        lambda module, args: pytest.fail("block 1 computed before its read finished") if len(reads) < 2 else None
    )
    assert_bitwise(run_model(model, inputs), resident)
    model.disable_weight_streaming()
    assert _reader_threads(others) == []


def test_a_streamer_dropped_with_its_model_stops_its_reader_thread(tmp_path):
    model, inputs, resident, streamer, others = _disk_streamed(tmp_path)
    assert_bitwise(run_model(model, inputs), resident)
    (thread,) = _reader_threads(others)
    del model, streamer
    # the model and its hooks refer to each other: freed by the cyclic collection, once no read is running (the
    # forward's last block queued block 0's read for the next forward; while it runs, its frame holds the streamer)
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        gc.collect()
        thread.join(timeout=0.05)
    assert not thread.is_alive()


def test_a_failed_read_is_raised_where_its_block_runs_naming_it(tmp_path):
    model, inputs, resident, streamer, others = _disk_streamed(tmp_path)

    def fail_block_2(index):
        if index == 2:
            raise OSError(5, "Input/output error")

    _record_reads(streamer, fail_block_2)
    with pytest.raises(
        RuntimeError, match=r"reading block 2's weights from the files failed on the reader thread"
    ) as e:
        run_model(model, inputs)
    assert isinstance(e.value.__cause__, OSError) and "Input/output error" in str(e.value)
    del streamer.reader.read
    assert_bitwise(run_model(model, inputs), resident)  # block 2 read again
    model.disable_weight_streaming()
    assert _reader_threads(others) == []


def test_a_lora_step_reads_the_blocks_in_reverse_order_for_the_backward_bit_for_bit(tmp_path):
    resident = _saved(tiny_model(**LAYERS).to(torch.bfloat16), tmp_path)
    resident.requires_grad_(False)
    resident = with_lora(resident).train()  # the factors trainable, the rest frozen
    resident.enable_gradient_checkpointing()
    model = copy.deepcopy(resident)
    inputs = tiny_inputs(dtype=torch.bfloat16)
    streamer = model.enable_weight_streaming("cpu", host_memory="disk")
    reads, _ = _record_reads(streamer)
    for step in range(2):
        grads = []
        for m in (resident, model):
            out = m(**inputs)
            (out.sample.float().square().mean() + out.audio_sample.float().square().mean()).backward()
            grads.append([p.grad for n, p in m.named_parameters() if p.requires_grad])
        assert len(grads[0]) > 0 and all(torch.equal(a, b) for a, b in zip(*grads))
    # the forward reads 0..3 (not 0 again after 3: the backward comes next); the backward finds 3 and 2 in the ring
    # and reads 1, then 0; the next step's forward finds 0 and 1 there
    assert [i for i, _ in reads] == [0, 1, 2, 3, 1, 0, 2, 3, 1, 0]
    assert all(name.startswith(READER_THREAD_NAME) for _, name in reads)


def test_host_holds_the_staging_ring_and_the_adapters_not_the_blocks(tmp_path):
    model = with_lora(_saved(int4_transformer(tiny_model(**LAYERS).to(torch.bfloat16), 16), tmp_path))
    blocks = list(model.transformer_blocks)
    adapters = sum(p.nbytes for b in blocks for n, p in b.named_parameters() if ".lora_" in n)
    planned = model.weight_streaming_host_nbytes(pinned=False, host_memory="disk", ring_size=3)
    streamer = model.enable_weight_streaming("cpu", ring_size=3, host_memory="disk")
    slot = streamer.slots[0].buffer.nbytes
    assert len(streamer.staging) == 3 and all(s.nbytes == slot for s in streamer.staging)
    # (loaded without torch_dtype, some tensors are cast from their stored dtype: through the cast buffer, one by one)
    cast = streamer.reader.cast_buffer.nbytes
    assert 0 < cast <= max(t.nbytes for b in blocks for t in b.parameters())
    # the LoRA factors are not streamed: they stay resident on the device (here the CPU), not in the host's count
    assert adapters > 0 and streamer.host_nbytes == streamer.host_reserved_nbytes == 3 * slot + cast
    assert streamer.host_nbytes == planned
    streamer.free()  # a stage's release frees the cast buffer with the rings; its return makes it again
    assert not streamer.staging and streamer.reader.cast_buffer.nbytes == 0
    streamer.allocate()
    assert streamer.reader.cast_buffer.nbytes == cast
    # nothing of the blocks' weights stays in host memory between uses: the placeholders are one element per dtype
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for b in blocks for t in b.parameters()}
    assert sum(storages.values()) - adapters <= 8 * len(storages)


def test_refusals_before_any_weight_moves(tmp_path):
    in_memory = tiny_model(**LAYERS).to(torch.bfloat16)
    before = block_ptrs(in_memory)
    with pytest.raises(ValueError, match=r"was not loaded with from_pretrained .*save_pretrained\(folder\)"):
        in_memory.enable_weight_streaming("cpu", host_memory="disk")
    assert block_ptrs(in_memory) == before
    in_memory.save_pretrained(tmp_path)
    # routed experts quantized while loading: the files hold bf16 banks, the model int4 codes and scales
    quantized = Magi2Transformer3DModel.from_pretrained(tmp_path, expert_dtype="int4", expert_int4_group_size=16)
    with pytest.raises(ValueError, match=r"differ from the model in memory .*W_gate: stored \[.*save_pretrained"):
        quantized.enable_weight_streaming("cpu", host_memory="disk")
    model = Magi2Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    model.enable_fp8_storage(torch.bfloat16)  # FP8 and scales made after loading
    with pytest.raises(ValueError, match=r"weight_scale is not in the files"):
        model.enable_weight_streaming("cpu", host_memory="disk")
    fused = with_lora(Magi2Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16))
    fused.fuse_lora()
    before = block_ptrs(fused)
    with pytest.raises(ValueError, match=r"a LoRA is fused into this model's weights in memory; unfuse_lora\(\)"):
        fused.enable_weight_streaming("cpu", host_memory="disk")
    assert block_ptrs(fused) == before
    # a LoRA fused, then unloaded: no adapter left, each targeted weight (the first: block 1's; block 0's projections
    # are grouped, left out) changed in memory, not in the files
    unloaded = with_lora(Magi2Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16))
    unloaded.fuse_lora()
    unloaded.unload_lora()
    assert not any(".lora_" in n for n, _ in unloaded.named_parameters())
    before = block_ptrs(unloaded)
    with pytest.raises(
        ValueError, match=r"transformer_blocks\.1\.attention\.linear_proj\.weight differs from .* changed in memory"
    ):
        unloaded.enable_weight_streaming("cpu", host_memory="disk")
    assert block_ptrs(unloaded) == before
    edited = Magi2Transformer3DModel.from_pretrained(tmp_path)  # one tensor of the last block edited in place
    name, weight = [(n, p) for n, p in edited.transformer_blocks[-1].named_parameters() if p.dim() == 2 and p.numel()][
        -1
    ]
    with torch.no_grad():
        weight[0, 0] += 1
    with pytest.raises(ValueError, match=rf"transformer_blocks\.3\.{name} differs from"):
        edited.enable_weight_streaming("cpu", host_memory="disk")
    loaded = Magi2Transformer3DModel.from_pretrained(tmp_path)
    os.utime(tmp_path / "diffusion_pytorch_model.safetensors", ns=(0, 0))  # (as a later save_pretrained there would)
    with pytest.raises(ValueError, match=r"changed since the model was loaded from it; load the model again"):
        loaded.enable_weight_streaming("cpu", host_memory="disk")


SAVE_WORKER = """
import sys, torch
from diffusers_magi2 import Magi2Transformer3DModel
Magi2Transformer3DModel(num_layers=6, num_attention_heads=8, attention_head_dim=64, num_key_value_heads=8,
    in_channels=16, audio_in_channels=16, text_in_channels=64, multimodal_layers=[0], moe_layers=[1, 2, 3, 4, 5],
    moe_num_heads=4, moe_num_experts=32, moe_top_k=2, moe_expert_intermediate_size=256,
    shared_expert_intermediate_size=256, modality_specific_expert_intermediate_size=256,
    params_dtype=torch.bfloat16).save_pretrained(sys.argv[1])
"""
RSS_WORKER = (
    """
import gc, json, sys, torch
from diffusers_magi2 import Magi2Transformer3DModel
"""
    + RSS_WORKER_PRELUDE
    + """
def load():
    return Magi2Transformer3DModel.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16).eval()
forward(load())  # the warm-up (helpers.fresh_interpreter.run_host_memory_checks): the same forward, resident
gc.collect(); base = anon()
model = load()
blocks = sum(t.nbytes for b in model.transformer_blocks for t in [*b.parameters(), *b.buffers()])
host = model.weight_streaming_host_nbytes(pinned=False, host_memory="disk")
plan = host + model.weight_streaming_device_nbytes(2)
model.enable_weight_streaming("cpu", host_memory="disk")
forward(model)  # touches every page of the ring and the staging buffers
gc.collect()
print(json.dumps({"measured": anon() - base, "plan": plan, "host": host, "blocks": blocks}))
"""
)


@pytest.mark.slow  # the session's host-memory checks, if this test asks first: ~40 s of CPU
@pytest.mark.host_memory_checks({"disk_save": (SAVE_WORKER, ["{folder}"]), "disk_stream": (RSS_WORKER, ["{folder}"])})
def test_host_memory_of_a_fresh_process_matches_the_plan_within_10_percent(host_memory_checks):
    """A reduced-width model (six layers, 170 MB of bf16 weights) loaded from its files and streamed from them on
    the CPU ring: the fresh process's anonymous RSS growth is the resident non-block weights, the ring and the
    staging ring, as planned before streaming (the page cache of the files is not anonymous); glibc told to return
    every freed allocation over 64 KiB, so the loaded blocks freed by streaming leave the count."""
    for name in ("disk_save", "disk_stream"):  # (the model saved by another process: none of it is in this one)
        assert host_memory_checks[name].returncode == 0, host_memory_checks[name].stderr[-3000:]
    result = json.loads(host_memory_checks["disk_stream"].stdout.strip().splitlines()[-1])
    print(result)
    assert abs(result["measured"] - result["plan"]) <= 0.1 * result["plan"], result
    assert result["host"] < 0.5 * result["blocks"]  # the host holds two blocks' staging, not the six blocks
