"""Per-rank bodies of ``test_cp_pipeline.py``: the tiny default pipeline's I2V call under CP N (or alone), counting
the text-encoder and image-encoder calls of this rank; and the two-stage tiny pipeline (``magi2_tiny`` preview and
refiner) with its 1080p-style refiner stage under CP N, counting the refiner's FLOPs on this rank."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import ContextParallelConfig

from diffusers_magi2.pipelines.tiny_default import build_tiny_default_pipeline

from .fixtures import fixtures_root
from .flop_counter import register_cpu_sdpa_flop_formula
from .pipeline_stubs import TWO_STAGE_CALL as TWO_STAGE


IMAGE = np.random.default_rng(0).integers(0, 256, (40, 64, 3), dtype=np.uint8)


def i2v_latents(rank: int, world: int) -> dict:
    pipe = build_tiny_default_pipeline(dtype=torch.float32)
    if world > 1:
        pipe.enable_context_parallel(ContextParallelConfig(ulysses_degree=world))
    calls = {"text_encoder": 0, "image_encoder": 0}

    def count_text(*_):
        calls["text_encoder"] += 1

    encode = pipe.vae.encode

    def count_image(*args, **kwargs):
        calls["image_encoder"] += 1
        return encode(*args, **kwargs)

    pipe.text_encoder.register_forward_pre_hook(count_text)
    pipe.vae.encode = count_image
    out = pipe(
        prompt="a cat on a piano",
        image=IMAGE,
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
    )
    return {"calls": calls, "latents": out.frames, "audio_latents": out.audio}


def refiner_stage_latents(rank: int, world: int) -> dict:
    """The refined latent of a two-stage text-to-video call, and the FLOPs of this rank's refiner forwards."""
    from torch.utils.flop_counter import FlopCounterMode

    from .pipeline_stubs import tiny_two_stage_pipeline

    pipe = tiny_two_stage_pipeline(fixtures_root())
    if world > 1:
        pipe.enable_context_parallel(ContextParallelConfig(ulysses_degree=world))
    register_cpu_sdpa_flop_formula()
    counter = FlopCounterMode(display=False)
    forward = pipe.refiner.forward

    calls = []

    def counted(**kwargs):
        with counter:
            out = forward(**kwargs)
        calls.append(({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}, out.sample))
        return out

    pipe.refiner.forward = counted
    out = pipe(
        "a red fox in the snow", **TWO_STAGE, generator=torch.Generator("cpu").manual_seed(3), output_type="latent"
    )
    return {"latents": out.frames, "refiner_flops": counter.get_total_flops(), "refiner_calls": calls}


def enhanced_prompt_call(rank: int, world: int) -> dict:
    """A text-to-video call with ``enable_prompt_enhancement=True`` under CP ``world`` (or alone), then one whose
    enhancer fails on every rank that asks it: this rank's enhancer calls, the texts its text encoder received, the
    latents, ``enhance_prompt``'s text, and the failing call's error (type, message)."""
    from unittest import mock

    from diffusers_magi2.pipelines import text_conditioning

    from .enhancer_stubs import ScriptedPromptEnhancer

    pipe = build_tiny_default_pipeline(dtype=torch.float32)
    pipe.register_to_config(duration_s=2.0)
    pipe.set_progress_bar_config(disable=True)
    if world > 1:
        pipe.enable_context_parallel(ContextParallelConfig(ulysses_degree=world))
    pipe.prompt_enhancer = ScriptedPromptEnhancer()
    encoded = []
    encode = text_conditioning.encode_prompt_text

    def spy(tokenizer, text_encoder, text, *args, **kwargs):
        encoded.append(text)
        return encode(tokenizer, text_encoder, text, *args, **kwargs)

    call = {"height": 32, "width": 32, "num_inference_steps": 1, "output_type": "latent"}
    with mock.patch.object(text_conditioning, "encode_prompt_text", spy):
        out = pipe(
            "a cat on a piano", **call, enable_prompt_enhancement=True, generator=torch.Generator().manual_seed(7)
        )
    enhanced = pipe.enhance_prompt("a cat on a piano")
    result = {"enhancer_calls": pipe.prompt_enhancer.calls, "encoded": encoded, "latents": out.frames}
    result["enhanced"] = enhanced
    pipe.prompt_enhancer = ScriptedPromptEnhancer(failure="the endpoint http://127.0.0.1:9/v1 could not be reached")
    transformer_calls = []
    pipe.transformer.register_forward_pre_hook(lambda *_: transformer_calls.append(1))
    try:
        pipe("a cat on a piano", **call, enable_prompt_enhancement=True)
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        result["error"] = (type(error).__name__, str(error))
    result["forwards_after_failure"] = len(transformer_calls)
    return result
