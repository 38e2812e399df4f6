"""Blocks before the MAGI-2 denoising loop: the call's checks and plan, the conditioning broadcast under context
parallelism, the schedules and the initial noise (SandAI ``Magi2InferenceEngine.evaluate`` up to the sampler).

Each block calls the public function ``Magi2Pipeline`` calls for the same step: the input step
:func:`~diffusers_magi2.pipelines.validation_magi2.check_call_inputs` (against the components the pipeline holds)
and the stage plan, the schedule step :func:`~diffusers_magi2.pipelines.sampling_magi2.flow_schedulers` (sigmas
``linspace(sigma_start, 0, N + 1)[:-1]``, shifted once by the scheduler), the noise step
:func:`~diffusers_magi2.pipelines.sampling_magi2.prepare_latents` (video noise drawn first, then audio, from one
``generator``).
"""

from __future__ import annotations

import inspect

import torch
from diffusers import UniPCMultistepScheduler
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam
from diffusers.utils import logging

from ..parallel.context_parallel import broadcast_from_first_rank
from ..pipelines.pipeline_magi2 import Magi2Pipeline
from ..pipelines.presets_magi2 import (
    CALLBACK_TENSOR_INPUTS,
    COMPONENT_NAMES,
    apply_resolution_preset,
    resolve_stage_sizes,
)
from ..pipelines.refiner_stage import resolve_refiner_stage_config
from ..pipelines.sampling_magi2 import check_scheduler, flow_schedulers, prepare_latents, unshifted_sigmas
from ..pipelines.validation_magi2 import check_call_inputs, check_component_fits, warn_untrained_sizes
from .guidance import GUIDER_NAMES, MOVED_SCALES, check_guiders, refuse_moved_scales
from .utils import (
    CALL_STATE,
    Magi2Block,
    check_component_types,
    check_repo_files,
    pipeline_components,
    pipeline_config,
    pipeline_geometry,
    planned_input,
    planned_inputs,
)


logger = logging.get_logger(__name__)

__all__ = [
    "CALL_DEFAULTS",
    "Magi2BroadcastConditioningStep",
    "Magi2InputStep",
    "Magi2PrepareLatentsStep",
    "Magi2SetTimestepsStep",
    "call_input",
    "first_rank",
]

#: ``Magi2Pipeline.__call__``'s arguments and defaults (the blocks' input defaults are these, not copies), but the
#: guidance scales: a modular pipeline's are its guiders' (``guider``, ``audio_guider``).
CALL_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(Magi2Pipeline.__call__).parameters.items()
    if name not in ("self", "return_dict", "guidance_scale", "audio_guidance_scale")
}

#: The config values the input step's checks and plan read.
PLAN_CONFIG = (
    "preview_height",
    "preview_width",
    "refiner_num_inference_steps",
    "refiner_guidance_scale",
    "refiner_shift",
    "refiner_noise_value",
    "sigma_start",
    "duration_s",
    "fps",
    "audio_latent_fps",
    "trained_resolutions",
)

_DESCRIPTIONS = {
    "prompt": "text, or a JSON object string; a list gives a batch",
    "negative_prompt": "the unconditional text (default config.negative_prompt)",
    "image": "I2V reference (PIL, a file path or uint8 [H, W, 3])",
    "height": "output pixels, a multiple of 16 (1088 runs the refiner stage)",
    "width": "output pixels, a multiple of 16 (1920 runs the refiner stage)",
    "num_inference_steps": "preview denoising steps",
    "generator": "RNG of the noise (video drawn first, then audio) and of the refiner's re-noise",
    "latents": "initial video noise [B, 48, T, H/16, W/16] fp32",
    "audio_latents": "initial audio noise [B, L, 64] fp32",
    "prompt_embeds": "[B, Lt, C] text features instead of prompt",
    "prompt_attention_mask": "[B, Lt] bool mask of prompt_embeds",
    "negative_prompt_embeds": "[B, Lt, C] negative text features",
    "negative_prompt_attention_mask": "[B, Lt] bool mask of negative_prompt_embeds",
    "image_embeds": "[B, C] <Figure 1> token embedding (with image and prompt_embeds)",
    "output_type": "'np', 'pil', 'pt' or 'latent'",
    "attention_kwargs": "keys for the models that declare them",
    "callback_on_step_end": "fn(pipe, step, timestep, tensors) after each step of either stage",
    "callback_on_step_end_tensor_inputs": "names from _callback_tensor_inputs passed to the callback",
    "resolution": "'272p', '540p' or '1080p' (two-stage); replaces height/width",
    "preview_height": "preview pixels of the two-stage path",
    "preview_width": "preview pixels of the two-stage path",
    "refiner_num_inference_steps": "refiner steps (default config)",
    "refiner_guidance_scale": "refiner guidance scale (default config), with the guider's method",
    "output_height": "bilinear resize of the decoded frames",
    "output_width": "bilinear resize of the decoded frames",
    "num_videos_per_prompt": "videos per prompt, each from its own noise",
    "enable_prompt_enhancement": "rewrite each prompt once with the prompt_enhancer before encoding",
}


