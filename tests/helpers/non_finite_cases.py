"""NaN weights that no MoE router sees, for the non-finite tests of both pipelines (one process and context
parallel): where each goes in the tiny pipelines of ``modular_testing_utils`` (with the refiner), the 1-step call
that meets it, and the error expected."""

from __future__ import annotations

import contextlib

import torch


ONE_STEP = {"height": 32, "width": 32, "num_inference_steps": 1, "output_type": "latent"}
TWO_STAGE_ONE_STEP = {**ONE_STEP, "height": 64, "width": 64, "preview_height": 32, "preview_width": 32}
TWO_STAGE_ONE_STEP["refiner_num_inference_steps"] = 1

#: case -> (component, parameter, index poisoned, call, the error's expected text)
CASES = {
    "last MoE layer's experts": (
        "transformer",
        "transformer_blocks.1.mlp.moe_mlp.W_down",
        (slice(None), 0, 0),  # every expert of every head
        ONE_STEP,
        r"^the preview stage's result is not finite \(NaN/inf in latents, audio_latents\); the weight "
        r"transformer_blocks\.1\.mlp\.moe_mlp\.W_down holds nan at expert 0 of head 0 \(element \[0, 0, 0\]\)",
    ),
    "final projection": (
        "transformer",
        "post_adapter.final_linear_video.weight",
        (0, 0),
        ONE_STEP,
        r"^the preview stage's result is not finite \(NaN/inf in latents\); the weight "
        r"post_adapter\.final_linear_video\.weight holds nan at element \[0, 0\]",
    ),
    "refiner": (
        "refiner",
        "transformer_blocks.1.mlp.down_proj.weight",
        (0, 0),
        TWO_STAGE_ONE_STEP,
        r"^the refiner stage's result is not finite \(NaN/inf in latents\); the weight "
        r"transformer_blocks\.1\.mlp\.down_proj\.weight holds nan at element \[0, 0\]",
    ),
}


@contextlib.contextmanager
def poisoned(model, name: str, index):
    """``model``'s parameter ``name`` with NaN at ``index`` inside the context, restored after it."""
    param = model.get_parameter(name)
    saved = param.detach().clone()
    with torch.no_grad():
        param[index] = float("nan")
    try:
        yield
    finally:
        with torch.no_grad():
            param.copy_(saved)
