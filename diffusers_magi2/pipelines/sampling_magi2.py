"""Sampler pieces of the MAGI-2 pipeline (SandAI ``Magi2PreviewSampler``): flow-matching UniPC schedules, the
CFG batch and a forward's cache context; ``Magi2Pipeline._denoise`` runs the loop of both stages with them.

Sigmas are ``linspace(sigma_start, 0, N + 1)[:-1]``; the scheduler applies its ``flow_shift`` once. Per step ``t``
each latent steps ``x <- step(v, t, x)`` with its guided velocity ``v = v_u + g (v_c - v_u)``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler
from diffusers.models.cache_utils import CacheMixin


__all__ = [
    "cache_context",
    "check_scheduler",
    "flow_schedulers",
    "pad_text_batch",
    "unshifted_sigmas",
]


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
    """``scheduler`` (video) and a fresh audio one from its config, both set to ``sigmas`` and begin index 0.

    Returns:
        ``(video_scheduler, audio_scheduler, timesteps)``; ``timesteps`` int64 ``[N]``.

    Raises:
        ValueError: as :func:`check_scheduler`.
    """
    check_scheduler(scheduler)
    audio_scheduler = UniPCMultistepScheduler.from_config(scheduler.config)
    for s in (scheduler, audio_scheduler):
        s.set_timesteps(sigmas=sigmas, device=device)
        s.set_begin_index(0)
    return scheduler, audio_scheduler, scheduler.timesteps


def pad_text_batch(embeds: list[torch.Tensor], masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``[B_i, L_i, C]`` text batches (with ``[B_i, L_i]`` masks or ``None`` = all real), zero-padded:
    ``(text [sum B_i, max L_i, C], mask bool)`` in ``embeds[0]``'s dtype and device."""
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


def cache_context(model, name: str, **context):
    """``model.cache_context(name, **context)`` for a ``CacheMixin`` model, else a no-op context."""
    if isinstance(model, CacheMixin):
        return model.cache_context(name, **context)
    return contextlib.nullcontext()
