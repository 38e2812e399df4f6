"""Per-rank body of ``test_cp_non_finite.py``: three calls of the tiny random pipeline under CP N (or alone) on one
process group; the middle one has a NaN in the prompt's text embeddings only, whose tokens (the prompt's half of the
``[cond; uncond]`` batch, two segments of equal length) lie on CP rank 0 alone."""

from __future__ import annotations

import torch
from diffusers import ContextParallelConfig

from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline


def calls_around_a_non_finite_prompt(rank: int, world: int) -> dict:
    pipe = build_tiny_random_pipeline(dtype=torch.float32)
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


def errors_of_non_finite_weights(rank: int, world: int) -> dict:
    """Per case of ``non_finite_cases.CASES``: the error of a 1-step call of the classic and of the modular
    pipeline (tiny, with the refiner) under CP N with that weight poisoned, then the latents of a clean call."""
    from .modular_testing_utils import PROMPT, tiny_pipelines
    from .non_finite_cases import CASES, ONE_STEP, poisoned

    pipe, modular = tiny_pipelines(with_refiner=True)
    if world > 1:
        pipe.enable_context_parallel(ContextParallelConfig(ulysses_degree=world))
    runs = {
        "classic": lambda call: pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(3), **call),
        "modular": lambda call: modular(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(3), **call),
    }
    errors = {}
    for case, (component, name, index, call, _) in CASES.items():
        with poisoned(getattr(pipe, component), name, index):
            for kind, run in runs.items():
                try:
                    run(call)
                    errors[case, kind] = None
                except ValueError as err:
                    errors[case, kind] = str(err)
    return {"errors": errors, "after": runs["classic"](ONE_STEP).frames}
