"""The two prompt-enhancement tasks: what an LLM is asked for a MAGI-2 prompt, and what its reply must be.

As SandAI's enhancer (``inference/prompt_enhancement/enhancer.py``) asks:

- **Task.** Image-to-video (``"i2v"``) when an image is given, else text-to-video (``"t2v"``). Each has its own
  response schema (``prompt_enhancement_data/<task>_response_schema.json``, SandAI ``pe_schemas.py``) and its
  own template.
- **Request text.** The task's template with every ``{user_input_text}`` replaced by the raw prompt, then every
  ``{variation_seed}`` replaced by ``""`` (so one typed inside the prompt goes too).
- **Message.** One ``user`` message, no system message, whose content is a list of parts even for T2V: the text,
  then for I2V the image as an ``image_url`` part. A path is sent as its own bytes in a data URL whose mime type
  comes from the suffix alone (``.png``, ``.webp``, anything else ``image/jpeg``); a PIL image as RGB JPEG with
  PIL's defaults; an ``http(s)://`` or ``data:`` URL as it is.
- **Reply.** Parsed by ``json.loads`` as it is (no code-fence stripping); it must be a JSON object holding the
  schema's required top-level keys. Nothing else is checked: other keys are rendered like any key.

Templates (``template=`` of :class:`~diffusers_magi2.pipelines.prompt_enhancement.Magi2PromptEnhancer`): the package
ships short instructions of its own, ``prompt_enhancement_data/t2v.md`` and ``i2v.md``, each naming every field of
its schema. SandAI's long templates (its ``prompts/`` folder) or any other text work the same way.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


__all__ = [
    "IMAGE_TO_VIDEO",
    "TASKS",
    "TEMPLATE_FILE_NAMES",
    "TEXT_TO_VIDEO",
    "USER_INPUT_PLACEHOLDER",
    "VARIATION_SEED_PLACEHOLDER",
    "PromptEnhancementTask",
    "fill_template",
    "image_url",
    "parse_reply",
    "resolve_templates",
    "task_for",
    "user_message",
]

USER_INPUT_PLACEHOLDER = "{user_input_text}"
VARIATION_SEED_PLACEHOLDER = "{variation_seed}"
DATA_DIR = Path(__file__).resolve().parent / "prompt_enhancement_data"
#: Where a template folder (SandAI's ``prompts/``, a saved enhancer, the package's defaults) keeps each task's text.
TEMPLATE_FILE_NAMES = {"t2v": "t2v.md", "i2v": "i2v.md"}
_IMAGE_MIME_TYPES = {".png": "image/png", ".webp": "image/webp"}
#: Characters of a bad reply quoted in an error.
_QUOTED_REPLY_CHARS = 300


@dataclass(frozen=True)
class PromptEnhancementTask:
    """One task: its name, the name its schema is sent under, and the schema (package data)."""

    name: str
    schema_name: str

    @property
    def schema(self) -> dict:
        return _load_schema(self.name)

    @property
    def required_keys(self) -> tuple[str, ...]:
        """The reply's required top-level keys (the schema's ``required``)."""
        return tuple(self.schema["required"])

    def response_format(self) -> dict:
        """The chat-completions ``response_format``: the schema, strict."""
        return {
            "type": "json_schema",
            "json_schema": {"name": self.schema_name, "schema": self.schema, "strict": True},
        }


@functools.lru_cache(maxsize=None)
def _load_schema(task_name: str) -> dict:
    return json.loads((DATA_DIR / f"{task_name}_response_schema.json").read_text(encoding="utf-8"))


TEXT_TO_VIDEO = PromptEnhancementTask("t2v", "T2VEnhanceResult")
IMAGE_TO_VIDEO = PromptEnhancementTask("i2v", "I2VEnhanceResult")
TASKS = {task.name: task for task in (TEXT_TO_VIDEO, IMAGE_TO_VIDEO)}


def task_for(image: Any) -> PromptEnhancementTask:
    """I2V when an image is given, else T2V."""
    return TEXT_TO_VIDEO if image is None else IMAGE_TO_VIDEO


def fill_template(template: str, prompt: str) -> str:
    """The request text: ``{user_input_text}`` becomes ``prompt``, then ``{variation_seed}`` becomes ``""``."""
    return template.replace(USER_INPUT_PLACEHOLDER, prompt).replace(VARIATION_SEED_PLACEHOLDER, "")


def _checked(text: str, origin: str) -> str:
    if USER_INPUT_PLACEHOLDER not in text:
        raise ValueError(
            f"The prompt-enhancement template {origin} has no {USER_INPUT_PLACEHOLDER} placeholder, so the user's "
            f"prompt would never reach the LLM. A template is a text (or a file, or a folder of "
            f"{' and '.join(TEMPLATE_FILE_NAMES.values())}) with {USER_INPUT_PLACEHOLDER} where the prompt goes and "
            f"optionally {VARIATION_SEED_PLACEHOLDER}."
        )
    return text


def _folder_templates(folder: Path, *, required: bool) -> dict[str, str]:
    found = {
        task: _checked((folder / name).read_text(encoding="utf-8"), f"file {folder / name}")
        for task, name in TEMPLATE_FILE_NAMES.items()
        if (folder / name).is_file()
    }
    if required and not found:
        raise ValueError(
            f"The prompt-enhancement template folder {folder} holds neither of "
            f"{', '.join(TEMPLATE_FILE_NAMES.values())}."
        )
    return found


def _templates_from(template: Any) -> dict[str, str]:
    """The task texts one ``template=`` value names (a task it leaves out keeps the package default)."""
    if isinstance(template, Mapping):
        unknown = sorted(set(template) - set(TASKS))
        if unknown:
            raise ValueError(f"Prompt-enhancement templates are keyed by task, {sorted(TASKS)}; got {unknown}.")
        return {task: _single_template(value, task) for task, value in template.items()}
    if isinstance(template, (str, os.PathLike)) and USER_INPUT_PLACEHOLDER not in str(template):
        path = Path(template).expanduser()
        if path.is_dir():
            return _folder_templates(path, required=True)
    return dict.fromkeys(TASKS, _single_template(template, "both tasks"))


def _single_template(template: Any, task: str) -> str:
    if not isinstance(template, (str, os.PathLike)):
        raise TypeError(
            f"A prompt-enhancement template for {task} is a str (the text, or a path) or an os.PathLike; got "
            f"{type(template).__name__}."
        )
    if USER_INPUT_PLACEHOLDER in str(template):
        return str(template)
    path = Path(template).expanduser()
    if not path.is_file():
        _checked(str(template), f"given for {task} (not a path to a file either)")
    return _checked(path.read_text(encoding="utf-8"), f"file {path}")


def resolve_templates(template: Any = None, folder: str | os.PathLike | None = None) -> dict[str, str]:
    """The template text of each task, checked.

    Args:
        template (`str`, `os.PathLike` or `Mapping[str, str | os.PathLike]`, *optional*):
            A text with ``{user_input_text}`` (and optionally ``{variation_seed}``), used for both tasks; a path to
            such a file, used for both; a folder holding ``t2v.md`` and/or ``i2v.md`` (SandAI's ``prompts/``
            folder, a saved enhancer); or ``{"t2v": ..., "i2v": ...}`` of texts or files. ``None``: the package's.
        folder (`str` or `os.PathLike`, *optional*):
            A saved enhancer's folder: its ``t2v.md`` / ``i2v.md`` replace the package's, ``template`` replaces both.

    Returns:
        `dict[str, str]`: ``{"t2v": text, "i2v": text}``.

    Raises:
        ValueError: A template without ``{user_input_text}``, a string that is neither a template nor an existing
            path, a folder with neither file, a mapping with a key other than ``"t2v"`` / ``"i2v"``.
        TypeError: A template of another type.
    """
    templates = _folder_templates(DATA_DIR, required=True)
    if folder is not None:
        templates.update(_folder_templates(Path(folder), required=False))
    if template is not None:
        templates.update(_templates_from(template))
    return templates


def image_url(image: Any) -> str:
    """The ``image_url`` SandAI sends for an image (the module docstring's rules).

    Args:
        image (`PIL.Image.Image`, `str` or `os.PathLike`): An in-memory image, a local path, or an
            ``http(s)://`` / ``data:`` URL.

    Raises:
        ValueError: A path that is not a file. TypeError: Another type.
    """
    if isinstance(image, str) and image.startswith(("http://", "https://", "data:")):
        return image
    if isinstance(image, (str, os.PathLike)):
        path = Path(image).expanduser()
        if not path.is_file():
            raise ValueError(f"The image to enhance the prompt with, {str(image)!r}, is not a file.")
        mime, data = _IMAGE_MIME_TYPES.get(path.suffix.lower(), "image/jpeg"), path.read_bytes()
    elif hasattr(image, "convert") and hasattr(image, "save"):
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="JPEG")
        mime, data = "image/jpeg", buffer.getvalue()
    else:
        raise TypeError(
            "The image to enhance the prompt with is a PIL image, a local path, or an http(s)/data URL; got "
            f"{type(image).__name__}."
        )
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def user_message(text: str, image: Any = None) -> list[dict]:
    """The chat ``messages``: one user message whose content is the text part and, for I2V, the image part."""
    content: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image_url(image)}})
    return [{"role": "user", "content": content}]


def _quoted(text: str) -> str:
    return repr(text if len(text) <= _QUOTED_REPLY_CHARS else text[:_QUOTED_REPLY_CHARS] + "...")


def parse_reply(text: str, task: PromptEnhancementTask, source: str) -> dict:
    """The reply as a JSON object holding ``task``'s required keys.

    Args:
        text (`str`): The LLM's reply.
        task (`PromptEnhancementTask`): What was asked.
        source (`str`): Who replied, for the error (e.g. ``"endpoint http://127.0.0.1:8000/v1/ (model 'm')"``).

    Raises:
        ValueError: The reply is not JSON, not an object, or lacks a required key; the message names ``source``,
            what was wrong and the start of the reply.
    """
    try:
        reply = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"Prompt enhancement failed: {source} replied with text that is not JSON ({error}); a {task.name} reply "
            f"is one JSON object with the keys {list(task.required_keys)}. The reply began {_quoted(text)}."
        ) from None
    if not isinstance(reply, dict):
        raise ValueError(
            f"Prompt enhancement failed: {source} replied with a JSON {type(reply).__name__}, not an object; a "
            f"{task.name} reply is one JSON object with the keys {list(task.required_keys)}. The reply began "
            f"{_quoted(text)}."
        )
    missing = [key for key in task.required_keys if key not in reply]
    if missing:
        raise ValueError(
            f"Prompt enhancement failed: the {task.name} reply of {source} lacks the required key(s) {missing} "
            f"(it has {list(reply)}; required: {list(task.required_keys)})."
        )
    return reply
