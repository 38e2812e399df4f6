"""``Magi2Pipeline``: MAGI-2 Preview text/image-to-video with audio (SandAI ``Magi2InferenceEngine.evaluate``
and ``Magi2PreviewSampler`` at commit ``f68a0f9``).

Per preview step, one forward on ``[cond; uncond]`` and CFG ``v = v_u + g (v_c - v_u)`` (``g`` = 5 video, 7
audio). On the 1080p path the refiner stage upsamples the final video latent to ``2T - 1`` frames, re-noises
it from the same ``generator`` and denoises it with its own CFG; audio is not refined. Both stages run one
loop, as diffusers' Wan loop (``_denoise``: the loop, a cache context per forward, ``interrupt``, callbacks,
progress bar), with a step function per stage (``_preview_velocities``, ``_refiner_velocities``). The steps,
text conditioning, noise and decoding are public functions the modular blocks call too
(:mod:`~.sampling_magi2`, :mod:`~.text_conditioning`, :mod:`~.decoding_magi2`, :mod:`~.refiner_stage`). The
refiner is a stage, not a pipeline of its own as LTX-2's upsampler is: the 1080p preset is one call that
continues the preview's generator stream and reuses its text embeddings, callbacks and decoding.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any, Callable

import numpy as np
import PIL.Image
import torch
from diffusers import AutoencoderKLWan, AutoencoderOobleck, UniPCMultistepScheduler
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.utils import logging
from diffusers.video_processor import VideoProcessor

# imported by name: diffusers resolves model_index.json's ``diffusers_magi2.models.*`` through sys.modules
from ..loaders.lora_pipeline_magi2 import Magi2LoraLoaderMixin
from ..models.finite_checks_magi2 import apply_router_input_check, check_stage_result_finite
from ..models.transformer_magi2 import Magi2Transformer3DModel
from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from ..models.turbo_vae import Magi2TurboVAEDecoder
from ..parallel.context_parallel import broadcast_from_first_rank
from ..utils.dtype_utils import parse_dtype
from .autoencoding_magi2 import Magi2AutoencoderMixin
from .decoding_magi2 import (
    postprocess_audio,
    postprocess_video_frames,
    resize_video_frames,
)
from .enhancement_magi2 import PROMPT_ENHANCER, Magi2PromptEnhancementMixin
from .geometry_magi2 import Magi2LatentGeometryMixin
from .image_processing_magi2 import (
    letterbox_image,
    preprocess_reference_image,
    reference_image_processor,
)
from .loading_magi2 import Magi2PipelineLoadingMixin
from .modular_files import Magi2ModularFilesMixin
from .pipeline_output import Magi2PipelineOutput
from .presets_magi2 import (
    CALLBACK_TENSOR_INPUTS,
    DEFAULT_NEGATIVE_PROMPT,
    REFINER_RESOLUTION,
    RESOLUTION_PRESETS,
    TRAINED_RESOLUTIONS,
    apply_resolution_preset,
    resolve_stage_sizes,
)
from .refiner_stage import Magi2RefinerStageConfig, prepare_refiner_latents, resolve_refiner_stage_config
from .sampling_magi2 import (
    cache_context,
    check_scheduler,
    flow_schedulers,
    prepare_latents,
    preview_forward,
    refiner_forward,
    unshifted_sigmas,
)
from .text_conditioning import Magi2PromptEncodingMixin, encode_text_conditioning
from .text_encoding import DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_SKIP_LAYERS, apply_cjk_pre_tokenizer_split
from .validation_magi2 import Magi2PipelineChecksMixin, check_trained_resolutions, warn_untrained_sizes
from .weight_streaming_pipeline import Magi2WeightStreamingPipelineMixin


logger = logging.get_logger(__name__)

__all__ = [
    "DEFAULT_NEGATIVE_PROMPT",
    "Magi2Pipeline",
    "REFINER_RESOLUTION",
    "RESOLUTION_PRESETS",
    "TRAINED_RESOLUTIONS",
    "letterbox_image",
    "resize_video_frames",
]


def _call_state(name: str, doc: str) -> property:
    """A read-only view of the call state ``self._<name>`` (diffusers' pipeline properties)."""
    return property(operator.attrgetter(f"_{name}"), doc=doc)


class Magi2Pipeline(
    Magi2PipelineLoadingMixin,
    Magi2PromptEnhancementMixin,
    Magi2ModularFilesMixin,
    Magi2PipelineChecksMixin,
    Magi2PromptEncodingMixin,
    Magi2LatentGeometryMixin,
    Magi2AutoencoderMixin,
    Magi2WeightStreamingPipelineMixin,  # (before DiffusionPipeline: its ``to`` refuses while streaming)
    DiffusionPipeline,
    Magi2LoraLoaderMixin,
):
    r"""MAGI-2 Preview: a 10 s video with a stereo soundtrack from a prompt, optionally conditioned on an image.

    Components:
        tokenizer: Qwen3.5 fast tokenizer (the reference's CJK pre-tokenizer split is added, idempotently).
        text_encoder (`transformers.Qwen3_5TextModel`): prompt features are ``hidden_states[-3]``.
        transformer (`Magi2Transformer3DModel`): the MoE DiT.
        audio_vae (`AutoencoderOobleck`): decoder of the 64-channel audio latents.
        scheduler (`UniPCMultistepScheduler`, flow prediction, ``use_flow_sigmas``, ``flow_shift`` 7): the
            video scheduler; the audio one is built from its config per call.
        vae (`AutoencoderKLWan`, optional): encodes the I2V image; decodes video without ``video_decoder``.
        video_decoder (`Magi2TurboVAEDecoder`, optional): the default video decoder (TurboVAED).
        refiner (`Magi2RefinerTransformer3DModel`, optional): the 1080p stage, run for 1088 x 1920 or an
            explicit ``preview_height``/``preview_width``.
        prompt_enhancer (`Magi2PromptEnhancer`, optional): rewrites each prompt into MAGI-2's structured caption
            with ``enable_prompt_enhancement=True`` (:meth:`enhance_prompt`); saved into ``prompt_enhancer/``.

    Construction raises ``ValueError`` when a component's latent or text width does not fit the models
    (:data:`~diffusers_magi2.pipelines.validation_magi2.COMPONENT_FITS`). The reference's dtypes::

        pipe = Magi2Pipeline.from_pretrained(
            repo, dtype={"default": torch.bfloat16, "vae": torch.float32, "audio_vae": torch.float32}
        )

    Config (``model_index.json``; SandAI ``magi2_refiner.json`` ``evaluation_config`` values): ``negative_prompt``,
    ``sigma_start`` (0.999), ``text_skip_layers`` (2), ``max_sequence_length`` (7,000), ``fps`` (12.5),
    ``duration_s`` (10), ``audio_latent_fps`` (25), ``audio_resample_ratio`` (441/512),
    ``reference_image_dtype`` ("bfloat16"), ``preview_height`` x ``preview_width`` (512 x 896),
    ``refiner_num_inference_steps`` (5), ``refiner_guidance_scale`` (2.0), ``refiner_shift`` (5.0),
    ``refiner_noise_value`` (220); ``trained_resolutions`` (``[[256, 448], [512, 896]]``): the (height, width)
    sizes the preview was trained at; ``__call__`` warns of lower quality at any other (a model trained at other sizes,
    such as the shipped tiny one, saves its own).
    """

    model_cpu_offload_seq = "text_encoder->transformer->refiner->video_decoder->vae->audio_vae"
    _optional_components = ["vae", "video_decoder", "refiner", PROMPT_ENHANCER]
    _callback_tensor_inputs = list(CALLBACK_TENSOR_INPUTS)

    def __init__(
        self,
        tokenizer: Any,
        text_encoder: Any,
        transformer: Magi2Transformer3DModel,
        audio_vae: AutoencoderOobleck,
        scheduler: UniPCMultistepScheduler,
        vae: AutoencoderKLWan | None = None,
        video_decoder: Magi2TurboVAEDecoder | None = None,
        refiner: Magi2RefinerTransformer3DModel | None = None,
        negative_prompt: str = DEFAULT_NEGATIVE_PROMPT,
        sigma_start: float = 0.999,
        text_skip_layers: int = DEFAULT_SKIP_LAYERS,
        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
        fps: float = 12.5,
        duration_s: float = 10.0,
        audio_latent_fps: float = 25.0,
        audio_resample_ratio: float = 441 / 512,
        reference_image_dtype: str = "bfloat16",
        preview_height: int = 512,
        preview_width: int = 896,
        refiner_num_inference_steps: int = 5,
        refiner_guidance_scale: float = 2.0,
        refiner_shift: float = 5.0,
        refiner_noise_value: int = 220,
        prompt_enhancer: Any = None,
        trained_resolutions: list[list[int]] | tuple = TRAINED_RESOLUTIONS,
    ):
        super().__init__()
        if tokenizer is not None:
            apply_cjk_pre_tokenizer_split(tokenizer)
        self.register_modules(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            transformer=transformer,
            audio_vae=audio_vae,
            scheduler=scheduler,
            vae=vae,
            video_decoder=video_decoder,
            refiner=refiner,
            prompt_enhancer=prompt_enhancer,
        )
        self.register_to_config(
            negative_prompt=negative_prompt,
            sigma_start=sigma_start,
            text_skip_layers=text_skip_layers,
            max_sequence_length=max_sequence_length,
            fps=fps,
            duration_s=duration_s,
            audio_latent_fps=audio_latent_fps,
            audio_resample_ratio=audio_resample_ratio,
            reference_image_dtype=reference_image_dtype,
            preview_height=preview_height,
            preview_width=preview_width,
            refiner_num_inference_steps=refiner_num_inference_steps,
            refiner_guidance_scale=refiner_guidance_scale,
            refiner_shift=refiner_shift,
            refiner_noise_value=refiner_noise_value,
            trained_resolutions=check_trained_resolutions(trained_resolutions),
        )
        self._check_components()
        if transformer is not None:
            apply_router_input_check(transformer)  # every forward refuses NaN/inf router inputs on every rank
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)
        self.reference_image_processor = reference_image_processor(self.vae_scale_factor_spatial)

    # --- Properties (diffusers conventions)

    guidance_scale = _call_state("guidance_scale", "Video CFG scale of the current/last call.")
    audio_guidance_scale = _call_state("audio_guidance_scale", "Audio CFG scale of the current/last call.")
    num_timesteps = _call_state("num_timesteps", "Steps of the stage being (or last) denoised.")
    current_timestep = _call_state(
        "current_timestep", "The timestep being denoised (0-d tensor, 0-1000 scale), ``None`` outside the loops."
    )
    interrupt = _call_state(
        "interrupt",
        "``True`` once a callback set ``pipe._interrupt = True``: the rest is skipped, the latents decoded.",
    )
    attention_kwargs = _call_state("attention_kwargs", "The ``attention_kwargs`` of the current/last call.")

    @property
    def do_classifier_free_guidance(self) -> bool:
        """CFG runs unless both guidance scales are exactly 1 (then the uncond half is skipped)."""
        return self._guidance_scale != 1.0 or self._audio_guidance_scale != 1.0

    # --- Scheduling
    def base_sigmas(self, num_inference_steps: int) -> np.ndarray:
        """Unshifted sigmas ``linspace(sigma_start, 0, N + 1)[:-1]`` (float64, length N)."""
        return unshifted_sigmas(self.config.sigma_start, num_inference_steps)

    def prepare_timesteps(
        self, num_inference_steps: int, device: torch.device | str | None = None
    ) -> tuple[UniPCMultistepScheduler, UniPCMultistepScheduler, torch.Tensor]:
        """``(video_scheduler, audio_scheduler, timesteps [N] int64)`` on one schedule; the scheduler applies the shift
        once, ``s' = k s / (1 + (k - 1) s)`` (ValueError for a scheduler that is not a flow UniPC)."""
        return flow_schedulers(self.scheduler, self.base_sigmas(num_inference_steps), device)

    # --- Two-stage (1080p refiner) geometry and settings

    apply_resolution_preset = staticmethod(apply_resolution_preset)

    def stage_sizes(
        self, height: int, width: int, preview_height: int | None = None, preview_width: int | None = None
    ) -> tuple[bool, int, int]:
        """``(refine, denoise_height, denoise_width)`` of a call (:func:`~.presets_magi2.resolve_stage_sizes`)."""
        default_preview = (int(self.config.preview_height), int(self.config.preview_width))
        return resolve_stage_sizes(height, width, preview_height, preview_width, default_preview)

    def refiner_stage_config(
        self, num_inference_steps: int | None = None, guidance_scale: float | None = None
    ) -> Magi2RefinerStageConfig:
        """The :class:`Magi2RefinerStageConfig` of a call (``None`` arguments take the config's values)."""
        return resolve_refiner_stage_config(
            self.config, self.vae_scale_factor_spatial, num_inference_steps, guidance_scale
        )

    # --- Text (encode_text, encode_prompt: Magi2PromptEncodingMixin)

    def _encode_conditioning(self, text: dict, image, image_embeds, need_negative: bool, size: tuple, device) -> list:
        """``__call__``'s image and text step: the I2V image's latent at ``size`` (encoded first, as SandAI does), then
        :func:`~.text_conditioning.encode_text_conditioning` on ``text`` (:meth:`encode_prompt`'s keyword
        arguments). Returns the four text tensors, ``image_embeds`` per video and ``image_latents``
        ``[1, 48, 1, h, w]`` (``None`` without an image)."""
        image_latents = None
        if image is not None:
            image_latents = self.encode_reference_image(self.preprocess_reference_image(image, *size)).to(device)
        conditioning = encode_text_conditioning(
            self.tokenizer,
            self.text_encoder,
            image_to_video=image is not None,
            image_embeds=image_embeds,
            default_negative_prompt=self.config.negative_prompt,
            do_classifier_free_guidance=need_negative,
            device=device,
            **text,
            **self._text_options(),
        )
        return [*conditioning, image_latents]

    def _stage_progress_bar(self, total: int, description: str):
        """A diffusers progress bar labelled with the stage."""
        progress_bar = self.progress_bar(total=total)
        progress_bar.set_description(description)
        return progress_bar

    # --- Image

    def preprocess_reference_image(self, image, height: int, width: int) -> torch.Tensor:
        """The I2V image as VAE input ``[1, 3, 1, H', W']``
        (:func:`~diffusers_magi2.pipelines.image_processing_magi2.preprocess_reference_image`)."""
        rounding = parse_dtype(self.config.reference_image_dtype, "reference_image_dtype")
        return preprocess_reference_image(image, height, width, self.reference_image_processor, rounding)

    def encode_reference_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised fp32 mean latent ``[B, 48, 1, H/16, W/16]`` of ``pixels`` ``[B, 3, 1, H, W]`` in [-1, 1]
        (:meth:`encode_video` of one frame)."""
        return self.encode_video(pixels)

    # --- Latents

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        device: torch.device | str,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        audio_latents: torch.Tensor | None = None,
        num_latent_frames: int | None = None,
        num_audio_latents: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Initial fp32 noise: video ``[B, 48, T, H/16, W/16]`` drawn first, then audio ``[B, L, 64]`` (SandAI's
        draw order; :func:`~.sampling_magi2.prepare_latents`); given tensors are moved and cast. T and L default to
        the ``duration_s`` clip."""
        geometry = self.latent_geometry()
        lengths = {"num_frames": num_latent_frames, "num_audio_latents": num_audio_latents}
        geometry = dataclasses.replace(geometry, **{k: int(v) for k, v in lengths.items() if v is not None})
        return prepare_latents(batch_size, height, width, geometry, device, generator, latents, audio_latents)

    # --- Call

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        image: PIL.Image.Image | str | os.PathLike | np.ndarray | None = None,
        height: int = 512,
        width: int = 896,
        num_inference_steps: int = 100,
        guidance_scale: float = 5.0,
        audio_guidance_scale: float = 7.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        audio_latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        callback_on_step_end: Callable[[Any, int, torch.Tensor, dict], dict]
        | PipelineCallback
        | MultiPipelineCallbacks
        | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents", "audio_latents"],
        resolution: str | None = None,
        preview_height: int | None = None,
        preview_width: int | None = None,
        refiner_num_inference_steps: int | None = None,
        refiner_guidance_scale: float | None = None,
        output_height: int | None = None,
        output_width: int | None = None,
        num_videos_per_prompt: int = 1,
        enable_prompt_enhancement: bool = False,
    ):
        r"""Generate a 10 s clip (125 frames at 12.5 fps; 249 at 25 fps with the refiner) with 44.1 kHz stereo audio.

        Args:
            prompt: text, or a JSON object string (rendered to markdown); a list gives a batch.
            negative_prompt: the unconditional text; default the built-in one (``config.negative_prompt``).
            image: I2V reference (PIL, a file path, or uint8 ``[H, W, 3]``) conditioning the whole clip; it stays
                in the unconditional branch, so CFG steers the text only.
            height, width: pixels, multiples of 16; trained 256x448 and 512x896 (others warn). 1088x1920 runs
                the preview at ``config.preview_height x config.preview_width``, then the refiner.
            num_inference_steps: denoising steps (≥ 1; the preview uses 100).
            guidance_scale: video CFG scale (≥ 0; default 5.0). audio_guidance_scale: audio CFG (7.0).
            generator: RNG for the noise (video drawn first, then audio).
            latents, audio_latents: initial noise ``[B, 48, T, H/16, W/16]`` / ``[B, L, 64]`` (fp32).
            prompt_embeds, prompt_attention_mask: ``[B, Lt, C]`` features and their ``[B, Lt]`` bool mask, instead of
                ``prompt``; the negative pair likewise.
            image_embeds: ``[B, C]`` special-token embedding; required with ``image`` + ``prompt_embeds``.
            output_type: ``"np"`` (default), ``"pil"``, ``"pt"`` or ``"latent"``.
            return_dict: return :class:`Magi2PipelineOutput` (else a tuple ``(frames, audio)``).
            attention_kwargs: keys for the models that declare them; both MAGI-2 models take ``"scale"``, the scale
                of the loaded LoRA adapters for this call (``load_lora_weights``).
            callback_on_step_end: ``fn(pipe, step, timestep, tensors)`` after each step of either stage (``step``
                counts within the stage); a returned dict may replace any of the tensor inputs.
            callback_on_step_end_tensor_inputs: names from ``_callback_tensor_inputs``.
            resolution: ``"272p"`` (256×448), ``"540p"`` (512×896) or ``"1080p"`` (1088×1920, two-stage);
                replaces ``height``/``width`` (leave those at their defaults).
            preview_height, preview_width: run the two-stage path with the preview at this size and the
                refiner output at ``height x width``.
            refiner_num_inference_steps: refiner Flow-UniPC steps (default ``config``: 5).
            refiner_guidance_scale: refiner CFG scale (default ``config``: 2.0).
            output_height, output_width: bilinear resize of the decoded frames (both or neither; e.g.
                1080x1920), as the reference's ``--output-height/--output-width``.
            num_videos_per_prompt: videos per prompt (>= 1), each from its own noise, a prompt's videos adjacent.
            enable_prompt_enhancement: rewrite each prompt once with ``prompt_enhancer`` before encoding
                (:meth:`enhance_prompt`; not the negative prompt; not with ``prompt_embeds``).

        Returns:
            :class:`Magi2PipelineOutput` ``(frames, audio, audio_sample_rate, fps)`` (``fps`` 25 on the refiner path).
            Under context parallelism CP rank 0 alone encodes the text and image (broadcasting them) and decodes;
            the other ranks get ``frames=None`` and ``audio=None`` (the latents with ``output_type="latent"``).
            With ``config.duration_s`` other than 10 the video can end more than a frame before the audio (5 s: 61
            frames = 4.88 s), so export it with ``trim_or_pad_audio=True``, as ``examples/generate.py`` does.

        Raises:
            ValueError: any bad argument or missing component (:meth:`check_inputs`), or under weight streaming of
                the released model a call the plan does not cover (a stage above ``vram_gb``, a preview above 540p,
                a refined output above 1080p, more than one video) or that decodes the refined frames untiled where
                the plan tiles them, before any work starts.
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        if resolution is not None:
            height, width = self.apply_resolution_preset(resolution, height, width)
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            image=image,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            audio_guidance_scale=audio_guidance_scale,
            prompt_embeds=prompt_embeds,
            prompt_attention_mask=prompt_attention_mask,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_prompt_attention_mask=negative_prompt_attention_mask,
            image_embeds=image_embeds,
            output_type=output_type,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            latents=latents,
            audio_latents=audio_latents,
            preview_height=preview_height,
            preview_width=preview_width,
            output_height=output_height,
            output_width=output_width,
            refiner_num_inference_steps=refiner_num_inference_steps,
            refiner_guidance_scale=refiner_guidance_scale,
            attention_kwargs=attention_kwargs,
            num_videos_per_prompt=num_videos_per_prompt,
            generator=generator,
            enable_prompt_enhancement=enable_prompt_enhancement,
        )
        check_scheduler(self.scheduler)
        refine, denoise_height, denoise_width = self.stage_sizes(height, width, preview_height, preview_width)
        self._check_streamed_decode(refine and output_type != "latent")
        videos = (prompt_embeds.shape[0] if prompt is None else 1 if isinstance(prompt, str) else len(prompt)) * int(
            num_videos_per_prompt
        )
        self._check_streamed_stages(
            refine, denoise_height, denoise_width, image is not None, output_type != "latent", height, width, videos
        )
        refiner_config = None
        if refine:
            refiner_config = self.refiner_stage_config(refiner_num_inference_steps, refiner_guidance_scale)
        warn_untrained_sizes(refine, height, width, denoise_height, denoise_width, self.config.trained_resolutions)

        self._guidance_scale = float(guidance_scale)
        self._audio_guidance_scale = float(audio_guidance_scale)
        self._attention_kwargs = attention_kwargs
        self._current_timestep = None
        self._interrupt = False
        device = self._execution_device

        # 1. batch size
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            if enable_prompt_enhancement:  # every rank together: the first asks, all get its texts or its error
                prompts = self.enhance_prompt(prompts, image)
            batch_size = len(prompts)
        else:
            prompts = None
            batch_size = prompt_embeds.shape[0]
        num_videos = batch_size * num_videos_per_prompt

        # 2-3. reference image and text, encoded on CP rank 0 alone and broadcast (SandAI encodes the image first);
        # I2V prompts get the <Figure 1> reference and its pooled token from the same pass
        need_negative = self.do_classifier_free_guidance or (refine and refiner_config.guidance_scale != 1.0)
        text = {
            "prompt": prompts,
            "negative_prompt": negative_prompt,
            "num_videos_per_prompt": num_videos_per_prompt,
            "prompt_embeds": prompt_embeds,
            "negative_prompt_embeds": negative_prompt_embeds,
            "prompt_attention_mask": prompt_attention_mask,
            "negative_prompt_attention_mask": negative_prompt_attention_mask,
        }
        size = (denoise_height, denoise_width)
        encoded = self._on_first_cp_rank(
            self._encode_conditioning, text, image, image_embeds, need_negative, size, device, broadcast=True
        )
        prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask = encoded[:4]
        image_embeds, image_latents = encoded[4:]
        if image_latents is not None:
            image_latents = image_latents.expand(num_videos, -1, -1, -1, -1)

        # 4. schedule and noise (one draw per video)
        video_scheduler, audio_scheduler, timesteps = self.prepare_timesteps(num_inference_steps, device)
        latents, audio_latents = self.prepare_latents(
            num_videos, denoise_height, denoise_width, device, generator, latents, audio_latents
        )

        # 5. denoise: one forward per step on [cond, uncond]
        tensors = {
            "latents": latents,
            "audio_latents": audio_latents,
            "prompt_embeds": prompt_embeds,
            "negative_prompt_embeds": negative_prompt_embeds,
        }
        conditioning = {
            "prompt_attention_mask": prompt_attention_mask,
            "negative_prompt_attention_mask": negative_prompt_attention_mask,
            "image_latents": image_latents,
            "image_embeds": image_embeds,
        }
        callbacks = (callback_on_step_end, callback_on_step_end_tensor_inputs)
        schedulers = {"latents": video_scheduler, "audio_latents": audio_scheduler}
        self._denoise(
            self.transformer, timesteps, tensors, schedulers, conditioning, "Denoising", *callbacks,
            velocities=self._preview_velocities, stage="preview",
        )  # fmt: skip

        # 6. refiner stage; its re-noise continues the generator after the preview draws
        fps = float(self.config.fps)
        if refine and not self.interrupt:
            tensors["latents"], refiner_scheduler = prepare_refiner_latents(
                tensors["latents"], self.scheduler, refiner_config, height, width, generator
            )
            conditioning["guidance_scale"] = refiner_config.guidance_scale
            schedulers = {"latents": refiner_scheduler}
            timesteps = refiner_scheduler.timesteps
            self._denoise(
                self.refiner, timesteps, tensors, schedulers, conditioning, "Refining", *callbacks,
                velocities=self._refiner_velocities, stage="refiner",
            )  # fmt: skip
            fps = 2.0 * fps
        latents, audio_latents = tensors["latents"], tensors["audio_latents"]

        # 7. decode (under context parallelism on CP rank 0 only; the other ranks return no frames and no audio)
        if output_type == "latent":
            frames, audio, sample_rate, fps = latents, audio_latents, None, None
        else:
            decoded = self._on_first_cp_rank(
                self._decode_outputs, latents, audio_latents, output_type, output_height, output_width
            )
            frames, audio = (None, None) if decoded is None else decoded
            sample_rate = self.audio_sample_rate

        self.maybe_free_model_hooks()
        if not return_dict:
            return (frames, audio)
        return Magi2PipelineOutput(frames=frames, audio=audio, audio_sample_rate=sample_rate, fps=fps)

    def _on_first_cp_rank(self, fn: Callable, *args, broadcast: bool = False):
        """``fn(*args)`` on CP rank 0 alone (on the one process without context parallelism). With ``broadcast``
        (``fn`` returns a list of tensors or ``None``) every rank gets rank 0's list; else the other ranks get ``None``."""
        cp = getattr(self.transformer, "context_parallel_group", None)
        if cp is None:
            return fn(*args)
        result = fn(*args) if cp.rank == 0 else None
        if broadcast:
            return broadcast_from_first_rank(result or [], cp, self._execution_device)
        return result

    def _decode_outputs(self, latents, audio_latents, output_type: str, output_height, output_width):
        """``__call__``'s decoding step: ``(frames in output_type, audio)``, the frames resized if asked."""
        with self._stage_progress_bar(2, "Decoding video and audio") as progress_bar:
            video = self.decode_video(latents)
            frames = postprocess_video_frames(video, output_type, output_height, output_width, self.video_processor)
            progress_bar.update()
            audio = postprocess_audio(self.decode_audio(audio_latents), output_type)
            progress_bar.update()
        return frames, audio

    def _denoise(
        self,
        model,
        timesteps,
        tensors: dict,
        schedulers: dict,
        conditioning: dict,
        description: str,
        callback_on_step_end,
        callback_on_step_end_tensor_inputs,
        *,
        velocities: Callable,
        stage: str,
    ) -> dict:
        """The loop of both stages (``model`` is the transformer or the refiner), as diffusers' Wan loop.

        Per step ``t``: ``velocities(model, t, tensors, conditioning, context)`` gives the guided velocity of each
        latent in ``schedulers`` (:meth:`_preview_velocities` or :meth:`_refiner_velocities`; ``context``:
        step_index, num_inference_steps, timestep, for the forwards' cache contexts), one scheduler step per
        latent, then the step callback, which may replace any entry of ``tensors`` (the step table, updated in
        place and returned). ``conditioning`` holds the masks and I2V tensors (and the refiner's
        ``guidance_scale``). The router check runs in each forward (the transformer's hook); the stage's result is
        checked once, after its last step (``stage`` names it in the error).
        """
        self._num_timesteps = len(timesteps)
        with self._stage_progress_bar(len(timesteps), description) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                self._current_timestep = t
                context = {"step_index": i, "num_inference_steps": len(timesteps), "timestep": t}
                step = velocities(model, t, tensors, conditioning, context)
                for name, velocity in step.items():
                    tensors[name] = schedulers[name].step(velocity, t, tensors[name], return_dict=False)[0]
                if callback_on_step_end is not None:
                    inputs = {name: tensors[name] for name in callback_on_step_end_tensor_inputs}
                    outputs = callback_on_step_end(self, i, t, inputs) or {}
                    tensors.update({name: value for name, value in outputs.items() if name in tensors})
                progress_bar.update()
        self._current_timestep = None
        check_stage_result_finite(model, {name: tensors[name] for name in schedulers}, stage)
        return tensors

    def _preview_velocities(self, model, t, tensors: dict, conditioning: dict, context: dict) -> dict:
        """A preview step's guided video and audio velocities: :meth:`predict_velocity` in one cache context."""
        branch = "cond_uncond" if self.do_classifier_free_guidance else "cond"
        with cache_context(model, branch, **context):
            video, audio = self.predict_velocity(
                tensors["latents"], tensors["audio_latents"], t,
                tensors["prompt_embeds"], conditioning["prompt_attention_mask"],
                tensors["negative_prompt_embeds"], conditioning["negative_prompt_attention_mask"],
                conditioning["image_latents"], conditioning["image_embeds"],
            )  # fmt: skip
        return {"latents": video, "audio_latents": audio}

    def _refiner_velocities(self, model, t, tensors: dict, conditioning: dict, context: dict) -> dict:
        """A refiner step's guided video velocity: :func:`~.sampling_magi2.refiner_forward` for the cond, then the
        uncond text (only uncond at scale 0, only cond at 1), combined by CFG at the stage's ``guidance_scale``."""
        g = conditioning["guidance_scale"]
        branches = ("uncond",) if g == 0.0 else ("cond",) if g == 1.0 else ("cond", "uncond")
        latents = tensors["latents"]
        predicted = {}
        for branch in branches:
            prefix = "negative_" if branch == "uncond" else ""
            embeds, mask = tensors[f"{prefix}prompt_embeds"], conditioning[f"{prefix}prompt_attention_mask"]
            predicted[branch] = refiner_forward(model, latents, embeds, mask, self.attention_kwargs, branch, context)
        if len(branches) == 1:
            return {"latents": predicted[branches[0]]}
        scale = torch.tensor(float(g), dtype=torch.float32, device=latents.device)
        v_c, v_u = predicted["cond"], predicted["uncond"]
        return {"latents": v_u + scale * (v_c - v_u)}

    @torch.no_grad()
    def predict_velocity(
        self,
        latents,
        audio_latents,
        t,
        prompt_embeds,
        prompt_attention_mask,
        negative_prompt_embeds,
        negative_prompt_attention_mask,
        image_latents,
        image_embeds,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer forward on ``[cond; uncond]`` (:func:`~.sampling_magi2.preview_forward`) and the CFG
        combination (SandAI ``Magi2PreviewSampler.cfg_velocity``): the halves differ only in the text.

        Returns guided fp32 ``(video [B, 48, T, h, w], audio [B, L, 64])`` velocities; the arguments are the step's
        latents, timestep (0-1000), text pairs and I2V conditioning.
        """
        cfg = self.do_classifier_free_guidance
        texts = [prompt_embeds, negative_prompt_embeds] if cfg else [prompt_embeds]
        masks = [prompt_attention_mask, negative_prompt_attention_mask] if cfg else [prompt_attention_mask]
        video, audio = preview_forward(
            self.transformer, latents, audio_latents, t, texts, masks, image_latents, image_embeds,
            self.attention_kwargs,
        )  # fmt: skip
        if not cfg:
            return video[0], audio[0]
        (v_c, v_u), (a_c, a_u) = video, audio
        return v_u + self.guidance_scale * (v_c - v_u), a_u + self.audio_guidance_scale * (a_c - a_u)
