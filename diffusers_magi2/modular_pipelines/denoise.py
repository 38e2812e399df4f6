"""The MAGI-2 denoising loops as ``LoopSequentialPipelineBlocks`` (SandAI ``Magi2PreviewSampler`` and the
refiner stage of ``evaluate_magi2_refiner_with_latent``), in diffusers' Wan form: the wrapper owns the loop, a
denoiser declares the guiders it uses and asks them for the step's passes (:mod:`.guidance`).

Step ``i`` at timestep ``t``: the before-denoiser sets the current timestep and the step's cache-context keys
(``step_index``, ``num_inference_steps``, ``timestep``); the denoiser predicts each guidance pass (preview: one
:func:`~diffusers_magi2.pipelines.sampling_magi2.preview_forward` on the passes stacked, cache context
``"cond_uncond"``; refiner: :func:`~diffusers_magi2.pipelines.sampling_magi2.refiner_forward` per pass and sample,
on the latent of ``prepare_refiner_latents``) and each guider combines its latent's predictions (CFG
``v = v_u + g (v_c - v_u)``, ``g`` 5 video / 7 audio / 2 refiner by default); the after-denoiser steps each latent
with its scheduler, ``x <- step(v, t, x)``, then runs ``callback_on_step_end(pipe, i, t, tensors)``, whose
returned dict may replace any of the step's tensors. A step is skipped once a callback set
``pipe._interrupt = True``.
"""

from __future__ import annotations

import torch
from diffusers.modular_pipelines import LoopSequentialPipelineBlocks, ModularPipelineBlocks, PipelineState
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec, InputParam, OutputParam

from ..models.finite_checks_magi2 import apply_router_input_check, check_stage_result_finite
from ..pipelines.presets_magi2 import CALLBACK_TENSOR_INPUTS
from ..pipelines.refiner_stage import prepare_refiner_latents
from ..pipelines.sampling_magi2 import cache_context, preview_forward, refiner_forward
from .before_denoise import call_input, call_inputs
from .guidance import combine_passes, guidance_passes
from .utils import Magi2BlockChecks, component_spec, config_specs, pipeline_config, planned_input


__all__ = [
    "Magi2DenoiseLoopWrapper",
    "Magi2DenoiseStep",
    "Magi2LoopAfterDenoiser",
    "Magi2LoopBeforeDenoiser",
    "Magi2LoopDenoiser",
    "Magi2RefinerDenoiseStep",
    "Magi2RefinerLoopDenoiser",
]

_MASKS = ("prompt_attention_mask", "negative_prompt_attention_mask")
_I2V = ("image_latents", "image_embeds")
_HINTS = {
    "prompt_attention_mask": "[B, Lt] bool",
    "negative_prompt_attention_mask": "[B, Lt] bool",
    "image_latents": "[B, 48, 1, h, w] I2V latent",
    "image_embeds": "[B, C] I2V token embedding",
}


def _conditioning_inputs(names) -> list[InputParam]:
    return [InputParam(name, type_hint=torch.Tensor, description=_HINTS[name]) for name in names]


def _tensor_inputs() -> list[InputParam]:
    return [
        InputParam("latents", required=True, type_hint=torch.Tensor, description="[B, 48, T, h, w]"),
        InputParam("audio_latents", required=True, type_hint=torch.Tensor, description="[B, L, 64]"),
        InputParam("prompt_embeds", required=True, type_hint=torch.Tensor, description="[B, Lt, C]"),
        InputParam("negative_prompt_embeds", type_hint=torch.Tensor, description="[B, Lt, C] (for guidance)"),
    ]


class _Magi2LoopBlock(Magi2BlockChecks, ModularPipelineBlocks):
    model_name = "magi2"


class Magi2LoopBeforeDenoiser(_Magi2LoopBlock):
    """Loop step: the current timestep and the cache context of this step's forwards."""

    description = (
        "Step within the denoising loop that sets the current timestep and the cache context of the step's "
        "forwards (`model.cache_context`, for diffusers' cache hooks)"
    )

    @torch.no_grad()
    def __call__(self, components, block_state, i: int, t: torch.Tensor):
        components._current_timestep = t
        block_state.step_context = {
            "step_index": i,
            "num_inference_steps": len(block_state.step_timesteps),
            "timestep": t,
        }
        return components, block_state


