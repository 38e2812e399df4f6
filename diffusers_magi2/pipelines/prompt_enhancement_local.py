"""Prompt enhancement with a local transformers model, the way diffusers' LTX-2.5 prompt-enhancer step runs one.

A chat LLM (``AutoModelForCausalLM``) reads the request text through its tokenizer's chat template; an image-text
model (``AutoModelForImageTextToText``) reads the text and, for image-to-video, the image through its
``AutoProcessor``'s chat template. The message is SandAI's (:mod:`.prompt_enhancement_tasks`): one user turn, the
text, then the image. Decoding is greedy, under a fixed torch seed (the global generator is restored afterwards),
for at most ``max_new_tokens`` new tokens; the reply is the new tokens decoded without special tokens. There is no
constrained decoding, so the template must name the schema's fields (the package's templates do).
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import torch


__all__ = ["LocalModelClient", "pil_image"]


def pil_image(image: Any):
    """The image as an RGB PIL image for the processor: given, opened from a path, decoded from a data URL, or
    fetched from an http(s) URL (``diffusers.utils.load_image``).

    Raises:
        ValueError: A path that is not a file. TypeError: Another type.
    """
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, str) and image.startswith("data:"):
        return Image.open(io.BytesIO(base64.b64decode(image.split(",", 1)[1]))).convert("RGB")
    if isinstance(image, str) and image.startswith(("http://", "https://")):
        from diffusers.utils import load_image

        return load_image(image)
    if isinstance(image, (str, os.PathLike)):
        if not os.path.isfile(image):
            raise ValueError(f"The image to enhance the prompt with, {str(image)!r}, is not a file.")
        with Image.open(image) as opened:
            return opened.convert("RGB")
    raise TypeError(
        "The image to enhance the prompt with is a PIL image, a local path, or an http(s)/data URL; got "
        f"{type(image).__name__}."
    )


def _is_processor(tokenizer_or_processor: Any) -> bool:
    from transformers import ProcessorMixin

    return isinstance(tokenizer_or_processor, ProcessorMixin)


class LocalModelClient:
    """Generates the reply with a local model.

    Args:
        model (`str`, `os.PathLike` or `transformers.PreTrainedModel`): A path or Hub id, loaded on first use
            (``AutoModelForImageTextToText`` + ``AutoProcessor`` when its config is an image-text model's, else
            ``AutoModelForCausalLM`` + ``AutoTokenizer``, ``dtype="auto"``), or a loaded model.
        tokenizer_or_processor (*optional*): A loaded model's tokenizer or processor; else loaded from its path.
        max_new_tokens (`int`): The generation length.
        seed (`int`): The torch seed.
        device_map (`str` or `dict`, *optional*): transformers' ``device_map`` for a model loaded from its path.
        generate_kwargs (`dict`, *optional*): More arguments of ``generate``.

    Raises:
        ValueError: ``max_new_tokens`` not a positive int, ``seed`` not an int, no model, ``generate_kwargs`` that
            set what this client sets (``do_sample``, ``max_new_tokens``).
    """

    def __init__(
        self,
        model: Any,
        tokenizer_or_processor: Any,
        *,
        max_new_tokens: int,
        seed: int,
        device_map: str | dict | None = None,
        generate_kwargs: dict | None = None,
    ):
        if model is None:
            raise ValueError(
                "A local prompt enhancer needs a model: a path, a Hub id, or a loaded transformers model."
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens is an int >= 1; got {max_new_tokens!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed is an int; got {seed!r}.")
        generate_kwargs = dict(generate_kwargs or {})
        clashing = sorted({"do_sample", "max_new_tokens"} & set(generate_kwargs))
        if clashing:
            raise ValueError(
                f"generate_kwargs may not set {clashing}: decoding is greedy, and the length is max_new_tokens."
            )
        if isinstance(model, (str, os.PathLike)):
            self.path, self.model = os.fspath(model), None
        else:
            self.path, self.model = getattr(model, "name_or_path", None) or None, model
        self.tokenizer_or_processor = tokenizer_or_processor
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.device_map = device_map
        self.generate_kwargs = generate_kwargs

    @property
    def source(self) -> str:
        return f"the local model {self.path or type(self.model).__name__}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.path or type(self.model).__name__!r}, max_new_tokens={self.max_new_tokens})"

    def _load(self) -> None:
        """Loads what was given as a path: the model on first use, a missing tokenizer or processor."""
        import transformers

        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.path)
            image_text = type(config) in transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
            auto_model = transformers.AutoModelForImageTextToText if image_text else transformers.AutoModelForCausalLM
            self.model = auto_model.from_pretrained(self.path, dtype="auto", device_map=self.device_map)
        if self.tokenizer_or_processor is None:
            if self.path is None:
                raise ValueError(
                    f"{self.source} was passed without its tokenizer or processor and has no path to load one "
                    "from: pass tokenizer_or_processor=..."
                )
            image_text = type(self.model.config) in transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
            auto_class = transformers.AutoProcessor if image_text else transformers.AutoTokenizer
            self.tokenizer_or_processor = auto_class.from_pretrained(self.path)

    def complete(self, text: str, image: Any, task) -> str:
        """The reply text to ``text`` and, for I2V, ``image``.

        Raises:
            ValueError: An image for a model that has a tokenizer only (a text-only model); a bad image.
        """
        self._load()
        reader = self.tokenizer_or_processor
        if image is not None and not _is_processor(reader):
            raise ValueError(
                f"{self.source} reads text only (it has a {type(reader).__name__}, no processor), so it cannot "
                "enhance an image-to-video prompt: use an image-text model (AutoModelForImageTextToText with its "
                "AutoProcessor), or an endpoint, or enhance without the image."
            )
        if _is_processor(reader):
            content = [{"type": "text", "text": text}]
            if image is not None:
                content.append({"type": "image", "image": pil_image(image)})
        else:
            content = text
        inputs = reader.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        ).to(self.model.device)
        device = self.model.device
        forked = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked):
            torch.manual_seed(self.seed)
            output = self.model.generate(
                **inputs, do_sample=False, max_new_tokens=self.max_new_tokens, **self.generate_kwargs
            )
        new_tokens = output[0, inputs["input_ids"].shape[-1] :]
        return reader.decode(new_tokens, skip_special_tokens=True)
