"""``Magi2Pipeline``: MAGI-2 Preview text-to-video and image-to-video, with audio, as a diffusers pipeline.

Semantics follow SandAI's ``inference/pipeline`` (``Magi2InferenceEngine.evaluate`` and
``Magi2PreviewSampler``) at commit ``f68a0f9``; the code is this package's own.

One call, up to two stages, one sampler. The preview stage denoises the video and audio latents with one
``[cond; uncond]`` forward per step. On the 1080p path the refiner stage
(:func:`~diffusers_magi2.pipelines.refiner_stage.run_refiner_stage`) upsamples the final video latent to
``2T − 1`` frames at ``height/16 × width/16``, re-noises it (drawn from the same ``generator``, after the
preview draws) and denoises it with refiner CFG (two forwards per step, no audio tokens); the preview
audio is decoded as is, with 4·(2T − 2) + 1 = 249 frames at 2 · ``fps`` = 25 fps. Both stages run
``Magi2Pipeline._denoise`` (:func:`~diffusers_magi2.pipelines.sampling_magi2.denoise_steps`): a cache
context per forward (``"cond_uncond"``, or ``"cond"`` without CFG; the refiner's ``"cond_{b}"`` /
``"uncond_{b}"``, one per sample, as it runs a batch's samples one after another through its blocks),
``interrupt``, step callbacks and a progress bar. The refiner is a stage of this pipeline, not a
pipeline of its own as LTX-2's latent upsampler is, because the 1080p preset is one call: the re-noise
continues the preview's generator stream, the stage reuses the call's text embeddings, callbacks and
decoding, and ``model_index.json`` already holds the refiner as a component.
"""

from __future__ import annotations

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

# The model modules are imported by name so that they are in ``sys.modules`` when diffusers resolves
# the ``model_index.json`` entries ``diffusers_magi2.models.*`` of a converted repo.
from ..models.transformer_magi2 import Magi2Transformer3DModel
from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from ..models.turbo_vae import Magi2TurboVAEDecoder
from ..parallel.context_parallel_runtime import broadcast_from_first_rank
from ..utils.dtype_utils import parse_dtype
from .decoding_magi2 import decode_audio_latents, decode_video_latents, resize_video_frames, wan_latent_stats
from .image_processing_magi2 import letterbox_image, preprocess_reference_image
from .pipeline_output import Magi2PipelineOutput
from .presets_magi2 import (
    DEFAULT_NEGATIVE_PROMPT,
    REFINER_RESOLUTION,
    RESOLUTION_PRESETS,
    TRAINED_RESOLUTIONS,
    apply_resolution_preset,
    resolve_stage_sizes,
)
from .refiner_stage import Magi2RefinerStageConfig, run_refiner_stage
from .sampling_magi2 import (
    check_scheduler,
    combine_guidance,
    denoise_steps,
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
)
from .validation_magi2 import Magi2PipelineChecksMixin, attention_kwargs_for

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


