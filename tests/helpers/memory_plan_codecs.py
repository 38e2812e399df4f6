"""Device memory of the text encoder and the decoders at the released size, for the memory plan
(:mod:`helpers.memory_plan`): the VAEs traced on fake tensors (:func:`~helpers.memory_trace.trace_call`), the
Qwen3.5-27B text encoder estimated from its size (its config is not in this repository)."""

from __future__ import annotations

import torch

from diffusers_magi2.pipelines.decoding_magi2 import WAN22_VAE_CONFIG

from .memory_plan import (
    AUDIO_LATENTS,
    H200_BYTES,
    LATENT_FRAMES,
    REFINER_LATENT_FRAMES,
    SPARE_BYTES,
    Magi2StageMemory,
    check_plan_resolution,
    stage_row,
)
from .memory_trace import Trace, default_dtype, trace_call


__all__ = [
    "plan_audio_decode",
    "plan_audio_encode",
    "plan_clip_encode",
    "plan_image_encode",
    "plan_text_encode",
    "plan_video_decode",
    "plan_wan_decode",
]


#: Qwen3.5-27B: its parameter count (the full config is not in this repository), hidden size and depth.
TEXT_ENCODER_PARAMETERS = 27 * 10**9
TEXT_ENCODER_HIDDEN, TEXT_ENCODER_LAYERS = 5120, 64


def _clip_frames(resolution: str) -> int:
    """Latent frames of the clip a decoder sees: 540p the preview's 32, 1080p the refined 63."""
    return REFINER_LATENT_FRAMES if resolution == "1080p" else LATENT_FRAMES


