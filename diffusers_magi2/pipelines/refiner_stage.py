"""The 1080p refiner stage of MAGI-2 (SandAI ``Magi2InferenceEngine.evaluate_magi2_refiner_with_latent``), as plain
functions; ``Magi2Pipeline`` and the modular refiner step run its loop (the step: :func:`~.sampling_magi2.refiner_forward`).

On the final preview video latent ``[B, 48, T, h, w]`` (:func:`prepare_refiner_latents`):

1. trilinear upsample (``align_corners=True``) to ``[B, 48, 2T - 1, H/16, W/16]``;
2. VP re-noise ``x = s x + sqrt(1 - s^2) eps``, ``s`` = entry ``noise_value`` of the zero-terminal-SNR
   DDPM table (:func:`zero_snr_refiner_sigmas`);
3. a fresh Flow-UniPC (the pipeline's scheduler with ``flow_shift = shift``) on the unshifted sigmas
   ``linspace(sigma_start, 0, N + 1)[:-1]``.

Per step the refiner runs one forward per sample and text branch (cond, then uncond; no timestep, no audio),
combined as ``v = v_u + g (v_c - v_u)``. The settings come from the pipeline's config only
(:class:`Magi2RefinerStageConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import randn_tensor

from .sampling_magi2 import unshifted_sigmas


__all__ = [
    "Magi2RefinerStageConfig",
    "resolve_refiner_stage_config",
    "zero_snr_refiner_sigmas",
    "refiner_renoise_scale",
    "refiner_latent_size",
    "upsample_preview_latents",
    "renoise_latents",
    "make_refiner_scheduler",
    "prepare_refiner_latents",
]


@dataclass
class Magi2RefinerStageConfig:
    """Refiner-stage settings of one call, from ``Magi2Pipeline.config`` (``Magi2Pipeline.refiner_stage_config``;
    the converter writes SandAI's ``magi2_refiner.json`` ``evaluation_config`` values there).

    Attributes:
        num_inference_steps: Flow-UniPC steps.
        shift: flow shift.
        guidance_scale: text CFG scale; 1.0 skips the uncond forward, 0.0 runs it alone.
        noise_value: index into :func:`zero_snr_refiner_sigmas` (0 = no re-noise).
        sigma_start: first unshifted sigma.
        vae_stride_spatial: pixels per latent cell.
    """

    num_inference_steps: int
    shift: float
    guidance_scale: float
    noise_value: int
    sigma_start: float
    vae_stride_spatial: int


def resolve_refiner_stage_config(
    config: Mapping[str, Any],
    vae_stride_spatial: int,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
) -> Magi2RefinerStageConfig:
    """The :class:`Magi2RefinerStageConfig` of a call.

    Args:
        config: the pipeline config (``refiner_num_inference_steps``, ``refiner_shift``, ``refiner_guidance_scale``,
            ``refiner_noise_value``, ``sigma_start``).
        vae_stride_spatial: pixels per latent cell.
        num_inference_steps, guidance_scale: the call's values; ``None`` takes the config's.
    """
    steps = config["refiner_num_inference_steps"] if num_inference_steps is None else num_inference_steps
    scale = config["refiner_guidance_scale"] if guidance_scale is None else guidance_scale
    return Magi2RefinerStageConfig(
        num_inference_steps=int(steps),
        shift=float(config["refiner_shift"]),
        guidance_scale=float(scale),
        noise_value=int(config["refiner_noise_value"]),
        sigma_start=float(config["sigma_start"]),
        vae_stride_spatial=int(vae_stride_spatial),
    )


def zero_snr_refiner_sigmas(
    num_timesteps: int = 1000, linear_start: float = 0.00085, linear_end: float = 0.012
) -> torch.Tensor:
    """Signal scales of SandAI's ``ZeroSNRDDPMDiscretization``, ``[num_timesteps]`` fp32: ``a = sqrt(cumprod(1 -
    betas))`` with ``betas = linspace(sqrt(start), sqrt(end), n)^2``, rescaled to ``(a - a[-1]) a[0] / (a[0] - a[-1])``."""
    betas = torch.linspace(linear_start**0.5, linear_end**0.5, num_timesteps, dtype=torch.float64) ** 2
    abar = torch.cumprod(1.0 - betas, dim=0).to(torch.float32)
    a = abar.sqrt()
    a0, a_last = a[0].clone(), a[-1].clone()
    a = a - a_last
    a = a * (a0 / (a0 - a_last))
    return a


def refiner_renoise_scale(noise_value: int) -> torch.Tensor:
    """Signal scale ``s`` of the re-noise (``[]`` fp32).

    Raises:
        ValueError: ``noise_value`` outside ``[0, 999]``.
    """
    if not 0 <= int(noise_value) < 1000:
        raise ValueError(f"noise_value must be in [0, 999], got {noise_value}")
    return zero_snr_refiner_sigmas()[int(noise_value)]


def refiner_latent_size(height: int, width: int, vae_stride_spatial: int = 16) -> tuple[int, int]:
    """Refiner latent ``(h, w)`` of ``height x width`` pixels (floor division); ValueError below one cell."""
    h, w = int(height) // vae_stride_spatial, int(width) // vae_stride_spatial
    if h < 1 or w < 1:
        raise ValueError(f"refiner height/width must be >= {vae_stride_spatial} pixels, got {height}x{width}")
    return h, w


def upsample_preview_latents(latents: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
    """Trilinear (``align_corners=True``) upsample ``[B, C, T, h, w]`` -> ``[B, C, 2T - 1, H, W]``; ValueError if not 5-D."""
    if latents.dim() != 5:
        raise ValueError(f"latents must be [B, C, T, h, w], got {tuple(latents.shape)}")
    t = latents.shape[2]
    return F.interpolate(
        latents, size=(2 * t - 1, int(latent_height), int(latent_width)), mode="trilinear", align_corners=True
    )


def renoise_latents(latents: torch.Tensor, noise: torch.Tensor, noise_value: int) -> torch.Tensor:
    """VP re-noise ``s latents + sqrt(1 - s^2) noise``; ``noise_value == 0`` returns ``latents``.

    Raises:
        ValueError: ``noise`` shape differs from ``latents``.
    """
    if noise.shape != latents.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} must equal latents shape {tuple(latents.shape)}")
    if int(noise_value) == 0:
        return latents
    s = refiner_renoise_scale(noise_value).to(latents.device)
    return latents * s + noise * (1 - s**2) ** 0.5


def make_refiner_scheduler(scheduler: Any, shift: float):
    """A fresh scheduler of the same class as ``scheduler`` with ``flow_shift = shift``.

    Raises:
        ValueError: the scheduler is not configured for flow sigmas / flow prediction.
    """
    cfg = scheduler.config
    if not (cfg.get("use_flow_sigmas", False) and cfg.get("prediction_type") == "flow_prediction"):
        raise ValueError(
            "the refiner stage needs a flow-matching UniPCMultistepScheduler (use_flow_sigmas=True, "
            f"prediction_type='flow_prediction'); got {dict(cfg)}"
        )
    return type(scheduler).from_config(cfg, flow_shift=float(shift))


def prepare_refiner_latents(
    latents: torch.Tensor,
    scheduler: Any,
    config: Magi2RefinerStageConfig,
    height: int,
    width: int,
    generator: Optional[Union[torch.Generator, list]] = None,
    noise: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Any]:
    """The refiner stage's first latent and its scheduler (steps 1-3 of the module docstring).

    Args:
        latents: ``[B, C, T, h, w]`` final preview video latent.
        scheduler: the pipeline's scheduler (:func:`make_refiner_scheduler` derives the stage's).
        config: the call's :class:`Magi2RefinerStageConfig`.
        height, width: output pixels.
        generator: draws the re-noise (fp32), continuing the preview's stream; a list draws one row each.
        noise: fixed re-noise ``[B, C, 2T - 1, H/16, W/16]`` instead.

    Returns:
        ``(latents [B, C, 2T - 1, H/16, W/16] fp32, scheduler)``; the scheduler's ``timesteps`` are the stage's.

    Raises:
        ValueError: ``latents`` not 5-D, a size below one latent cell, a ``noise`` of another shape, a
            ``noise_value`` outside ``[0, 999]`` or a non-flow scheduler.
    """
    lh, lw = refiner_latent_size(height, width, config.vae_stride_spatial)
    x = upsample_preview_latents(latents.float(), lh, lw)
    if int(config.noise_value) != 0:
        if noise is None:
            noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        x = renoise_latents(x, noise.to(x.device, torch.float32), config.noise_value)
    stage_scheduler = make_refiner_scheduler(scheduler, config.shift)
    stage_scheduler.set_timesteps(
        sigmas=unshifted_sigmas(config.sigma_start, config.num_inference_steps), device=x.device
    )
    stage_scheduler.set_begin_index(0)
    return x, stage_scheduler
