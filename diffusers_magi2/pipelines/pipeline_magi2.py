"""``Magi2Pipeline``: MAGI-2 Preview text/image-to-video with audio (SandAI ``Magi2InferenceEngine.evaluate``
and ``Magi2PreviewSampler`` at commit ``f68a0f9``).

Per preview step, one forward on ``[cond; uncond]`` and CFG ``v = v_u + g (v_c - v_u)`` (``g`` = 5 video, 7
audio). On the 1080p path the refiner stage upsamples the final video latent to ``2T - 1`` frames, re-noises
it from the same ``generator`` and denoises it with its own CFG; audio is not refined. Both stages run one
sampler, inline as diffusers' Wan loop (``_denoise``: the loop, a cache context per forward, ``interrupt``,
callbacks, progress bar); ``refiner_stage`` gives it the refiner's first latent and velocity. The refiner is a
stage, not a pipeline of its own as LTX-2's upsampler is: the 1080p preset is one call that continues the
preview's generator stream and reuses its text embeddings, callbacks and decoding.
"""

from __future__ import annotations

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
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

# imported by name: diffusers resolves model_index.json's ``diffusers_magi2.models.*`` through sys.modules
from ..loaders.lora_pipeline_magi2 import Magi2LoraLoaderMixin
from ..models.transformer_magi2 import Magi2Transformer3DModel
from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from ..models.turbo_vae import Magi2TurboVAEDecoder
from ..parallel.context_parallel import broadcast_from_first_rank
from ..utils.dtype_utils import parse_dtype
from .decoding_magi2 import decode_audio_latents, decode_video_latents, resize_video_frames, wan_latent_stats
from .image_processing_magi2 import letterbox_image, preprocess_reference_image
from .modular_files import Magi2ModularFilesMixin
from .pipeline_output import Magi2PipelineOutput
from .presets_magi2 import (
    DEFAULT_NEGATIVE_PROMPT,
    REFINER_RESOLUTION,
    RESOLUTION_PRESETS,
    TRAINED_RESOLUTIONS,
    apply_resolution_preset,
    resolve_stage_sizes,
)
from .refiner_stage import Magi2RefinerStageConfig, prepare_refiner_latents
from .sampling_magi2 import (
    cache_context,
    check_scheduler,
    flow_schedulers,
    pad_text_batch,
    unshifted_sigmas,
)
from .text_encoding import (
    DEFAULT_MAX_SEQUENCE_LENGTH,
    DEFAULT_SKIP_LAYERS,
    add_figure_reference,
    apply_cjk_pre_tokenizer_split,
    encode_prompt_text,
    repeat_text_per_video,
)
from .validation_magi2 import Magi2PipelineChecksMixin, attention_kwargs_for, warn_untrained_sizes


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


