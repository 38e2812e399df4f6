"""Small stand-ins shared by the pipeline tests (imported by file path; not a test module)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderOobleck, UniPCMultistepScheduler
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput


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

    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        audio_hidden_states,
        encoder_attention_mask=None,
        image_latents=None,
        image_embeds=None,
        attention_kwargs=None,
        return_dict=True,
    ):
        self.calls.append(
            {
                "hidden_states": hidden_states.clone(),
                "timestep": timestep.clone(),
                "encoder_hidden_states": encoder_hidden_states.clone(),
                "encoder_attention_mask": None if encoder_attention_mask is None else encoder_attention_mask.clone(),
                "audio_hidden_states": audio_hidden_states.clone(),
                "image_latents": None if image_latents is None else image_latents.clone(),
                "image_embeds": None if image_embeds is None else image_embeds.clone(),
            }
        )
        x, a = hidden_states, audio_hidden_states
        half = x.shape[0] // 2 if x.shape[0] > 1 else x.shape[0]
        tau = timestep.float() / 1000.0
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


@dataclass
class RefinerStubOutput(BaseOutput):
    sample: torch.Tensor
    audio_sample: torch.Tensor | None = None


class StandInRefiner(ModelMixin, ConfigMixin):
    """Deterministic velocity with the refiner's keyword API; depends on the text so that the cond
    and uncond forwards differ. Records every call."""

    @register_to_config
    def __init__(self, in_channels: int = 48):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls = []

    def forward(
        self,
        hidden_states,
        encoder_hidden_states,
        audio_hidden_states=None,
        encoder_attention_mask=None,
        attention_kwargs=None,
        return_dict=True,
    ):
        self.calls.append(
            {
                "hidden_states": hidden_states.clone(),
                "encoder_hidden_states": encoder_hidden_states.clone(),
                "audio_hidden_states": audio_hidden_states,
                "attention_kwargs": attention_kwargs,
            }
        )
        text = encoder_hidden_states.float().mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)
        v = 0.9 * hidden_states - 0.2 * torch.tanh(hidden_states) + 0.3 * text
        return RefinerStubOutput(sample=v) if return_dict else (v, None)


def preview_scheduler() -> UniPCMultistepScheduler:
    """The converter's scheduler config: flow-prediction UniPC, flow sigmas, shift 7."""
    return UniPCMultistepScheduler(
        use_flow_sigmas=True,
        flow_shift=7.0,
        prediction_type="flow_prediction",
        solver_order=2,
        solver_type="bh2",
        predict_x0=True,
        lower_order_final=True,
        final_sigmas_type="zero",
    )


def tiny_oobleck(**overrides) -> AutoencoderOobleck:
    """A tiny random ``AutoencoderOobleck`` (2048 samples per latent), its config updated by ``overrides``."""
    torch.manual_seed(0)
    config = {
        "encoder_hidden_size": 4,
        "downsampling_ratios": [2, 4, 4, 8, 8],
        "channel_multiples": [1, 2, 2, 2, 2],
        "decoder_channels": 4,
        "decoder_input_channels": 64,
        "audio_channels": 2,
        "sampling_rate": 44100,
    }
    return AutoencoderOobleck(**{**config, **overrides}).eval()


def tiny_wan22_vae():
    """A tiny random ``AutoencoderKLWan`` in Wan2.2 form (patchify 2, z_dim 48, stride 4x16x16)."""
    from diffusers import AutoencoderKLWan

    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=6,
        z_dim=48,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=(torch.rand(48, generator=g) - 0.5).tolist(),
        latents_std=(torch.rand(48, generator=g) + 0.5).tolist(),
    ).eval()


def tiny_text_encoder(
    tokenizer, hidden_size: int = 48, intermediate_size: int = 64, head_dim: int = 16, linear_num_heads: int = 2
):
    """A tiny random ``Qwen3_5TextModel`` (3 linear-attention layers + 1 full-attention layer) for
    ``tokenizer``; ``hidden_size`` is the text width the DiT sees (48 for the ``magi2_tiny`` models).
    Draws from the global torch RNG (seed it first)."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    return Qwen3_5TextModel(
        Qwen3_5TextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=head_dim,
            linear_num_key_heads=linear_num_heads,
            linear_num_value_heads=linear_num_heads,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            pad_token_id=0,
        )
    ).eval()


def tiny_real_format_components(with_vae: bool = False) -> dict:
    """``Magi2Pipeline`` keyword arguments (all but ``transformer``/``refiner``) matching the
    ``magi2_tiny`` SandAI models (video 12, audio 16, text 48 channels): tiny BPE tokenizer, tiny
    Qwen3.5 text encoder, TurboVAE decoder and Oobleck (random, deterministic), the converter's
    UniPC scheduler and, with ``with_vae``, a 12-channel Wan2.2-form ``AutoencoderKLWan`` sharing the
    decoder's latent statistics."""
    from diffusers import AutoencoderKLWan

    from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder
    from diffusers_magi2.pipelines.tiny_default import build_tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(vocab_size=512)
    components = {"tokenizer": tokenizer, "text_encoder": tiny_text_encoder(tokenizer)}
    g = torch.Generator().manual_seed(1)
    mean = (torch.rand(12, generator=g) - 0.5).tolist()
    std = (torch.rand(12, generator=g) + 0.5).tolist()
    if with_vae:
        components["vae"] = AutoencoderKLWan(
            base_dim=4,
            decoder_base_dim=4,
            z_dim=12,
            num_res_blocks=1,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=mean,
            latents_std=std,
        ).eval()
    components["video_decoder"] = Magi2TurboVAEDecoder(
        latent_channels=12,
        decoder_block_out_channels=[4, 4, 4, 4],
        decoder_layers_per_block=[1, 1, 1, 1, 1],
        first_chunk_size=7,
        step_size=7,
        latents_mean=mean,
        latents_std=std,
    ).eval()
    components["audio_vae"] = AutoencoderOobleck(
        encoder_hidden_size=2,
        channel_multiples=[1, 2, 2, 2, 2],
        decoder_channels=2,
        decoder_input_channels=16,
    ).eval()
    components["scheduler"] = preview_scheduler()
    return components


