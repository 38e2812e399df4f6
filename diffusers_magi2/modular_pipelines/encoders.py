"""Encoder blocks of MAGI-2: the text (prompt and negative prompt; SandAI ``Qwen35TextEncoder.encode`` with
the reference's templates, ``hidden_states[-3]``) and the I2V reference image (the Wan2.2 VAE mean latent,
normalised ``(mu - mean) / std``).

They run ``Magi2Pipeline``'s ``_encode_text_conditioning`` (which adds ``<Figure 1>`` to I2V prompts and pools its
tokens into ``image_embeds``), ``preprocess_reference_image`` and ``encode_reference_image``. Under context
parallelism only CP rank 0 encodes; :class:`~.before_denoise.Magi2BroadcastConditioningStep` shares the result.
"""

from __future__ import annotations

import torch
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam

from .before_denoise import call_input, call_inputs, first_rank
from .utils import Magi2Block, classic_steps, planned_inputs


__all__ = ["Magi2ImageEncoderStep", "Magi2TextEncoderStep"]

_TEXT_OUTPUTS = (
    ("prompt_embeds", "[B n, Lt, C] text features"),
    ("prompt_attention_mask", "[B n, Lt] bool"),
    ("negative_prompt_embeds", "[B n, Lt, C] negative text features (None without any CFG)"),
    ("negative_prompt_attention_mask", "[B n, Lt] bool"),
    ("image_embeds", "[B n, C] <Figure 1> token embedding (I2V)"),
)


class Magi2TextEncoderStep(Magi2Block):
    """Prompt and negative prompt features (``Magi2Pipeline._encode_text_conditioning``); I2V prompts get the
    ``<Figure 1>`` reference and its pooled token. Given embeddings pass through (repeated per video)."""

    description = (
        "Text encoder step: Qwen3.5 features of the prompt and of the negative prompt (SandAI's templates; "
        "I2V prompts with the <Figure 1> reference and its pooled token embedding)"
    )

    component_names = ("tokenizer", "text_encoder")

    @property
    def inputs(self) -> list[InputParam]:
        return [
            *call_inputs("prompt", "negative_prompt", "image", "num_videos_per_prompt"),
            *call_inputs("guidance_scale", "audio_guidance_scale"),
            InputParam("refiner_config", description="from the input step: the refiner's CFG needs the negative"),
            *(InputParam(name, type_hint=torch.Tensor) for name, _ in _TEXT_OUTPUTS),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [OutputParam(name, type_hint=torch.Tensor, description=text) for name, text in _TEXT_OUTPUTS]

    def run(self, components, bs) -> None:
        if first_rank(components):
            steps = classic_steps(components)
            prompts = None
            if bs.prompt is not None:
                prompts = [bs.prompt] if isinstance(bs.prompt, str) else list(bs.prompt)
            need_negative = (float(bs.guidance_scale) != 1.0 or float(bs.audio_guidance_scale) != 1.0) or (
                bs.refiner_config is not None and bs.refiner_config.guidance_scale != 1.0
            )
            (
                bs.prompt_embeds,
                bs.prompt_attention_mask,
                bs.negative_prompt_embeds,
                bs.negative_prompt_attention_mask,
                bs.image_embeds,
            ) = steps._encode_text_conditioning(
                {
                    "prompt": prompts,
                    "negative_prompt": bs.negative_prompt,
                    "num_videos_per_prompt": bs.num_videos_per_prompt,
                    "prompt_embeds": bs.prompt_embeds,
                    "negative_prompt_embeds": bs.negative_prompt_embeds,
                    "prompt_attention_mask": bs.prompt_attention_mask,
                    "negative_prompt_attention_mask": bs.negative_prompt_attention_mask,
                },
                bs.image,
                bs.image_embeds,
                need_negative,
                steps._execution_device,
            )


class Magi2ImageEncoderStep(Magi2Block):
    """The I2V image latent: ``Magi2Pipeline.preprocess_reference_image`` (letterbox to the preview size, the
    reference's dtype rounding) and ``encode_reference_image`` (normalised fp32 VAE mean)."""

    description = "Image encoder step: the I2V reference letterboxed to the preview size and encoded by the Wan2.2 VAE"

    component_names = ("vae",)

    @property
    def inputs(self) -> list[InputParam]:
        return [call_input("image", required=True), *planned_inputs("denoise_height", "denoise_width")]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [OutputParam("image_latents", type_hint=torch.Tensor, description="[1, 48, 1, h, w] fp32")]

    def run(self, components, bs) -> None:
        bs.image_latents = None
        if first_rank(components):
            steps = classic_steps(components)
            pixels = steps.preprocess_reference_image(bs.image, bs.denoise_height, bs.denoise_width)
            bs.image_latents = steps.encode_reference_image(pixels).to(steps._execution_device)
