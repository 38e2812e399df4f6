"""The text conditioning of a MAGI-2 call, shared by ``Magi2Pipeline`` and the modular text step (SandAI
``Magi2InferenceEngine.evaluate``'s prompt handling before the sampler).

Each prompt is encoded alone (:func:`~.text_encoding.encode_prompt_text`) and the batch zero-padded to the
longest (:func:`encode_prompts`). The negative pair is encoded only when guidance runs an unconditional branch,
from ``negative_prompt`` or the pipeline's default text, one per prompt (:func:`encode_prompt_pair`). An I2V prompt
first gets the ``<Figure 1>`` reference, and the mean feature of those tokens becomes ``image_embeds``
(:func:`encode_text_conditioning`). Every tensor is then repeated ``num_videos_per_prompt`` times, a prompt's rows
adjacent.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch

from .sampling_magi2 import pad_text_batch
from .text_encoding import add_figure_reference, encode_prompt_text, repeat_text_per_video


__all__ = [
    "FIGURE_TARGET",
    "Magi2PromptEncodingMixin",
    "encode_prompt_pair",
    "encode_prompts",
    "encode_text_conditioning",
]

#: The reference an I2V prompt mentions; its tokens' mean feature is the image special-token embedding.
FIGURE_TARGET = "<Figure 1>"

#: ``progress_bar(total=n)``: a tqdm-like context manager (a diffusers pipeline's ``progress_bar``).
ProgressBar = Callable[..., Any]


def _bar(progress_bar: ProgressBar | None, total: int):
    if progress_bar is None:
        return contextlib.nullcontext(types.SimpleNamespace(update=lambda: None))
    bar = progress_bar(total=total)
    bar.set_description("Encoding text")
    return bar


@torch.no_grad()
def encode_prompts(
    tokenizer: Any,
    text_encoder: torch.nn.Module,
    prompt: str | list[str],
    device: torch.device | str,
    max_sequence_length: int,
    skip_layers: int,
    figure_target: str | None = None,
    progress_bar: ProgressBar | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Qwen3.5 features of each prompt (SandAI ``Qwen35TextEncoder.encode``), zero-padded to the longest.

    Args:
        tokenizer, text_encoder: the pipeline's.
        prompt: one string or a list; each is normalised and tokenised alone (at most ``max_sequence_length``
            tokens, longer ones cut with a warning).
        device: where the text encoder runs.
        skip_layers: final layers skipped (features ``hidden_states[-(skip_layers + 1)]``).
        figure_target: e.g. ``"<Figure 1>"``: also return the mean feature of its tokens.
        progress_bar: a pipeline's ``progress_bar``, one step per prompt, labelled "Encoding text" (default: none).

    Returns:
        ``(embeds [B, Lt, C], mask [B, Lt] bool, target_embeds [B, C] or None)``.
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    features, pooled = [], []
    with _bar(progress_bar, len(prompts)) as bar:
        for text in prompts:
            f, target = encode_prompt_text(
                tokenizer, text_encoder, text, device, max_sequence_length, skip_layers, figure_target
            )
            features.append(f)
            pooled.append(target)
            bar.update()
    embeds, mask = pad_text_batch(features, [None] * len(features))
    return embeds, mask, (None if figure_target is None else torch.stack(pooled, 0))


@torch.no_grad()
def encode_prompt_pair(
    tokenizer: Any,
    text_encoder: torch.nn.Module,
    prompt: str | list[str] | None,
    *,
    default_negative_prompt: str,
    max_sequence_length: int,
    skip_layers: int,
    device: torch.device | str,
    negative_prompt: str | list[str] | None = None,
    do_classifier_free_guidance: bool = True,
    num_videos_per_prompt: int = 1,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    prompt_attention_mask: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    progress_bar: ProgressBar | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The prompt pair of a call (``Magi2Pipeline.encode_prompt``'s body, Wan / LTX-2 ``encode_prompt``).

    Args:
        prompt: ``B`` prompts, or ``None`` with ``prompt_embeds`` ``[B, Lt, C]`` and ``prompt_attention_mask``
            ``[B, Lt]``; the negative pair likewise (text ``negative_prompt``, else ``default_negative_prompt``).
        do_classifier_free_guidance: also encode the negative pair (when not given).
        num_videos_per_prompt: ``n``; each prompt's rows are repeated ``n`` times, adjacent.
        dtype: of the returned embeddings (default: the encoder's).
        Others: as :func:`encode_prompts`.

    Returns:
        ``(prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask)``,
        ``[B n, Lt, C]`` and ``[B n, Lt]`` bool on ``device`` (the negative pair ``None`` when neither encoded nor
        given).
    """
    encode = {"max_sequence_length": max_sequence_length, "skip_layers": skip_layers, "progress_bar": progress_bar}
    if prompt_embeds is None:
        prompt_embeds, prompt_attention_mask, _ = encode_prompts(tokenizer, text_encoder, prompt, device, **encode)
    if do_classifier_free_guidance and negative_prompt_embeds is None:
        negative = default_negative_prompt if negative_prompt is None else negative_prompt
        negatives = [negative] * prompt_embeds.shape[0] if isinstance(negative, str) else list(negative)
        negative_prompt_embeds, negative_prompt_attention_mask, _ = encode_prompts(
            tokenizer, text_encoder, negatives, device, **encode
        )
    prompt_embeds, prompt_attention_mask = repeat_text_per_video(
        prompt_embeds, prompt_attention_mask, num_videos_per_prompt, device, dtype
    )
    if negative_prompt_embeds is not None:
        negative_prompt_embeds, negative_prompt_attention_mask = repeat_text_per_video(
            negative_prompt_embeds, negative_prompt_attention_mask, num_videos_per_prompt, device, dtype
        )
    return prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask


@torch.no_grad()
def encode_text_conditioning(
    tokenizer: Any,
    text_encoder: torch.nn.Module,
    prompt: str | list[str] | None,
    *,
    image_to_video: bool,
    image_embeds: torch.Tensor | None = None,
    num_videos_per_prompt: int = 1,
    **pair: Any,
) -> list[torch.Tensor | None]:
    """The text conditioning of a call (module docstring): :func:`encode_prompt_pair` on ``pair``, an I2V prompt
    with the ``<Figure 1>`` reference and its pooled token.

    Args:
        prompt: ``B`` prompts, or ``None`` with ``prompt_embeds`` in ``pair``.
        image_to_video: the call has an ``image``.
        image_embeds: ``[B, C]`` given image special-token embedding (default: pooled from the I2V prompts).
        num_videos_per_prompt: ``n``.
        pair: the other arguments of :func:`encode_prompt_pair` (``default_negative_prompt``, ``device``, ...).

    Returns:
        ``[prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask,
        image_embeds]``, ``B n`` rows each (``image_embeds`` ``None`` for text-to-video).
    """
    if prompt is not None and image_to_video:
        prompts = [add_figure_reference(p) for p in ([prompt] if isinstance(prompt, str) else prompt)]
        options = {k: pair[k] for k in ("max_sequence_length", "skip_layers", "progress_bar") if k in pair}
        embeds, mask, pooled = encode_prompts(
            tokenizer, text_encoder, prompts, pair["device"], figure_target=FIGURE_TARGET, **options
        )
        prompt, pair = None, {**pair, "prompt_embeds": embeds, "prompt_attention_mask": mask}
        image_embeds = pooled if image_embeds is None else image_embeds
    text = encode_prompt_pair(tokenizer, text_encoder, prompt, num_videos_per_prompt=num_videos_per_prompt, **pair)
    if image_embeds is not None:
        image_embeds = image_embeds.to(pair["device"]).repeat_interleave(num_videos_per_prompt, 0)
    return [*text, image_embeds]


class Magi2PromptEncodingMixin:
    """``Magi2Pipeline``'s text methods over its ``tokenizer``, ``text_encoder`` and config (``max_sequence_length``,
    ``text_skip_layers``, ``negative_prompt``), each step of the encoding on the pipeline's progress bar."""

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
        options = self._text_options()
        return encode_prompts(
            self.tokenizer, self.text_encoder, prompt, device, figure_target=figure_target, **options
        )

    def _text_options(self) -> dict:
        """The text encoding settings of :mod:`~.text_conditioning`'s functions: config values and progress bar."""
        return {
            "max_sequence_length": int(self.config.max_sequence_length),
            "skip_layers": int(self.config.text_skip_layers),
            "progress_bar": self.progress_bar,
        }

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
        # named returns: diffusers' encode_prompt convention (its tests read the names from the source)
        prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask = (
            encode_prompt_pair(
                self.tokenizer,
                self.text_encoder,
                prompt,
                default_negative_prompt=self.config.negative_prompt,
                device=device or self._execution_device,
                negative_prompt=negative_prompt,
                do_classifier_free_guidance=do_classifier_free_guidance,
                num_videos_per_prompt=num_videos_per_prompt,
                prompt_embeds=prompt_embeds,
                negative_prompt_embeds=negative_prompt_embeds,
                prompt_attention_mask=prompt_attention_mask,
                negative_prompt_attention_mask=negative_prompt_attention_mask,
                dtype=dtype,
                **self._text_options(),
            )
        )
        return prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask
