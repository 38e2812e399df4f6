"""Render the Hub model card (``README.md``) of a converted repository.

The template is the top-level ``model_card.md``, packaged through the symlink ``conversion/model_card.md``
(a wheel copies its target). Placeholders are ``{{ name }}``; an unfilled or unknown one fails.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources


__all__ = ["COMPONENTS", "format_parameter_count", "load_model_card_template", "model_summary", "render_model_card"]

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")

#: folder -> (library or defining module, class, what it was converted from): the model_index.json entries
#: (the tokenizer class is read from the converted ``tokenizer_config.json``) and the card's table.
COMPONENTS: dict[str, tuple[str, str, str]] = {
    "transformer": (
        "diffusers_magi2.models.transformer_magi2",
        "Magi2Transformer3DModel",
        "SandAI `preview/` (every tensor, renamed only)",
    ),
    "refiner": (
        "diffusers_magi2.models.transformer_magi2_refiner",
        "Magi2RefinerTransformer3DModel",
        "SandAI `refiner/` (every tensor, renamed only)",
    ),
    "vae": ("diffusers", "AutoencoderKLWan", "`vae/Wan2.2_VAE.pth`"),
    "video_decoder": (
        "diffusers_magi2.models.turbo_vae",
        "Magi2TurboVAEDecoder",
        "`turbo_vae/checkpoint.ckpt` (EMA weights)",
    ),
    "audio_vae": ("diffusers", "AutoencoderOobleck", "`stable-audio-open-1.0/` (`pretransform.model.*`)"),
    "text_encoder": ("transformers", "Qwen3_5TextModel", "`text_encoder/` (Qwen3.5-27B)"),
    "tokenizer": ("transformers", "PreTrainedTokenizerFast", "`text_encoder/`"),
    "scheduler": ("diffusers", "UniPCMultistepScheduler", "flow prediction, shift 7"),
    "prompt_enhancer": (
        "diffusers_magi2.pipelines.prompt_enhancement",
        "Magi2PromptEnhancer",
        "SandAI's `prompts/t2v.md`, `i2v.md` and endpoint defaults (`--sandai_code_dir`)",
    ),
}


def load_model_card_template() -> str:
    """Text of the top-level ``model_card.md`` (via the packaged resource).

    Raises:
        FileNotFoundError: the package was installed without it.
    """
    return resources.files("diffusers_magi2.conversion").joinpath("model_card.md").read_text(encoding="utf-8")


def render_model_card(values: Mapping[str, str], template: str | None = None) -> str:
    """Fill the ``{{ name }}`` placeholders of the model card.

    Args:
        values: placeholder -> text.
        template: card text; the shipped ``model_card.md`` when ``None``.

    Raises:
        ValueError: a placeholder has no value, or a value names no placeholder.
    """
    text = load_model_card_template() if template is None else template
    names = set(_PLACEHOLDER.findall(text))
    missing = sorted(names - set(values))
    unknown = sorted(set(values) - names)
    if missing or unknown:
        raise ValueError(
            f"model card placeholders: missing values for {missing}, values without a placeholder {unknown}"
        )
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


def components_table(components: list[str]) -> str:
    """Markdown table rows (``| folder | class | source |``) for the converted components."""
    rows = []
    for name in components:
        library, cls, src = COMPONENTS[name]
        shown = cls if library.startswith("diffusers_magi2") else f"{library}.{cls}"
        rows.append(f"| `{name}/` | `{shown}` | {src} |")
    return "\n".join(rows)


def format_parameter_count(count: int) -> str:
    """``count`` to three significant digits with a K/M/B suffix: 113,934,732,336 -> ``"114B"``, 1,234,567 -> ``"1.23M"``."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        rounded = float(f"{count / scale:.3g}")
        if rounded >= 1:
            return f"{rounded:g}{suffix}"
    return str(count)


def model_summary(transformer_parameters: int | None) -> str:
    """The card's description of the model: with the converted transformer's real parameter count, or without
    a count when no transformer was converted."""
    kind = "mixture-of-experts audio+video diffusion transformer"
    if transformer_parameters is None:
        return f"a {kind}"
    return f"a {format_parameter_count(transformer_parameters)}-parameter {kind}"
