"""Streamed block weights on the CPU ring: bit-for-bit equal to the resident model (bf16 and int4 experts, with a
LoRA, the refiner), poisoned slots between uses, what the ring and the host hold, and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.int4_models import int4_transformer
from helpers.modular_testing_utils import tiny_refiner
from helpers.tiny_transformer import tiny_inputs, tiny_model
from helpers.weight_streaming_testing import assert_bitwise, refiner_inputs, run_model, with_lora

from diffusers_magi2.models.finite_checks_magi2 import apply_router_input_check
from diffusers_magi2.models.weight_streaming import _next_pow2, pinned_bytes, plan_pinned_arenas


#: four layers (two MoE, two multimodal) so a two-slot ring is reused within one forward
LAYERS = {"num_layers": 4, "multimodal_layers": [0, 3], "moe_layers": [1, 2]}


def _bf16_model():
    return tiny_model(**LAYERS).to(torch.bfloat16)


def _block_tensors(model):
    return [t for b in model.transformer_blocks for t in [*b.parameters(), *b.buffers()]]


@pytest.mark.parametrize("variant", ["bf16", "int4", "int4+fp8 storage", "bf16+lora"])
def test_streamed_output_equals_resident_bit_for_bit(variant):
    model = _bf16_model()
    if variant.startswith("int4"):
        model = int4_transformer(model, 16)
    if variant.endswith("fp8 storage"):  # the 80 GB recipe's dense weights: FP8 in host memory and in the ring
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    if variant.endswith("lora"):
        model = with_lora(model)
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    n_lora = sum(".lora_" in n for n, _ in model.named_parameters())
    streamer = model.enable_weight_streaming("cpu")
    want = {"bf16": torch.bfloat16, "int4": torch.uint8, "int4+fp8 storage": torch.float8_e4m3fn}
    assert want.get(variant, torch.bfloat16) in {t.dtype for t in _block_tensors(model)}
    assert_bitwise(run_model(model, inputs), resident)
    assert_bitwise(run_model(model, inputs), resident)  # the ring's slots reused across calls
    assert sum(".lora_" in n for n, _ in model.named_parameters()) == n_lora > 0 or not variant.endswith("lora")
    model.disable_weight_streaming()
    hosts = {b.host.data_ptr() for b in streamer.blocks if b.host is not None}
    assert not hosts and all(t.untyped_storage().nbytes() == t.nbytes for t in _block_tensors(model))
    assert_bitwise(run_model(model, inputs), resident)


def test_refiner_streamed_output_equals_resident_bit_for_bit():
    model = tiny_refiner().to(torch.bfloat16)
    inputs = refiner_inputs(model.config)
    resident = run_model(model, inputs)
    model.enable_weight_streaming("cpu")
    assert_bitwise(run_model(model, inputs), resident)


def test_poisoned_slots_between_uses_give_the_same_output():
    model = int4_transformer(_bf16_model(), 16)
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
    model = _bf16_model()
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
    assert all(t.numel() == 0 for t in _block_tensors(model))


def test_ring_holds_at_most_ring_size_blocks_and_the_host_holds_the_weights_once():
    model = with_lora(int4_transformer(_bf16_model(), 16))
    inputs = tiny_inputs(dtype=torch.bfloat16)
    lora = {id(p) for n, p in model.named_parameters() if ".lora_" in n}

    def frozen(block):  # what streams: every tensor but the LoRA factors, which stay resident
        return [t for t in [*block.parameters(), *block.buffers()] if id(t) not in lora]

    weights = {t.data_ptr(): t.nbytes for t in _block_tensors(model) if id(t) not in lora}
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
        model = _bf16_model()
        streamer = model.enable_weight_streaming("cpu")
        streamer.pinned = pinned
        assert calls == []
        streamer.free() if release == "free" else model.disable_weight_streaming()
        assert calls == [1] * (pinned and cuda), release
        calls.clear()


def test_pinned_arenas_keep_the_power_of_two_rounding_small_at_the_released_sizes():
    # the released preview's blocks with int4 experts (GB): 2 dense multimodal, 36 MoE, 2 dense multimodal
    sizes = [int(0.26e9)] * 2 + [int(1.69e9)] * 36 + [int(0.26e9)] * 2
    groups = plan_pinned_arenas(sizes)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    per_block = sum(_next_pow2(n) for n in sizes)
    assert per_block > 1.15 * sum(sizes)  # pinning block by block: > 15 % rounding
    assert pinned_bytes(sizes) == sum(_next_pow2(sum(sizes[i] for i in g)) for g in groups) <= 1.1 * sum(sizes)


def test_refusals_before_any_weight_moves():
    model = _bf16_model()
    before = [t.data_ptr() for t in _block_tensors(model)]
    with pytest.raises(ValueError, match=r"host_memory='disk' .* was not loaded with from_pretrained"):
        model.enable_weight_streaming("cpu", host_memory="disk")  # (the disk mode's own tests: its test file)
    with pytest.raises(ValueError, match=r"host_memory must be one of \('pinned', 'disk'\), got 'ram'"):
        model.enable_weight_streaming("cpu", host_memory="ram")
    with pytest.raises(ValueError, match=r"a side stream for the weight copies needs a CUDA device, got device='cpu'"):
        model.enable_weight_streaming("cpu", use_stream=True)
    with pytest.raises(ValueError, match=r"ring_size must be an int >= 2"):
        model.enable_weight_streaming("cpu", ring_size=1)
    need = model.weight_streaming_device_nbytes(2)
    with pytest.raises(ValueError, match=r"vram_gb=[0-9.e-]+: the resident weights plus a 2-block ring need"):
        model.enable_weight_streaming("cpu", vram_gb=need / 1e9 / 2)
    assert [t.data_ptr() for t in _block_tensors(model)] == before
    model.enable_weight_streaming("cpu", vram_gb=need / 1e9)
    with pytest.raises(ValueError, match=r"weights are streamed already; call disable_weight_streaming\(\) first"):
        model.enable_weight_streaming("cpu")
    with pytest.raises(RuntimeError, match=r"grad enabled under weight streaming needs per-block gradient checkpoint"):
        model(**tiny_inputs(dtype=torch.bfloat16))


def test_an_adapter_loaded_after_streaming_started_is_refused():
    # (block 0 is multimodal: its grouped projections take no adapter here)
    model = _bf16_model()
    model.enable_weight_streaming("cpu")
    with_lora(model)
    with pytest.raises(RuntimeError, match=r"block 1's tensors changed after enable_weight_streaming"):
        run_model(model, tiny_inputs(dtype=torch.bfloat16))


def test_router_check_hook_composes_with_streaming():
    model = _bf16_model()
    apply_router_input_check(model)
    inputs = tiny_inputs(dtype=torch.bfloat16)
    resident = run_model(model, inputs)
    weight = model.transformer_blocks[0].attention.linear_proj.weight
    original = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    with pytest.raises(ValueError) as resident_error:
        run_model(model, inputs)
    model.enable_weight_streaming("cpu")
    with pytest.raises(ValueError) as streamed_error:
        run_model(model, inputs)  # the NaN streamed with its block reaches the next MoE router
    assert str(streamed_error.value) == str(resident_error.value)
    with torch.no_grad():
        weight[0, 0] = original  # written into its host buffer, streamed from there
    assert_bitwise(run_model(model, inputs), resident)


RSS_WORKER = """
import gc, json, torch
from diffusers_magi2 import Magi2Transformer3DModel
def anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))
gc.collect(); base = anon()
model = Magi2Transformer3DModel(num_layers=4, num_attention_heads=8, attention_head_dim=64, num_key_value_heads=8,
    in_channels=16, audio_in_channels=16, text_in_channels=64, multimodal_layers=[0], moe_layers=[1, 2, 3],
    moe_num_heads=4, moe_num_experts=32, moe_top_k=2, moe_expert_intermediate_size=256,
    shared_expert_intermediate_size=256, modality_specific_expert_intermediate_size=256,
    params_dtype=torch.bfloat16).eval()
plan = model.weight_streaming_host_nbytes(pinned=False) + model.weight_streaming_device_nbytes(2)
model.enable_weight_streaming("cpu")
g = torch.Generator().manual_seed(0)
with torch.no_grad():  # one forward touches every page of the ring
    model(hidden_states=torch.randn(1, 16, 1, 4, 4, generator=g), timestep=torch.tensor([500.0]),
          encoder_hidden_states=torch.randn(1, 3, 64, generator=g), audio_hidden_states=torch.randn(1, 2, 16, generator=g))
gc.collect()
print(json.dumps({"measured": anon() - base, "plan": plan}))
"""


@pytest.mark.slow  # a fresh interpreter: ~10 s of CPU, mostly imports
def test_host_memory_of_a_fresh_process_matches_the_plan_within_10_percent():
    """A reduced-width model (115 MB of bf16 weights) streamed on the CPU ring in a fresh process: its anonymous RSS
    growth is the weights once (blocks packed, the rest resident) plus the ring, as planned before streaming; glibc
    told to return every freed allocation over 64 KiB, so the originals freed by the packing leave the count."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RSS_WORKER], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["plan"] > 150e6
    assert abs(result["measured"] - result["plan"]) <= 0.1 * result["plan"], result
