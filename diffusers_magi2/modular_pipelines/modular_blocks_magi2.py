"""MAGI-2's block compositions: :class:`Magi2AutoBlocks` picks text-to-video, image-to-video (``image``) and the
two-stage 1080p path (``height x width`` 1088 x 1920, ``resolution="1080p"`` or a ``preview_height``) from the
call's inputs, in ``Magi2Pipeline.__call__``'s order: checks, (prompt enhancement), image, text, (CP broadcast), schedule, noise,
preview loop, refiner stage, decoding.
"""

from __future__ import annotations

import inspect

from diffusers.modular_pipelines import AutoPipelineBlocks, ConditionalPipelineBlocks, SequentialPipelineBlocks
from diffusers.modular_pipelines.modular_pipeline_utils import OutputParam

from .before_denoise import (
    Magi2BroadcastConditioningStep,
    Magi2InputStep,
    Magi2PrepareLatentsStep,
    Magi2SetTimestepsStep,
)
from .decoders import Magi2AudioDecoderStep, Magi2VideoDecoderStep
from .denoise import Magi2DenoiseStep, Magi2RefinerDenoiseStep
from .encoders import Magi2ImageEncoderStep, Magi2PromptEnhancerStep, Magi2TextEncoderStep


__all__ = [
    "Magi2AutoBlocks",
    "Magi2AutoImageEncoderStep",
    "Magi2AutoPromptEnhancerStep",
    "Magi2AutoRefinerStep",
    "Magi2CoreDenoiseStep",
    "Magi2DecodeStep",
]


class _Magi2StepBlocks:
    """A composite MAGI-2 step whose ``description`` is its class docstring (the one statement of what it does)."""

    model_name = "magi2"

    @property
    def description(self) -> str:
        return " ".join(inspect.getdoc(type(self)).split())  # a subclass without one: its base's


class Magi2AutoImageEncoderStep(_Magi2StepBlocks, AutoPipelineBlocks):
    """Image encoder step for image-to-video, run when `image` is given (skipped for text-to-video)."""

    block_classes = [Magi2ImageEncoderStep]
    block_names = ["image_encoder"]
    block_trigger_inputs = ["image"]


class Magi2AutoPromptEnhancerStep(_Magi2StepBlocks, ConditionalPipelineBlocks):
    """Prompt enhancer step, run when `enable_prompt_enhancement` is true (skipped otherwise): each prompt rewritten
    once by the `prompt_enhancer` before the text encoder (LTX-2.5's `LTX2AutoPromptEnhancerStep` form)."""

    block_classes = [Magi2PromptEnhancerStep]
    block_names = ["prompt_enhancer"]
    block_trigger_inputs = ["enable_prompt_enhancement"]

    def select_block(self, enable_prompt_enhancement=False) -> str | None:
        return "prompt_enhancer" if enable_prompt_enhancement else None


class Magi2CoreDenoiseStep(_Magi2StepBlocks, SequentialPipelineBlocks):
    """Denoise block: shares the conditioning across CP ranks, sets the schedule, draws the noise, denoises the
    preview latents."""

    block_classes = [Magi2BroadcastConditioningStep, Magi2SetTimestepsStep, Magi2PrepareLatentsStep, Magi2DenoiseStep]
    block_names = ["broadcast", "set_timesteps", "prepare_latents", "denoise"]


class Magi2AutoRefinerStep(_Magi2StepBlocks, AutoPipelineBlocks):
    """Refiner step of the two-stage 1080p path, run when the input step planned it (`refiner_config`); else
    skipped."""

    block_classes = [Magi2RefinerDenoiseStep]
    block_names = ["refiner"]
    block_trigger_inputs = ["refiner_config"]


class Magi2DecodeStep(_Magi2StepBlocks, SequentialPipelineBlocks):
    """Decode block: video frames (TurboVAED or the Wan2.2 VAE), then the stereo soundtrack."""

    block_classes = [Magi2VideoDecoderStep, Magi2AudioDecoderStep]
    block_names = ["video_decoder", "audio_decoder"]


class Magi2AutoBlocks(SequentialPipelineBlocks):
    """MAGI-2 Preview text/image-to-video with audio, one or two stages, as modular blocks.

    Outputs ``videos`` (frames), ``audio``, ``audio_sample_rate`` and ``fps`` as ``Magi2PipelineOutput``'s
    ``frames``, ``audio``, ``audio_sample_rate`` and ``fps``; ``latents``/``audio_latents`` stay in the state.
    """

    model_name = "magi2"
    block_classes = [
        Magi2InputStep,
        Magi2AutoPromptEnhancerStep,
        Magi2AutoImageEncoderStep,
        Magi2TextEncoderStep,
        Magi2CoreDenoiseStep,
        Magi2AutoRefinerStep,
        Magi2DecodeStep,
    ]
    block_names = ["input", "prompt_enhancer", "image_encoder", "text_encoder", "denoise", "refiner", "decode"]

    @property
    def description(self) -> str:
        return (
            "MAGI-2 Preview: a video with a stereo soundtrack from a prompt (text-to-video), conditioned on an "
            "`image` (image-to-video), at 1088x1920 through the refiner stage (two-stage)"
        )

    @property
    def outputs(self):
        return [
            OutputParam("videos", description="the frames (Magi2PipelineOutput.frames)"),
            OutputParam("audio", description="[B, 2, S] stereo audio"),
            OutputParam("audio_sample_rate", type_hint=int),
            OutputParam("fps", type_hint=float),
        ]
