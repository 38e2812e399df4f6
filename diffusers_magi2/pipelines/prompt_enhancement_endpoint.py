"""Prompt enhancement through an OpenAI-compatible chat-completions endpoint (the ``openai`` package).

Any server speaking OpenAI's chat-completions API works (image-to-video needs a model that reads images); the
``base_url`` and ``model`` to pass:

======================================================  ===================================================
server                                                  ``base_url``, ``model``
======================================================  ===================================================
vLLM, ``vllm serve <model> --port 8000``                ``http://127.0.0.1:8000/v1``, ``<model>``
SGLang, ``python -m sglang.launch_server ...``          ``http://127.0.0.1:30000/v1``, its ``--model-path``
llama.cpp, ``llama-server -m <file.gguf> --port 8080``  ``http://127.0.0.1:8080/v1``, any name
Ollama, ``ollama serve``                                ``http://localhost:11434/v1``, the model's tag
OpenAI                                                  ``None`` (the ``openai`` default), a model name
Gemini                                                  ``https://generativelanguage.googleapis.com/v1beta/openai/``,
                                                        a Gemini model (SandAI's: ``gemini-3.1-pro-preview``)
======================================================  ===================================================

The request is SandAI's (:mod:`.prompt_enhancement_tasks`): the task's schema as a strict ``json_schema``
``response_format``, ``max_tokens=16384`` (a server with a shorter context may refuse the request), and no temperature,
top-p or seed. The reply is ``choices[0].message.content``. A hosted endpoint receives the prompt and the image.

Where nothing is passed, the ``openai`` package's own environment variables apply: ``OPENAI_BASE_URL`` (else its
default, OpenAI's API) and ``OPENAI_API_KEY``; a server that needs no key gets the placeholder ``"EMPTY"``.
"""

from __future__ import annotations

import os
from typing import Any

from .prompt_enhancement_tasks import PromptEnhancementTask, user_message


__all__ = ["DEFAULT_MAX_TOKENS", "PLACEHOLDER_API_KEY", "EndpointClient"]

#: ``max_tokens`` of every request (SandAI's ``MAX_OUTPUT_TOKENS``).
DEFAULT_MAX_TOKENS = 16384
#: The key sent where neither ``api_key`` nor ``OPENAI_API_KEY`` gives one (local servers ignore it).
PLACEHOLDER_API_KEY = "EMPTY"


def _openai():
    try:
        import openai
    except ImportError as error:
        raise ImportError(
            "Prompt enhancement through an endpoint needs the `openai` package: pip install 'diffusers-magi2[enhance]'"
        ) from error
    return openai


class EndpointClient:
    """Sends one request per prompt to an OpenAI-compatible endpoint and returns the reply text.

    Args:
        base_url (`str`, *optional*): The endpoint, e.g. ``"http://127.0.0.1:8000/v1"``; else ``OPENAI_BASE_URL``.
        model (`str`): The model name the endpoint serves.
        api_key (`str`, *optional*): Else ``OPENAI_API_KEY``, else ``"EMPTY"``. Held by the ``openai`` client only.
        timeout (`float`): Seconds one request may take.
        max_retries (`int`): The ``openai`` client's retries of a failed connection, timeout or 408/409/429/5xx.

    Raises:
        ValueError: No model name, a timeout that is not positive, a negative ``max_retries``.
        ImportError: Without the ``openai`` package, at the first request (building the client needs no package).
    """

    def __init__(self, base_url: str | None, model: str | None, api_key: str | None, timeout: float, max_retries: int):
        if not model or not isinstance(model, str):
            raise ValueError(
                "An endpoint prompt enhancer needs the name of the model the endpoint serves: pass model=... (for "
                "example the name given to `vllm serve`, an Ollama tag, or a hosted model's name)."
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout is the seconds one request may take, a number > 0; got {timeout!r}.")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries is an int >= 0; got {max_retries!r}.")
        self.model = model
        self.timeout = float(timeout)
        self._settings = {
            "base_url": base_url,
            "api_key": api_key or os.environ.get("OPENAI_API_KEY") or PLACEHOLDER_API_KEY,
            "timeout": self.timeout,
            "max_retries": max_retries,
        }
        self._openai_client = None

    @property
    def _client(self):
        """The ``openai`` client, built on first use: a saved endpoint enhancer loads without the package."""
        if self._openai_client is None:
            self._openai_client = _openai().OpenAI(**self._settings)
        return self._openai_client

    @property
    def base_url(self) -> str:
        """The endpoint requests go to (``base_url`` or what the ``openai`` package resolves)."""
        return str(self._client.base_url)

    @property
    def source(self) -> str:
        return f"the endpoint {self.base_url} (model {self.model!r})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, model={self.model!r}, timeout={self.timeout})"

    def complete(self, text: str, image: Any, task: PromptEnhancementTask) -> str:
        """The reply text (``""`` for an empty message) to ``text`` and, for I2V, ``image``.

        Raises:
            RuntimeError: The endpoint could not be reached, did not answer within the timeout, answered an HTTP
                error, or sent no choice; the message names the endpoint and the model.
        """
        messages = user_message(text, image)
        openai = _openai()
        try:
            response = self._client.chat.completions.create(
                model=self.model,
                messages=messages,
                max_tokens=DEFAULT_MAX_TOKENS,
                response_format=task.response_format(),
            )
        except openai.APITimeoutError as error:
            raise RuntimeError(
                f"Prompt enhancement failed: {self.source} did not answer within {self.timeout:g} s (timeout=...)."
            ) from error
        except openai.APIConnectionError as error:
            raise RuntimeError(
                f"Prompt enhancement failed: {self.source} could not be reached "
                f"({'; '.join(str(reason) for reason in (error, error.__cause__) if reason)}). Is the server running "
                "at that address (base_url=... or OPENAI_BASE_URL)?"
            ) from error
        except openai.APIStatusError as error:
            raise RuntimeError(
                f"Prompt enhancement failed: {self.source} answered HTTP {error.status_code}: {error.message}"
            ) from error
        if not response.choices:
            raise RuntimeError(f"Prompt enhancement failed: {self.source} answered with no choice: {response}")
        return response.choices[0].message.content or ""
