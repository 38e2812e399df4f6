"""Per-rank body of ``test_cp_non_finite.py``: three calls of the tiny default pipeline under CP N (or alone) on one
process group; the middle one has a NaN in the prompt's text embeddings only, whose tokens (the prompt's half of the
``[cond; uncond]`` batch, two segments of equal length) lie on CP rank 0 alone."""

from __future__ import annotations

import torch
from diffusers import ContextParallelConfig

from diffusers_magi2.pipelines.tiny_default import build_tiny_default_pipeline


def calls_around_a_non_finite_prompt(rank: int, world: int) -> dict:
    pipe = build_tiny_default_pipeline(dtype=torch.float32)
    if world > 1:
        pipe.enable_context_parallel(ContextParallelConfig(ulysses_degree=world))
    embeds, mask, _, _ = pipe.encode_prompt("a cat on a piano", do_classifier_free_guidance=False)
    text = {"prompt_attention_mask": mask, "negative_prompt_attention_mask": mask, "negative_prompt_embeds": embeds}
    bad = embeds.clone()
    bad[0, 1, 2] = float("nan")

    def call(prompt_embeds, steps):
        out = pipe(
            prompt_embeds=prompt_embeds,
            **text,
            height=32,
            width=32,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(3),
            output_type="latent",
        )
        return out.frames

    result = {"before": call(embeds, 1), "error": None}
    try:
        call(bad, 2)
    except ValueError as err:
        result["error"] = str(err)
    result["after"] = call(embeds, 1)  # the same group serves the next request
    return result
