"""``examples/train_lora.py``'s flow-matching objective (SandAI's sampler predicts ``v = eps - x0`` and steps
``x0 = x - sigma * v``), for one cached sample::

    u ~ p(u)                                 --weighting_scheme: none / sigma_sqrt / cosmap: U(0, 1); logit_normal:
                                             sigmoid(N(--logit_mean, --logit_std)); mode: diffusers' mode density
                                             (--mode_scale); diffusers' compute_density_for_timestep_sampling
    sigma = s u / (1 + (s - 1) u)            s = --flow_shift (1: none; the sampler's scheduler shifts by its
                                             flow_shift, 7 for the tiny model), clamped to [1e-5, 1 - 1e-5]
    x_t = (1 - sigma) x0 + sigma eps         a_t = (1 - sigma) a0 + sigma eps_a          eps, eps_a ~ N(0, I)
    timestep = floor(1000 sigma)             (0-1000 scale, as at inference)
    text = the negative prompt's states with probability --cfg_dropout (the sampler's unconditional branch), else
           the sample's
    loss = w(sigma) mean((v - (eps - x0))^2) + --audio_loss_weight w(sigma) mean((v_a - (eps_a - a0))^2)

with ``w`` diffusers' ``compute_loss_weighting_for_sd3`` (``sigma_sqrt``: ``sigma^-2``; ``cosmap``:
``2 / (pi (1 - 2 sigma + 2 sigma^2))``; else 1). The defaults (uniform sigma, no shift, no dropout, audio weight 0:
the audio latent is noised at the video's sigma and takes no loss) are ``train_lora.py``'s original objective. The
tiny model's transformer (``examples/tiny/train_tiny_transformer.py``) trained with half of its sigmas shifted by
7, CFG dropout 0.1 and audio weight 0.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


__all__ = ["WEIGHTING_SCHEMES", "Objective", "flow_matching_inputs", "shift_sigma"]

#: ``--weighting_scheme`` values (diffusers' training scripts' names).
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "logit_normal", "mode", "cosmap")
SIGMA_MIN = 1e-5


@dataclass(frozen=True)
class Objective:
    """The objective's choices (module docstring); the defaults are ``train_lora.py``'s original objective.
    ``negative_text_states`` ``[Lt, C]`` is the pipeline's negative prompt, needed when ``cfg_dropout > 0``."""

    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    flow_shift: float = 1.0
    audio_loss_weight: float = 0.0
    cfg_dropout: float = 0.0
    negative_text_states: Any = None

    def __post_init__(self):
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme {self.weighting_scheme!r}: choose from {list(WEIGHTING_SCHEMES)}")
        if not self.flow_shift > 0:
            raise ValueError(f"flow_shift must be > 0; got {self.flow_shift}")
        if not 0 <= self.cfg_dropout < 1:
            raise ValueError(f"cfg_dropout must be in [0, 1); got {self.cfg_dropout}")
        if not self.audio_loss_weight >= 0:
            raise ValueError(f"audio_loss_weight must be >= 0; got {self.audio_loss_weight}")
        if self.cfg_dropout > 0 and self.negative_text_states is None:
            raise ValueError("cfg_dropout > 0 needs negative_text_states (the pipeline's negative prompt)")

    def sample_sigma(self, generator) -> float:
        """One ``sigma`` (module docstring) drawn from ``generator``."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling(
            self.weighting_scheme, 1, self.logit_mean, self.logit_std, self.mode_scale, generator=generator
        )
        sigma = shift_sigma(float(u[0]), self.flow_shift)
        return min(max(sigma, SIGMA_MIN), 1 - SIGMA_MIN)

    def loss_weight(self, sigma: float) -> float:
        """``w(sigma)`` (module docstring)."""
        import torch
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        return float(compute_loss_weighting_for_sd3(self.weighting_scheme, torch.tensor(sigma, dtype=torch.float64)))


def shift_sigma(u: float, shift: float) -> float:
    """The flow shift ``s u / (1 + (s - 1) u)`` (the scheduler's ``flow_shift``; 1 leaves ``u``)."""
    return shift * u / (1 + (shift - 1) * u)


def flow_matching_inputs(sample: dict, generator, device, fixed: dict | None, objective: Objective) -> dict:
    """The objective's tensors for one cached sample: ``x_t``, ``a_t``, ``timestep``, ``text_states`` (batch of
    one), the targets ``target`` / ``audio_target`` and the loss weight ``weight``. ``fixed`` (``sigma``, ``eps``,
    ``eps_a``) replaces the draws; the draws otherwise come from ``generator`` in the order sigma, eps, eps_a, and
    with ``cfg_dropout`` the dropout."""
    import torch

    x0 = sample["latents"][None].to(device)
    a0 = sample["audio_latents"][None].to(device)
    if fixed is not None:
        sigma, eps, eps_a = fixed["sigma"], fixed["eps"], fixed["eps_a"]
    else:
        sigma = objective.sample_sigma(generator)
        eps = torch.randn(x0.shape, generator=generator).to(device)
        eps_a = torch.randn(a0.shape, generator=generator).to(device)
    text = sample["text_states"]
    if objective.cfg_dropout > 0 and float(torch.rand((), generator=generator)) < objective.cfg_dropout:
        text = objective.negative_text_states
    return {
        "x_t": (1 - sigma) * x0 + sigma * eps,
        "a_t": (1 - sigma) * a0 + sigma * eps_a,
        "timestep": torch.full((1,), float(math.floor(1000 * sigma)), device=device),
        "text_states": text[None].to(device),
        "target": eps - x0,
        "audio_target": eps_a - a0,
        "weight": objective.loss_weight(sigma),
    }