class Magi2Pipeline(Magi2ModularFilesMixin, Magi2PipelineChecksMixin, DiffusionPipeline, Magi2LoraLoaderMixin):
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
    ``refiner_noise_value`` (220).
    """

    model_cpu_offload_seq = "text_encoder->transformer->refiner->video_decoder->vae->audio_vae"
    _optional_components = ["vae", "video_decoder", "refiner"]
    _callback_tensor_inputs = ["latents", "audio_latents", "prompt_embeds", "negative_prompt_embeds"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``DiffusionPipeline.from_pretrained`` with two parallel options.

        Args:
            expert_parallel: ``Magi2ExpertParallelConfig(ep_degree=E)``: load only this rank's routed experts.
            context_parallel: ``diffusers.ContextParallelConfig(ulysses_degree=N)`` (N = world size, ``E | N``):
                :meth:`enable_context_parallel` after loading.

        Raises:
            ValueError: a bad degree, before the weights load.
        """
        expert_parallel = kwargs.pop("expert_parallel", None)
        context_parallel = kwargs.pop("context_parallel", None)
        if context_parallel is not None:
            from ..parallel.context_parallel import resolve_context_parallel

            cp = resolve_context_parallel(context_parallel)  # a bad degree fails here, before any weight loads
            if expert_parallel is not None and cp.size % expert_parallel.ep_degree:
                raise ValueError(
                    f"ep_degree={expert_parallel.ep_degree} must divide the context-parallel degree {cp.size}"
                )
        if expert_parallel is not None:
            from .loading_magi2 import load_pipeline_with_expert_parallel

            pipe = load_pipeline_with_expert_parallel(
                cls, pretrained_model_name_or_path, expert_parallel=expert_parallel, **kwargs
            )
        else:
            pipe = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if context_parallel is not None:
            pipe.enable_context_parallel(context_parallel)
        return pipe

    def enable_context_parallel(self, config) -> None:
        """``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` on the transformer and the refiner."""
        for model in (self.transformer, getattr(self, "refiner", None)):
            if model is not None:
                model.enable_parallelism(config=config)

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
        )
        self._check_components()
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)
        self.reference_image_processor = VideoProcessor(vae_scale_factor=2 * self.vae_scale_factor_spatial)

    # --- Geometry read from the component configs

    def _video_latent_geometry(self, vae_key: str, decoder_key: str, default: int) -> int:
        """``vae.config[vae_key]``, else ``video_decoder.config[decoder_key]``, else ``default``."""
        vae = getattr(self, "vae", None)
        if vae is not None:
            return int(getattr(vae.config, vae_key))
        decoder = getattr(self, "video_decoder", None)
        if decoder is not None and decoder_key in decoder.config:
            return int(getattr(decoder.config, decoder_key))
        return default

    @property
    def vae_scale_factor_spatial(self) -> int:
        """Pixels per latent cell along H and W (16 for Wan2.2 / TurboVAED)."""
        return self._video_latent_geometry("scale_factor_spatial", "spatial_compression_ratio", 16)

    @property
    def vae_scale_factor_temporal(self) -> int:
        """Frames per latent frame after the first (4)."""
        return self._video_latent_geometry("scale_factor_temporal", "temporal_compression_ratio", 4)

    @property
    def num_channels_latents(self) -> int:
        """Video latent channels (48), from the VAE / video decoder config."""
        return self._video_latent_geometry("z_dim", "latent_channels", 48)

    @property
    def num_channels_audio_latents(self) -> int:
        """Audio latent channels (64), from ``audio_vae.config.decoder_input_channels``."""
        return int(self.audio_vae.config.decoder_input_channels)

    @property
    def audio_sample_rate(self) -> int:
        """Sample rate of the returned audio (``audio_vae.config.sampling_rate``, 44,100)."""
        return int(self.audio_vae.config.sampling_rate)

    def num_latent_frames(self) -> int:
        """Video latent length of a ``duration_s`` clip, ``(round(2 duration fps) - 1) // 8 + 1`` (SandAI ``_resolve_lengths``)."""
        frames = int(round(float(self.config.duration_s) * float(self.config.fps) * 2))
        return (frames - 1) // (2 * self.vae_scale_factor_temporal) + 1

    def num_audio_latents(self) -> int:
        """Audio latent length of a ``duration_s`` clip (250)."""
        return int(round(float(self.config.duration_s) * float(self.config.audio_latent_fps)))

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
        cfg = self.config
        return Magi2RefinerStageConfig(
            num_inference_steps=int(
                cfg.refiner_num_inference_steps if num_inference_steps is None else num_inference_steps
            ),
            shift=float(cfg.refiner_shift),
            guidance_scale=float(cfg.refiner_guidance_scale if guidance_scale is None else guidance_scale),
            noise_value=int(cfg.refiner_noise_value),
            sigma_start=float(cfg.sigma_start),
            vae_stride_spatial=self.vae_scale_factor_spatial,
        )

    # --- Text

    @torch.no_grad()
    def encode_text(
        self,
        prompt: str | list[str],
        device: torch.device | str | None = None,
        figure_target: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Qwen3.5 features of each prompt (SandAI ``Qwen35TextEncoder.encode``), zero-padded to the longest.

        Args:
            prompt: one string or a list; each is normalised and tokenised alone (at most
                ``max_sequence_length`` tokens, longer ones cut with a warning).
            device: where to run the text encoder (default: the execution device).
            figure_target: e.g. ``"<Figure 1>"``: also return the mean feature of its tokens (the image
                special-token embedding).

        Returns:
            ``(embeds [B, Lt, C], mask [B, Lt] bool, target_embeds [B, C] or None)``.
        """
        device = device or self._execution_device
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        features, pooled = [], []
        with self._stage_progress_bar(len(prompts), "Encoding text") as progress_bar:
            for text in prompts:
                f, target = encode_prompt_text(
                    self.tokenizer,
                    self.text_encoder,
                    text,
                    device,
                    int(self.config.max_sequence_length),
                    int(self.config.text_skip_layers),
                    figure_target,
                )
                features.append(f)
                pooled.append(target)
                progress_bar.update()
        embeds, mask = pad_text_batch(features, [None] * len(features))
        return embeds, mask, (None if figure_target is None else torch.stack(pooled, 0))

    @torch.no_grad()
    def encode_prompt(
        self,
        prompt: str | list[str] | None,
        negative_prompt: str | list[str] | None = None,
        do_classifier_free_guidance: bool = True,
        num_videos_per_prompt: int = 1,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        r"""Text conditioning as Wan / LTX-2 ``encode_prompt``.

        Args:
            prompt: ``B`` prompts, or ``None`` with ``prompt_embeds`` ``[B, Lt, C]`` and ``prompt_attention_mask``
                ``[B, Lt]``; the negative pair likewise (default text ``config.negative_prompt``).
            do_classifier_free_guidance: also return the negative pair.
            num_videos_per_prompt: ``n``; each prompt's rows are repeated ``n`` times, adjacent.
            device, dtype: where the text encoder runs and the results live; dtype of the embeddings.

        Returns:
            ``(prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask)``,
            ``[B n, Lt, C]`` and ``[B n, Lt]`` bool (the negative pair ``None`` without CFG).
        """
        device = device or self._execution_device
        if prompt_embeds is None:
            prompt_embeds, prompt_attention_mask, _ = self.encode_text(prompt, device)
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            negative = self.config.negative_prompt if negative_prompt is None else negative_prompt
            negatives = [negative] * prompt_embeds.shape[0] if isinstance(negative, str) else list(negative)
            negative_prompt_embeds, negative_prompt_attention_mask, _ = self.encode_text(negatives, device)

        prompt_embeds, prompt_attention_mask = repeat_text_per_video(
            prompt_embeds, prompt_attention_mask, num_videos_per_prompt, device, dtype
        )
        if negative_prompt_embeds is not None:
            negative_prompt_embeds, negative_prompt_attention_mask = repeat_text_per_video(
                negative_prompt_embeds, negative_prompt_attention_mask, num_videos_per_prompt, device, dtype
            )
        return prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask

    def _encode_conditioning(self, text: dict, image, image_embeds, need_negative: bool, size: tuple, device) -> list:
        """``__call__``'s image and text step: the I2V image's latent at ``size`` (encoded first, as SandAI does), then
        :meth:`encode_prompt` on ``text`` (its keyword arguments; I2V prompts get the ``<Figure 1>`` reference and its
        pooled token). Returns the four text tensors, ``image_embeds`` per video and ``image_latents``
        ``[1, 48, 1, h, w]`` (``None`` without an image)."""
        image_latents = None
        if image is not None:
            image_latents = self.encode_reference_image(self.preprocess_reference_image(image, *size)).to(device)
        return [*self._encode_text_conditioning(text, image, image_embeds, need_negative, device), image_latents]

    def _encode_text_conditioning(self, text: dict, image, image_embeds, need_negative: bool, device) -> list:
        """The text half of :meth:`_encode_conditioning` (also the modular text-encoder block's step):
        :meth:`encode_prompt` on ``text``, I2V prompts (``image`` given) with the ``<Figure 1>`` reference and its
        pooled token. Returns the four text tensors and ``image_embeds`` per video."""
        if text["prompt"] is not None and image is not None:
            prompts = [add_figure_reference(p) for p in text["prompt"]]
            embeds, mask, pooled = self.encode_text(prompts, device, figure_target="<Figure 1>")
            text = {**text, "prompt": None, "prompt_embeds": embeds, "prompt_attention_mask": mask}
            image_embeds = pooled if image_embeds is None else image_embeds
        # The refiner's CFG needs the negative prompt even when the preview runs without CFG (need_negative).
        embeds = self.encode_prompt(**text, do_classifier_free_guidance=need_negative, device=device)
        if image_embeds is not None:
            image_embeds = image_embeds.to(device).repeat_interleave(text["num_videos_per_prompt"], 0)
        return [*embeds, image_embeds]

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

    @torch.no_grad()
    def encode_reference_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised fp32 mean latent ``[B, 48, 1, H/16, W/16]`` of ``pixels`` ``[B, 3, 1, H, W]`` in [-1, 1]."""
        vae = self.vae
        mu = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().float()
        mean, inv_std = wan_latent_stats(vae, mu.device)
        return (mu - mean) * inv_std

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
        draw order); given tensors are moved and cast. T and L default to the ``duration_s`` clip."""
        scale = self.vae_scale_factor_spatial
        frames = self.num_latent_frames() if num_latent_frames is None else int(num_latent_frames)
        audio_len = self.num_audio_latents() if num_audio_latents is None else int(num_audio_latents)
        if latents is None:
            shape = (batch_size, self.num_channels_latents, frames, height // scale, width // scale)
            latents = randn_tensor(shape, generator=generator, device=torch.device(device), dtype=torch.float32)
        else:
            latents = latents.to(device=device, dtype=torch.float32)
        if audio_latents is None:
            shape = (batch_size, audio_len, self.num_channels_audio_latents)
            audio_latents = randn_tensor(shape, generator=generator, device=torch.device(device), dtype=torch.float32)
        else:
            audio_latents = audio_latents.to(device=device, dtype=torch.float32)
        return latents, audio_latents

    # --- Decoding

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised video latents ``[B, 48, T, h, w]`` -> pixels ``[B, 3, 4(T-1)+1, 16h, 16w]`` in [-1, 1]."""
        return decode_video_latents(getattr(self, "video_decoder", None), getattr(self, "vae", None), latents)

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> np.ndarray:
        """Audio latents ``[B, L, 64]`` -> stereo ``[B, 2, S]`` float32 numpy at ``audio_sample_rate``."""
        return decode_audio_latents(self.audio_vae, audio_latents, float(self.config.audio_resample_ratio))

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

        Returns:
            :class:`Magi2PipelineOutput` ``(frames, audio, audio_sample_rate, fps)`` (``fps`` 25 on the refiner path).
            Under context parallelism CP rank 0 alone encodes the text and image (broadcasting them) and decodes;
            the other ranks get ``frames=None`` and ``audio=None`` (the latents with ``output_type="latent"``).
            With ``config.duration_s`` other than 10 the video can end more than a frame before the audio (5 s: 61
            frames = 4.88 s), so export it with ``trim_or_pad_audio=True``, as ``examples/generate.py`` does.

        Raises:
            ValueError: any bad argument or missing component (:meth:`check_inputs`), before any work starts.
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
        )
        check_scheduler(self.scheduler)
        refine, denoise_height, denoise_width = self.stage_sizes(height, width, preview_height, preview_width)
        refiner_config = None
        if refine:
            refiner_config = self.refiner_stage_config(refiner_num_inference_steps, refiner_guidance_scale)
        warn_untrained_sizes(refine, height, width, denoise_height, denoise_width)

        self._guidance_scale = float(guidance_scale)
        self._audio_guidance_scale = float(audio_guidance_scale)
        self._attention_kwargs = attention_kwargs
        self._current_timestep = None
        self._interrupt = False
        device = self._execution_device

        # 1. batch size
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
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
        (
            prompt_embeds,
            prompt_attention_mask,
            negative_prompt_embeds,
            negative_prompt_attention_mask,
            image_embeds,
            image_latents,
        ) = self._on_first_cp_rank(
            self._encode_conditioning,
            text,
            image,
            image_embeds,
            need_negative,
            (denoise_height, denoise_width),
            device,
            broadcast=True,
        )
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
        self._denoise(self.transformer, timesteps, tensors, schedulers, conditioning, "Denoising", *callbacks)

        # 6. refiner stage; its re-noise continues the generator after the preview draws
        fps = float(self.config.fps)
        if refine and not self.interrupt:
            tensors["latents"], refiner_scheduler = prepare_refiner_latents(
                tensors["latents"], self.scheduler, refiner_config, height, width, generator
            )
            conditioning["guidance_scale"] = refiner_config.guidance_scale
            schedulers = {"latents": refiner_scheduler}
            timesteps = refiner_scheduler.timesteps
            self._denoise(self.refiner, timesteps, tensors, schedulers, conditioning, "Refining", *callbacks)
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
            if output_height is not None:
                video = resize_video_frames(video, output_height, output_width)
            frames = self.video_processor.postprocess_video(video, output_type=output_type)
            progress_bar.update()
            audio = self.decode_audio(audio_latents)
            progress_bar.update()
        if output_type == "pt":
            audio = torch.from_numpy(audio)
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
    ) -> dict:
        """The sampler of both stages (``model`` is the transformer or the refiner), as diffusers' Wan loop.

        Per step ``t``: the guided velocity of each latent in ``schedulers``, each forward in its cache context (the
        preview: one forward on ``[cond; uncond]``, :meth:`predict_velocity`; the refiner: cond then uncond, one
        forward per sample, no timestep and no audio), one scheduler step per latent, then the step
        callback, which may replace any entry of ``tensors`` (the step table, updated in place and returned).
        ``conditioning`` holds the masks and I2V tensors (and the refiner's ``guidance_scale``).
        """
        self._num_timesteps = len(timesteps)
        with self._stage_progress_bar(len(timesteps), description) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                self._current_timestep = t
                context = {"step_index": i, "num_inference_steps": len(timesteps), "timestep": t}
                velocities = self._step_velocities(model, t, tensors, conditioning, context)
                for name, velocity in velocities.items():
                    tensors[name] = schedulers[name].step(velocity, t, tensors[name], return_dict=False)[0]
                if callback_on_step_end is not None:
                    inputs = {name: tensors[name] for name in callback_on_step_end_tensor_inputs}
                    outputs = callback_on_step_end(self, i, t, inputs) or {}
                    tensors.update({name: value for name, value in outputs.items() if name in tensors})
                progress_bar.update()
        self._current_timestep = None
        return tensors

    def _step_velocities(self, model, t, tensors: dict, conditioning: dict, context: dict) -> dict:
        """One step's guided velocity of each latent (the body of :meth:`_denoise`'s loop, also the modular
        denoiser blocks' step): the preview's :meth:`predict_velocity` for ``self.transformer``, else the refiner's
        cond/uncond forwards per sample and CFG; every forward in its cache context (``context``: step_index,
        num_inference_steps, timestep)."""
        refining = model is not self.transformer
        if not refining:
            branch = "cond_uncond" if self.do_classifier_free_guidance else "cond"
            with cache_context(model, branch, **context):
                video, audio = self.predict_velocity(
                    tensors["latents"],
                    tensors["audio_latents"],
                    t,
                    tensors["prompt_embeds"],
                    conditioning["prompt_attention_mask"],
                    tensors["negative_prompt_embeds"],
                    conditioning["negative_prompt_attention_mask"],
                    conditioning["image_latents"],
                    conditioning["image_embeds"],
                )
            velocities = {"latents": video, "audio_latents": audio}
        else:
            # cond then uncond text (only uncond at scale 0, only cond at 1); the refiner runs the samples of
            # a batch one by one through its blocks, so each sample's forward has its own cache context
            g = conditioning["guidance_scale"]
            branches = ("uncond",) if g == 0.0 else ("cond",) if g == 1.0 else ("cond", "uncond")
            latents = tensors["latents"]
            batch = latents.shape[0]
            attention_kwargs = attention_kwargs_for(model, self.attention_kwargs)
            branch_velocity = {}
            for branch in branches:
                prefix = "negative_" if branch == "uncond" else ""
                embeds = tensors[f"{prefix}prompt_embeds"]
                mask = conditioning[f"{prefix}prompt_attention_mask"]
                rows = []
                for b in range(batch):
                    with cache_context(model, f"{branch}_{b}", **context):
                        output = model(
                            hidden_states=latents[b : b + 1],
                            encoder_hidden_states=embeds[b : b + 1],
                            encoder_attention_mask=None if mask is None else mask[b : b + 1],
                            attention_kwargs=attention_kwargs,
                            return_dict=True,
                        )
                    rows.append(output.sample.float())
                branch_velocity[branch] = torch.cat(rows, dim=0)
            if len(branches) == 1:
                velocities = {"latents": branch_velocity[branches[0]]}
            else:
                scale = torch.tensor(float(g), dtype=torch.float32, device=latents.device)
                v_c, v_u = branch_velocity["cond"], branch_velocity["uncond"]
                velocities = {"latents": v_u + scale * (v_c - v_u)}
        return velocities

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
        """One transformer forward on ``[cond; uncond]`` and the CFG combination (SandAI
        ``Magi2PreviewSampler.prepare_model_input``/``cfg_velocity``, ``use_ref_for_uncond``): the halves differ
        only in the text.

        Returns guided fp32 ``(video [B, 48, T, h, w], audio [B, L, 64])`` velocities; the arguments are the step's
        latents, timestep (0-1000), text pairs and I2V conditioning.
        """
        batch = latents.shape[0]
        cfg = self.do_classifier_free_guidance
        copies = 2 if cfg else 1
        if cfg:
            text, mask = pad_text_batch(
                [prompt_embeds, negative_prompt_embeds], [prompt_attention_mask, negative_prompt_attention_mask]
            )
        else:
            text, mask = prompt_embeds, prompt_attention_mask
        timestep = t.to(device=latents.device, dtype=torch.float32).reshape(1).expand(copies * batch)
        kwargs = {}
        if image_latents is not None:
            kwargs["image_latents"] = torch.cat([image_latents] * copies, dim=0)
            kwargs["image_embeds"] = torch.cat([image_embeds] * copies, dim=0)
        output = self.transformer(
            hidden_states=torch.cat([latents] * copies, dim=0),
            timestep=timestep,
            encoder_hidden_states=text,
            audio_hidden_states=torch.cat([audio_latents] * copies, dim=0),
            encoder_attention_mask=mask,
            attention_kwargs=attention_kwargs_for(self.transformer, self.attention_kwargs),
            return_dict=True,
            **kwargs,
        )
        video = output.sample.float()
        audio = output.audio_sample.float()
        if not cfg:
            return video, audio
        video = video[batch:] + self.guidance_scale * (video[:batch] - video[batch:])
        return video, audio[batch:] + self.audio_guidance_scale * (audio[:batch] - audio[batch:])
