"""Argument and component checks of a MAGI-2 call, shared by ``Magi2Pipeline`` (:class:`Magi2PipelineChecksMixin`)
and the modular input step: :func:`check_call_inputs`, :func:`check_component_fits` and the pure checks they run.

:func:`check_call_inputs` takes ``__call__``'s arguments by keyword, with the pipeline's components and config
given explicitly, and hands each concern only what it needs, so every bad argument raises a ``ValueError``
(``TypeError`` for none here) before any work starts. A component check reads only the components the pipeline
has: ``Magi2Pipeline`` has all eight (``None`` when not loaded); a modular pipeline has those its blocks declare.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np
import PIL.Image
from diffusers.utils import logging

from ..models.attention_magi2 import check_attention_kwargs
from .enhancement_magi2 import check_prompt_enhancement
from .geometry_magi2 import latent_geometry
from .image_processing_magi2 import IMAGE_TYPES
from .presets_magi2 import (
    CALLBACK_TENSOR_INPUTS,
    COMPONENT_NAMES,
    OUTPUT_TYPES,
    REFINER_RESOLUTION,
    TRAINED_RESOLUTIONS,
    resolve_stage_sizes,
)
from .refiner_stage import resolve_refiner_stage_config


logger = logging.get_logger(__name__)

__all__ = [
    "COMPONENT_FITS",
    "Magi2PipelineChecksMixin",
    "check_batch_sizes",
    "check_call_inputs",
    "check_component_fits",
    "check_guidance_scales",
    "check_per_video_inputs",
    "warn_untrained_sizes",
    "check_output_size",
    "check_negative_prompt_inputs",
    "check_prompt_inputs",
    "check_sampling_inputs",
    "check_sizes",
    "check_trained_resolutions",
]


def check_sizes(height, width, preview_height=None, preview_width=None) -> None:
    """``height``/``width`` (and the optional preview size) must be positive multiples of 16."""
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 (e.g. 256x448 or 512x896); got {value!r}")
    for name, value in (("preview_height", preview_height), ("preview_width", preview_width)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 16):
            raise ValueError(
                f"{name} must be a positive multiple of 16 (512x896 for the released model); got {value!r}"
            )


def check_output_size(output_height, output_width, output_type) -> None:
    """``output_height``/``output_width``: both or neither, positive ints, not with ``output_type='latent'``."""
    if (output_height is None) != (output_width is None):
        raise ValueError(
            "output_height and output_width go together (a bilinear resize of the decoded frames); "
            f"got output_height={output_height!r}, output_width={output_width!r}"
        )
    if output_height is not None:
        for name, value in (("output_height", output_height), ("output_width", output_width)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int (pixels, e.g. 1080x1920); got {value!r}")
        if output_type == "latent":
            raise ValueError(
                "output_height/output_width resize decoded frames; they are not allowed with output_type='latent'"
            )


def _check_embeds(name: str, embeds, mask) -> None:
    """``embeds`` (if given) is ``[B, Lt, C]`` with a ``[B, Lt]`` mask."""
    if embeds is None:
        return
    mask_name = name.replace("_embeds", "_attention_mask")
    if embeds.ndim != 3:
        raise ValueError(f"{name} must be [batch, tokens, channels]; got shape {tuple(embeds.shape)}")
    if mask is None:
        raise ValueError(f"{name} needs {mask_name} ([batch, tokens], true for real tokens)")
    if tuple(mask.shape) != tuple(embeds.shape[:2]):
        raise ValueError(f"{mask_name} must be {tuple(embeds.shape[:2])} to match {name}; got {tuple(mask.shape)}")


def check_prompt_inputs(prompt, prompt_embeds, prompt_attention_mask) -> None:
    """Exactly one of ``prompt``/``prompt_embeds``; non-empty strings; embeddings ``[B, Lt, C]`` with a matching
    ``[B, Lt]`` mask."""
    if prompt is not None and prompt_embeds is not None:
        raise ValueError("pass either prompt or prompt_embeds, not both")
    if prompt is None and prompt_embeds is None:
        raise ValueError("a prompt is required: pass prompt (a non-empty string or list of strings) or prompt_embeds")
    if prompt is not None:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(
                f"prompt must be a non-empty string or a non-empty list of strings; got {type(prompt).__name__}"
            )
        if any(not p.strip() for p in prompts):
            raise ValueError("prompt must not be empty or whitespace only")
    _check_embeds("prompt_embeds", prompt_embeds, prompt_attention_mask)


def check_negative_prompt_inputs(
    negative_prompt, negative_prompt_embeds, negative_prompt_attention_mask, prompt_embeds
) -> None:
    """At most one of ``negative_prompt``/``negative_prompt_embeds``; strings; embeddings ``[B, Lt, C]`` with a
    matching ``[B, Lt]`` mask and the batch of ``prompt_embeds``."""
    if negative_prompt is not None and negative_prompt_embeds is not None:
        raise ValueError("pass either negative_prompt or negative_prompt_embeds, not both")
    if negative_prompt is not None:
        negatives = [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt
        if not isinstance(negatives, list) or not all(isinstance(p, str) for p in negatives):
            raise ValueError("negative_prompt must be a string or a list of strings")
    _check_embeds("negative_prompt_embeds", negative_prompt_embeds, negative_prompt_attention_mask)
    if negative_prompt_embeds is not None:
        if prompt_embeds is not None and negative_prompt_embeds.shape[0] != prompt_embeds.shape[0]:
            raise ValueError(
                f"negative_prompt_embeds batch {negative_prompt_embeds.shape[0]} != prompt_embeds batch {prompt_embeds.shape[0]}"
            )


def check_sampling_inputs(num_inference_steps, num_videos_per_prompt) -> None:
    """Steps ≥ 1, videos per prompt ≥ 1."""
    for name, value in (
        ("num_inference_steps", num_inference_steps),
        ("num_videos_per_prompt", num_videos_per_prompt),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")


def check_guidance_scales(guidance_scale, audio_guidance_scale) -> None:
    """Finite guidance scales ≥ 0 (``Magi2Pipeline``'s; a modular pipeline's scales are its guiders')."""
    for name, value in (("guidance_scale", guidance_scale), ("audio_guidance_scale", audio_guidance_scale)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0 (1 disables guidance); got {value!r}")


def check_batch_sizes(prompt, prompt_embeds, negative_prompt, negative_prompt_embeds, image_embeds) -> int:
    """Every batched text input matches the prompt batch (checked before anything is encoded); returns that batch."""
    batch_size = len([prompt] if isinstance(prompt, str) else prompt) if prompt is not None else prompt_embeds.shape[0]
    if negative_prompt is not None and not isinstance(negative_prompt, str) and len(negative_prompt) != batch_size:
        raise ValueError(
            f"negative_prompt has {len(negative_prompt)} entries for a batch of {batch_size}: pass one string "
            f"or a list of {batch_size} strings"
        )
    for name, tensor in (("negative_prompt_embeds", negative_prompt_embeds), ("image_embeds", image_embeds)):
        if tensor is not None and tensor.shape[0] != batch_size:
            raise ValueError(
                f"{name} has batch {tensor.shape[0]}; it must equal the prompt batch {batch_size} "
                f"({_batch_source(prompt)})"
            )
    return batch_size


def check_per_video_inputs(prompt, batch_size, num_videos_per_prompt, latents, audio_latents, generator=None):
    """Given noise and a list of generators have one entry per video: ``batch_size x num_videos_per_prompt``."""
    videos, source = batch_size * num_videos_per_prompt, _batch_source(prompt)
    for name, tensor in (("latents", latents), ("audio_latents", audio_latents)):
        if tensor is not None and tensor.shape[0] != videos:
            raise ValueError(
                f"{name} has batch {tensor.shape[0]}; it must be one row per video: the prompt batch {batch_size} "
                f"({source}) x num_videos_per_prompt {num_videos_per_prompt} = {videos}"
            )
    if isinstance(generator, list) and len(generator) != videos:
        raise ValueError(
            f"generator is a list of {len(generator)} generators for {videos} videos (the "
            f"prompt batch {batch_size} x num_videos_per_prompt {num_videos_per_prompt}): pass one torch.Generator "
            f"or a list of exactly {videos}, one per video"
        )


def _batch_source(prompt) -> str:
    return "len(prompt)" if prompt is not None else "prompt_embeds.shape[0]"


def check_trained_resolutions(trained_resolutions) -> list[list[int]]:
    """The ``trained_resolutions`` config value as ``[[height, width], ...]``; raises ``ValueError`` unless it is a
    non-empty sequence of (height, width) pairs of positive ints."""
    try:
        pairs = [[int(h), int(w)] for h, w in trained_resolutions]
    except (TypeError, ValueError):
        pairs = []
    if not pairs or any(v <= 0 for pair in pairs for v in pair) or isinstance(trained_resolutions, str):
        raise ValueError(
            f"trained_resolutions must be a non-empty sequence of (height, width) pairs of positive ints, e.g. "
            f"{[list(r) for r in TRAINED_RESOLUTIONS]}; got {trained_resolutions!r}"
        )
    return pairs


def warn_untrained_sizes(
    refine: bool,
    height: int,
    width: int,
    denoise_height: int,
    denoise_width: int,
    trained_resolutions=TRAINED_RESOLUTIONS,
) -> None:
    """Warn (not raise) when the denoised size is not one of ``trained_resolutions`` (the pipeline's config value),
    or the refiner output not 1088x1920."""
    trained = [tuple(pair) for pair in check_trained_resolutions(trained_resolutions)]
    if (denoise_height, denoise_width) not in trained:
        logger.warning(
            f"{denoise_height}x{denoise_width} is outside the trained resolutions {tuple(trained)}; "
            "expect lower quality."
        )
    if refine and (height, width) != REFINER_RESOLUTION:
        logger.warning(
            f"refiner output {height}x{width} differs from the trained {REFINER_RESOLUTION[0]}x{REFINER_RESOLUTION[1]}; "
            "expect lower quality."
        )


def _config_value(component, field: str):
    config = getattr(component, "config", None)
    value = None if config is None else getattr(config, field, None)
    return None if value is None else int(value)


#: Component pairs whose widths must agree: ``(component, config field, model, config field, what)``.

COMPONENT_FITS = (
    ("vae", "z_dim", "transformer", "in_channels", "video latent channels"),
    ("video_decoder", "latent_channels", "transformer", "in_channels", "video latent channels"),
    ("audio_vae", "decoder_input_channels", "transformer", "audio_in_channels", "audio latent channels"),
    ("text_encoder", "hidden_size", "transformer", "text_in_channels", "text feature width"),
    ("vae", "z_dim", "refiner", "in_channels", "video latent channels"),
    ("video_decoder", "latent_channels", "refiner", "in_channels", "video latent channels"),
    ("text_encoder", "hidden_size", "refiner", "text_in_channels", "text feature width"),
    ("transformer", "in_channels", "refiner", "in_channels", "video latent channels"),
)


def check_component_fits(components: Mapping[str, Any]) -> None:
    """Each :data:`COMPONENT_FITS` pair present on both sides of ``components`` (name -> component) agrees.

    Raises:
        ValueError: naming both config fields and their values.
    """
    for component, field, model, model_field, what in COMPONENT_FITS:
        have = _config_value(components.get(component), field)
        want = _config_value(components.get(model), model_field)
        if have is not None and want is not None and have != want:
            raise ValueError(
                f"{component}.config.{field} is {have} but {model}.config.{model_field} is {want}: the {what} of "
                f"the {component} must equal the {model}'s; load components converted for the same MAGI-2 model"
            )


def check_call_inputs(
    components: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    pipeline_name: str = "Magi2Pipeline",
    callback_tensor_inputs: Sequence[str] = CALLBACK_TENSOR_INPUTS,
    prompt=None,
    negative_prompt=None,
    image=None,
    height=512,
    width=896,
    num_inference_steps=100,
    prompt_embeds=None,
    prompt_attention_mask=None,
    negative_prompt_embeds=None,
    negative_prompt_attention_mask=None,
    image_embeds=None,
    output_type="np",
    callback_on_step_end_tensor_inputs=None,
    latents=None,
    audio_latents=None,
    preview_height=None,
    preview_width=None,
    output_height=None,
    output_width=None,
    refiner_num_inference_steps=None,
    refiner_guidance_scale=None,
    attention_kwargs=None,
    num_videos_per_prompt=1,
    generator=None,
    enable_prompt_enhancement=False,
) -> None:
    """Reject a bad MAGI-2 call (``Magi2Pipeline.__call__``'s arguments, same names and defaults, but the guidance
    scales: :func:`check_guidance_scales`) with a ``ValueError`` before any work starts.

    Args:
        components: the pipeline's components by name (:data:`~.presets_magi2.COMPONENT_NAMES`; ``None`` for one
            not loaded). A name missing from the mapping is not part of this pipeline: nothing that needs it is
            checked (a modular pipeline of the text blocks alone has no decoder to require).
        config: the pipeline config (``preview_height``/``preview_width``, the ``refiner_*`` settings,
            ``sigma_start``, ``duration_s``, ``fps``, ``audio_latent_fps``).
        pipeline_name: named in the ``attention_kwargs`` errors.
        callback_tensor_inputs: what ``callback_on_step_end_tensor_inputs`` may name.
        The rest: the call's arguments (keyword only).

    Raises:
        ValueError: the rules listed under ``Raises`` in ``Magi2Pipeline.__call__``.
    """
    check_sizes(height, width, preview_height, preview_width)
    geometry = latent_geometry(
        components.get("vae"),
        components.get("video_decoder"),
        components.get("audio_vae"),
        duration_s=config["duration_s"],
        fps=config["fps"],
        audio_latent_fps=config["audio_latent_fps"],
    )
    default_preview = (int(config["preview_height"]), int(config["preview_width"]))
    refine, denoise_height, denoise_width = resolve_stage_sizes(
        height, width, preview_height, preview_width, default_preview
    )
    _check_refiner_inputs(
        components,
        resolve_refiner_stage_config(config, geometry.spatial_scale, None, refiner_guidance_scale).guidance_scale,
        refine,
        (height, width),
        refiner_num_inference_steps,
        refiner_guidance_scale,
        negative_prompt_embeds,
    )
    _check_attention_kwargs(components, pipeline_name, attention_kwargs, refine)
    check_output_size(output_height, output_width, output_type)
    check_sampling_inputs(num_inference_steps, num_videos_per_prompt)
    _check_output_inputs(output_type, callback_on_step_end_tensor_inputs, callback_tensor_inputs)
    check_prompt_inputs(prompt, prompt_embeds, prompt_attention_mask)
    check_prompt_enhancement(components.get("prompt_enhancer"), enable_prompt_enhancement, prompt_embeds)
    check_negative_prompt_inputs(
        negative_prompt, negative_prompt_embeds, negative_prompt_attention_mask, prompt_embeds
    )
    _check_image_inputs(components, image, prompt_embeds, image_embeds)
    # batch size and text width, checked here so that nothing is encoded before a mismatch raises
    batch = check_batch_sizes(prompt, prompt_embeds, negative_prompt, negative_prompt_embeds, image_embeds)
    check_per_video_inputs(prompt, batch, num_videos_per_prompt, latents, audio_latents, generator)
    _check_text_widths(components, prompt_embeds, negative_prompt_embeds, image_embeds)
    _check_latents_and_decoder(
        components, geometry, config, output_type, latents, audio_latents, refine, denoise_height, denoise_width
    )


def _check_refiner_inputs(
    components,
    stage_guidance_scale: float,
    refine: bool,
    size,
    refiner_num_inference_steps,
    refiner_guidance_scale,
    negative_prompt_embeds,
) -> None:
    """The two-stage path's component and settings (refused on a single-stage call)."""
    if refine and "refiner" in components and components["refiner"] is None:
        if tuple(size) == REFINER_RESOLUTION:
            what = "1088x1920 (1080p) is produced by the MAGI-2 refiner stage (preview at 512x896, then the refiner)"
        else:
            what = "preview_height/preview_width select the two-stage path (preview, then the refiner stage)"
        raise ValueError(
            f"{what}, which needs the `refiner` component (Magi2RefinerTransformer3DModel), and this pipeline has "
            "none: load a repo converted with the refiner or pass refiner=...; or use height=512, width=896 "
            "(or 256x448) without preview_height/preview_width"
        )
    if refine:
        if refiner_num_inference_steps is not None and (
            not isinstance(refiner_num_inference_steps, int)
            or isinstance(refiner_num_inference_steps, bool)
            or refiner_num_inference_steps < 1
        ):
            raise ValueError(
                f"refiner_num_inference_steps must be an integer >= 1 (released: 5); got {refiner_num_inference_steps!r}"
            )
        if refiner_guidance_scale is not None and (
            not isinstance(refiner_guidance_scale, (int, float))
            or isinstance(refiner_guidance_scale, bool)
            or not np.isfinite(refiner_guidance_scale)
            or refiner_guidance_scale < 0
        ):
            raise ValueError(
                f"refiner_guidance_scale must be a finite number >= 0 (released: 2.0); got {refiner_guidance_scale!r}"
            )
        if (
            stage_guidance_scale != 1.0
            and negative_prompt_embeds is None
            and (components.get("tokenizer") is None or components.get("text_encoder") is None)
        ):
            raise ValueError(
                f"the refiner stage runs CFG (refiner_guidance_scale={stage_guidance_scale}) and needs the negative "
                "prompt's embeddings even when the preview runs without CFG: pass negative_prompt_embeds and "
                "negative_prompt_attention_mask, or load the tokenizer and text_encoder"
            )
    elif refiner_num_inference_steps is not None or refiner_guidance_scale is not None:
        raise ValueError(
            "refiner_num_inference_steps/refiner_guidance_scale only apply to the two-stage refiner path "
            "(height=1088, width=1920, resolution='1080p', or preview_height/preview_width)"
        )


def _check_attention_kwargs(components, pipeline_name: str, attention_kwargs, refine: bool) -> None:
    """Every ``attention_kwargs`` key is declared by a model of this call (an undeclaring model checks its own)."""
    names = ("transformer", "refiner") if refine else ("transformer",)
    models = [components[name] for name in names if components.get(name) is not None]
    declared = [getattr(m, "supported_attention_kwargs", None) for m in models]
    if not models or any(d is None for d in declared):
        supported = list(attention_kwargs) if isinstance(attention_kwargs, dict) else []
    else:
        supported = sorted({k for d in declared for k in d})
    check_attention_kwargs(pipeline_name, attention_kwargs, supported)


def _check_output_inputs(output_type, callback_on_step_end_tensor_inputs, callback_tensor_inputs) -> None:
    """A known ``output_type``; callback tensor names from ``callback_tensor_inputs``."""
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {OUTPUT_TYPES}; got {output_type!r}")
    if callback_on_step_end_tensor_inputs is not None:
        bad = [k for k in callback_on_step_end_tensor_inputs if k not in callback_tensor_inputs]
        if bad:
            raise ValueError(
                f"callback_on_step_end_tensor_inputs may only name {list(callback_tensor_inputs)}; got {bad}"
            )


def _check_image_inputs(components, image, prompt_embeds, image_embeds) -> None:
    """``image`` type/shape/path, the ``vae`` it needs, and ``image_embeds`` (only with ``image``, ``[B, C]``,
    required with ``prompt_embeds``)."""
    if image is not None:
        if not isinstance(image, (PIL.Image.Image, str, os.PathLike, np.ndarray)):
            raise ValueError(f"image must be a {IMAGE_TYPES}; got {type(image).__name__}")
        if isinstance(image, np.ndarray) and (image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8):
            raise ValueError(f"a numpy image must be uint8 [H, W, 3] (RGB); got {image.dtype} {image.shape}")
        if isinstance(image, (str, os.PathLike)) and not os.path.isfile(image):
            raise ValueError(f"image path {os.fspath(image)!r} is not an existing file")
        if "vae" in components and components["vae"] is None:
            raise ValueError("image-to-video needs the `vae` component (AutoencoderKLWan) to encode the image")
        if prompt_embeds is not None and image_embeds is None:
            raise ValueError(
                "image with prompt_embeds also needs image_embeds (the <Figure 1> special-token embedding, "
                "[batch, channels]); or pass prompt instead of prompt_embeds"
            )
    elif image_embeds is not None:
        raise ValueError("image_embeds is only used with image (image-to-video); pass image too")
    if image_embeds is not None and image_embeds.ndim != 2:
        raise ValueError(f"image_embeds must be [batch, channels]; got shape {tuple(image_embeds.shape)}")


def _check_text_widths(components, prompt_embeds, negative_prompt_embeds, image_embeds) -> None:
    """Given embeddings have the ``text_in_channels`` of the transformer (and of the refiner)."""
    text_widths = {}
    for component in ("transformer", "refiner"):
        width = getattr(getattr(components.get(component), "config", None), "text_in_channels", None)
        if width is not None:
            text_widths[component] = int(width)
    for name, tensor in (
        ("prompt_embeds", prompt_embeds),
        ("negative_prompt_embeds", negative_prompt_embeds),
        ("image_embeds", image_embeds),
    ):
        if tensor is None:
            continue
        for component, width in text_widths.items():
            if tensor.shape[-1] != width:
                raise ValueError(
                    f"{name} has {tensor.shape[-1]} channels; {component}.config.text_in_channels allows "
                    f"only {width} (the text encoder's hidden size)"
                )


def _check_latents_and_decoder(
    components,
    geometry,
    config,
    output_type,
    latents,
    audio_latents,
    refine: bool,
    denoise_height: int,
    denoise_width: int,
) -> None:
    """A video decoder for decoded output; given latents fit the (preview) stage's size."""
    decoders = [name for name in ("video_decoder", "vae") if name in components]
    if output_type != "latent" and decoders and all(components[name] is None for name in decoders):
        raise ValueError("decoding needs `video_decoder` or `vae`; neither is loaded (use output_type='latent')")

    h, w = denoise_height // geometry.spatial_scale, denoise_width // geometry.spatial_scale
    channels, audio_channels = geometry.channels, geometry.audio_channels
    frames, audio_frames = geometry.num_frames, geometry.num_audio_latents
    clip = f"a config.duration_s={config['duration_s']} s clip"
    if latents is not None:
        if latents.ndim != 5 or latents.shape[1] != channels or tuple(latents.shape[3:]) != (h, w):
            stage = " (the preview stage of the refiner path)" if refine else ""
            raise ValueError(
                f"latents must be [batch, {channels}, T, {h}, {w}] for "
                f"{denoise_height}x{denoise_width}{stage}; got {tuple(latents.shape)}"
            )
        if latents.shape[2] != frames:
            raise ValueError(
                f"latents have {latents.shape[2]} latent frames; {clip} has {frames} "
                f"(config.fps={config['fps']}): pass latents of shape [batch, {channels}, "
                f"{frames}, {h}, {w}], or set the pipeline's duration_s to the clip the latents describe"
            )
    if audio_latents is not None:
        if audio_latents.ndim != 3 or audio_latents.shape[2] != audio_channels:
            raise ValueError(
                f"audio_latents must be [batch, {audio_frames}, {audio_channels}]; got {tuple(audio_latents.shape)}"
            )
        if audio_latents.shape[1] != audio_frames:
            raise ValueError(
                f"audio_latents have {audio_latents.shape[1]} latent frames; {clip} has {audio_frames} "
                f"(config.audio_latent_fps={config['audio_latent_fps']}): pass audio_latents of shape "
                f"[batch, {audio_frames}, {audio_channels}], or set the pipeline's duration_s"
            )
    if latents is not None and audio_latents is not None and latents.shape[0] != audio_latents.shape[0]:
        raise ValueError(f"latents batch {latents.shape[0]} != audio_latents batch {audio_latents.shape[0]}")


class Magi2PipelineChecksMixin:
    """``Magi2Pipeline``'s checks over its own components and config (mixed into the pipeline)."""

    def _component_map(self) -> dict[str, Any]:
        """Every component by name, ``None`` where not loaded."""
        return {name: getattr(self, name, None) for name in COMPONENT_NAMES}

    def check_inputs(self, *, guidance_scale=5.0, audio_guidance_scale=7.0, **call_arguments) -> None:
        """Reject bad ``__call__`` arguments (same names and defaults, by keyword) with a ``ValueError`` before any
        work starts: :func:`check_guidance_scales` and :func:`check_call_inputs`; the rules are listed under
        ``Raises`` in ``Magi2Pipeline.__call__``."""
        check_guidance_scales(guidance_scale, audio_guidance_scale)
        check_call_inputs(
            self._component_map(),
            self.config,
            pipeline_name=type(self).__name__,
            callback_tensor_inputs=self._callback_tensor_inputs,
            **call_arguments,
        )

    def _check_components(self) -> None:
        """:func:`check_component_fits` on this pipeline's components (at construction)."""
        check_component_fits(self._component_map())