class Magi2LoopDenoiser(_Magi2LoopBlock):
    """Loop step of the preview: the guiders' passes in one transformer forward, combined by each guider."""

    description = (
        "Step within the preview loop that predicts the guided video and audio velocities: the passes of `guider` "
        "(video) and `audio_guider` (audio) in one transformer forward on the passes stacked, then each guider's "
        "combination (CFG: v = v_u + g (v_c - v_u))"
    )

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [component_spec(name) for name in ("transformer", "guider", "audio_guider")]

    @property
    def inputs(self) -> list[InputParam]:
        return [*_conditioning_inputs((*_MASKS, *_I2V)), call_input("attention_kwargs")]

    @torch.no_grad()
    def __call__(self, components, bs, i: int, t: torch.Tensor):
        guiders = {"latents": components.guider, "audio_latents": components.audio_guider}
        passes, own = guidance_passes(guiders, bs, i, len(bs.step_timesteps), t)
        with cache_context(components.transformer, "_".join(passes), **bs.step_context):
            video, audio = preview_forward(
                components.transformer,
                bs.latents,
                bs.audio_latents,
                t,
                [p.encoder_hidden_states for p in passes.values()],
                [p.encoder_attention_mask for p in passes.values()],
                bs.image_latents,
                bs.image_embeds,
                bs.attention_kwargs,
            )
        predictions = {"latents": dict(zip(passes, video)), "audio_latents": dict(zip(passes, audio))}
        bs.velocities = combine_passes(guiders, own, predictions)
        return components, bs


class Magi2RefinerLoopDenoiser(_Magi2LoopBlock):
    """Loop step of the refiner: each pass of the stage's guider (cond, then uncond) through the refiner, one
    forward per sample, combined by the guider."""

    description = (
        "Step within the refiner loop that predicts the guided video velocity: one refiner forward per pass of the "
        "stage's guider and sample (cond, then uncond; no audio, no timestep), then the guider's combination"
    )

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [component_spec(name) for name in ("refiner", "guider")]

    @property
    def inputs(self) -> list[InputParam]:
        return [*_conditioning_inputs(_MASKS), call_input("attention_kwargs")]

    @torch.no_grad()
    def __call__(self, components, bs, i: int, t: torch.Tensor):
        guiders = {"latents": bs.step_guider}
        passes, own = guidance_passes(guiders, bs, i, len(bs.step_timesteps), t)
        predictions = {
            branch: refiner_forward(
                components.refiner,
                bs.latents,
                batch.encoder_hidden_states,
                batch.encoder_attention_mask,
                bs.attention_kwargs,
                branch,
                bs.step_context,
            )
            for branch, batch in passes.items()
        }
        bs.velocities = combine_passes(guiders, own, {"latents": predictions})
        return components, bs


class Magi2LoopAfterDenoiser(_Magi2LoopBlock):
    """Loop step: each latent's scheduler step, then ``callback_on_step_end``."""

    description = (
        "Step within the denoising loop that steps each latent with its scheduler, x <- step(v, t, x), then "
        "runs callback_on_step_end(pipe, i, t, tensors) (a returned dict may replace any step tensor)"
    )

    @property
    def inputs(self) -> list[InputParam]:
        return [call_input("callback_on_step_end"), call_input("callback_on_step_end_tensor_inputs")]

    @torch.no_grad()
    def __call__(self, components, bs, i: int, t: torch.Tensor):
        for name, velocity in bs.velocities.items():
            setattr(bs, name, bs.step_schedulers[name].step(velocity, t, getattr(bs, name), return_dict=False)[0])
        outputs = {}
        callback = bs.callback_on_step_end
        if callback is not None:
            inputs = {name: getattr(bs, name) for name in bs.callback_on_step_end_tensor_inputs}
            outputs = callback(components, i, t, inputs) or {}
        bs.step_progress.update()
        for name, value in outputs.items():
            if name in CALLBACK_TENSOR_INPUTS:
                setattr(bs, name, value)
        return components, bs


class Magi2DenoiseLoopWrapper(Magi2BlockChecks, LoopSequentialPipelineBlocks):
    """The loop over a stage's timesteps (skipping steps once interrupted); the sub-blocks run each step on the
    block state's ``latents``, ``audio_latents`` and text tensors.

    A stage gives :meth:`stage` (its timesteps and each latent's scheduler); ``__call__`` runs the loop, then checks
    the stage's result once (``check_stage_result_finite`` on the latents it stepped, blaming the weights of
    ``stage_model``; the router check runs in each transformer forward, its hook).
    """

    model_name = "magi2"
    #: the component the stage runs (whose weights a non-finite result blames) and its name in the error
    stage_model = "transformer"
    stage_name = "preview"
    description = "Pipeline block that iteratively denoises the latents; each step runs the sub-blocks in order"
    block_names = ["before_denoiser", "denoiser", "after_denoiser"]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return self.loop_intermediate_outputs

    def stage(self, components, block_state):
        """``(timesteps, schedulers)`` of this loop (``schedulers``: latent name -> scheduler), or ``None`` to skip
        it; may replace the block state's ``latents`` (the refiner's upsampled latent)."""
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, components, state: PipelineState):
        bs = self.get_block_state(state)
        self.check_components(components)
        stage = self.stage(components, bs)
        if stage is not None:
            bs.step_timesteps, bs.step_schedulers = stage
            components._num_timesteps = len(bs.step_timesteps)
            with self.progress_bar(total=len(bs.step_timesteps)) as progress_bar:
                bs.step_progress = progress_bar
                for i, t in enumerate(bs.step_timesteps):
                    if getattr(components, "_interrupt", False):
                        continue
                    components, bs = self.loop_step(components, bs, i=i, t=t)
            components._current_timestep = None
            results = {name: getattr(bs, name) for name in bs.step_schedulers}
            check_stage_result_finite(getattr(components, self.stage_model), results, self.stage_name)
        self.set_block_state(state, bs)
        return components, state


