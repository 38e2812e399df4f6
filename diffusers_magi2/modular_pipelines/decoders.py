"""Decoder blocks of MAGI-2 (SandAI ``Magi2InferenceEngine.decode_video`` / ``decode_audio``): normalised video
latents to frames through TurboVAED (``video_decoder``) or, without it, the Wan2.2 VAE; audio latents to 44.1 kHz
stereo through the Oobleck decoder and the ``441/512`` resample. ``Magi2Pipeline.decode_video`` /
``decode_audio`` do the work; under context parallelism only CP rank 0 decodes (the others output ``None``).
"""

from __future__ import annotations

import torch
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam

from ..pipelines.decoding_magi2 import resize_video_frames
from .before_denoise import call_input, call_inputs, first_rank
from .utils import Magi2Block, classic_steps


__all__ = ["Magi2AudioDecoderStep", "Magi2VideoDecoderStep"]


class Magi2VideoDecoderStep(Magi2Block):
    """Frames from the final video latent (``output_type`` ``"latent"`` passes the latent through)."""

    description = (
        "Video decoder step: the final video latent to frames through TurboVAED (video_decoder) or the Wan2.2 "
        "VAE, optionally resized to output_height x output_width"
    )

    component_names = ("video_decoder", "vae")

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
        steps = classic_steps(components)
        fps = float(steps.config.fps) if bs.fps is None else bs.fps
        if bs.output_type == "latent":
            bs.videos, bs.fps = bs.latents, None
        elif not first_rank(components):
            bs.videos, bs.fps = None, fps
        else:
            video = steps.decode_video(bs.latents)
            if bs.output_height is not None:
                video = resize_video_frames(video, bs.output_height, bs.output_width)
            bs.videos = steps.video_processor.postprocess_video(video, output_type=bs.output_type)
            bs.fps = fps


class Magi2AudioDecoderStep(Magi2Block):
    """Stereo audio from the final audio latent (``output_type`` ``"latent"`` passes the latent through)."""

    description = (
        "Audio decoder step: the audio latent to 44.1 kHz stereo [B, 2, S] (Oobleck decoder, 441/512 resample)"
    )

    component_names = ("audio_vae",)

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
        steps = classic_steps(components)
        if bs.output_type == "latent":
            bs.audio, bs.audio_sample_rate = bs.audio_latents, None
        elif not first_rank(components):
            bs.audio, bs.audio_sample_rate = None, steps.audio_sample_rate
        else:
            audio = steps.decode_audio(bs.audio_latents)
            bs.audio = torch.from_numpy(audio) if bs.output_type == "pt" else audio
            bs.audio_sample_rate = steps.audio_sample_rate
