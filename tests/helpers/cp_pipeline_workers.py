"""Per-rank bodies of ``test_cp_pipeline.py``: the tiny random pipeline's I2V call under CP N (or alone), counting
the text-encoder and image-encoder calls of this rank; and the two-stage tiny pipeline (``magi2_tiny`` preview and
refiner) with its 1080p-style refiner stage under CP N, counting the refiner's FLOPs on this rank."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import ContextParallelConfig

from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline

from .fixtures import fixtures_root
from .flop_counter import register_cpu_sdpa_flop_formula
from .pipeline_stubs import TWO_STAGE_CALL as TWO_STAGE


IMAGE = np.random.default_rng(0).integers(0, 256, (40, 64, 3), dtype=np.uint8)


def i2v_latents(rank: int, world: int) -> dict:
    pipe = build_tiny_random_pipeline(dtype=torch.float32)
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
    """A text-to-video call with ``enable_prompt_enhancement=True`` under CP ``world`` (or alone), each rank's
    ``Magi2PromptEnhancer`` pointing at its own chat-completions server on 127.0.0.1 that answers a fixture reply;
    then a call whose server answers HTTP 400. Returns the requests this rank's server got, the texts this rank's
    text encoder received, the latents, ``enhance_prompt``'s text, the failing call's error (type, message), this
    rank's server URLs and the transformer forwards after the failure."""
    from unittest import mock

    from diffusers_magi2 import Magi2PromptEnhancer
    from diffusers_magi2.pipelines import text_conditioning

    from .chat_completions_stub import ChatCompletionsStub
    from .fixtures import golden_text

    pipe = build_tiny_random_pipeline(dtype=torch.float32)
    pipe.register_to_config(duration_s=2.0)
    pipe.set_progress_bar_config(disable=True)
    if world > 1:
        pipe.enable_context_parallel(ContextParallelConfig(ulysses_degree=world))
    encoded = []
    encode = text_conditioning.encode_prompt_text

    def spy(tokenizer, text_encoder, text, *args, **kwargs):
        encoded.append(text)
        return encode(tokenizer, text_encoder, text, *args, **kwargs)

    call = {"height": 32, "width": 32, "num_inference_steps": 1, "output_type": "latent"}
    result = {"encoded": encoded}
    with ChatCompletionsStub(reply=golden_text("prompt_enhancement/t2v_fox_snow.input.json")) as server:
        pipe.prompt_enhancer = Magi2PromptEnhancer.from_endpoint(server.base_url, "stub", timeout=0.9, max_retries=0)
        with mock.patch.object(text_conditioning, "encode_prompt_text", spy):
            out = pipe("a fox", **call, enable_prompt_enhancement=True, generator=torch.Generator().manual_seed(7))
        result["enhanced"] = pipe.enhance_prompt("a fox")
    result.update(requests=len(server.requests), latents=out.frames, urls=[server.base_url])
    transformer_calls = []
    pipe.transformer.register_forward_pre_hook(lambda *_: transformer_calls.append(1))
    with ChatCompletionsStub(status=400) as failing:
        pipe.prompt_enhancer = Magi2PromptEnhancer.from_endpoint(failing.base_url, "stub", timeout=0.9, max_retries=0)
        try:
            pipe("a fox", **call, enable_prompt_enhancement=True)
        except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
            result["error"] = (type(error).__name__, str(error))
    result.update(failing_requests=len(failing.requests), forwards_after_failure=len(transformer_calls))
    result["urls"].append(failing.base_url)
    return result
