"""Guidance of the MAGI-2 denoise loops through diffusers guiders (``diffusers.guiders``), as LTX-2 carries its
audio and video scales: the ``guider`` guides the video latents and ``audio_guider`` the audio latents, each a
``ClassifierFreeGuidance`` by default (scales 5 and 7, SandAI's), and any diffusers guider may replace either.
The refiner stage guides its video latents with the ``guider``'s method at its own scale,
``guider.new(guidance_scale=refiner_guidance_scale)``.

Per step each guider lays out its passes (``prepare_inputs_from_block_state``: ``pred_cond`` reads the prompt,
``pred_uncond`` the negative prompt); the passes of both guiders are merged by the text they read and predicted
together, then each guider combines its latent's predictions (``guider(passes)``: ``v_u + g (v_c - v_u)`` for CFG). The preview
predicts every pass in one forward on the passes stacked along the batch, as ``Magi2Pipeline`` does, so CFG at
the same scales gives its velocities bit for bit. That one forward is why a guider that changes the model for one
pass (``prepare_models`` hooks: PAG, skip-layer, smoothed-energy, auto guidance) is refused.
"""

from __future__ import annotations

from diffusers.guiders import BaseGuidance

from .utils import GUIDER_SCALES


__all__ = [
    "GUIDER_INPUT_FIELDS",
    "GUIDER_NAMES",
    "MOVED_SCALES",
    "check_guiders",
    "refuse_moved_scales",
    "combine_passes",
    "guidance_passes",
    "uses_negative_prompt",
]

GUIDER_NAMES = tuple(GUIDER_SCALES)

#: ``Magi2Pipeline.__call__``'s guidance scales -> the guider that carries each in a modular pipeline.
MOVED_SCALES = {"guidance_scale": "guider", "audio_guidance_scale": "audio_guider"}


def refuse_moved_scales(values: dict) -> None:
    """Refuse a :data:`MOVED_SCALES` call argument that is set (``values``: name -> value or ``None``); a modular
    pipeline would otherwise ignore it and guide at its guider's scale.

    Raises:
        ValueError: naming the argument and the ``update_components`` call that sets the scale.
    """
    for name, guider in MOVED_SCALES.items():
        if values.get(name) is not None:
            raise ValueError(
                f"{name} is not an input of a MAGI-2 modular pipeline: the scale is the {guider}'s; set it with "
                f"pipe.update_components({guider}=pipe.{guider}.new(guidance_scale={values[name]!r}))"
            )


#: The model argument each pass sets, from the block state (``pred_cond``: the first name, ``pred_uncond``: the second).
GUIDER_INPUT_FIELDS = {
    "encoder_hidden_states": ("prompt_embeds", "negative_prompt_embeds"),
    "encoder_attention_mask": ("prompt_attention_mask", "negative_prompt_attention_mask"),
}


def check_guiders(components) -> None:
    """Refuse a declared guider that is missing or changes the model for one pass (module docstring).

    Raises:
        ValueError: naming the guider and what is allowed.
    """
    declared = set(getattr(components, "component_names", GUIDER_NAMES))
    for name in GUIDER_NAMES:
        if name not in declared:
            continue
        guider = getattr(components, name, None)
        if guider is None:
            raise ValueError(
                f"the {name!r} component is None; set a diffusers guider (ClassifierFreeGuidance(guidance_scale=1.0) "
                "runs the conditional pass alone)"
            )
        hooks = [
            m for m in ("prepare_models", "cleanup_models") if getattr(type(guider), m) is not getattr(BaseGuidance, m)
        ]
        if hooks:
            raise ValueError(
                f"{name} is a {type(guider).__name__}, which changes the model for one pass ({', '.join(hooks)}); "
                "MAGI-2 predicts every pass of a step in one batched forward, so it takes guiders that combine "
                "predictions only (ClassifierFreeGuidance, AdaptiveProjectedGuidance, ClassifierFreeZeroStarGuidance, "
                "TangentialClassifierFreeGuidance, ...)"
            )


def uses_negative_prompt(guider: BaseGuidance, num_inference_steps: int) -> bool:
    """Whether ``guider`` runs more than the conditional pass at any of ``num_inference_steps`` steps (so the
    negative prompt is needed). Sets the guider's step state, which the loop sets again before each step."""
    for step in range(int(num_inference_steps)):
        guider.set_state(step=step, num_inference_steps=num_inference_steps, timestep=None)
        if guider.num_conditions > 1:
            return True
    return False


def guidance_passes(guiders: dict, block_state, step: int, num_inference_steps: int, timestep):
    """Set each guider's step state and collect the step's passes.

    Args:
        guiders: latent name -> its guider (one guider may guide several latents).
        block_state: holds the :data:`GUIDER_INPUT_FIELDS` tensors.

    Returns:
        ``(passes, own)``: ``passes`` maps each distinct text branch of the step, ``"cond"`` (the prompt) or
        ``"uncond"`` (the negative prompt), to a ``BlockState`` with its model arguments, in first-seen order;
        ``own`` maps each latent name to its guider's own passes, as ``(branch, BlockState)`` pairs.

    Raises:
        ValueError: a pass reads no text (the negative prompt was not encoded).
    """
    passes, own, prepared = {}, {}, {}
    for latent, guider in guiders.items():
        if id(guider) not in prepared:
            guider.set_state(step=step, num_inference_steps=num_inference_steps, timestep=timestep)
            batches = guider.prepare_inputs_from_block_state(block_state, GUIDER_INPUT_FIELDS)
            prepared[id(guider)] = [(_branch(batch, block_state, guider), batch) for batch in batches]
        own[latent] = prepared[id(guider)]
        for branch, batch in own[latent]:
            passes.setdefault(branch, batch)
    return passes, own


def _branch(batch, block_state, guider) -> str:
    """``"cond"`` or ``"uncond"``: the text a pass reads."""
    text = getattr(batch, "encoder_hidden_states", None)
    if text is not None and text is block_state.prompt_embeds:
        return "cond"
    if text is not None and text is getattr(block_state, "negative_prompt_embeds", None):
        return "uncond"
    raise ValueError(
        f"{type(guider).__name__} runs a pass with no text: negative_prompt_embeds is None (the text step encodes "
        "the negative prompt only for a guider that runs an unconditional pass at some step)"
    )


def combine_passes(guiders: dict, own: dict, predictions: dict) -> dict:
    """Each latent's guided velocity: its guider (``guider(batches).pred``) on its own passes, each pass's
    ``noise_pred`` the prediction of its branch.

    Args:
        guiders, own: as :func:`guidance_passes`.
        predictions: latent name -> branch -> fp32 prediction.
    """
    velocities = {}
    for latent, guider in guiders.items():
        for branch, batch in own[latent]:
            batch.noise_pred = predictions[latent][branch]
        velocities[latent] = guider([batch for _, batch in own[latent]]).pred
    return velocities
