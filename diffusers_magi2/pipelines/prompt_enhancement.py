"""Prompt enhancement: a short prompt becomes the long structured caption MAGI-2 was trained on (SandAI
``inference/prompt_enhancement/``).

An LLM, behind an OpenAI-compatible endpoint or loaded locally with transformers, answers the task's template
(:mod:`.prompt_enhancement_tasks`) with a JSON object of the task's schema; the object is rendered to Markdown
(:func:`render_enhanced_prompt`), which is the prompt the pipeline encodes. For image-to-video the pipeline then
appends the ``<Figure 1>`` reference (``text_encoding.add_figure_reference``), as SandAI's engine does.

With a remote endpoint the prompt and the image leave the machine.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from diffusers.configuration_utils import ConfigMixin, register_to_config

from .prompt_enhancement_endpoint import EndpointClient
from .prompt_enhancement_markdown import render_enhanced_prompt
from .prompt_enhancement_tasks import (
    TASKS,
    TEMPLATE_FILE_NAMES,
    fill_template,
    parse_reply,
    resolve_templates,
    task_for,
)


__all__ = ["Magi2PromptEnhancer", "render_enhanced_prompt"]

KINDS = ("endpoint", "local")


class Magi2PromptEnhancer(ConfigMixin):
    r"""Turns a prompt (and, for image-to-video, its first frame) into MAGI-2's structured Markdown prompt.

    Build one with :meth:`from_endpoint` (any OpenAI-compatible server) or :meth:`from_local_model` (a transformers
    model), then call it: ``enhancer(prompt, image=None) -> str``. It is saved like a diffusers config
    (:meth:`save_pretrained` / :meth:`from_pretrained` of a folder): ``prompt_enhancer_config.json`` holds the kind,
    the base URL, the model (a local model's path, never its weights), the timeout and retries, the local
    generation length and seed; ``t2v.md`` and ``i2v.md`` beside it hold the templates. The API key is never
    written anywhere: pass it (or set ``OPENAI_API_KEY``) again when loading.

    Args:
        kind (`str`): ``"endpoint"`` or ``"local"``.
        base_url (`str`, *optional*): The endpoint (``kind="endpoint"``); else ``OPENAI_BASE_URL``.
        model (`str`, *optional*): The endpoint's model name, or a local model's path or Hub id.
        timeout (`float`, defaults to 180.0): Seconds one endpoint request may take.
        max_retries (`int`, defaults to 2): The ``openai`` client's retries of a failed request.
        max_new_tokens (`int`, defaults to 16384): A local model's generation length.
        seed (`int`, defaults to 0): The torch seed a local model generates under.
        device_map (`str` or `dict`, *optional*): Where a local model given as a path is loaded (transformers'
            ``device_map``, e.g. ``"cuda"``); by default the CPU.
        template (`str`, `os.PathLike` or `dict`, *optional*): The templates (see
            :func:`~diffusers_magi2.pipelines.prompt_enhancement_tasks.resolve_templates`); the package's by default.
            Not a config entry: saved as the ``t2v.md`` / ``i2v.md`` files.
        api_key (`str`, *optional*): The endpoint's key; else ``OPENAI_API_KEY``, else a placeholder. Never saved.
        local_model (`transformers.PreTrainedModel`, *optional*): A loaded local model (else ``model`` is loaded).
        tokenizer_or_processor (*optional*): Its tokenizer (text-only model) or processor (image-text model).
        generate_kwargs (`dict`, *optional*): More arguments of a local model's ``generate`` (e.g.
            ``logits_processor``). Not saved.
        template_folder (`str` or `os.PathLike`, *optional*): A folder whose ``t2v.md`` / ``i2v.md`` replace the
            package's templates (``from_pretrained`` passes the loaded folder).

    Raises:
        ValueError: An unknown ``kind``, an endpoint without a model name, a bad timeout / retries / generation
            length / seed, a template without ``{user_input_text}`` (see ``resolve_templates``).
    """

    config_name = "prompt_enhancer_config.json"
    ignore_for_config = [
        "template",
        "api_key",
        "local_model",
        "tokenizer_or_processor",
        "generate_kwargs",
        "template_folder",
    ]

    @register_to_config
    def __init__(
        self,
        kind: str = "endpoint",
        base_url: str | None = None,
        model: str | None = None,
        timeout: float = 180.0,
        max_retries: int = 2,
        max_new_tokens: int = 16384,
        seed: int = 0,
        device_map: str | dict | None = None,
        template: Any = None,
        api_key: str | None = None,
        local_model: Any = None,
        tokenizer_or_processor: Any = None,
        generate_kwargs: dict | None = None,
        template_folder: str | os.PathLike | None = None,
    ):
        if kind not in KINDS:
            raise ValueError(f"A prompt enhancer's kind is one of {KINDS}; got {kind!r}.")
        self.templates = resolve_templates(template, folder=template_folder)
        if kind == "endpoint":
            self.client = EndpointClient(base_url, model, api_key, timeout, max_retries)
        else:
            from .prompt_enhancement_local import LocalModelClient

            self.client = LocalModelClient(
                local_model if local_model is not None else model,
                tokenizer_or_processor,
                max_new_tokens=max_new_tokens,
                seed=seed,
                device_map=device_map,
                generate_kwargs=generate_kwargs,
            )

    @classmethod
    def from_endpoint(
        cls,
        base_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        template: Any = None,
        timeout: float = 180.0,
        max_retries: int = 2,
    ) -> "Magi2PromptEnhancer":
        """An enhancer asking an OpenAI-compatible chat-completions endpoint.

        Args:
            base_url (`str`, *optional*): E.g. ``"http://127.0.0.1:8000/v1"`` (vLLM, SGLang, llama.cpp),
                ``"http://localhost:11434/v1"`` (Ollama), ``"https://generativelanguage.googleapis.com/v1beta/openai/"``
                (Gemini); else ``OPENAI_BASE_URL``, else OpenAI's API.
            model (`str`): The model name the endpoint serves.
            api_key (`str`, *optional*): Else ``OPENAI_API_KEY``, else the placeholder ``"EMPTY"`` (for a local server).
            template (*optional*): See the class's ``template``.
            timeout (`float`, defaults to 180.0): Seconds one request may take.
            max_retries (`int`, defaults to 2): Retries of a failed connection, timeout or 408/409/429/5xx answer.

        Raises:
            ValueError: No model name, bad timeout or retries, a bad template. ImportError: without ``openai``, at the first request.
        """
        return cls(
            kind="endpoint",
            base_url=base_url,
            model=model,
            api_key=api_key,
            template=template,
            timeout=timeout,
            max_retries=max_retries,
        )

    @classmethod
    def from_local_model(
        cls,
        model: Any,
        tokenizer_or_processor: Any = None,
        template: Any = None,
        max_new_tokens: int = 16384,
        seed: int = 0,
        generate_kwargs: dict | None = None,
        device_map: str | dict | None = None,
    ) -> "Magi2PromptEnhancer":
        """An enhancer generating with a local transformers model (greedy, seeded).

        A chat LLM (``AutoModelForCausalLM`` with its tokenizer's chat template) enhances text-to-video prompts; an
        image-text model (``AutoModelForImageTextToText`` with its ``AutoProcessor``) enhances both tasks.

        Args:
            model (`str`, `os.PathLike` or `transformers.PreTrainedModel`): A path or Hub id (loaded on first use,
                as an image-text model when its config is one, else as a causal LM), or a loaded model.
            tokenizer_or_processor (*optional*): The loaded model's tokenizer or processor; by default loaded from
                the model's path.
            template (*optional*): See the class's ``template``.
            max_new_tokens (`int`, defaults to 16384): The generation length.
            seed (`int`, defaults to 0): The torch seed generation runs under (the global generator is restored).
            generate_kwargs (`dict`, *optional*): More ``generate`` arguments (e.g. ``logits_processor``).
            device_map (`str` or `dict`, *optional*): Where a model given as a path is loaded (transformers'
                ``device_map``, e.g. ``"cuda"``; saved); by default the CPU. A loaded model stays where it is.

        Raises:
            ValueError: A bad length or seed, a bad template, a loaded model without a tokenizer or processor and
                without a path to load one from.
        """
        if isinstance(model, (str, os.PathLike)):
            path, local_model = os.fspath(model), None
        else:
            path, local_model = getattr(model, "name_or_path", None) or None, model
        return cls(
            kind="local",
            model=path,
            max_new_tokens=max_new_tokens,
            seed=seed,
            device_map=device_map,
            template=template,
            local_model=local_model,
            tokenizer_or_processor=tokenizer_or_processor,
            generate_kwargs=generate_kwargs,
        )

    def __call__(self, prompt: str, image: Any = None) -> str:
        """The enhanced prompt: the LLM's reply rendered to Markdown (before the pipeline's ``<Figure 1>`` step).

        Args:
            prompt (`str`): The user's prompt, sent as it is.
            image (`PIL.Image.Image`, `str` or `os.PathLike`, *optional*): The first frame: image-to-video when
                given, else text-to-video.

        Returns:
            `str`: The Markdown (:func:`render_enhanced_prompt`).

        Raises:
            TypeError: A prompt that is not a str.
            ValueError: A reply that is not a JSON object with the task's required keys; an image for a text-only
                local model; a bad image.
            RuntimeError: The endpoint could not be reached, timed out, or answered an HTTP error.
            Each message names the endpoint (or local model) and what was wrong.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"The prompt to enhance is a str; got {type(prompt).__name__}.")
        task = task_for(image)
        text = self.client.complete(fill_template(self.templates[task.name], prompt), image, task)
        return render_enhanced_prompt(parse_reply(text, task, self.client.source))

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Writes ``prompt_enhancer_config.json``, ``t2v.md`` and ``i2v.md`` into ``save_directory`` (each file
        written to a temporary name, then renamed). The API key is not written.

        Raises:
            ValueError: A local enhancer built from a loaded model that has no path (``name_or_path``).
        """
        if self.config.kind == "local" and not self.config.model:
            raise ValueError(
                "This local prompt enhancer's model was passed as an object without a path (name_or_path), so a "
                "saved enhancer could not find it: save the model with save_pretrained and build the enhancer from "
                "that folder."
            )
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        files = {self.config_name: self.to_json_string()}
        files.update({TEMPLATE_FILE_NAMES[task]: self.templates[task] for task in TASKS})
        for name, text in files.items():
            with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, delete=False, suffix=".tmp") as file:
                file.write(text)
            os.replace(file.name, folder / name)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        subfolder: str | None = None,
        api_key: str | None = None,
        revision: str | None = None,
        variant: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
        **kwargs,
    ) -> "Magi2PromptEnhancer":
        """Loads a saved enhancer from a local folder (or a Hub repository's ``subfolder``).

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): The folder (or Hub id).
            subfolder (`str`, *optional*): E.g. ``"prompt_enhancer"`` in a pipeline's repository.
            api_key (`str`, *optional*): The endpoint's key (never saved); else ``OPENAI_API_KEY``.
            revision (`str`, *optional*): The Hub revision. variant: unused (an enhancer has no weights); taken
                because diffusers' modular ``load_components`` passes both to every component.
            cache_dir, force_download, local_files_only, token: ``huggingface_hub.snapshot_download``'s, for a Hub
                id (a pipeline's ``from_pretrained`` passes its own).
            kwargs: Overrides of the class's arguments (``base_url=``, ``model=``, ``timeout=``, ``template=``,
                ``local_model=``, ...).

        Raises:
            TypeError: An argument the class does not take.
        """
        folder = Path(pretrained_model_name_or_path)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            pattern = f"{subfolder}/*" if subfolder else "*"
            hub = {"revision": revision, "cache_dir": cache_dir, "token": token}
            folder = Path(
                snapshot_download(
                    os.fspath(pretrained_model_name_or_path),
                    allow_patterns=[pattern],
                    force_download=force_download,
                    local_files_only=local_files_only,
                    **{key: value for key, value in hub.items() if value is not None},
                )
            )
        if subfolder:
            folder = folder / subfolder
        config = {key: value for key, value in cls.load_config(folder).items() if not key.startswith("_")}
        return cls(**{**config, "template_folder": folder, "api_key": api_key, **kwargs})
