"""The 1080p refiner stage of MAGI-2 (spec §5.7), run by ``Magi2Pipeline.__call__`` on its two-stage path.

``Magi2Pipeline`` calls :func:`run_refiner_stage` with its final preview latent, its prompt and
negative-prompt embeddings (the negative ones are encoded even when the preview runs without CFG),
its ``scheduler``, the requested output size, a :class:`Magi2RefinerStageConfig` built from the
pipeline config (``refiner_*`` keys), the same ``generator`` the preview drew from and its own
``_denoise`` as the loop; it is also usable on its own (e.g. to refine a saved preview latent).

After the preview denoise, SandAI's engine (``Magi2InferenceEngine.evaluate_magi2_refiner_with_latent``)

1. upsamples the final preview video latent ``[1, 48, T, h, w]`` trilinearly (``align_corners=True``)
   to ``[1, 48, 2T - 1, H/16, W/16]`` (1080p: 63 x 68 x 120);
2. re-noises it VP-style, ``x = x * s + eps * sqrt(1 - s^2)``, with ``s`` = entry ``noise_value`` (220)
   of the zero-terminal-SNR DDPM table (:func:`zero_snr_refiner_sigmas`; ``s = 0.838910``);
3. denoises it with a fresh Flow-UniPC, 5 steps at shift 5 (timesteps 999, 952, 882, 768, 555), two
   batch-1 refiner forwards per step (cond text, then the negative prompt) combined as
   ``v = v_u + 2.0 * (v_c - v_u)``; no timestep is given to the refiner and no audio tokens
   (``magi2_refiner_audio_noise_scale = -1``); the preview audio latent is decoded as is.

The scheduler is a diffusers ``UniPCMultistepScheduler`` derived from the pipeline's own one
(``from_config(..., flow_shift=shift)``) and driven with ``set_timesteps(sigmas=linspace(0.999, 0,
N + 1)[:-1])``, which reproduces the reference's Flow-UniPC bit-exactly (component fixture README).

Independent implementation; no reference code is copied.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from .sampling_magi2 import denoise_steps

__all__ = [
    "Magi2RefinerStageConfig",
    "zero_snr_refiner_sigmas",
    "refiner_renoise_scale",
    "refiner_latent_size",
    "upsample_preview_latents",
    "renoise_latents",
    "make_refiner_scheduler",
    "refiner_base_sigmas",
    "run_refiner_stage",
]


@dataclass
class Magi2RefinerStageConfig:
    """Refiner-stage settings (released values from ``magi2_refiner.json`` ``evaluation_config``).

    Attributes:
        num_inference_steps: Flow-UniPC steps (``magi2_refiner_num_inference_steps`` = 5).
        shift: flow shift (``magi2_refiner_shift`` = 5.0).
        guidance_scale: text CFG scale (``magi2_refiner_video_txt_guidance_scale`` = 2.0); 1.0 skips
            the uncond forward; 0.0 runs the uncond forward only (as the reference).
        noise_value: index into :func:`zero_snr_refiner_sigmas` for the re-noise (220); 0 = no re-noise.
        sigma_start: first unshifted sigma (0.999, as the preview).
        vae_stride_spatial: pixels per latent cell (16).
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
    """Zero-terminal-SNR "sigmas" (signal scales) of SandAI's ``ZeroSNRDDPMDiscretization`` (flipped).

    ``betas = linspace(sqrt(linear_start), sqrt(linear_end), n)**2`` (float64),
    ``abar = cumprod(1 - betas)``; then in fp32: ``a = sqrt(abar)``, rescaled so the last entry is
    0 and the first keeps its value: ``a = (a - a[-1]) * a[0] / (a[0] - a[-1])``.

    Returns:
        ``[num_timesteps]`` fp32, index ``i`` = timestep ``i`` (index 0 = 0.99957, last = 0).
    """
    betas = torch.linspace(linear_start**0.5, linear_end**0.5, num_timesteps, dtype=torch.float64) ** 2
    abar = torch.cumprod(1.0 - betas, dim=0).to(torch.float32)
    a = abar.sqrt()
    a0, a_last = a[0].clone(), a[-1].clone()
    a = a - a_last
    a = a * (a0 / (a0 - a_last))
    return a


