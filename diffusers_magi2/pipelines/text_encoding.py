"""MAGI-2 prompt handling (SandAI ``qwen35.py`` ``Qwen35TextEncoder`` and ``Magi2InferenceEngine``'s prompt edits).

In the pipeline's order: I2V prompts mention ``<Figure 1>`` (:func:`add_figure_reference`); JSON prompts become
compact markdown (:func:`normalize_prompt`); the tokenizer gets SandAI's extra CJK pre-tokenizer split; tokens
(right padding, at most 7,000, no chat template) give ``hidden_states[-3]``; the image special-token embedding
is the mean feature of the tokens overlapping ``<Figure 1>``.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

import torch
from diffusers.utils import logging


logger = logging.get_logger(__name__)

__all__ = [
    "repeat_text_per_video",
    "CJK_SPLIT_PATTERN",
    "DEFAULT_MAX_SEQUENCE_LENGTH",
    "DEFAULT_SKIP_LAYERS",
    "FIGURE_REFERENCE_TEXT",
    "add_figure_reference",
    "apply_cjk_pre_tokenizer_split",
    "encode_prompt_features",
    "encode_prompt_text",
    "find_target_token_indices",
    "has_cjk_pre_tokenizer_split",
    "json_to_compact_markdown",
    "normalize_prompt",
    "pool_target_features",
    "tokenize_prompt",
]

#: SandAI's CJK isolation pattern, character for character. Oniguruma reads ``\U0002...`` as the literal range
#: ``0``-``U``, so the split also isolates digits, ``:;<=>?@`` and ``A``-``U``, and not CJK Extension B; the
#: released model was trained on those token ids, so the quirk stays (do not "fix" it with Python ``re``).
CJK_SPLIT_PATTERN = (
    r"([\u1100-\u11ff\u2e80-\ua4cf\ua840-\uD7AF\uF900-\uFAFF\uFE30-\uFE4F\uFF65-\uFFDC"
    r"\U00020000-\U0002FFFF])"
)

DEFAULT_MAX_SEQUENCE_LENGTH = 7000
DEFAULT_SKIP_LAYERS = 2
#: Text the reference engine adds for an I2V prompt (``_ensure_figure_tokens``).
FIGURE_REFERENCE_TEXT = "The first frame refers to <Figure 1>"


def _backend(tokenizer: Any):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"the MAGI-2 prompt wrapper needs a fast (`tokenizers`-backed) tokenizer; got "
            f"{type(tokenizer).__name__}, which has no `backend_tokenizer`"
        )
    return backend


def _is_cjk_split(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and entry.get("type") == "Split"
        and isinstance(entry.get("pattern"), dict)
        and entry["pattern"].get("Regex") == CJK_SPLIT_PATTERN
    )


def has_cjk_pre_tokenizer_split(tokenizer: Any) -> bool:
    """Whether the fast ``tokenizer``'s pre-tokenizer starts with a ``Split`` on :data:`CJK_SPLIT_PATTERN`.

    Raises:
        ValueError: the tokenizer has no ``tokenizers`` backend.
    """
    state = json.loads(_backend(tokenizer).to_str()).get("pre_tokenizer")
    if state is None:
        return False
    if _is_cjk_split(state):
        return True
    if state.get("type") == "Sequence":
        entries = state.get("pretokenizers") or []
        return bool(entries) and _is_cjk_split(entries[0])
    return False


def apply_cjk_pre_tokenizer_split(tokenizer: Any) -> Any:
    """Prepend SandAI's CJK ``Split`` pre-tokenizer (``Sequence([cjk_split, original])``) in place, idempotently.

    Returns:
        The same tokenizer.

    Raises:
        ValueError: the tokenizer has no ``tokenizers`` backend.
    """
    from tokenizers import Regex, pre_tokenizers

    if has_cjk_pre_tokenizer_split(tokenizer):
        return tokenizer
    backend = _backend(tokenizer)
    split = pre_tokenizers.Split(pattern=Regex(CJK_SPLIT_PATTERN), behavior="isolated")
    original = backend.pre_tokenizer
    backend.pre_tokenizer = split if original is None else pre_tokenizers.Sequence([split, original])
    return tokenizer


def _drop_empty(value: Any) -> Any:
    """Drop ``None``/``[]``/``{}`` values, recursively."""
    if isinstance(value, dict):
        cleaned = {}
        for key, child in value.items():
            child = _drop_empty(child)
            if child is None or (isinstance(child, (list, dict)) and len(child) == 0):
                continue
            cleaned[key] = child
        return cleaned
    if isinstance(value, list):
        return [_drop_empty(item) for item in value if item is not None]
    return value


def _flat(value: Any) -> str:
    """One line of text, whitespace runs collapsed."""
    if value is None:
        return ""
    return " ".join(str(value).split())


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _joined(parts: Iterable[str], sep: str) -> str:
    return sep.join(part for part in parts if part)


def _render_global(global_layer: dict, lines: list[str]) -> None:
    context = _flat(global_layer.get("context"))
    description = _flat(global_layer.get("description"))
    if context or description:
        lines.append(f"context: {context}" if context else "context")
        if description:
            lines.append(description)

    aesthetics = _mapping(global_layer.get("aesthetics"))
    looks = [
        f"{label}={_flat(aesthetics.get(key))}"
        for label, key in (("style", "style"), ("mood", "mood_atmosphere"), ("color", "color_scheme"))
        if _flat(aesthetics.get(key))
    ]
    if looks:
        lines.append("aesthetics: " + "; ".join(looks))

    audio = _mapping(global_layer.get("audio_baseline"))
    dialogue = _mapping(audio.get("dialogue"))
    sound = []
    if _flat(dialogue.get("language")):
        sound.append(f"language={_flat(dialogue.get('language'))}")
    speakers = _items(dialogue.get("speaker_tags"))
    if speakers:
        sound.append("speakers=" + ",".join(_flat(s) for s in speakers))
    if _flat(audio.get("ambience")):
        sound.append(f"ambience={_flat(audio.get('ambience'))}")
    if sound:
        lines.append("audio: " + "; ".join(sound))

    _render_rows(lines, "subjects:", global_layer.get("alive_subjects_static"), _subject_row)
    _render_rows(lines, "objects:", global_layer.get("objects_static"), _object_row)


def _render_rows(lines: list[str], heading: str, items: Any, row) -> None:
    """A heading and one ``row(item)`` line per dict item, when ``items`` is a non-empty list."""
    if isinstance(items, list) and items:
        lines.append(heading)
        lines.extend(row(item) for item in items if isinstance(item, dict))


def _subject_row(subject: dict) -> str:
    row = " - " + _joined((_flat(subject.get("subject_id")), _flat(subject.get("description"))), " | ")
    where = _joined((_flat(subject.get("position")), _flat(subject.get("orientation"))), "; ")
    if where:
        row += f" ({where})"
    visual = _mapping(subject.get("visual_attributes"))
    keys = ("gender", "age_group", "ethnicity", "clothing", "appearance_details")
    attrs = [
        f"{key}={_flat(visual[key])}" for key in keys if visual.get(key) not in (None, [], {}) and _flat(visual[key])
    ]
    return row + (" :: " + "; ".join(attrs) if attrs else "")


def _object_row(item: dict) -> str:
    row = " - " + _joined((_flat(item.get("object_id")), _flat(item.get("description"))), " | ")
    details = _joined((_flat(item.get("shape_and_color")), _flat(item.get("position"))), "; ")
    return row + (" :: " + details if details else "")


def _render_timeline(dynamic_layer: dict, lines: list[str]) -> None:
    segments = dynamic_layer.get("timeline_segments")
    if not (isinstance(segments, list) and segments):
        return
    lines.append("timeline:")
    for segment in segments:
        if not isinstance(segment, dict):
            continue
        basic = _mapping(segment.get("segment_basic_info"))
        stamp = _flat(basic.get("timestamp_range"))
        head = f" - {stamp}" if stamp else " -"
        if _flat(basic.get("segment_description")):
            head += " " + _flat(basic.get("segment_description"))
        lines.append(head.rstrip())

        for said in _mapping(segment.get("audio")).get("dialogue_lines", []) or []:
            if not isinstance(said, dict) or not _flat(said.get("text")):
                continue
            speaker = _flat(said.get("speaker"))
            line = (f"   - dialogue {speaker}: " if speaker else "   - dialogue: ") + _flat(said.get("text"))
            if _flat(said.get("timestamp")):
                line += f" ({_flat(said.get('timestamp'))})"
            lines.append(line)

        for alive in segment.get("alive_subjects", []) or []:
            if not isinstance(alive, dict):
                continue
            action = _mapping(alive.get("action"))
            what = _joined(
                (_flat(action.get(k)) for k in ("primary_action", "interaction", "facial_expression")), "; "
            )
            if what:
                lines.append(f"   - action {_flat(alive.get('subject_id'))}: {what}")

        for item in segment.get("objects", []) or []:
            if not isinstance(item, dict):
                continue
            state = _mapping(item.get("dynamic_state"))
            what = _joined((_flat(state.get(k)) for k in ("state_change", "motion_detail")), "; ")
            if what:
                lines.append(f"   - objects {_flat(item.get('object_id'))}: {what}")


def json_to_compact_markdown(prompt: str | dict) -> str:
    """A structured prompt (``global_layer`` / ``dynamic_layer`` / ``reference_layer``) as the compact markdown of
    SandAI ``qwen35.py::json_to_compact_markdown``; anything without ``global_layer`` is returned as text.

    Args:
        prompt: JSON text or an already parsed object.

    Returns:
        The rendered prompt text.

    Raises:
        json.JSONDecodeError: ``prompt`` is a string that is not valid JSON.
    """
    parsed = json.loads(prompt.strip()) if isinstance(prompt, str) else prompt
    parsed = _drop_empty(parsed)
    if not isinstance(parsed, dict) or "global_layer" not in parsed:
        return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)

    lines: list[str] = []
    _render_global(_mapping(parsed.get("global_layer")), lines)
    _render_timeline(_mapping(parsed.get("dynamic_layer")), lines)
    references = parsed.get("reference_layer", [])
    if isinstance(references, list):
        lines.extend(str(line) for line in references if str(line).strip())
    return "\n".join(line for line in lines if line.strip())


def normalize_prompt(prompt: str) -> str:
    """The text the tokenizer sees (SandAI ``Qwen35TextEncoder._normalize_prompt``)."""
    try:
        parsed = json.loads(prompt)
    except (json.JSONDecodeError, TypeError):
        return prompt
    if isinstance(parsed, (dict, list)):
        return json_to_compact_markdown(prompt)
    return prompt


def add_figure_reference(prompt: str) -> str:
    """An I2V prompt that mentions ``<Figure 1>`` (SandAI ``_ensure_figure_tokens``): a JSON object gets it as its
    ``reference_layer``, other text gets ``"reference_layer:..."`` appended."""
    try:
        parsed = json.loads(prompt)
    except (json.JSONDecodeError, TypeError):
        parsed = None
    if isinstance(parsed, dict):
        parsed["reference_layer"] = [FIGURE_REFERENCE_TEXT]
        return json.dumps(parsed, ensure_ascii=False)
    return prompt + "reference_layer:" + FIGURE_REFERENCE_TEXT


def tokenize_prompt(
    tokenizer: Any,
    prompt: str,
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
    return_offsets_mapping: bool = False,
) -> dict:
    """Tokenise one normalised prompt as SandAI does (right padding, at most ``max_sequence_length`` tokens;
    a longer prompt is cut with a warning).

    Returns:
        ``BatchEncoding`` with ``input_ids``/``attention_mask`` ``[1, Lt]`` (and ``offset_mapping`` ``[1, Lt, 2]``).
    """
    tokenizer.padding_side = "right"
    tokens = tokenizer(
        [prompt],
        return_tensors="pt",
        padding="longest",
        max_length=max_sequence_length,
        truncation=True,
        return_offsets_mapping=return_offsets_mapping,
    )
    if tokens["input_ids"].shape[1] >= max_sequence_length:
        full = tokenizer(prompt, truncation=False, return_offsets_mapping=True)
        dropped = len(full["input_ids"]) - tokens["input_ids"].shape[1]
        if dropped > 0:
            kept_chars = full["offset_mapping"][tokens["input_ids"].shape[1] - 1][1]
            logger.warning(
                f"The prompt has {len(full['input_ids'])} tokens and MAGI-2 reads at most {max_sequence_length} "
                f"(max_sequence_length): the last {dropped} tokens ({len(prompt) - kept_chars} characters) are "
                f"dropped, starting with {prompt[kept_chars : kept_chars + 60]!r}"
            )
    return tokens


@torch.no_grad()
def encode_prompt_features(
    text_encoder: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    skip_layers: int = DEFAULT_SKIP_LAYERS,
) -> torch.Tensor:
    """Qwen3.5 features ``hidden_states[-(skip_layers + 1)]`` (``last_hidden_state`` for 0; SandAI ``encode``).

    Args:
        text_encoder: a ``Qwen3_5TextModel`` or any model returning ``hidden_states``.
        input_ids, attention_mask: ``[B, Lt]`` int64, on the encoder's device.
        skip_layers: final layers to skip (>= 0).

    Returns:
        ``[B, Lt, hidden]`` in the text encoder's dtype.
    """
    outputs = text_encoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        return_dict=True,
    )
    if skip_layers == 0:
        return outputs.last_hidden_state
    return outputs.hidden_states[-(skip_layers + 1)]


def find_target_token_indices(text: str, offsets: Sequence[Sequence[int]] | torch.Tensor, target: str) -> list[int]:
    """Indices of the tokens overlapping the first ``target`` in ``text`` (SandAI ``get_target_token_indices``).

    Args:
        text: the normalised prompt the offsets refer to.
        offsets: ``[Lt, 2]`` (start, end) character offsets of each token.
        target: e.g. ``"<Figure 1>"``.

    Returns:
        the token indices (empty when ``target`` does not occur).
    """
    start = text.find(target)
    if not target or start < 0:
        return []
    end = start + len(target)
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.tolist()
    found = []
    for index, (lo, hi) in enumerate(offsets):
        if lo == 0 and hi == 0 and index != 0:
            continue
        if max(lo, start) < min(hi, end):
            found.append(index)
    return found


def pool_target_features(features: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    """Mean of ``features[0, indices]``, zeros when empty (SandAI ``get_special_token``).

    Args:
        features: ``[1, Lt, C]`` prompt features.
        indices: token indices from :func:`find_target_token_indices`.

    Returns:
        ``[C]`` in ``features``' dtype.
    """
    if len(indices) == 0:
        return features.new_zeros(features.shape[-1])
    return features[0, list(indices), :].mean(dim=0)


def encode_prompt_text(
    tokenizer: Any,
    text_encoder: torch.nn.Module,
    prompt: str,
    device: torch.device | str,
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
    skip_layers: int = DEFAULT_SKIP_LAYERS,
    figure_target: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One prompt normalised, tokenised and encoded, with its ``figure_target`` embedding when asked.

    Returns:
        ``(features [1, Lt, C], target_embeds [C] or None)``.
    """
    normalized = normalize_prompt(prompt)
    tokens = tokenize_prompt(
        tokenizer, normalized, max_sequence_length, return_offsets_mapping=figure_target is not None
    )
    features = encode_prompt_features(
        text_encoder, tokens["input_ids"].to(device), tokens["attention_mask"].to(device), skip_layers=skip_layers
    )
    if figure_target is None:
        return features, None
    indices = find_target_token_indices(normalized, tokens["offset_mapping"][0], figure_target)
    return features, pool_target_features(features, indices)


def repeat_text_per_video(embeds: torch.Tensor, mask: torch.Tensor | None, num_videos_per_prompt: int, device, dtype):
    """Text ``(embeds [B, Lt, C], bool mask [B, Lt])`` on ``device``/``dtype`` with each row repeated ``num_videos_per_prompt`` times, adjacent."""
    embeds = embeds.to(device=device, dtype=dtype or embeds.dtype)
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask
    mask = mask.to(device=device, dtype=torch.bool)
    return embeds.repeat_interleave(num_videos_per_prompt, 0), mask.repeat_interleave(num_videos_per_prompt, 0)
