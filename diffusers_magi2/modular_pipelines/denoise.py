"""The MAGI-2 denoising loops as ``LoopSequentialPipelineBlocks`` (SandAI ``Magi2PreviewSampler`` and the
refiner stage of ``evaluate_magi2_refiner_with_latent``).

Step ``i`` at timestep ``t``, the same sampler as ``Magi2Pipeline._denoise``: the before-denoiser sets the current
timestep and the step's cache-context keys (``step_index``, ``num_inference_steps``, ``timestep``); the denoiser
runs ``Magi2Pipeline._step_velocities`` (preview: one forward on ``[cond; uncond]`` and ``v = v_u + g (v_c -
v_u)`` with ``g`` 5 video / 7 audio; refiner: cond then uncond forwards per sample, ``g`` 2, on the latent of
``prepare_refiner_latents``), each forward in its cache context; the after-denoiser steps each latent with its scheduler,
``x <- step(v, t, x)``, then runs ``callback_on_step_end(pipe, i, t, tensors)``, whose returned dict may replace
any of the step's tensors. A step is skipped once a callback set ``pipe._interrupt = True``.
"""

from __future__ import annotations

import torch
from diffusers.modular_pipelines import LoopSequentialPipelineBlocks, ModularPipelineBlocks, PipelineState
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec, InputParam, OutputParam

from ..pipelines.refiner_stage import prepare_refiner_latents
from .before_denoise import call_input, call_inputs
from .utils import Magi2BlockChecks, classic_steps, component_spec, planned_input


__all__ = [
    "Magi2DenoiseLoopWrapper",
    "Magi2DenoiseStep",
    "Magi2LoopAfterDenoiser",
    "Magi2LoopBeforeDenoiser",
    "Magi2LoopDenoiser",
    "Magi2RefinerDenoiseStep",
    "Magi2RefinerLoopDenoiser",
]

_STEP_TENSORS = ("latents", "audio_latents", "prompt_embeds", "negative_prompt_embeds")
_CONDITIONING = ("prompt_attention_mask", "negative_prompt_attention_mask", "image_latents", "image_embeds")
_CONDITIONING_HINTS = ("[B, Lt] bool", "[B, Lt] bool", "[B, 48, 1, h, w] I2V latent", "[B, C] I2V token embedding")


def _conditioning_inputs(names=_CONDITIONING) -> list[InputParam]:
    hints = dict(zip(_CONDITIONING, _CONDITIONING_HINTS))
    return [InputParam(name, type_hint=torch.Tensor, description=hints[name]) for name in names]


def _tensor_inputs() -> list[InputParam]:
    return [
        InputParam("latents", required=True, type_hint=torch.Tensor, description="[B, 48, T, h, w]"),
        InputParam("audio_latents", required=True, type_hint=torch.Tensor, description="[B, L, 64]"),
        InputParam("prompt_embeds", required=True, type_hint=torch.Tensor, description="[B, Lt, C]"),
        InputParam("negative_prompt_embeds", type_hint=torch.Tensor, description="[B, Lt, C] (with CFG)"),
    ]


class Magi2LoopBeforeDenoiser(Magi2BlockChecks, ModularPipelineBlocks):
    """Loop step: the current timestep and the cache context of this step's forwards."""

    model_name = "magi2"
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


class Magi2LoopDenoiser(Magi2BlockChecks, ModularPipelineBlocks):
    """Loop step of the preview: ``Magi2Pipeline.predict_velocity`` (one forward on ``[cond; uncond]``, CFG)."""

    model_name = "magi2"
    description = (
        "Step within the preview loop that predicts the guided video and audio velocities: one transformer "
        "forward on [cond; uncond] and v = v_u + g (v_c - v_u) (Magi2Pipeline.predict_velocity)"
    )
    #: the model the loop runs, and the conditioning its forward reads
    model_component = "transformer"
    conditioning = _CONDITIONING

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [component_spec(self.model_component)]

    @property
    def inputs(self) -> list[InputParam]:
        return _conditioning_inputs(self.conditioning)

    @torch.no_grad()
    def __call__(self, components, block_state, i: int, t: torch.Tensor):
        block_state.velocities = classic_steps(components)._step_velocities(
            block_state.step_model,
            t,
            block_state.step_tensors,
            block_state.step_conditioning,
            block_state.step_context,
        )
        return components, block_state


class Magi2RefinerLoopDenoiser(Magi2LoopDenoiser):
    """Loop step of the refiner: cond, then uncond forwards per sample and CFG (``Magi2Pipeline._step_velocities``)."""

    description = (
        "Step within the refiner loop that predicts the guided video velocity: one refiner forward per sample "
        "and branch (cond, then uncond; no audio, no timestep) and v = v_u + g (v_c - v_u)"
    )
    model_component = "refiner"
    conditioning = _CONDITIONING[:2]


