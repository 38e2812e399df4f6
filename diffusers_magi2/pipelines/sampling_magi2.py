"""The MAGI-2 sampler's pieces (SandAI ``Magi2PreviewSampler``), shared by ``Magi2Pipeline`` and the modular blocks:
flow-matching UniPC schedules, the initial noise, each stage's forward and a forward's cache context.

Sigmas are ``linspace(sigma_start, 0, N + 1)[:-1]``; the scheduler applies its ``flow_shift`` once. Per step ``t``
each latent steps ``x <- step(v, t, x)`` with its guided velocity, ``v = v_u + g (v_c - v_u)`` under CFG. The
preview predicts every text branch (cond, uncond, ...) in one transformer forward on the branches stacked along
the batch (:func:`preview_forward`); the refiner runs one forward per sample and branch, with no timestep and no
audio (:func:`refiner_forward`). Who combines the branches is the caller's choice: ``Magi2Pipeline`` computes
CFG itself, the modular denoisers hand the predictions to their diffusers guider.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler
from diffusers.models.cache_utils import CacheMixin
from diffusers.utils.torch_utils import randn_tensor

from .geometry_magi2 import Magi2LatentGeometry


__all__ = [
    "attention_kwargs_for",
    "cache_context",
    "check_scheduler",
    "flow_schedulers",
    "pad_text_batch",
    "prepare_latents",
    "preview_forward",
    "refiner_forward",
    "unshifted_sigmas",
]


def attention_kwargs_for(model, attention_kwargs):
    """The keys of ``attention_kwargs`` that ``model`` declares (all for an undeclaring model), or ``None``."""
    if not attention_kwargs:
        return None
    supported = getattr(model, "supported_attention_kwargs", None)
    if supported is None:
        return attention_kwargs
    return {k: v for k, v in attention_kwargs.items() if k in supported} or None


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


def prepare_latents(
    batch_size: int,
    height: int,
    width: int,
    geometry: Magi2LatentGeometry,
    device: torch.device | str,
    generator: torch.Generator | list[torch.Generator] | None = None,
    latents: torch.Tensor | None = None,
    audio_latents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The initial fp32 noise of ``batch_size`` videos of ``height x width`` pixels (SandAI's draw order).

    Args:
        geometry: the call's :class:`~.geometry_magi2.Magi2LatentGeometry` (channels, scale, lengths).
        generator: draws video ``[B, C, T, H/s, W/s]`` first, then audio ``[B, L, A]``.
        latents, audio_latents: given noise instead (moved to ``device``, cast to fp32).

    Returns:
        ``(latents, audio_latents)`` fp32 on ``device``.
    """
    device = torch.device(device)
    if latents is None:
        s = geometry.spatial_scale
        shape = (batch_size, geometry.channels, geometry.num_frames, height // s, width // s)
        latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
    else:
        latents = latents.to(device=device, dtype=torch.float32)
    if audio_latents is None:
        shape = (batch_size, geometry.num_audio_latents, geometry.audio_channels)
        audio_latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
    else:
        audio_latents = audio_latents.to(device=device, dtype=torch.float32)
    return latents, audio_latents


def preview_forward(
    transformer,
    latents: torch.Tensor,
    audio_latents: torch.Tensor,
    timestep: torch.Tensor,
    prompt_embeds: Sequence[torch.Tensor],
    prompt_attention_masks: Sequence[torch.Tensor | None],
    image_latents: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
    attention_kwargs: dict | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One Preview forward on ``K`` text branches stacked along the batch (SandAI ``prepare_model_input``,
    ``use_ref_for_uncond``): the branches share the latents, the timestep and the I2V conditioning and differ only
    in the text, zero-padded to the longest (:func:`pad_text_batch`; one branch goes in as it is).

    Args:
        transformer: the ``Magi2Transformer3DModel``.
        latents: ``[B, 48, T, h, w]``; audio_latents: ``[B, L, 64]``; timestep: 0-d, 0-1000 scale.
        prompt_embeds, prompt_attention_masks: one ``[B, Lt_k, C]`` batch and its ``[B, Lt_k]`` mask per branch.
        image_latents, image_embeds: ``[B, 48, 1, h, w]`` / ``[B, C]`` I2V conditioning, or ``None``.
        attention_kwargs: the call's; the keys the transformer declares are passed on.

    Returns:
        ``(video, audio)``: per branch, the fp32 ``[B, 48, T, h, w]`` / ``[B, L, 64]`` velocities.
    """
    batch, copies = latents.shape[0], len(prompt_embeds)
    if copies == 1:
        text, mask = prompt_embeds[0], prompt_attention_masks[0]
    else:
        text, mask = pad_text_batch(list(prompt_embeds), list(prompt_attention_masks))
    kwargs = {}
    if image_latents is not None:
        kwargs["image_latents"] = torch.cat([image_latents] * copies, dim=0)
        kwargs["image_embeds"] = torch.cat([image_embeds] * copies, dim=0)
    output = transformer(
        hidden_states=torch.cat([latents] * copies, dim=0),
        timestep=timestep.to(device=latents.device, dtype=torch.float32).reshape(1).expand(copies * batch),
        encoder_hidden_states=text,
        audio_hidden_states=torch.cat([audio_latents] * copies, dim=0),
        encoder_attention_mask=mask,
        attention_kwargs=attention_kwargs_for(transformer, attention_kwargs),
        return_dict=True,
        **kwargs,
    )
    return list(output.sample.float().split(batch)), list(output.audio_sample.float().split(batch))


def refiner_forward(
    refiner,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor | None,
    attention_kwargs: dict | None = None,
    branch: str = "cond",
    context: dict | None = None,
) -> torch.Tensor:
    """The refiner's velocity for one text branch: one forward per sample (the refiner runs a batch's samples one
    by one through its blocks), each in its cache context ``f"{branch}_{b}"``.

    Args:
        refiner: the ``Magi2RefinerTransformer3DModel``.
        latents: ``[B, 48, T', H, W]``; prompt_embeds, prompt_attention_mask: the branch's ``[B, Lt, C]`` / ``[B, Lt]``.
        attention_kwargs: the call's; the keys the refiner declares are passed on.
        branch, context: the cache context's name prefix and keys (``step_index``, ``num_inference_steps``,
            ``timestep``).

    Returns:
        fp32 ``[B, 48, T', H, W]``.
    """
    attention_kwargs = attention_kwargs_for(refiner, attention_kwargs)
    rows = []
    for b in range(latents.shape[0]):
        with cache_context(refiner, f"{branch}_{b}", **(context or {})):
            output = refiner(
                hidden_states=latents[b : b + 1],
                encoder_hidden_states=prompt_embeds[b : b + 1],
                encoder_attention_mask=None if prompt_attention_mask is None else prompt_attention_mask[b : b + 1],
                attention_kwargs=attention_kwargs,
                return_dict=True,
            )
        rows.append(output.sample.float())
    return torch.cat(rows, dim=0)