def refiner_renoise_scale(noise_value: int = 220) -> torch.Tensor:
    """Signal scale ``s`` of the re-noise (``[]`` fp32; 0.838910 for the released ``noise_value`` 220).

    Raises:
        ValueError: ``noise_value`` outside ``[0, 999]``.
    """
    if not 0 <= int(noise_value) < 1000:
        raise ValueError(f"noise_value must be in [0, 999], got {noise_value}")
    return zero_snr_refiner_sigmas()[int(noise_value)]


def refiner_latent_size(height: int, width: int, vae_stride_spatial: int = 16) -> tuple[int, int]:
    """Refiner latent ``(h, w)`` for an output of ``height x width`` pixels (floor division, as the reference).

    1088 x 1920 -> (68, 120). Raises ValueError for sizes below one latent cell.
    """
    h, w = int(height) // vae_stride_spatial, int(width) // vae_stride_spatial
    if h < 1 or w < 1:
        raise ValueError(f"refiner height/width must be >= {vae_stride_spatial} pixels, got {height}x{width}")
    return h, w


def upsample_preview_latents(latents: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
    """Trilinear (``align_corners=True``) upsample ``[B, C, T, h, w]`` -> ``[B, C, 2T - 1, H, W]``.

    Computed in the input dtype (fp32 in the reference). Raises ValueError for a non-5-D input.
    """
    if latents.dim() != 5:
        raise ValueError(f"latents must be [B, C, T, h, w], got {tuple(latents.shape)}")
    t = latents.shape[2]
    return F.interpolate(
        latents, size=(2 * t - 1, int(latent_height), int(latent_width)), mode="trilinear", align_corners=True
    )


def renoise_latents(latents: torch.Tensor, noise: torch.Tensor, noise_value: int = 220) -> torch.Tensor:
    """VP re-noise ``latents * s + noise * (1 - s^2) ** 0.5`` with ``s = refiner_renoise_scale(noise_value)``.

    ``noise_value == 0`` returns ``latents`` unchanged (the reference skips the re-noise).

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

    Args:
        scheduler: the pipeline's flow-prediction ``UniPCMultistepScheduler`` (its config is reused:
            solver order 2, bh2, predict_x0, lower_order_final, final sigma 0).

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


def refiner_base_sigmas(num_inference_steps: int, sigma_start: float = 0.999) -> np.ndarray:
    """Unshifted sigmas ``linspace(sigma_start, 0, N + 1)[:-1]`` passed to ``set_timesteps(sigmas=...)``."""
    return np.linspace(float(sigma_start), 0.0, int(num_inference_steps) + 1)[:-1]


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
    """Run the refiner stage on a final preview latent and return the refined latent.

    Args:
        refiner: a ``Magi2RefinerTransformer3DModel`` (or any callable with its keyword API:
            ``refiner(hidden_states=, encoder_hidden_states=, encoder_attention_mask=,
            attention_kwargs=)`` returning ``.sample`` ``[B, C, T', H, W]``).
        latents: ``[B, C, T, h, w]`` final preview video latent (fp32).
        prompt_embeds / negative_prompt_embeds: ``[B, Lt, Ct]`` text features (cond / uncond).
            ``negative_prompt_embeds`` may be ``None`` only when ``guidance_scale == 1``.
        scheduler: the pipeline's scheduler; a fresh one is derived (:func:`make_refiner_scheduler`).
        height, width: output pixels (1088 x 1920 -> latent 68 x 120).
        prompt_attention_mask / negative_prompt_attention_mask: optional ``[B, Lt]`` valid-token masks.
        config: :class:`Magi2RefinerStageConfig` (released defaults).
        noise: optional fixed re-noise ``eps`` ``[B, C, 2T-1, H, W]``; else drawn with ``generator``
            (``randn`` in fp32 on the latents' device, after the preview draws, as the reference).
        attention_kwargs: passed to the refiner.
        callback_on_step_end: ``fn(step_index, timestep, latents)`` after each scheduler step.
        denoise: the loop, called as ``denoise(refiner, timesteps, tensors, schedulers, predict)`` with
            the step table ``{"latents", "prompt_embeds", "negative_prompt_embeds"}``; default
            :func:`~diffusers_magi2.pipelines.sampling_magi2.denoise_steps`. ``Magi2Pipeline`` passes
            its ``_denoise`` (progress bar, interrupt, step callbacks); not together with
            ``callback_on_step_end``.

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
    sched.set_timesteps(sigmas=refiner_base_sigmas(cfg.num_inference_steps, cfg.sigma_start), device=x.device)
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
                    hidden_states=pick(latents), encoder_hidden_states=pick(embeds), encoder_attention_mask=pick(mask),
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