def plan_video_decode(
    resolution: str,
    *,
    tiled: bool = False,
    capacity: int = H200_BYTES,
    margin: int = SPARE_BYTES,
    dtype=torch.bfloat16,
) -> Magi2StageMemory:
    """Peak device memory of the TurboVAE decode of one clip (540p: 32 latents -> 125 frames; 1080p: the refined
    63 latents -> 249 frames), the decoded frames kept on the device as ``decode_video_latents`` returns them;
    ``tiled``: with the decoder's ``enable_tiling()`` (its default 512-pixel tiles).

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder
    from diffusers_magi2.pipelines.decoding_magi2 import decode_video_latents

    height, width = check_plan_resolution(resolution)
    frames = _clip_frames(resolution)

    def build():
        with default_dtype(dtype):  # (a module move cannot swap fake parameters)
            decoder = Magi2TurboVAEDecoder()
        if tiled:
            decoder.enable_tiling()
        return decoder

    def call(decoder):
        latents = torch.empty(1, decoder.config.latent_channels, frames, height // 16, width // 16, dtype=dtype)
        return decode_video_latents(decoder, None, latents)

    notes = [f"{4 * (frames - 1) + 1} frames; the class's default widths (SandAI's TurboVAE JSON is not public)"]
    notes[0] += ", tiled (enable_tiling)" if tiled else ""
    trace = trace_call(build, call)
    return stage_row(f"TurboVAE decode {resolution}", f"turbovae_decode_{resolution}", trace, capacity, margin, notes)


def plan_wan_decode(
    resolution: str, *, tiled: bool = False, capacity: int = H200_BYTES, margin: int = SPARE_BYTES
) -> Magi2StageMemory:
    """Peak device memory of the Wan2.2 VAE decoding one clip (fp32; the pipeline's decoder without a TurboVAE),
    frames as :func:`plan_video_decode`; ``tiled``: with diffusers' ``enable_tiling()`` (its default tiles).

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers import AutoencoderKLWan

    from diffusers_magi2.pipelines.decoding_magi2 import decode_video_latents

    height, width = check_plan_resolution(resolution)
    frames = _clip_frames(resolution)

    def build():
        vae = AutoencoderKLWan(**WAN22_VAE_CONFIG, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)  # (48 channels)
        if tiled:
            vae.enable_tiling()
        return vae

    def call(vae):
        return decode_video_latents(None, vae, torch.empty(1, 48, frames, height // 16, width // 16))

    notes = [f"{4 * (frames - 1) + 1} frames" + (", tiled (enable_tiling)" if tiled else "")]
    trace = trace_call(build, call)
    return stage_row(f"Wan2.2 VAE decode {resolution}", f"wan_decode_{resolution}", trace, capacity, margin, notes)


def plan_image_encode(
    resolution: str = "540p", *, capacity: int = H200_BYTES, margin: int = SPARE_BYTES
) -> Magi2StageMemory:
    """Peak device memory of the Wan2.2 VAE encoding the I2V reference image (fp32, one frame).

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers import AutoencoderKLWan

    height, width = check_plan_resolution(resolution)

    def call(vae):
        return vae.encode(torch.empty(1, 3, 1, height, width)).latent_dist.mean

    trace = trace_call(lambda: AutoencoderKLWan(**WAN22_VAE_CONFIG), call)
    return stage_row(f"Wan2.2 VAE image encode {resolution}", f"image_encode_{resolution}", trace, capacity, margin)


def plan_clip_encode(
    resolution: str = "272p", *, capacity: int = H200_BYTES, margin: int = SPARE_BYTES
) -> Magi2StageMemory:
    """Peak device memory of the Wan2.2 VAE encoding one training clip for ``train_lora.py --cache`` (fp32; the
    clip of the plan's LoRA step: 32 latents <- 125 frames).

    Raises:
        ValueError: an unknown resolution.
    """
    from diffusers import AutoencoderKLWan

    height, width = check_plan_resolution(resolution)
    frames = 4 * (LATENT_FRAMES - 1) + 1

    def call(vae):
        return vae.encode(torch.empty(1, 3, frames, height, width)).latent_dist.mode()

    trace = trace_call(lambda: AutoencoderKLWan(**WAN22_VAE_CONFIG), call)
    return stage_row(
        f"Wan2.2 VAE clip encode {resolution}",
        f"clip_encode_{resolution}",
        trace,
        capacity,
        margin,
        [f"{frames} frames"],
    )


def plan_audio_encode(*, capacity: int = H200_BYTES, margin: int = SPARE_BYTES) -> Magi2StageMemory:
    """Peak device memory of the Stable Audio Open VAE (fp32) encoding a clip's 10 s of stereo at its own rate
    (``train_lora.py --cache``: 250 latents x 2048 samples)."""
    from diffusers import AutoencoderOobleck

    def call(vae):
        hop = 1
        for ratio in vae.config.downsampling_ratios:
            hop *= ratio
        return vae.encode(torch.empty(1, vae.config.audio_channels, AUDIO_LATENTS * hop)).latent_dist.mean

    trace = trace_call(AutoencoderOobleck, call)
    return stage_row("audio encode (Oobleck)", "audio_encode", trace, capacity, margin, ["10 s stereo"])


def plan_audio_decode(*, capacity: int = H200_BYTES, margin: int = SPARE_BYTES) -> Magi2StageMemory:
    """Peak device memory of the Stable Audio Open VAE (``AutoencoderOobleck``, fp32) decoding 250 latents."""
    from diffusers import AutoencoderOobleck

    def call(vae):
        return vae.decode(torch.empty(1, vae.config.decoder_input_channels, AUDIO_LATENTS)).sample

    trace = trace_call(AutoencoderOobleck, call)
    return stage_row("audio decode (Oobleck)", "audio_decode", trace, capacity, margin, ["10 s stereo"])


def plan_text_encode(
    text_tokens: int = 7000, *, capacity: int = H200_BYTES, margin: int = SPARE_BYTES
) -> Magi2StageMemory:
    """Device memory of the Qwen3.5-27B text encoder on one prompt of ``text_tokens`` tokens, an estimate:
    bf16 weights of 27 B parameters, every layer's hidden states (``output_hidden_states``), and one layer's MLP
    (intermediate ``3.4 x`` hidden, gate and up) in flight.

    Raises:
        ValueError: a negative ``text_tokens``.
    """
    if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be a non-negative int; got {text_tokens!r}")
    hidden_states = (TEXT_ENCODER_LAYERS + 1) * text_tokens * TEXT_ENCODER_HIDDEN * 2
    mlp = 3 * text_tokens * (17408 * 2)
    notes = [f"estimate: 27 B bf16 parameters, {text_tokens} tokens (the longest prompt)"]
    trace = Trace(TEXT_ENCODER_PARAMETERS * 2, hidden_states + mlp, None)
    return stage_row("text encoding (Qwen3.5-27B)", "text_encode", trace, capacity, margin, notes)
