"""Prompt enhancement in a MAGI-2 call (SandAI ``Magi2InferenceEngine``'s ``enhance_prompt`` step): with
``enable_prompt_enhancement=True`` each prompt of the call is rewritten once by the pipeline's ``prompt_enhancer``
(a :class:`~diffusers_magi2.Magi2PromptEnhancer`, or any callable ``enhancer(prompt, image=None) -> str``) before
anything is encoded, and the rewritten text is what the text encoder receives (an I2V prompt then gets the
``<Figure 1>`` reference, as any I2V prompt does).

- A prompt's videos (``num_videos_per_prompt``) share its one rewrite; the negative prompt is never rewritten; a
  JSON prompt is sent as its raw text (SandAI substitutes the user's string into the template as it is).
- Under context or expert parallelism the ranks of the transformer's group run one call together: the group's first
  rank alone asks the enhancer, and every rank receives its texts, or its error, in one ``all_gather_object``
  (:func:`~diffusers_magi2.parallel.distributed.first_message_of_ranks`), so an endpoint failure raises the same
  error on every rank and no rank waits in a later collective.

:class:`Magi2PromptEnhancementMixin` gives ``Magi2Pipeline`` the optional ``prompt_enhancer`` component's save and
load: diffusers saves only the classes it knows (models, schedulers, tokenizers ...), so the enhancer is written by
its own ``save_pretrained`` into ``prompt_enhancer/`` and read back by its ``from_pretrained``.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import PIL.Image
import torch.distributed as dist

from ..parallel.distributed import first_message_of_ranks


__all__ = [
    "PROMPT_ENHANCER",
    "Magi2PromptEnhancementMixin",
    "check_prompt_enhancement",
    "enhance_prompts",
    "load_saved_prompt_enhancer",
    "pop_prompt_enhancer",
    "prompt_enhancement_group",
]

#: The optional component's name (``model_index.json`` key and subfolder).
PROMPT_ENHANCER = "prompt_enhancer"

_HOW_TO_PROVIDE = (
    "set one with pipe.prompt_enhancer = Magi2PromptEnhancer.from_endpoint(base_url=..., model=...) (any "
    "OpenAI-compatible server) or Magi2PromptEnhancer.from_local_model(...), or pass prompt_enhancer=... to "
    "from_pretrained (a modular pipeline: pipe.update_components(prompt_enhancer=...))"
)

#: ``from_pretrained`` options that locate ``model_index.json``.
_HUB_OPTIONS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision")

#: The errors an enhancer documents; another type reaches the other ranks as a ``RuntimeError``.
_ERROR_TYPES = {error.__name__: error for error in (ValueError, RuntimeError, TypeError, ImportError)}


def check_prompt_enhancement(enhancer: Any, enable_prompt_enhancement: Any, prompt_embeds: Any) -> None:
    """Refuse a call that asks for prompt enhancement it cannot have, before any work.

    Args:
        enhancer: the pipeline's ``prompt_enhancer`` (``None`` when it has none).
        enable_prompt_enhancement: the call's flag (a bool).
        prompt_embeds: the call's ``prompt_embeds`` (enhancement rewrites text, so it needs ``prompt``).

    Raises:
        ValueError: a flag that is not a bool; ``True`` with ``prompt_embeds``; ``True`` without an enhancer (saying
            how to provide one).
    """
    if not isinstance(enable_prompt_enhancement, bool):
        raise ValueError(f"enable_prompt_enhancement must be True or False; got {enable_prompt_enhancement!r}")
    if not enable_prompt_enhancement:
        return
    if prompt_embeds is not None:
        raise ValueError(
            "enable_prompt_enhancement=True rewrites the prompt's text, so it takes prompt, not prompt_embeds: pass "
            "prompt, or encode the enhanced text yourself (pipe.enhance_prompt(prompt), then pipe.encode_prompt)"
        )
    if enhancer is None:
        raise ValueError(
            f"enable_prompt_enhancement=True needs a prompt enhancer and this pipeline has none: {_HOW_TO_PROVIDE}"
        )


def prompt_enhancement_group(transformer: Any) -> Any:
    """The process group whose ranks run one call together: the transformer's context-parallel group, else the
    expert-parallel group of its first MoE layer with ``ep_size > 1``, else ``None`` (one process)."""
    cp = getattr(transformer, "context_parallel_group", None)
    if cp is not None:
        return cp.group
    modules = transformer.modules() if hasattr(transformer, "modules") else ()
    return next((m.ep_group for m in modules if getattr(m, "ep_size", 1) > 1 and m.ep_group is not None), None)


def _enhancer_image(image: Any) -> Any:
    """The image as the enhancer takes it: a numpy ``[H, W, 3]`` uint8 array as a PIL image, else as given."""
    return PIL.Image.fromarray(image) if isinstance(image, np.ndarray) else image


def enhance_prompts(
    enhancer: Callable[..., str], prompts: list[str], image: Any = None, group: Any = None
) -> list[str]:
    """Each prompt rewritten once by ``enhancer`` (module docstring), on the first rank of ``group`` alone.

    Args:
        enhancer: ``enhancer(prompt, image=None) -> str`` (a ``Magi2PromptEnhancer``).
        prompts: the call's prompts (raw text; a JSON prompt as its string).
        image: the I2V reference (PIL, a path, or uint8 ``[H, W, 3]``), or ``None`` for text-to-video.
        group: the ranks of one call (:func:`prompt_enhancement_group`); every rank of it calls this together.

    Returns:
        the rewritten prompts, in order, equal on every rank.

    Raises:
        ValueError, RuntimeError, TypeError: the enhancer's error (an unreachable endpoint, a timeout, an HTTP
            error, a reply that is not a JSON object with the task's keys), raised on every rank of ``group`` with
            the first rank's message.
    """
    if group is None:
        return [enhancer(prompt, image=_enhancer_image(image)) for prompt in prompts]
    message = None
    failure: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            texts = [enhancer(prompt, image=_enhancer_image(image)) for prompt in prompts]
            message = json.dumps({"prompts": texts})
        except Exception as error:  # noqa: BLE001 - every rank must learn of it, then it is raised again
            failure = error
            message = json.dumps({"error": type(error).__name__, "message": str(error)})
    shared = json.loads(first_message_of_ranks(message, group))
    if "error" in shared:
        if failure is not None:
            raise failure
        raise _ERROR_TYPES.get(shared["error"], RuntimeError)(shared["message"])
    return shared["prompts"]


def load_saved_prompt_enhancer(
    pretrained_model_name_or_path: str | os.PathLike, config_dict: dict, hub_options: dict | None = None
) -> Any:
    """The enhancer a saved pipeline holds, or ``None``: the ``model_index.json`` entry ``[module, class]`` of
    :data:`PROMPT_ENHANCER` names the class, whose ``from_pretrained(path, subfolder="prompt_enhancer")`` reads
    it (a saved endpoint enhancer holds no API key: ``OPENAI_API_KEY`` gives it).

    Args:
        pretrained_model_name_or_path: the pipeline's folder or Hub id.
        config_dict: its ``model_index.json``.
        hub_options: the pipeline's Hub options (``revision``, ``token``, ``cache_dir``, ``local_files_only``, ...).
    """
    entry = config_dict.get(PROMPT_ENHANCER)
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] is None:
        return None
    module, class_name = entry
    cls = getattr(importlib.import_module(module), class_name)
    hub = {key: value for key, value in (hub_options or {}).items() if key != "proxies"}  # (no snapshot option)
    return cls.from_pretrained(pretrained_model_name_or_path, subfolder=PROMPT_ENHANCER, **hub)


def pop_prompt_enhancer(pipeline_cls: type, pretrained_model_name_or_path, kwargs: dict) -> Any:
    """``from_pretrained``'s enhancer: ``kwargs``' ``prompt_enhancer`` (popped), else the repo's saved one
    (:func:`load_saved_prompt_enhancer`); leaves ``prompt_enhancer=None`` in ``kwargs``, since diffusers' loader
    can neither load nor type-check a component of a class it does not know (it is registered after loading)."""
    if PROMPT_ENHANCER in kwargs:
        enhancer = kwargs.pop(PROMPT_ENHANCER)
    else:
        hub = {k: kwargs[k] for k in _HUB_OPTIONS if k in kwargs}
        config = pipeline_cls.load_config(pretrained_model_name_or_path, **hub)
        enhancer = load_saved_prompt_enhancer(pretrained_model_name_or_path, config, hub)
    kwargs[PROMPT_ENHANCER] = None
    return enhancer


class Magi2PromptEnhancementMixin:
    """``Magi2Pipeline``'s ``enhance_prompt`` and the save of its optional ``prompt_enhancer`` (module docstring)."""

    def enhance_prompt(self, prompt: str | list[str], image: Any = None) -> str | list[str]:
        """The prompt as ``enable_prompt_enhancement=True`` rewrites it (:func:`enhance_prompts`): the enhancer's
        Markdown, before the ``<Figure 1>`` reference an I2V call adds; reusable as ``prompt`` with the same image.

        Under context or expert parallelism every rank calls it together: the first rank asks the enhancer and every
        rank returns its text.

        Args:
            prompt: one prompt (raw text, or a JSON object string sent as it is), or a list.
            image: the I2V reference (PIL, a path, or uint8 ``[H, W, 3]``): the image-to-video task; ``None``:
                text-to-video.

        Returns:
            the rewritten prompt (a list for a list).

        Raises:
            ValueError: no ``prompt_enhancer`` (saying how to set one); the enhancer's ``ValueError`` /
                ``RuntimeError``, naming the endpoint and what was wrong, on every rank.
        """
        check_prompt_enhancement(getattr(self, PROMPT_ENHANCER, None), True, None)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        group = prompt_enhancement_group(getattr(self, "transformer", None))
        texts = enhance_prompts(self.prompt_enhancer, prompts, image, group)
        return texts[0] if isinstance(prompt, str) else texts

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``save_pretrained`` that also writes the ``prompt_enhancer`` (its own ``save_pretrained`` into
        ``prompt_enhancer/``, its ``[module, class]`` in ``model_index.json``), which diffusers alone would drop."""
        enhancer = getattr(self, PROMPT_ENHANCER, None)
        if enhancer is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        self.register_modules(**{PROMPT_ENHANCER: None})  # diffusers' loop saves only the classes it knows
        self._prompt_enhancer_to_save = enhancer
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.__dict__.pop("_prompt_enhancer_to_save", None)
            self.register_modules(**{PROMPT_ENHANCER: enhancer})

    def save_config(self, save_directory, *args, **kwargs):
        """The enhancer's folder, then ``model_index.json`` with its entry (and what the classes after this write)."""
        enhancer = self.__dict__.pop("_prompt_enhancer_to_save", None)
        if enhancer is not None:
            enhancer.save_pretrained(Path(save_directory) / PROMPT_ENHANCER)
            self.register_modules(**{PROMPT_ENHANCER: enhancer})
        super().save_config(save_directory, *args, **kwargs)
