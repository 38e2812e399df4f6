"""Streamed block weights on the CPU ring, through ``enable_weight_streaming``: bit-for-bit equal to the resident
model (bf16 and int4 experts, with a LoRA, the refiner), the refusals, the hooks beside it, host memory against the
plan. The ring itself: ``test_weight_streaming_ring.py``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.fresh_interpreter import RSS_WORKER_PRELUDE
from helpers.int4_models import int4_transformer
from helpers.modular_testing_utils import tiny_refiner
from helpers.tiny_transformer import tiny_inputs
from helpers.weight_streaming_testing import (
    assert_bitwise,
    bf16_model,
    block_ptrs,
    block_tensors,
    refiner_inputs,
    run_model,
    with_lora,
)

from diffusers_magi2.models.finite_checks_magi2 import apply_router_input_check


@pytest.mark.parametrize("variant", ["bf16", "int4", "int4+fp8 storage", "bf16+lora"])
def test_streamed_output_equals_resident_bit_for_bit(variant):
    model = bf16_model()
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
    assert want.get(variant, torch.bfloat16) in {t.dtype for t in block_tensors(model)}
    assert_bitwise(run_model(model, inputs), resident)
    assert_bitwise(run_model(model, inputs), resident)  # the ring's slots reused across calls
    assert sum(".lora_" in n for n, _ in model.named_parameters()) == n_lora > 0 or not variant.endswith("lora")
    model.disable_weight_streaming()
    hosts = {b.host.data_ptr() for b in streamer.blocks if b.host is not None}
    assert not hosts and all(t.untyped_storage().nbytes() == t.nbytes for t in block_tensors(model))
    assert_bitwise(run_model(model, inputs), resident)


def test_refiner_streamed_output_equals_resident_bit_for_bit():
    model = tiny_refiner().to(torch.bfloat16)
    inputs = refiner_inputs(model.config)
    resident = run_model(model, inputs)
    model.enable_weight_streaming("cpu")
    assert_bitwise(run_model(model, inputs), resident)


def test_refusals_before_any_weight_moves():
    model = bf16_model()
    before = block_ptrs(model)
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
    assert block_ptrs(model) == before
    model.enable_weight_streaming("cpu", vram_gb=need / 1e9)
    with pytest.raises(ValueError, match=r"weights are streamed already; call disable_weight_streaming\(\) first"):
        model.enable_weight_streaming("cpu")
    with pytest.raises(RuntimeError, match=r"grad enabled under weight streaming needs per-block gradient checkpoint"):
        model(**tiny_inputs(dtype=torch.bfloat16))


def test_an_adapter_loaded_after_streaming_started_is_refused():
    # (block 0 is multimodal: its grouped projections take no adapter here)
    model = bf16_model()
    model.enable_weight_streaming("cpu")
    with_lora(model)
    with pytest.raises(RuntimeError, match=r"block 1's tensors changed after enable_weight_streaming"):
        run_model(model, tiny_inputs(dtype=torch.bfloat16))


def test_router_check_hook_composes_with_streaming():
    model = bf16_model()
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


RSS_WORKER = (
    """
import gc, json, torch
from diffusers_magi2 import Magi2Transformer3DModel
"""
    + RSS_WORKER_PRELUDE
    + """
def build():
    torch.manual_seed(0)
    return Magi2Transformer3DModel(num_layers=4, num_attention_heads=8, attention_head_dim=64, num_key_value_heads=8,
        in_channels=16, audio_in_channels=16, text_in_channels=64, multimodal_layers=[0], moe_layers=[1, 2, 3],
        moe_num_heads=4, moe_num_experts=32, moe_top_k=2, moe_expert_intermediate_size=256,
        shared_expert_intermediate_size=256, modality_specific_expert_intermediate_size=256,
        params_dtype=torch.bfloat16).eval()
forward(build())  # the warm-up (helpers.fresh_interpreter.run_host_memory_checks): the same forward, resident
gc.collect(); base = anon()
model = build()
plan = model.weight_streaming_host_nbytes(pinned=False) + model.weight_streaming_device_nbytes(2)
model.enable_weight_streaming("cpu")
forward(model)  # touches every page of the ring
gc.collect()
print(json.dumps({"measured": anon() - base, "plan": plan}))
"""
)


@pytest.mark.slow  # the session's host-memory checks, if this test asks first: ~40 s of CPU
@pytest.mark.host_memory_checks({"weight_streaming": (RSS_WORKER, [])})
def test_host_memory_of_a_fresh_process_matches_the_plan_within_10_percent(host_memory_checks):
    """A reduced-width model (115 MB of bf16 weights) streamed on the CPU ring in a fresh process: its anonymous RSS
    growth is the weights once (blocks packed, the rest resident) plus the ring, as planned before streaming; glibc
    told to return every freed allocation over 64 KiB, so the originals freed by the packing leave the count."""
    out = host_memory_checks["weight_streaming"]
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result)
    assert result["plan"] > 150e6
    assert abs(result["measured"] - result["plan"]) <= 0.1 * result["plan"], result
