"""Sampler pieces of the MAGI-2 pipeline: the flow-matching UniPC schedules, the classifier-free
guidance batch and the one denoising loop both stages run (:func:`denoise_steps`).

Each step ``i`` at timestep ``t``: the stage's ``predict`` returns one velocity per latent it
denoises (preview: video and audio; refiner: video), its forwards inside ``model.cache_context``;
each latent takes its scheduler's Flow-UniPC step ``x ← step(v, t, x)``; then ``on_step_end`` may
replace any tensor of the step table (latents or text embeddings) for the following steps.

Follows SandAI ``Magi2PreviewSampler`` (``prepare_model_input``, ``cfg_velocity``) at commit ``f68a0f9``
(spec ``magi2_reference_spec.md`` §5.2–5.3); the code is this package's own.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler
from diffusers.models.cache_utils import CacheMixin

__all__ = ["cache_context", "check_scheduler", "denoise_steps", "combine_guidance", "flow_schedulers", "pad_text_batch", "unshifted_sigmas"]


def check_scheduler(scheduler) -> None:
    """Raises ``ValueError`` unless ``scheduler`` is a flow-matching UniPC (``use_flow_sigmas=True``,
    ``prediction_type='flow_prediction'``, ``final_sigmas_type='zero'``)."""
    config = scheduler.config
    if not (
        config.get("use_flow_sigmas", False)
        and config.get("prediction_type") == "flow_prediction"
        and config.get("final_sigmas_type") == "zero"
    ):
        raise ValueError(
            "Magi2Pipeline needs a flow-matching UniPCMultistepScheduler: use_flow_sigmas=True, "
            "prediction_type='flow_prediction', final_sigmas_type='zero' (flow_shift=7 for the preview); got "
            f"use_flow_sigmas={config.get('use_flow_sigmas')}, prediction_type={config.get('prediction_type')!r}, "
            f"final_sigmas_type={config.get('final_sigmas_type')!r}"
        )


def unshifted_sigmas(sigma_start: float, num_inference_steps: int) -> np.ndarray:
    """Unshifted sigmas ``linspace(sigma_start, 0, N + 1)[:-1]`` (float64, length N)."""
    return np.linspace(float(sigma_start), 0.0, num_inference_steps + 1)[:-1]


def flow_schedulers(
    scheduler: UniPCMultistepScheduler, sigmas: np.ndarray, device: torch.device | str | None = None
) -> tuple[UniPCMultistepScheduler, UniPCMultistepScheduler, torch.Tensor]:
    """``scheduler`` (video) and a fresh audio scheduler built from its config, both set to the unshifted
    ``sigmas`` (the scheduler applies its ``flow_shift`` once) and to begin at index 0.

    Returns:
        ``(video_scheduler, audio_scheduler, timesteps)``; ``timesteps`` int64 ``[N]``.

    Raises:
        ValueError: the scheduler is not a flow-prediction UniPC with flow sigmas (:func:`check_scheduler`).
    """
    check_scheduler(scheduler)
    audio_scheduler = UniPCMultistepScheduler.from_config(scheduler.config)
    for s in (scheduler, audio_scheduler):
        s.set_timesteps(sigmas=sigmas, device=device)
        s.set_begin_index(0)
    return scheduler, audio_scheduler, scheduler.timesteps


def pad_text_batch(
    embeds: list[torch.Tensor], masks: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack text feature batches of different lengths along the batch, zero-padded to the longest.

    Args:
        embeds: tensors ``[B_i, L_i, C]``; the result has ``embeds[0]``'s dtype and device.
        masks: per entry a ``[B_i, L_i]`` mask, or ``None`` for "all ``L_i`` tokens are real".

    Returns:
        ``(text [ΣB_i, max L_i, C], mask [ΣB_i, max L_i] bool)``; padding is zero / ``False``.
    """
    longest = max(e.shape[1] for e in embeds)
    total = sum(e.shape[0] for e in embeds)
    text = embeds[0].new_zeros(total, longest, embeds[0].shape[-1])
    mask = torch.zeros(total, longest, dtype=torch.bool, device=embeds[0].device)
    row = 0
    for e, m in zip(embeds, masks):
        rows, length = e.shape[:2]
        text[row : row + rows, :length] = e.to(text.dtype)
        mask[row : row + rows, :length] = True if m is None else m
        row += rows
    return text, mask


def combine_guidance(velocity: torch.Tensor, batch: int, scale: float) -> torch.Tensor:
    """CFG on a ``[cond; uncond]`` batch (``2·batch`` rows): ``v_u + scale · (v_c − v_u)``, ``[batch, ...]``."""
    cond, uncond = velocity[:batch], velocity[batch:]
    return uncond + scale * (cond - uncond)


def cache_context(model, name: str, **context):
    """``model.cache_context(name, **context)`` for a diffusers ``CacheMixin`` model (what its caching
    hooks read: ``step_index``, ``num_inference_steps``, ``timestep``); a no-op context for any other
    callable, which has no caching hooks to inform."""
    if isinstance(model, CacheMixin):
        return model.cache_context(name, **context)
    return contextlib.nullcontext()


def denoise_steps(model, timesteps, tensors: dict, schedulers: dict, predict, *, on_step_end=None, skip_step=None) -> dict:
    """The denoising loop of both stages (see the module docstring).

    Args:
        model: the denoiser ``predict`` runs (its cache context is set per step).
        timesteps: the schedule, ``[N]``.
        tensors: the step table, name → tensor (e.g. ``latents``, ``prompt_embeds``); updated in place.
        schedulers: name → scheduler for each latent ``predict`` returns a velocity for.
        predict: ``fn(step_index, t, tensors, context)`` → name → velocity, where ``context(name)`` is
            the cache context manager of one forward at this step.
        on_step_end: ``fn(step_index, t, tensors)`` → a dict of replacements (or ``None``).
        skip_step: ``fn() -> bool`` checked before each step; true skips it (interrupt).

    Returns:
        ``tensors`` after the last step.
    """
    for i, t in enumerate(timesteps):
        if skip_step is not None and skip_step():
            continue

        def context(name: str, i=i, t=t):
            return cache_context(model, name, step_index=i, num_inference_steps=len(timesteps), timestep=t)

        for name, velocity in predict(i, t, tensors, context).items():
            tensors[name] = schedulers[name].step(velocity, t, tensors[name], return_dict=False)[0]
        if on_step_end is not None:
            tensors.update(on_step_end(i, t, tensors) or {})
    return tensors
