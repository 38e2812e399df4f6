"""The short two-stage call the weight-streaming pipeline tests compare, resident against streamed."""

from __future__ import annotations

import torch


#: A 64 x 96 clip refined from a 32 x 48 preview, one step each, latents out.
TWO_STAGE_CALL = {
    "prompt": "A red fox trots through fresh snow",
    "height": 64,
    "width": 96,
    "preview_height": 32,
    "preview_width": 48,
    "num_inference_steps": 1,
    "output_type": "latent",
}


def two_stage_call(pipe):
    """``(frames, audio)`` of :data:`TWO_STAGE_CALL` with a fixed seed."""
    out = pipe(**TWO_STAGE_CALL, generator=torch.Generator().manual_seed(0))
    return out.frames, out.audio