def stub_embeds(n: int = 1) -> dict:
    """Prompt and negative-prompt embeddings (width 8, 5 and 3 tokens) for the stand-in pipelines."""
    g = torch.Generator().manual_seed(3)
    return {
        "prompt_embeds": torch.randn(n, 5, 8, generator=g),
        "prompt_attention_mask": torch.ones(n, 5, dtype=torch.bool),
        "negative_prompt_embeds": torch.randn(n, 3, 8, generator=g),
        "negative_prompt_attention_mask": torch.ones(n, 3, dtype=torch.bool),
    }


#: a small call of :func:`tiny_two_stage_pipeline`: preview 16x32, refined 32x64, one step each
TWO_STAGE_CALL = {
    "height": 32,
    "width": 64,
    "preview_height": 16,
    "preview_width": 32,
    "num_inference_steps": 1,
    "refiner_num_inference_steps": 1,
}


def tiny_two_stage_pipeline(fixtures_dir):
    """``Magi2Pipeline`` with the ``magi2_tiny`` preview (``preview_h4``) and refiner DiTs, both fp32 from
    their SandAI checkpoints, and :func:`tiny_real_format_components`."""
    from diffusers_magi2 import Magi2Pipeline, Magi2RefinerTransformer3DModel, Magi2Transformer3DModel

    tiny = fixtures_dir / "magi2_tiny"
    transformer = Magi2Transformer3DModel.from_original_checkpoint(
        tiny / "preview_h4" / "sandai_checkpoint", dtype=torch.float32
    )
    refiner = Magi2RefinerTransformer3DModel.from_original_checkpoint(
        tiny / "refiner" / "sandai_checkpoint", torch_dtype=torch.float32
    )
    return Magi2Pipeline(transformer=transformer, refiner=refiner, **tiny_real_format_components())


def refiner_velocity(refiner, latents, prompt_embeds, prompt_attention_mask=None) -> torch.Tensor:
    """One refiner forward (no timestep, no audio): the fp32 velocity (``.sample`` of a model output, or a tensor)."""
    out = refiner(
        hidden_states=latents, encoder_hidden_states=prompt_embeds, encoder_attention_mask=prompt_attention_mask
    )
    return getattr(out, "sample", out).float()


def refine_directly(
    refiner,
    latents,
    prompt_embeds,
    negative_prompt_embeds,
    scheduler,
    config,
    height,
    width,
    prompt_attention_mask=None,
    negative_prompt_attention_mask=None,
    generator=None,
    noise=None,
    on_step=None,
):
    """The refiner stage of one sample composed from ``refiner_stage``'s functions by a loop of its own (the
    independent computation the pipeline's sampler is compared with); ``on_step(i, t, latents)`` after each step."""
    from diffusers_magi2.pipelines.refiner_stage import prepare_refiner_latents

    x, stage_scheduler = prepare_refiner_latents(latents, scheduler, config, height, width, generator, noise)
    g = float(config.guidance_scale)
    for i, t in enumerate(stage_scheduler.timesteps):
        v_c = None if g == 0.0 else refiner_velocity(refiner, x, prompt_embeds, prompt_attention_mask)
        v_u = (
            None if g == 1.0 else refiner_velocity(refiner, x, negative_prompt_embeds, negative_prompt_attention_mask)
        )
        v = v_c if v_u is None else v_u if v_c is None else v_u + torch.tensor(g) * (v_c - v_u)
        x = stage_scheduler.step(v, t, x, return_dict=False)[0]
        if on_step is not None:
            on_step(i, t, x)
    return x


def short_clip_noise(pipe) -> dict:
    """Initial noise of a 0.4 s clip (2 video latent frames at 2x3, 10 audio latents), with ``pipe``'s
    ``duration_s`` set to that clip (the pipeline refuses noise of another length)."""
    pipe.register_to_config(duration_s=0.4)
    return {"latents": torch.randn(1, 48, 2, 2, 3), "audio_latents": torch.randn(1, 10, 64)}