def call_input(name: str, required: bool = False, **kwargs) -> InputParam:
    """An ``InputParam`` for one of ``Magi2Pipeline.__call__``'s arguments, with its default and description."""
    default = kwargs.pop("default", None if required else CALL_DEFAULTS.get(name))
    return InputParam(
        name,
        default=default,
        required=required,
        description=_DESCRIPTIONS.get(name, kwargs.pop("description", "")),
        **kwargs,
    )


def call_inputs(*names: str, **kwargs) -> list[InputParam]:
    """:func:`call_input` for each name, with the same options."""
    return [call_input(name, **kwargs) for name in names]


def first_rank(components) -> bool:
    """True outside context parallelism and on CP rank 0 (the rank that encodes and decodes)."""
    group = getattr(getattr(components, "transformer", None), "context_parallel_group", None)
    return group is None or group.rank == 0


class Magi2InputStep(Magi2Block):
    """The call's checks and plan: resolution preset, ``check_call_inputs`` against the components the pipeline
    holds (every bad argument raises before any work), the stage sizes and the refiner settings; resets the call
    state (``interrupt`` ...). It declares no component: it reads the ones the other blocks declare. It declares
    ``Magi2Pipeline``'s guidance scales too, and refuses them (the guiders carry them), so that diffusers'
    ``ModularPipeline``, which only warns about an undeclared input, does not guide at another scale than asked."""

    description = (
        "Input step: applies `resolution`, checks every argument against the pipeline's components (as "
        "Magi2Pipeline.check_inputs), and plans the call (preview size, whether the 1080p refiner stage runs, "
        "batch sizes)"
    )
    config_names = PLAN_CONFIG

    @property
    def inputs(self) -> list[InputParam]:
        moved = [
            InputParam(name, description=f"refused: the scale is the {guider}'s (guider.new(guidance_scale=...))")
            for name, guider in MOVED_SCALES.items()
        ]
        return [*(call_input(n) for n in CALL_DEFAULTS), *moved]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("refine", type_hint=bool, description="whether the refiner stage runs"),
            OutputParam("denoise_height", type_hint=int, description="preview height in pixels"),
            OutputParam("denoise_width", type_hint=int, description="preview width in pixels"),
            OutputParam("refiner_config", description="Magi2RefinerStageConfig of the call, None without refiner"),
            OutputParam("batch_size", type_hint=int, description="number of prompts"),
            OutputParam("num_videos", type_hint=int, description="batch_size * num_videos_per_prompt"),
        ]

    def run(self, components, bs) -> None:
        refuse_moved_scales({name: getattr(bs, name) for name in MOVED_SCALES})
        check_repo_files(components)
        if isinstance(bs.callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            bs.callback_on_step_end_tensor_inputs = bs.callback_on_step_end.tensor_inputs
        if bs.resolution is not None:
            bs.height, bs.width = apply_resolution_preset(bs.resolution, bs.height, bs.width)
        check_component_types(components, (*COMPONENT_NAMES, *GUIDER_NAMES), type(self).__name__)
        present = pipeline_components(components)
        check_component_fits(present)
        config = pipeline_config(components)
        arguments = [name for name in inspect.signature(check_call_inputs).parameters if name in CALL_DEFAULTS]
        check_call_inputs(
            present,
            config,
            pipeline_name=type(components).__name__,
            callback_tensor_inputs=CALLBACK_TENSOR_INPUTS,
            **{name: getattr(bs, name) for name in arguments},
        )
        if present.get("scheduler") is not None:
            check_scheduler(present["scheduler"])
        check_guiders(components)
        bs.refine, bs.denoise_height, bs.denoise_width = resolve_stage_sizes(
            bs.height,
            bs.width,
            bs.preview_height,
            bs.preview_width,
            (config["preview_height"], config["preview_width"]),
        )
        bs.refiner_config = None
        if bs.refine:
            bs.refiner_config = resolve_refiner_stage_config(
                config,
                pipeline_geometry(components).spatial_scale,
                bs.refiner_num_inference_steps,
                bs.refiner_guidance_scale,
            )
        warn_untrained_sizes(
            bs.refine, bs.height, bs.width, bs.denoise_height, bs.denoise_width, config["trained_resolutions"]
        )
        for name in CALL_STATE:
            setattr(components, name, None)
        components._attention_kwargs = bs.attention_kwargs
        components._interrupt = False
        if bs.prompt is not None:
            bs.batch_size = 1 if isinstance(bs.prompt, str) else len(bs.prompt)
        else:
            bs.batch_size = bs.prompt_embeds.shape[0]
        bs.num_videos = bs.batch_size * bs.num_videos_per_prompt


class Magi2BroadcastConditioningStep(Magi2Block):
    """Under context parallelism CP rank 0's text and image conditioning goes to every rank (the others encode
    nothing); then the I2V latent is expanded to one row per video."""

    description = (
        "Broadcasts CP rank 0's conditioning (text embeddings, masks, image embedding and latent) to every "
        "context-parallel rank and expands the image latent to one row per video"
    )

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam("prompt_embeds", type_hint=torch.Tensor, description="[B, Lt, C] text features"),
            InputParam("prompt_attention_mask", type_hint=torch.Tensor),
            InputParam("negative_prompt_embeds", type_hint=torch.Tensor),
            InputParam("negative_prompt_attention_mask", type_hint=torch.Tensor),
            InputParam("image_embeds", type_hint=torch.Tensor),
            InputParam("image_latents", type_hint=torch.Tensor, description="[1, 48, 1, h, w] I2V latent"),
            planned_input("num_videos"),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("prompt_embeds", type_hint=torch.Tensor),
            OutputParam("prompt_attention_mask", type_hint=torch.Tensor),
            OutputParam("negative_prompt_embeds", type_hint=torch.Tensor),
            OutputParam("negative_prompt_attention_mask", type_hint=torch.Tensor),
            OutputParam("image_embeds", type_hint=torch.Tensor),
            OutputParam("image_latents", type_hint=torch.Tensor, description="[num_videos, 48, 1, h, w]"),
        ]

    def run(self, components, bs) -> None:
        names = [p.name for p in self.intermediate_outputs]
        group = getattr(getattr(components, "transformer", None), "context_parallel_group", None)
        if group is not None:
            values = broadcast_from_first_rank([getattr(bs, n) for n in names], group, components._execution_device)
            for name, value in zip(names, values):
                setattr(bs, name, value)
        if bs.image_latents is not None:
            bs.image_latents = bs.image_latents.expand(bs.num_videos, -1, -1, -1, -1)