class Magi2LoopAfterDenoiser(Magi2BlockChecks, ModularPipelineBlocks):
    """Loop step: each latent's scheduler step, then ``callback_on_step_end``."""

    model_name = "magi2"
    description = (
        "Step within the denoising loop that steps each latent with its scheduler, x <- step(v, t, x), then "
        "runs callback_on_step_end(pipe, i, t, tensors) (a returned dict may replace any step tensor)"
    )

    @property
    def inputs(self) -> list[InputParam]:
        return [call_input("callback_on_step_end"), call_input("callback_on_step_end_tensor_inputs")]

    @torch.no_grad()
    def __call__(self, components, block_state, i: int, t: torch.Tensor):
        tensors, schedulers = block_state.step_tensors, block_state.step_schedulers
        for name, velocity in block_state.velocities.items():
            tensors[name] = schedulers[name].step(velocity, t, tensors[name], return_dict=False)[0]
        outputs = {}
        callback = block_state.callback_on_step_end
        if callback is not None:
            inputs = {name: tensors[name] for name in block_state.callback_on_step_end_tensor_inputs}
            outputs = callback(components, i, t, inputs) or {}
        block_state.step_progress.update()
        tensors.update({name: value for name, value in outputs.items() if name in tensors})
        return components, block_state


class Magi2DenoiseLoopWrapper(Magi2BlockChecks, LoopSequentialPipelineBlocks):
    """The loop over a stage's timesteps (skipping steps once interrupted); the sub-blocks run each step.

    A stage gives :meth:`stage` (its model, timesteps, schedulers and conditioning); ``__call__`` runs the loop
    on the step tensors and writes them back.
    """

    model_name = "magi2"
    description = "Pipeline block that iteratively denoises the latents; each step runs the sub-blocks in order"
    block_names = ["before_denoiser", "denoiser", "after_denoiser"]

    @property
    def loop_expected_components(self) -> list[ComponentSpec]:
        return [component_spec("scheduler")]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return self.loop_intermediate_outputs

    def stage(self, components, block_state, tensors: dict):
        """``(model, timesteps, schedulers, conditioning)`` of this loop, or ``None`` to skip it; may replace
        ``tensors`` entries (the refiner's upsampled latent)."""
        raise NotImplementedError

    def run_loop(
        self, components, block_state, model, timesteps, tensors: dict, schedulers: dict, conditioning: dict
    ) -> dict:
        """Run the sub-blocks for each step on the step table ``tensors`` (updated in place, returned);
        ``conditioning`` holds the masks and I2V tensors (and the refiner's ``guidance_scale``)."""
        components._num_timesteps = len(timesteps)
        block_state.step_model, block_state.step_timesteps = model, timesteps
        block_state.step_tensors, block_state.step_schedulers = tensors, schedulers
        block_state.step_conditioning = conditioning
        with self.progress_bar(total=len(timesteps)) as progress_bar:
            block_state.step_progress = progress_bar
            for i, t in enumerate(timesteps):
                if getattr(components, "_interrupt", False):
                    continue
                components, block_state = self.loop_step(components, block_state, i=i, t=t)
        components._current_timestep = None
        return tensors

    @torch.no_grad()
    def __call__(self, components, state: PipelineState):
        bs = self.get_block_state(state)
        self.check_components(components)
        tensors = {name: getattr(bs, name) for name in _STEP_TENSORS}
        stage = self.stage(components, bs, tensors)
        if stage is not None:
            model, timesteps, schedulers, conditioning = stage
            self.run_loop(components, bs, model, timesteps, tensors, schedulers, conditioning)
            for name in _STEP_TENSORS:
                setattr(bs, name, tensors[name])
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

    def stage(self, components, block_state, tensors: dict):
        schedulers = {"latents": block_state.video_scheduler, "audio_latents": block_state.audio_scheduler}
        conditioning = {name: getattr(block_state, name) for name in _CONDITIONING}
        return components.transformer, block_state.timesteps, schedulers, conditioning


class Magi2RefinerDenoiseStep(Magi2DenoiseLoopWrapper):
    """The 1080p refiner stage: ``prepare_refiner_latents`` (upsample to ``2T - 1`` frames, VP re-noise from the
    same ``generator``, the stage's Flow-UniPC, shift 5), then its loop (``refiner_num_inference_steps``, CFG 2)."""

    block_classes = [Magi2LoopBeforeDenoiser, Magi2RefinerLoopDenoiser, Magi2LoopAfterDenoiser]
    description = (
        "Refiner step (1080p stage): upsamples the preview latent to 2T - 1 frames at the output size, "
        "re-noises it from the same generator, then iterates `before_denoiser`, `denoiser` "
        "(Magi2RefinerLoopDenoiser) and `after_denoiser`; audio is not refined"
    )

    @property
    def loop_inputs(self) -> list[InputParam]:
        return [
            planned_input("refiner_config", type_hint=None),
            *call_inputs("height", "width", "generator"),
            *_conditioning_inputs(_CONDITIONING[:2]),
            *_tensor_inputs(),
        ]

    @property
    def loop_intermediate_outputs(self) -> list[OutputParam]:
        return [
            OutputParam("latents", type_hint=torch.Tensor, description="refined video latent [B, 48, 2T-1, H, W]"),
            OutputParam("fps", type_hint=float, description="frame rate of the refined video (2 config.fps)"),
        ]

    def stage(self, components, block_state, tensors: dict):
        block_state.fps = None
        if getattr(components, "_interrupt", False):
            return None
        config = block_state.refiner_config
        tensors["latents"], scheduler = prepare_refiner_latents(
            tensors["latents"], components.scheduler, config, block_state.height, block_state.width,
            block_state.generator,
        )  # fmt: skip
        conditioning = {name: getattr(block_state, name, None) for name in _CONDITIONING}
        conditioning["guidance_scale"] = config.guidance_scale
        block_state.fps = 2.0 * float(classic_steps(components).config.fps)
        return components.refiner, scheduler.timesteps, {"latents": scheduler}, conditioning
