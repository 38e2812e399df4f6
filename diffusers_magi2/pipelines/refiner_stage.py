"""The 1080p refiner stage of MAGI-2 (SandAI ``Magi2InferenceEngine.evaluate_magi2_refiner_with_latent``).

On the final preview video latent ``[B, 48, T, h, w]``:

1. trilinear upsample (``align_corners=True``) to ``[B, 48, 2T - 1, H/16, W/16]``;
2. VP re-noise ``x = s x + sqrt(1 - s^2) eps``, ``s`` = entry ``noise_value`` (220) of the zero-terminal-SNR
   DDPM table (:func:`zero_snr_refiner_sigmas`);
3. a fresh Flow-UniPC (the pipeline's scheduler with ``flow_shift = shift``), two forwards per step (cond,
   then uncond text; no timestep, no audio) combined as ``v = v_u + g (v_c - v_u)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from .sampling_magi2 import denoise_steps, unshifted_sigmas


__all__ = [
    "Magi2RefinerStageConfig",
    "zero_snr_refiner_sigmas",
    "refiner_renoise_scale",
    "refiner_latent_size",
    "upsample_preview_latents",
    "renoise_latents",
    "make_refiner_scheduler",
    "run_refiner_stage",
]


@dataclass
class Magi2RefinerStageConfig:
    """Refiner-stage settings (defaults: SandAI ``magi2_refiner.json`` ``evaluation_config``).

    Attributes:
        num_inference_steps: Flow-UniPC steps.
        shift: flow shift.
        guidance_scale: text CFG scale; 1.0 skips the uncond forward, 0.0 runs it alone.
        noise_value: index into :func:`zero_snr_refiner_sigmas` (0 = no re-noise).
        sigma_start: first unshifted sigma.
        vae_stride_spatial: pixels per latent cell.
    """

    num_inference_steps: int = 5
    shift: float = 5.0
    guidance_scale: float = 2.0
    noise_value: int = 220
    sigma_start: float = 0.999
    vae_stride_spatial: int = 16


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


def refiner_renoise_scale(noise_value: int = 220) -> torch.Tensor:
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


def renoise_latents(latents: torch.Tensor, noise: torch.Tensor, noise_value: int = 220) -> torch.Tensor:
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


def make_refiner_scheduler(scheduler: Any, shift: float = 5.0):
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


def _velocity(out: Any) -> torch.Tensor:
    if hasattr(out, "sample"):
        return out.sample
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def run_refiner_stage(
    refiner: Callable[..., Any],
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: Optional[torch.Tensor],
    scheduler: Any,
    *,
    height: int = 1088,
    width: int = 1920,
    prompt_attention_mask: Optional[torch.Tensor] = None,
    negative_prompt_attention_mask: Optional[torch.Tensor] = None,
    config: Optional[Magi2RefinerStageConfig] = None,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[Union[torch.Generator, list]] = None,
    attention_kwargs: Optional[dict] = None,
    callback_on_step_end: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None,
    denoise: Optional[Callable[..., dict]] = None,
) -> torch.Tensor:
    """Run the refiner stage (module docstring) on a final preview latent.

    Args:
        refiner: a ``Magi2RefinerTransformer3DModel`` or a callable with its keyword API.
        latents: ``[B, C, T, h, w]`` final preview video latent (fp32).
        prompt_embeds / negative_prompt_embeds: ``[B, Lt, Ct]`` text features; the negative ones may be
            ``None`` only when ``guidance_scale == 1``.
        scheduler: the pipeline's scheduler (:func:`make_refiner_scheduler` derives the stage's).
        height, width: output pixels.
        prompt_attention_mask / negative_prompt_attention_mask: optional ``[B, Lt]`` valid-token masks.
        config: :class:`Magi2RefinerStageConfig` (released defaults).
        noise: fixed re-noise ``[B, C, 2T-1, H, W]``; else drawn with ``generator`` (fp32).
        attention_kwargs: passed to the refiner.
        callback_on_step_end: ``fn(step_index, timestep, latents)`` after each step.
        denoise: the loop ``denoise(refiner, timesteps, tensors, schedulers, predict)`` (default
            :func:`~diffusers_magi2.pipelines.sampling_magi2.denoise_steps`); not with ``callback_on_step_end``.

    Returns:
        ``[B, C, 2T - 1, H, W]`` fp32 refined latent.

    Raises:
        ValueError: bad shapes, a missing negative prompt with CFG, a non-flow scheduler, or both
            ``callback_on_step_end`` and ``denoise``.
    """
    from diffusers.utils.torch_utils import randn_tensor

    cfg = config or Magi2RefinerStageConfig()
    if denoise is not None and callback_on_step_end is not None:
        raise ValueError("pass callback_on_step_end or denoise (which runs its own callbacks), not both")
    if latents.dim() != 5:
        raise ValueError(f"latents must be [B, C, T, h, w], got {tuple(latents.shape)}")
    if prompt_embeds.dim() != 3 or prompt_embeds.shape[0] != latents.shape[0]:
        raise ValueError(f"prompt_embeds must be [{latents.shape[0]}, Lt, Ct], got {tuple(prompt_embeds.shape)}")
    use_cfg = cfg.guidance_scale != 1.0
    uncond_only = cfg.guidance_scale == 0.0
    if use_cfg and negative_prompt_embeds is None:
        raise ValueError("negative_prompt_embeds are required when the refiner guidance_scale != 1")
    if negative_prompt_embeds is not None and (
        negative_prompt_embeds.dim() != 3 or negative_prompt_embeds.shape[0] != latents.shape[0]
    ):
        raise ValueError(
            f"negative_prompt_embeds must be [{latents.shape[0]}, Lt, Ct], got {tuple(negative_prompt_embeds.shape)}"
        )
    lh, lw = refiner_latent_size(height, width, cfg.vae_stride_spatial)
    x = upsample_preview_latents(latents.float(), lh, lw)
    if int(cfg.noise_value) != 0:
        if noise is None:
            noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        x = renoise_latents(x, noise.to(x.device, torch.float32), cfg.noise_value)

    sched = make_refiner_scheduler(scheduler, cfg.shift)
    sched.set_timesteps(sigmas=unshifted_sigmas(cfg.sigma_start, cfg.num_inference_steps), device=x.device)
    sched.set_begin_index(0)
    g = torch.tensor(float(cfg.guidance_scale), dtype=torch.float32, device=x.device)
    masks = {"cond": prompt_attention_mask, "uncond": negative_prompt_attention_mask}

    def forward(branch, tensors, context):
        # one forward per sample, each in its own cache context (the refiner runs the samples of a
        # batch one after another through its blocks, so a cache hook must not mix them)
        latents, mask = tensors["latents"], masks[branch]
        embeds = tensors["negative_prompt_embeds" if branch == "uncond" else "prompt_embeds"]
        batch = latents.shape[0]
        rows = []
        for b in range(batch):
            pick = (lambda v: v) if batch == 1 else (lambda v: None if v is None else v[b : b + 1])
            with context(f"{branch}_{b}"):
                out = refiner(
                    hidden_states=pick(latents),
                    encoder_hidden_states=pick(embeds),
                    encoder_attention_mask=pick(mask),
                    attention_kwargs=attention_kwargs,
                )
            rows.append(_velocity(out).float())
        return torch.cat(rows, dim=0) if batch > 1 else rows[0]

    def predict(i, t, tensors, context):
        if uncond_only:
            return {"latents": forward("uncond", tensors, context)}
        if not use_cfg:
            return {"latents": forward("cond", tensors, context)}
        v_c = forward("cond", tensors, context)
        v_u = forward("uncond", tensors, context)
        return {"latents": v_u + g * (v_c - v_u)}

    if denoise is None:

        def on_step_end(i, t, tensors):
            if callback_on_step_end is not None:
                callback_on_step_end(i, t, tensors["latents"])

        denoise = functools.partial(denoise_steps, on_step_end=on_step_end)
    tensors = {"latents": x, "prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_prompt_embeds}
    return denoise(refiner, sched.timesteps, tensors, {"latents": sched}, predict)["latents"]