class Magi2SetTimestepsStep(Magi2Block):
    """The preview schedule (``flow_schedulers``): the video scheduler and a fresh audio one on one flow schedule."""

    description = "Sets the preview schedule: the video scheduler and an audio scheduler from its config, same sigmas"

    component_names = ("scheduler",)
    config_names = ("sigma_start",)

    @property
    def inputs(self) -> list[InputParam]:
        return [call_input("num_inference_steps")]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("timesteps", type_hint=torch.Tensor, description="[N] int64 preview timesteps"),
            OutputParam("video_scheduler", type_hint=UniPCMultistepScheduler),
            OutputParam("audio_scheduler", type_hint=UniPCMultistepScheduler),
        ]

    def run(self, components, bs) -> None:
        sigmas = unshifted_sigmas(pipeline_config(components)["sigma_start"], bs.num_inference_steps)
        bs.video_scheduler, bs.audio_scheduler, bs.timesteps = flow_schedulers(
            components.scheduler, sigmas, components._execution_device
        )


class Magi2PrepareLatentsStep(Magi2Block):
    """The initial noise (``prepare_latents``): fp32 video noise drawn first, then audio (SandAI's draw order), sized
    by the components the pipeline holds and its ``duration_s`` clip."""

    description = "Prepares the initial noise: video [B, 48, T, H/16, W/16] first, then audio [B, L, 64], fp32"

    config_names = ("duration_s", "fps", "audio_latent_fps")

    @property
    def inputs(self) -> list[InputParam]:
        return [
            *planned_inputs("num_videos", "denoise_height", "denoise_width"),
            call_input("generator"),
            *call_inputs("latents", "audio_latents", type_hint=torch.Tensor),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("latents", type_hint=torch.Tensor, description="[B, 48, T, h, w] fp32 video noise"),
            OutputParam("audio_latents", type_hint=torch.Tensor, description="[B, L, 64] fp32 audio noise"),
        ]

    def run(self, components, bs) -> None:
        bs.latents, bs.audio_latents = prepare_latents(
            bs.num_videos,
            bs.denoise_height,
            bs.denoise_width,
            pipeline_geometry(components),
            components._execution_device,
            bs.generator,
            bs.latents,
            bs.audio_latents,
        )