class Magi2Pipeline(Magi2PipelineChecksMixin, DiffusionPipeline):
    r"""MAGI-2 Preview: a 10 s video with a stereo soundtrack from a prompt, optionally conditioned on an image.

    Components:
        tokenizer: Qwen3.5 tokenizer (a transformers fast tokenizer). The reference's extra CJK
            pre-tokenizer split is applied here when the pipeline is built (idempotent).
        text_encoder (`transformers.Qwen3_5TextModel`): prompt features are ``hidden_states[-3]``.
        transformer (`Magi2Transformer3DModel`): the MoE DiT; one forward per step on the batch
            ``[cond, uncond]`` (each row its own attention segment).
        audio_vae (`AutoencoderOobleck`): Stable Audio Open decoder for the 64-channel audio latents.
        scheduler (`UniPCMultistepScheduler`, flow prediction, ``use_flow_sigmas``, ``flow_shift`` 7):
            steps the video latent; the audio instance is built from its config at call time.
        vae (`AutoencoderKLWan`, Wan2.2 form, optional): encodes the I2V reference image; decodes
            video when there is no ``video_decoder``.
        video_decoder (`Magi2TurboVAEDecoder`, optional): the default video decoder (TurboVAED).
        refiner (`Magi2RefinerTransformer3DModel`, optional): the 1080p refiner stage (spec §5.7),
            run after the preview when ``height=1088, width=1920`` (``resolution="1080p"``) or an
            explicit ``preview_height/preview_width`` is given; without it those raise.

    Construction (and so ``from_pretrained``) raises ``ValueError`` when a component's latent or text width
    does not fit the transformer or refiner (:data:`~diffusers_magi2.pipelines.validation_magi2.COMPONENT_FITS`).

    Loading a converted repo (``import diffusers_magi2`` registers the model modules)::

        pipe = Magi2Pipeline.from_pretrained(
            repo, dtype={"default": torch.bfloat16, "vae": torch.float32, "audio_vae": torch.float32}
        )

    The reference runs the Wan2.2 encoder (I2V image) in fp32 and the DiT, text encoder and TurboVAE
    in bf16; the dict above reproduces that. Latents and the CFG/scheduler math stay fp32 whatever
    the component dtypes.

    Config (stored in ``model_index.json``): ``negative_prompt`` (the built-in one),
    ``sigma_start`` (0.999: sigmas are ``linspace(sigma_start, 0, N + 1)[:-1]`` before the shift),
    ``text_skip_layers`` (2 → ``hidden_states[-3]``), ``max_sequence_length`` (7,000),
    ``fps`` (12.5), ``duration_s`` (10), ``audio_latent_fps`` (25), ``audio_resample_ratio``
    (441/512), ``reference_image_dtype`` ("bfloat16": the reference rounds the I2V pixels to its
    engine dtype before encoding). Two-stage (refiner) settings: ``preview_height`` /
    ``preview_width`` (512 × 896: the preview size of the 1080p preset; a repo with a small model
    can store a smaller one), ``refiner_num_inference_steps`` (5), ``refiner_guidance_scale`` (2.0),
    ``refiner_shift`` (5.0), ``refiner_noise_value`` (220 → re-noise signal scale 0.838910); the
    values of SandAI ``magi2_refiner.json`` ``evaluation_config``.
    """

    model_cpu_offload_seq = "text_encoder->transformer->refiner->video_decoder->vae->audio_vae"
    _optional_components = ["vae", "video_decoder", "refiner"]
    _callback_tensor_inputs = ["latents", "audio_latents", "prompt_embeds", "negative_prompt_embeds"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``DiffusionPipeline.from_pretrained``, plus two parallel options (both off unless given):

        * ``expert_parallel=Magi2ExpertParallelConfig(ep_degree=E)``: the transformer is loaded with only this
          rank's routed experts (:func:`~diffusers_magi2.pipelines.loading_magi2.load_pipeline_with_expert_parallel`);
        * ``context_parallel=diffusers.ContextParallelConfig(ulysses_degree=N)``: after loading, the transformer and
          the refiner (if any) get ``enable_parallelism(config=...)`` (N = the world size; with EP, ``E`` divides
          ``N``).

        Raises:
            ValueError: the errors of both (see ``Magi2Transformer3DModel.enable_parallelism``), before the
                weights load where the sizes alone decide.
        """
        expert_parallel = kwargs.pop("expert_parallel", None)
        context_parallel = kwargs.pop("context_parallel", None)
        if context_parallel is not None:
            from ..parallel.context_parallel_runtime import resolve_context_parallel

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
        """``enable_parallelism(config=config)`` on the transformer and the refiner (when present).

        Args:
            config: ``diffusers.ContextParallelConfig(ulysses_degree=N)``, N = the world size.
        """
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
        # The reference preprocesses the I2V image with VideoProcessor(vae_scale_factor=2 * 16).
        self.reference_image_processor = VideoProcessor(vae_scale_factor=2 * self.vae_scale_factor_spatial)

    # --- Geometry read from the component configs

    def _video_latent_geometry(self, vae_key: str, decoder_key: str, default: int) -> int:
        """``vae.config[vae_key]`` when there is a ``vae``, else ``video_decoder.config[decoder_key]`` when
        the decoder declares it, else ``default`` (the released model's value)."""
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
        """Frames per latent frame after the first (4): F = 4·(T − 1) + 1."""
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
        """Video latent length of a ``duration_s`` clip: frames on the 25 fps timeline
        ``round(duration·fps·2)``, then ``(frames − 1) // 8 + 1`` (32 for 10 s; SandAI ``_resolve_lengths``)."""
        frames = int(round(float(self.config.duration_s) * float(self.config.fps) * 2))
        return (frames - 1) // (2 * self.vae_scale_factor_temporal) + 1

    def num_audio_latents(self) -> int:
        """Audio latent length of a ``duration_s`` clip: ``round(duration·audio_latent_fps)`` (250)."""
        return int(round(float(self.config.duration_s) * float(self.config.audio_latent_fps)))

    # --- Properties (diffusers conventions)

    @property
    def guidance_scale(self) -> float:
        """Video CFG scale of the current/last call (Python float, ≥ 0; 1 = no video guidance); set by
        ``__call__`` from its ``guidance_scale`` argument (SandAI ``Magi2PreviewSampler`` video scale, 5.0).
        Reading it before the first call raises ``AttributeError``."""
        return self._guidance_scale

    @property
    def audio_guidance_scale(self) -> float:
        """Audio CFG scale of the current/last call (Python float, ≥ 0; reference default 7.0); set by
        ``__call__``. Reading it before the first call raises ``AttributeError``."""
        return self._audio_guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        """CFG runs unless both guidance scales are exactly 1 (then the uncond half is skipped)."""
        return self._guidance_scale != 1.0 or self._audio_guidance_scale != 1.0

    @property
    def num_timesteps(self) -> int:
        """Number of denoising steps of the stage being (or last) denoised: ``num_inference_steps`` in the
        preview, the refiner steps in the refiner stage. Reading it before a call raises ``AttributeError``."""
        return self._num_timesteps

    @property
    def current_timestep(self):
        """The timestep being denoised (a 0-d scheduler tensor on the 0–1000 scale), or ``None``
        outside the denoising loops (diffusers convention, for callbacks and hooks)."""
        return self._current_timestep

    @property
    def interrupt(self) -> bool:
        """``True`` once a step callback set ``pipe._interrupt = True``: the remaining steps of the stage
        (and, from the preview, the refiner stage) are skipped and the current latents are decoded."""
        return self._interrupt

    @property
    def attention_kwargs(self):
        """The ``attention_kwargs`` dict (or ``None``) of the current/last call, as the user passed it;
        each model receives only the keys it declares in ``supported_attention_kwargs``
        (see ``check_inputs``)."""
        return self._attention_kwargs

    # --- Scheduling (the shift is applied exactly once, by the scheduler, on every task path)
    def base_sigmas(self, num_inference_steps: int) -> np.ndarray:
        """Unshifted sigmas ``linspace(sigma_start, 0, N + 1)[:-1]`` (float64, length N)."""
        return unshifted_sigmas(self.config.sigma_start, num_inference_steps)

    def prepare_timesteps(
        self, num_inference_steps: int, device: torch.device | str | None = None
    ) -> tuple[UniPCMultistepScheduler, UniPCMultistepScheduler, torch.Tensor]:
        """Set up the video scheduler (``self.scheduler``) and a fresh audio scheduler built from its
        config, both with the same schedule.

        The pipeline passes the unshifted :meth:`base_sigmas` to ``set_timesteps(sigmas=…)``; the
        scheduler applies ``flow_shift`` once: σ' = sσ/(1 + (s − 1)σ), final σ 0, integer timesteps
        int64(σ'·1000) (truncated). For N = 100, s = 7: 999, 998, 996, …, 124, 65 (T2V and I2V alike).

        Returns:
            ``(video_scheduler, audio_scheduler, timesteps)``; ``timesteps`` int64 ``[N]``.

        Raises:
            ValueError: the scheduler is not a flow-prediction UniPC with flow sigmas.
        """
        return flow_schedulers(self.scheduler, self.base_sigmas(num_inference_steps), device)

    # --- Two-stage (1080p refiner) geometry and settings

    apply_resolution_preset = staticmethod(apply_resolution_preset)

    def stage_sizes(
        self, height: int, width: int, preview_height: int | None = None, preview_width: int | None = None
    ) -> tuple[bool, int, int]:
        """Whether the call runs the refiner, and the size the preview stage denoises at:
        :func:`~diffusers_magi2.pipelines.presets_magi2.resolve_stage_sizes` with the config's preview size
        (``config.preview_height × config.preview_width``, 512 × 896 for the released model).

        Returns:
            ``(refine, denoise_height, denoise_width)`` in pixels.

        Raises:
            ValueError: only one of ``preview_height``/``preview_width`` given.
        """
        default_preview = (int(self.config.get("preview_height", 512)), int(self.config.get("preview_width", 896)))
        return resolve_stage_sizes(height, width, preview_height, preview_width, default_preview)

    def refiner_stage_config(
        self, num_inference_steps: int | None = None, guidance_scale: float | None = None
    ) -> Magi2RefinerStageConfig:
        """The :class:`Magi2RefinerStageConfig` of a call: steps and CFG from the arguments (``None`` →
        ``config.refiner_num_inference_steps`` / ``config.refiner_guidance_scale``), shift and re-noise
        index from the config, the preview's ``sigma_start`` and the VAE's spatial factor."""
        cfg = self.config
        if num_inference_steps is None:
            num_inference_steps = cfg.get("refiner_num_inference_steps", 5)
        if guidance_scale is None:
            guidance_scale = cfg.get("refiner_guidance_scale", 2.0)
        return Magi2RefinerStageConfig(
            num_inference_steps=int(num_inference_steps),
            shift=float(cfg.get("refiner_shift", 5.0)),
            guidance_scale=float(guidance_scale),
            noise_value=int(cfg.get("refiner_noise_value", 220)),
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
        """Qwen3.5 features of each prompt, zero-padded to the longest with a boolean mask.

        Each prompt is normalised (JSON → compact markdown), tokenised alone (at most
        ``max_sequence_length`` tokens; longer prompts are cut with a warning) and encoded; features
        are ``hidden_states[-3]`` in the text encoder's dtype, as SandAI ``Qwen35TextEncoder.encode``.
        A progress bar counts the prompts.

        Args:
            prompt: one string or a list.
            device: where to run the text encoder (default: the pipeline's execution device).
            figure_target: e.g. ``"<Figure 1>"``: also return the mean feature of the tokens that
                overlap it in each (normalised) prompt — the image special-token embedding.

        Returns:
            ``(embeds [B, Lt, C], mask [B, Lt] bool, target_embeds [B, C] or None)``.
        """
        device = device or self._execution_device
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        features, pooled = [], []
        with self._stage_progress_bar(len(prompts), "Encoding text") as progress_bar:
            for text in prompts:
                f, target = encode_prompt_text(
                    self.tokenizer, self.text_encoder, text, device, int(self.config.max_sequence_length),
                    int(self.config.text_skip_layers), figure_target,
                )
                features.append(f)
                pooled.append(target)
                progress_bar.update()
        embeds, mask = pad_text_batch(features, [None] * len(features))
        return embeds, mask, (None if figure_target is None else torch.stack(pooled, 0))

    @torch.no_grad()
    def encode_prompt(
        self, prompt: str | list[str] | None, negative_prompt: str | list[str] | None = None,
        do_classifier_free_guidance: bool = True, num_videos_per_prompt: int = 1,
        prompt_embeds: torch.Tensor | None = None, negative_prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None, negative_prompt_attention_mask: torch.Tensor | None = None,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        r"""Text conditioning as Wan / LTX-2 ``encode_prompt``: ``(prompt_embeds, prompt_attention_mask,
        negative_prompt_embeds, negative_prompt_attention_mask)``, embeddings ``[B·n, Lt, C]`` with
        ``[B·n, Lt]`` bool masks, each prompt's rows repeated ``n = num_videos_per_prompt`` times (adjacent).

        Args:
            prompt: ``B`` prompts (a string or list), or ``None`` with ``prompt_embeds`` (``[B, Lt, C]``) and
                ``prompt_attention_mask``; the negative pair likewise (default text ``config.negative_prompt``).
            do_classifier_free_guidance: also return the negative pair (else ``None, None`` unless given).
            device, dtype: where the text encoder runs and the results live; cast of the embeddings.

        The I2V ``image_embeds`` (the ``<Figure 1>`` special-token embedding) come from the same pass:
        ``embeds, mask, image_embeds = pipe.encode_text(add_figure_reference(prompt), figure_target="<Figure 1>")``
        (``add_figure_reference`` from :mod:`diffusers_magi2.pipelines.text_encoding`; what ``__call__`` does).
        """
        device = device or self._execution_device
        if prompt_embeds is None:
            prompt_embeds, prompt_attention_mask, _ = self.encode_text(prompt, device)
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            negative = self.config.negative_prompt if negative_prompt is None else negative_prompt
            negatives = [negative] * prompt_embeds.shape[0] if isinstance(negative, str) else list(negative)
            negative_prompt_embeds, negative_prompt_attention_mask, _ = self.encode_text(negatives, device)

        def per_video(embeds, mask):
            if embeds is None:
                return None, None
            embeds = embeds.to(device=device, dtype=dtype or embeds.dtype)
            mask = mask.to(device=device, dtype=torch.bool)
            return embeds.repeat_interleave(num_videos_per_prompt, 0), mask.repeat_interleave(num_videos_per_prompt, 0)

        return (
            *per_video(prompt_embeds, prompt_attention_mask),
            *per_video(negative_prompt_embeds, negative_prompt_attention_mask),
        )

    def _encode_conditioning(
        self, prompts, negative_prompt, image, need_negative, num_videos_per_prompt, prompt_embeds,
        negative_prompt_embeds, prompt_attention_mask, negative_prompt_attention_mask, image_embeds, device,
    ):
        """``__call__``'s text step: :meth:`encode_prompt` (I2V prompts with the ``<Figure 1>`` reference and its
        pooled token) and ``image_embeds`` per video; returns the four text tensors and ``image_embeds``."""
        if prompts is not None and image is not None:
            prompts = [add_figure_reference(p) for p in prompts]
            prompt_embeds, prompt_attention_mask, pooled = self.encode_text(prompts, device, figure_target="<Figure 1>")
            image_embeds = pooled if image_embeds is None else image_embeds
            prompts = None
        # The refiner's CFG needs the negative prompt even when the preview runs without CFG (need_negative).
        embeds = self.encode_prompt(
            prompts, negative_prompt, need_negative, num_videos_per_prompt, prompt_embeds, negative_prompt_embeds,
            prompt_attention_mask, negative_prompt_attention_mask, device=device,
        )
        if image_embeds is not None:
            image_embeds = image_embeds.to(device).repeat_interleave(num_videos_per_prompt, 0)
        return (*embeds, image_embeds)

    def _stage_progress_bar(self, total: int, description: str):
        """A diffusers progress bar (``set_progress_bar_config`` applies) labelled with the stage."""
        progress_bar = self.progress_bar(total=total)
        progress_bar.set_description(description)
        return progress_bar

    # --- Image

    def preprocess_reference_image(self, image, height: int, width: int) -> torch.Tensor:
        """The I2V image as VAE input ``[1, 3, 1, H', W']`` (fp32 values): SandAI
        ``Magi2InferenceEngine._encode_image`` with ``ref_image_type="original"`` (long side scaled to
        ``max(height, width)``, letterboxed, floored to multiples of 32, rounded to
        ``config.reference_image_dtype``); see
        :func:`~diffusers_magi2.pipelines.image_processing_magi2.preprocess_reference_image`.
        """
        rounding = parse_dtype(self.config.reference_image_dtype, "reference_image_dtype")
        return preprocess_reference_image(image, height, width, self.reference_image_processor, rounding)

    @torch.no_grad()
    def encode_reference_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised mean latent of the reference image with the Wan2.2 VAE:
        ``(μ − mean) · (1 / std)`` with the tables from ``vae.config.latents_mean/latents_std``
        (``1/std`` computed in fp32 first, as the reference).

        Args:
            pixels: ``[B, 3, 1, H, W]`` in [-1, 1].

        Returns:
            ``[B, 48, 1, H/16, W/16]`` float32.
        """
        vae = self.vae
        mu = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().float()
        mean, inv_std = wan_latent_stats(vae, mu.device)
        return (mu - mean) * inv_std

    # --- Latents

    def prepare_latents(
        self, batch_size: int, height: int, width: int, device: torch.device | str,
        generator: torch.Generator | list[torch.Generator] | None = None, latents: torch.Tensor | None = None,
        audio_latents: torch.Tensor | None = None, num_latent_frames: int | None = None,
        num_audio_latents: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Initial noise, fp32: video ``[B, 48, T, H/16, W/16]`` drawn first, then audio ``[B, L, 64]``,
        from ``generator`` (spec §5.6 draw order). Given tensors are used as they are (moved to
        ``device``, cast to fp32); T and L default to the ``duration_s`` clip (32 and 250).
        """
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
        """Normalised video latents ``[B, 48, T, h, w]`` → pixels ``[B, 3, 4(T−1)+1, 16h, 16w]`` in [-1, 1].

        Uses ``video_decoder`` (TurboVAED; it de-normalises internally) when present, else the Wan
        VAE after de-normalising ``z / (1/std) + mean`` with its config tables
        (:func:`~diffusers_magi2.pipelines.decoding_magi2.decode_video_latents`).
        """
        return decode_video_latents(getattr(self, "video_decoder", None), getattr(self, "vae", None), latents)

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> np.ndarray:
        """Audio latents ``[B, L, 64]`` → stereo ``[B, 2, S]`` float32 numpy at ``audio_sample_rate``.

        Oobleck decode of ``[B, 64, L]`` (L·2048 samples, identity latent scaling), then
        ``scipy.signal.resample`` to ``int(N · audio_resample_ratio)`` samples (441/512: 250 latents →
        512,000 → 441,000 = 10 s). Matches SandAI ``decode_audio``/``resample_audio_sinc``
        (:func:`~diffusers_magi2.pipelines.decoding_magi2.decode_audio_latents`).
        """
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
        r"""Generate a 10 s clip (125 frames at 12.5 fps; 249 at 25 fps with the refiner) with a 44.1 kHz
        stereo soundtrack.

        Args:
            prompt: text, or a JSON object string (rendered to compact markdown when it has a
                ``global_layer``). A list gives a batch.
            negative_prompt: the unconditional text; default the built-in one (``config.negative_prompt``).
            image: I2V reference (PIL, a local file path, or uint8 ``[H, W, 3]``). It conditions the whole
                clip (it is not the first frame); the prompt gets a ``<Figure 1>`` reference and the image
                is kept in the unconditional branch, so CFG steers the text only.
            height, width: pixels, multiples of 16. Trained: 256×448 and 512×896 (others warn);
                1088×1920 runs the two-stage refiner path (needs the ``refiner`` component): the preview
                at ``config.preview_height × config.preview_width`` (512×896), then the refiner stage.
            num_inference_steps: denoising steps (≥ 1; the preview uses 100).
            guidance_scale: video CFG scale (≥ 0; default 5.0). audio_guidance_scale: audio CFG (7.0).
            generator: RNG for the noise (video drawn first, then audio).
            latents, audio_latents: initial noise ``[B, 48, T, H/16, W/16]`` / ``[B, L, 64]`` (fp32).
            prompt_embeds, prompt_attention_mask: ``[B, Lt, C]`` text features and ``[B, Lt]`` bool mask
                (replace ``prompt``; the mask is required). The negative pair likewise.
            image_embeds: ``[B, C]`` special-token embedding; required with ``image`` + ``prompt_embeds``.
            output_type: ``"np"`` (default), ``"pil"``, ``"pt"`` or ``"latent"``.
            return_dict: return :class:`Magi2PipelineOutput` (else a tuple ``(frames, audio)``).
            attention_kwargs: passed to each model that declares the key in ``supported_attention_kwargs``
                (both MAGI-2 models declare none; kernels are chosen with ``set_attn_processor``). Any
                other key raises ``ValueError`` before work starts.
            callback_on_step_end: called as ``fn(pipe, step, timestep, tensors)`` after each step of
                either stage (``step`` counts within the stage; in the refiner stage ``latents`` is the
                refined latent and ``audio_latents`` the preview's); a returned dict may replace any of
                ``callback_on_step_end_tensor_inputs``. Setting ``pipe._interrupt = True`` skips the
                remaining steps (and, from the preview, the refiner stage) and decodes what there is.
            callback_on_step_end_tensor_inputs: names from ``_callback_tensor_inputs``.
            resolution: ``"272p"`` (256×448), ``"540p"`` (512×896) or ``"1080p"`` (1088×1920, two-stage);
                replaces ``height``/``width`` (leave those at their defaults).
            preview_height, preview_width: run the two-stage path with the preview at this size and the
                refiner output at ``height × width`` (for models other than the released one, e.g. a tiny
                test model: preview 32×48, output 64×96). Default for 1088×1920: the config's 512×896.
            refiner_num_inference_steps: refiner Flow-UniPC steps (default ``config``: 5).
            refiner_guidance_scale: refiner CFG scale (default ``config``: 2.0; needs the negative prompt
                even when the preview CFG is off).
            output_height, output_width: optional bilinear resize of the decoded frames (both or neither;
                e.g. 1080×1920), as the reference's ``--output-height/--output-width``; not with
                ``output_type="latent"``.
            num_videos_per_prompt: videos per prompt (≥ 1), each from its own noise; the output batch
                is ``len(prompt) · num_videos_per_prompt`` (a prompt's videos adjacent).

        Returns:
            :class:`Magi2PipelineOutput` ``(frames, audio, audio_sample_rate, fps)``; ``fps`` is 25
            (2 · ``config.fps``) on the refiner path. With ``output_type="latent"`` the frames are the
            refined latents ``[B, 48, 2T − 1, height/16, width/16]`` and the audio the preview audio latents.
            Under context parallelism (``context_parallel=`` / :meth:`enable_context_parallel`) every rank
            denoises, but CP rank 0 alone encodes the text (and the I2V image), broadcasting them, and alone
            decodes: the other ranks get ``frames=None`` and ``audio=None`` (the latents with
            ``output_type="latent"``, as on rank 0).

        Raises:
            ValueError: before any work starts: bad sizes, empty prompt, wrong image type, steps or
                ``num_videos_per_prompt`` < 1, negative guidance, embeddings without masks, ``image`` +
                ``prompt_embeds`` without ``image_embeds``, a negative prompt / ``image_embeds`` not of the
                prompt batch, ``latents`` / ``audio_latents`` without one row per video, embeddings not of
                the models' ``text_in_channels``, bad ``output_type`` or ``resolution``, the refiner path
                without a ``refiner`` or with bad settings, a bad output size.
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        if resolution is not None:
            height, width = self.apply_resolution_preset(resolution, height, width)
        self.check_inputs(
            prompt=prompt, negative_prompt=negative_prompt, image=image, height=height, width=width,
            num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
            audio_guidance_scale=audio_guidance_scale, prompt_embeds=prompt_embeds,
            prompt_attention_mask=prompt_attention_mask, negative_prompt_embeds=negative_prompt_embeds,
            negative_prompt_attention_mask=negative_prompt_attention_mask, image_embeds=image_embeds,
            output_type=output_type, callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            latents=latents, audio_latents=audio_latents, preview_height=preview_height, preview_width=preview_width,
            output_height=output_height, output_width=output_width,
            refiner_num_inference_steps=refiner_num_inference_steps, refiner_guidance_scale=refiner_guidance_scale,
            attention_kwargs=attention_kwargs, num_videos_per_prompt=num_videos_per_prompt,
        )
        check_scheduler(self.scheduler)
        refine, denoise_height, denoise_width = self.stage_sizes(height, width, preview_height, preview_width)
        refiner_config = None
        if refine:
            refiner_config = self.refiner_stage_config(refiner_num_inference_steps, refiner_guidance_scale)
        if (denoise_height, denoise_width) not in TRAINED_RESOLUTIONS:
            logger.warning(
                f"{denoise_height}x{denoise_width} is outside the trained resolutions {TRAINED_RESOLUTIONS}; "
                "expect lower quality."
            )
        if refine and (height, width) != REFINER_RESOLUTION:
            logger.warning(
                f"refiner output {height}x{width} differs from the trained {REFINER_RESOLUTION[0]}x{REFINER_RESOLUTION[1]}; "
                "expect lower quality."
            )

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

        # Context parallel: CP rank 0 alone encodes the image and the text and broadcasts them; it alone decodes.
        cp_group = getattr(self.transformer, "context_parallel_group", None)
        first_rank = cp_group is None or cp_group.rank == 0

        # 2. reference image (encoded first, like the reference engine)
        image_latents = None
        if image is not None and first_rank:
            pixels = self.preprocess_reference_image(image, denoise_height, denoise_width)
            image_latents = self.encode_reference_image(pixels).to(device)

        # 3. text; I2V prompts get the <Figure 1> reference and its pooled token from the same pass
        need_negative = self.do_classifier_free_guidance or (refine and refiner_config.guidance_scale != 1.0)
        if first_rank:
            prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask, image_embeds = (
                self._encode_conditioning(
                    prompts, negative_prompt, image, need_negative, num_videos_per_prompt, prompt_embeds,
                    negative_prompt_embeds, prompt_attention_mask, negative_prompt_attention_mask, image_embeds, device,
                )
            )
        if cp_group is not None:
            conditioning = [prompt_embeds, prompt_attention_mask, negative_prompt_embeds,
                            negative_prompt_attention_mask, image_embeds, image_latents]
            (prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask, image_embeds,
             image_latents) = broadcast_from_first_rank(conditioning, cp_group, device)
        if image_latents is not None:
            image_latents = image_latents.expand(num_videos, -1, -1, -1, -1)

        # 4. schedule and noise (one draw per video)
        video_scheduler, audio_scheduler, timesteps = self.prepare_timesteps(num_inference_steps, device)
        latents, audio_latents = self.prepare_latents(
            num_videos, denoise_height, denoise_width, device, generator, latents, audio_latents
        )

        # 5. denoise: one forward per step on [cond, uncond]
        tensors = dict(latents=latents, audio_latents=audio_latents, prompt_embeds=prompt_embeds,
                       negative_prompt_embeds=negative_prompt_embeds)
        steps = dict(callback_on_step_end=callback_on_step_end,
                     callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs)
        branch = "cond_uncond" if self.do_classifier_free_guidance else "cond"

        def predict(i, t, tensors, context):
            with context(branch):
                video, audio = self.predict_velocity(
                    tensors["latents"], tensors["audio_latents"], t, tensors["prompt_embeds"], prompt_attention_mask,
                    tensors["negative_prompt_embeds"], negative_prompt_attention_mask, image_latents, image_embeds,
                )
            return {"latents": video, "audio_latents": audio}

        schedulers = {"latents": video_scheduler, "audio_latents": audio_scheduler}
        self._denoise(self.transformer, timesteps, tensors, schedulers, predict, "Denoising", **steps)

        # 6. (1080p) refiner stage on the final preview video latent; the same generator continues,
        # so the re-noise is drawn after the preview's video and audio noise. Audio is not refined.
        fps = float(self.config.fps)
        if refine and not self.interrupt:

            def refiner_denoise(model, timesteps, stage_tensors, schedulers, predict):
                # the refiner denoises within the call's step table: its callbacks see the preview audio too
                tensors.update(stage_tensors)
                return self._denoise(model, timesteps, tensors, schedulers, predict, "Refining", **steps)

            tensors["latents"] = run_refiner_stage(
                self.refiner,
                tensors["latents"],
                tensors["prompt_embeds"],
                tensors["negative_prompt_embeds"],
                self.scheduler,
                height=height,
                width=width,
                prompt_attention_mask=prompt_attention_mask,
                negative_prompt_attention_mask=negative_prompt_attention_mask,
                config=refiner_config,
                generator=generator,
                attention_kwargs=attention_kwargs_for(self.refiner, attention_kwargs),
                denoise=refiner_denoise,
            )
            # 2T − 1 latents on the 25 fps timeline: twice the preview frame rate.
            fps = 2.0 * fps
        latents, audio_latents = tensors["latents"], tensors["audio_latents"]

        # 7. decode (under context parallelism on CP rank 0 only; the other ranks return no frames and no audio)
        if output_type == "latent":
            frames, audio, sample_rate, fps = latents, audio_latents, None, None
        elif not first_rank:
            frames, audio, sample_rate = None, None, self.audio_sample_rate
        else:
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
            sample_rate = self.audio_sample_rate

        self.maybe_free_model_hooks()
        if not return_dict:
            return (frames, audio)
        return Magi2PipelineOutput(frames=frames, audio=audio, audio_sample_rate=sample_rate, fps=fps)

    def _denoise(
        self, model, timesteps, tensors, schedulers, predict, description, callback_on_step_end,
        callback_on_step_end_tensor_inputs,
    ) -> dict:
        """The sampler of both stages: :func:`~diffusers_magi2.pipelines.sampling_magi2.denoise_steps`
        (cache context per forward) with the pipeline's progress bar, ``interrupt``, ``current_timestep``,
        ``num_timesteps`` and step callbacks ``fn(pipe, step, timestep, tensors)``; returns ``tensors``."""
        self._num_timesteps = len(timesteps)
        with self._stage_progress_bar(len(timesteps), description) as progress_bar:

            def predict_step(i, t, tensors, context):
                self._current_timestep = t
                return predict(i, t, tensors, context)

            def on_step_end(i, t, tensors):
                outputs = {}
                if callback_on_step_end is not None:
                    # explicit table, not locals(): a renamed local must not silently break the callback contract
                    inputs = {name: tensors[name] for name in callback_on_step_end_tensor_inputs}
                    outputs = callback_on_step_end(self, i, t, inputs) or {}
                progress_bar.update()
                return {name: value for name, value in outputs.items() if name in tensors}

            denoise_steps(model, timesteps, tensors, schedulers, predict_step, on_step_end=on_step_end,
                          skip_step=lambda: self.interrupt)
        self._current_timestep = None
        return tensors

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
        """One transformer forward and the CFG combination: v = v_u + g·(v_c − v_u), g = 5 (video) / 7 (audio).

        Args:
            latents, audio_latents: ``[B, 48, T, h, w]`` / ``[B, L, 64]`` noisy latents (fp32).
            t: the step's timestep on the 0–1000 scale (0-d or ``[1]`` tensor).
            prompt_embeds, prompt_attention_mask: ``[B, Lt, C]`` / ``[B, Lt]`` bool.
            negative_prompt_embeds, negative_prompt_attention_mask: the uncond text (unused without CFG).
            image_latents, image_embeds: ``[B, 48, 1, hi, wi]`` / ``[B, C]`` I2V conditioning or ``None``.

        Returns:
            guided ``(video [B, 48, T, h, w], audio [B, L, 64])`` velocities, fp32.

        Both halves share the noisy latents, the timestep (the scheduler's integer value, as a float
        on the 0–1000 scale), the reference image latents and the special-token embedding; they differ
        only in the text (each keeps its own length through the mask). Matches SandAI
        ``Magi2PreviewSampler.prepare_model_input``/``cfg_velocity`` with ``use_ref_for_uncond``.
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
        video = combine_guidance(video, batch, self.guidance_scale)
        return video, combine_guidance(audio, batch, self.audio_guidance_scale)