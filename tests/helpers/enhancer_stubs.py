"""A scripted prompt enhancer for the pipeline tests: the ``enhancer(prompt, image=None) -> str`` interface of
``Magi2PromptEnhancer`` with a fixed rewrite, every call recorded, and a config-only save and load."""

from __future__ import annotations

from diffusers.configuration_utils import ConfigMixin, register_to_config


class ScriptedPromptEnhancer(ConfigMixin):
    """Returns ``reply`` with ``{prompt}`` replaced by the prompt and ``{task}`` by ``t2v`` / ``i2v``; raises
    ``RuntimeError(failure)`` instead when ``failure`` is set. ``calls`` holds ``(prompt, image)`` per call."""

    config_name = "prompt_enhancer_config.json"

    @register_to_config
    def __init__(self, reply: str = "# {task}\n\nsubject:{prompt}\n", failure: str | None = None):
        self.calls = []

    def __call__(self, prompt: str, image=None) -> str:
        self.calls.append((prompt, image))
        if self.config.failure:
            raise RuntimeError(self.config.failure)
        task = "t2v" if image is None else "i2v"
        return self.config.reply.replace("{prompt}", prompt).replace("{task}", task)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        self.save_config(save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder=None, **kwargs):
        return cls.from_config(cls.load_config(pretrained_model_name_or_path, subfolder=subfolder))