class Magi2DenoiseStep(Magi2DenoiseLoopWrapper):
    """The preview denoising loop (``num_inference_steps`` Flow-UniPC steps on video and audio)."""

    block_classes = [Magi2LoopBeforeDenoiser, Magi2LoopDenoiser, Magi2LoopAfterDenoiser]
    description = (
        "Preview denoise step: iterates over `timesteps`, each step running `before_denoiser` "
        "(Magi2LoopBeforeDenoiser), `denoiser` (Magi2LoopDenoiser) and `after_denoiser` (Magi2LoopAfterDenoiser)"
    )

    @property
    def loop_inputs(self) -> list[InputParam]:
        return [
            InputParam("timesteps", required=True, type_hint=torch.Tensor, description="[N], from set_timesteps"),
            InputParam("video_scheduler", required=True, description="from set_timesteps"),
            InputParam("audio_scheduler", required=True, description="from set_timesteps"),
            *_tensor_inputs(),
        ]

    @property
    def loop_intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("latents", type_hint=torch.Tensor, description="denoised preview video latent"),
            OutputParam("audio_latents", type_hint=torch.Tensor, description="denoised audio latent"),
        ]

    def stage(self, components, block_state):
        apply_router_input_check(components.transformer)  # (once: a transformer that has the hook keeps it)
        schedulers = {"latents": block_state.video_scheduler, "audio_latents": block_state.audio_scheduler}
        return block_state.timesteps, schedulers


class Magi2RefinerDenoiseStep(Magi2DenoiseLoopWrapper):
    """The 1080p refiner stage: ``prepare_refiner_latents`` (upsample to ``2T - 1`` frames, VP re-noise from the
    same ``generator``, the stage's Flow-UniPC, shift 5), then its loop (``refiner_num_inference_steps``), guided by
    ``guider.new(guidance_scale=refiner_guidance_scale)`` (CFG 2 by default)."""

    block_classes = [Magi2LoopBeforeDenoiser, Magi2RefinerLoopDenoiser, Magi2LoopAfterDenoiser]
    stage_model = "refiner"
    stage_name = "refiner"
    description = (
        "Refiner step (1080p stage): upsamples the preview latent to 2T - 1 frames at the output size, "
        "re-noises it from the same generator, then iterates `before_denoiser`, `denoiser` "
        "(Magi2RefinerLoopDenoiser, guided by the guider's method at refiner_guidance_scale) and "
        "`after_denoiser`; audio is not refined"
    )

    @property
    def loop_expected_components(self) -> list[ComponentSpec]:
        return [component_spec("scheduler")]

    @property
    def loop_expected_configs(self):
        return config_specs("fps")

    @property
    def loop_inputs(self) -> list[InputParam]:
        return [
            planned_input("refiner_config", type_hint=None),
            *call_inputs("height", "width", "generator"),
            *_tensor_inputs(),
        ]

    @property
    def loop_intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("latents", type_hint=torch.Tensor, description="refined video latent [B, 48, 2T-1, H, W]"),
            OutputParam("fps", type_hint=float, description="frame rate of the refined video (2 config.fps)"),
        ]

    def stage(self, components, block_state):
        block_state.fps = None
        if getattr(components, "_interrupt", False):
            return None
        config = block_state.refiner_config
        block_state.latents, scheduler = prepare_refiner_latents(
            block_state.latents, components.scheduler, config, block_state.height, block_state.width,
            block_state.generator,
        )  # fmt: skip
        block_state.step_guider = components.guider.new(guidance_scale=config.guidance_scale)
        block_state.fps = 2.0 * float(pipeline_config(components)["fps"])
        return scheduler.timesteps, {"latents": scheduler}
