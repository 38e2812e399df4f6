"""Per-rank body of ``test_cp_pipeline.py``: the tiny default pipeline's I2V call under CP N (or alone), counting
the text-encoder and image-encoder calls of this rank."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import ContextParallelConfig

from diffusers_magi2.pipelines.tiny_default import build_tiny_default_pipeline


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
