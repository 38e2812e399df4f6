"""Small stand-ins shared by the pipeline tests (imported by file path; not a test module)."""

from __future__ import annotations

import torch
from diffusers import AutoencoderOobleck, UniPCMultistepScheduler
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from dataclasses import dataclass


@dataclass
class StubOutput(BaseOutput):
    sample: torch.Tensor
    audio_sample: torch.Tensor


class StandInTransformer(ModelMixin, ConfigMixin):
    """The deterministic stand-in DiT of the ``sampler/`` fixture (README §4), behind the
    ``Magi2Transformer3DModel`` keyword interface. Rows ``[:B]`` are the cond half, ``[B:]`` the
    uncond half. ``tau = timestep / 1000`` (fp32). Records every call in ``self.calls``."""

    @register_to_config
    def __init__(self, video_channels: int = 48, audio_channels: int = 64):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, audio_hidden_states,
                encoder_attention_mask=None, image_latents=None, image_embeds=None,
                attention_kwargs=None, return_dict=True):
        self.calls.append(dict(hidden_states=hidden_states.clone(), timestep=timestep.clone(),
                               encoder_hidden_states=encoder_hidden_states.clone(),
                               encoder_attention_mask=None if encoder_attention_mask is None else encoder_attention_mask.clone(),
                               audio_hidden_states=audio_hidden_states.clone(),
                               image_latents=None if image_latents is None else image_latents.clone(),
                               image_embeds=None if image_embeds is None else image_embeds.clone()))
        x, a = hidden_states, audio_hidden_states
        half = x.shape[0] // 2 if x.shape[0] > 1 else x.shape[0]
        tau = (timestep.float() / 1000.0)
        tv = tau.view(-1, 1, 1, 1, 1)
        ta = tau.view(-1, 1, 1)
        bv = torch.linspace(-0.05, 0.05, x.shape[1]).view(1, -1, 1, 1, 1)
        ba = torch.linspace(-0.05, 0.05, a.shape[2]).view(1, 1, -1)
        v_cond = 1.05 * x - 0.25 * tv * torch.sin(x) + bv
        v_uncond = 0.95 * x + 0.15 * tv * torch.cos(x)
        a_cond = 1.1 * a - 0.3 * ta * torch.sin(a) + ba
        a_uncond = 0.9 * a + 0.1 * ta * torch.cos(a)
        rows = torch.arange(x.shape[0]) < half
        video = torch.where(rows.view(-1, 1, 1, 1, 1), v_cond, v_uncond)
        audio = torch.where(rows.view(-1, 1, 1), a_cond, a_uncond)
        if not return_dict:
            return (video, audio)
        return StubOutput(sample=video, audio_sample=audio)


def preview_scheduler() -> UniPCMultistepScheduler:
    """The converter's scheduler config: flow-prediction UniPC, flow sigmas, shift 7."""
    return UniPCMultistepScheduler(
        use_flow_sigmas=True, flow_shift=7.0, prediction_type="flow_prediction", solver_order=2,
        solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero",
    )


def tiny_oobleck() -> AutoencoderOobleck:
    torch.manual_seed(0)
    return AutoencoderOobleck(encoder_hidden_size=4, downsampling_ratios=[2, 4, 4, 8, 8],
                              channel_multiples=[1, 2, 2, 2, 2], decoder_channels=4,
                              decoder_input_channels=64, audio_channels=2, sampling_rate=44100).eval()


def tiny_wan22_vae():
    """A tiny random ``AutoencoderKLWan`` in Wan2.2 form (patchify 2, z_dim 48, stride 4x16x16)."""
    from diffusers import AutoencoderKLWan

    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    return AutoencoderKLWan(
        base_dim=4, decoder_base_dim=6, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
        patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=(torch.rand(48, generator=g) - 0.5).tolist(),
        latents_std=(torch.rand(48, generator=g) + 0.5).tolist(),
    ).eval()
