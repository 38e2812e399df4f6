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
