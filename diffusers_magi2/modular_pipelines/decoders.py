"""Decoder blocks of MAGI-2 (SandAI ``Magi2InferenceEngine.decode_video`` / ``decode_audio``): normalised video
latents to frames through TurboVAED (``video_decoder``) or, without it, the Wan2.2 VAE; audio latents to 44.1 kHz
stereo through the Oobleck decoder and the ``441/512`` resample. ``decode_video_latents`` /
``decode_audio_latents`` and their postprocessing do the work, as in ``Magi2Pipeline``; under context parallelism only CP rank 0 decodes (the others output ``None``).
"""

from __future__ import annotations

import torch
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam

from ..pipelines.decoding_magi2 import (
    decode_audio_latents,
    decode_video_latents,
    postprocess_audio,
    postprocess_video_frames,
)
from .before_denoise import call_input, call_inputs, first_rank
from .utils import Magi2Block, pipeline_config


__all__ = ["Magi2AudioDecoderStep", "Magi2VideoDecoderStep"]


class Magi2VideoDecoderStep(Magi2Block):
    """Frames from the final video latent (``output_type`` ``"latent"`` passes the latent through)."""

    description = (
        "Video decoder step: the final video latent to frames through TurboVAED (video_decoder) or the Wan2.2 "
        "VAE, optionally resized to output_height x output_width"
    )

    component_names = ("video_decoder", "vae")
    config_names = ("fps",)

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam("latents", required=True, type_hint=torch.Tensor, description="final video latent"),
            *call_inputs("output_type", "output_height", "output_width"),
            InputParam("fps", type_hint=float, description="from the refiner step (default config.fps)"),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam(
                "videos", description="frames [B, F, H, W, 3] (np / pt) or PIL lists; the latent for 'latent'"
            ),
            OutputParam("fps", type_hint=float, description="frame rate of the frames (None for 'latent')"),
        ]

    def run(self, components, bs) -> None:
        fps = float(pipeline_config(components)["fps"]) if bs.fps is None else bs.fps
        if bs.output_type == "latent":
            bs.videos, bs.fps = bs.latents, None
        elif not first_rank(components):
            bs.videos, bs.fps = None, fps
        else:
            decoders = [getattr(components, name, None) for name in ("video_decoder", "vae")]
            video = decode_video_latents(*decoders, bs.latents)
            bs.videos = postprocess_video_frames(video, bs.output_type, bs.output_height, bs.output_width)
            bs.fps = fps


class Magi2AudioDecoderStep(Magi2Block):
    """Stereo audio from the final audio latent (``output_type`` ``"latent"`` passes the latent through)."""

    description = (
        "Audio decoder step: the audio latent to 44.1 kHz stereo [B, 2, S] (Oobleck decoder, 441/512 resample)"
    )

    component_names = ("audio_vae",)
    config_names = ("audio_resample_ratio",)

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam("audio_latents", required=True, type_hint=torch.Tensor, description="final audio latent"),
            call_input("output_type"),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("audio", description="[B, 2, S] float32 numpy (torch for 'pt'); the latent for 'latent'"),
            OutputParam("audio_sample_rate", type_hint=int, description="44,100 (None for 'latent')"),
        ]

    def run(self, components, bs) -> None:
        sample_rate = int(components.audio_vae.config.sampling_rate)
        if bs.output_type == "latent":
            bs.audio, bs.audio_sample_rate = bs.audio_latents, None
        elif not first_rank(components):
            bs.audio, bs.audio_sample_rate = None, sample_rate
        else:
            ratio = float(pipeline_config(components)["audio_resample_ratio"])
            audio = decode_audio_latents(components.audio_vae, bs.audio_latents, ratio)
            bs.audio = postprocess_audio(audio, bs.output_type)
            bs.audio_sample_rate = sample_rate
