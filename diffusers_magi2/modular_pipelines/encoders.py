"""Encoder blocks of MAGI-2: the prompt enhancer (``enable_prompt_enhancement``: each prompt rewritten once into
MAGI-2's structured caption, :func:`~diffusers_magi2.pipelines.enhancement_magi2.enhance_prompts`), the text (prompt and negative prompt; SandAI ``Qwen35TextEncoder.encode`` with
the reference's templates, ``hidden_states[-3]``) and the I2V reference image (the Wan2.2 VAE mean latent,
normalised ``(mu - mean) / std``).

They call the functions ``Magi2Pipeline`` calls: :func:`~diffusers_magi2.pipelines.text_conditioning.encode_text_conditioning`
(which adds ``<Figure 1>`` to I2V prompts and pools its tokens into ``image_embeds``), ``preprocess_reference_image``
and ``encode_reference_image``. The text step encodes the negative prompt when a guider of the call runs an
unconditional pass. Under context parallelism only CP rank 0 encodes;
:class:`~.before_denoise.Magi2BroadcastConditioningStep` shares the result.
"""

from __future__ import annotations

import torch
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam

from ..pipelines.enhancement_magi2 import PROMPT_ENHANCER, enhance_prompts, prompt_enhancement_group
from ..pipelines.image_processing_magi2 import (
    encode_reference_image,
    preprocess_reference_image,
    reference_image_processor,
)
from ..pipelines.text_conditioning import encode_text_conditioning
from ..utils.dtype_utils import parse_dtype
from .before_denoise import call_input, call_inputs, first_rank
from .guidance import uses_negative_prompt
from .utils import Magi2Block, pipeline_config, pipeline_geometry, planned_inputs


__all__ = ["Magi2ImageEncoderStep", "Magi2PromptEnhancerStep", "Magi2TextEncoderStep"]

_TEXT_OUTPUTS = (
    ("prompt_embeds", "[B n, Lt, C] text features"),
    ("prompt_attention_mask", "[B n, Lt] bool"),
    ("negative_prompt_embeds", "[B n, Lt, C] negative text features (None without any CFG)"),
    ("negative_prompt_attention_mask", "[B n, Lt] bool"),
    ("image_embeds", "[B n, C] <Figure 1> token embedding (I2V)"),
)


class Magi2PromptEnhancerStep(Magi2Block):
    """Each prompt rewritten once by the ``prompt_enhancer`` (``enhance_prompts``) into MAGI-2's structured caption,
    for the text encoder step after it; under context or expert parallelism the first rank asks and every rank
    gets its texts, or its error. The input step has already refused a call without an enhancer or with
    ``prompt_embeds``."""

    description = (
        "Prompt enhancer step: rewrites each prompt once into MAGI-2's structured Markdown caption with the "
        "prompt_enhancer (an OpenAI-compatible endpoint or a local model; the image-to-video task with `image`)"
    )

    component_names = (PROMPT_ENHANCER,)

    @property
    def inputs(self) -> list[InputParam]:
        return [call_input("prompt", required=True), *call_inputs("image", "enable_prompt_enhancement")]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [OutputParam("prompt", type_hint=list, description="the rewritten prompts (raw text before)")]

    def run(self, components, bs) -> None:
        prompts = [bs.prompt] if isinstance(bs.prompt, str) else list(bs.prompt)
        group = prompt_enhancement_group(getattr(components, "transformer", None))
        bs.prompt = enhance_prompts(getattr(components, PROMPT_ENHANCER), prompts, bs.image, group)


class Magi2TextEncoderStep(Magi2Block):
    """Prompt and negative prompt features (``encode_text_conditioning``); I2V prompts get the ``<Figure 1>``
    reference and its pooled token. Given embeddings pass through (repeated per video). The negative prompt is
    encoded when ``guider`` or ``audio_guider`` (or the refiner stage's guider) runs an unconditional pass."""

    description = (
        "Text encoder step: Qwen3.5 features of the prompt and, when a guider runs an unconditional pass, of the "
        "negative prompt (SandAI's templates; I2V prompts with the <Figure 1> reference and its pooled token "
        "embedding)"
    )

    component_names = ("tokenizer", "text_encoder", "guider", "audio_guider")
    config_names = ("negative_prompt", "max_sequence_length", "text_skip_layers")

    @property
    def inputs(self) -> list[InputParam]:
        return [
            *call_inputs("prompt", "negative_prompt", "image", "num_videos_per_prompt", "num_inference_steps"),
            InputParam(
                "refiner_config", description="from the input step: the refiner's guidance may need the negative"
            ),
            *(InputParam(name, type_hint=torch.Tensor) for name, _ in _TEXT_OUTPUTS),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [OutputParam(name, type_hint=torch.Tensor, description=text) for name, text in _TEXT_OUTPUTS]

    def run(self, components, bs) -> None:
        if not first_rank(components):
            return
        need_negative = any(
            uses_negative_prompt(guider, bs.num_inference_steps)
            for guider in (components.guider, components.audio_guider)
        )
        stage = bs.refiner_config
        if stage is not None and not need_negative:
            guider = components.guider.new(guidance_scale=stage.guidance_scale)
            need_negative = uses_negative_prompt(guider, stage.num_inference_steps)
        config = pipeline_config(components)
        (
            bs.prompt_embeds,
            bs.prompt_attention_mask,
            bs.negative_prompt_embeds,
            bs.negative_prompt_attention_mask,
            bs.image_embeds,
        ) = encode_text_conditioning(
            getattr(components, "tokenizer", None),
            getattr(components, "text_encoder", None),
            bs.prompt,
            image_to_video=bs.image is not None,
            image_embeds=bs.image_embeds,
            num_videos_per_prompt=bs.num_videos_per_prompt,
            default_negative_prompt=config["negative_prompt"],
            max_sequence_length=int(config["max_sequence_length"]),
            skip_layers=int(config["text_skip_layers"]),
            device=components._execution_device,
            negative_prompt=bs.negative_prompt,
            do_classifier_free_guidance=need_negative,
            prompt_embeds=bs.prompt_embeds,
            negative_prompt_embeds=bs.negative_prompt_embeds,
            prompt_attention_mask=bs.prompt_attention_mask,
            negative_prompt_attention_mask=bs.negative_prompt_attention_mask,
        )


class Magi2ImageEncoderStep(Magi2Block):
    """The I2V image latent: ``preprocess_reference_image`` (letterbox to the preview size, the reference's dtype
    rounding) and ``encode_reference_image`` (normalised fp32 VAE mean)."""

    description = "Image encoder step: the I2V reference letterboxed to the preview size and encoded by the Wan2.2 VAE"

    component_names = ("vae",)
    config_names = ("reference_image_dtype",)

    @property
    def inputs(self) -> list[InputParam]:
        return [call_input("image", required=True), *planned_inputs("denoise_height", "denoise_width")]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [OutputParam("image_latents", type_hint=torch.Tensor, description="[1, 48, 1, h, w] fp32")]

    def run(self, components, bs) -> None:
        bs.image_latents = None
        if first_rank(components):
            rounding = parse_dtype(pipeline_config(components)["reference_image_dtype"], "reference_image_dtype")
            processor = reference_image_processor(pipeline_geometry(components).spatial_scale)
            pixels = preprocess_reference_image(bs.image, bs.denoise_height, bs.denoise_width, processor, rounding)
            bs.image_latents = encode_reference_image(components.vae, pixels).to(components._execution_device)
