"""The Markdown an enhanced prompt becomes: an LLM's JSON reply laid out as MAGI-2's text encoder was trained to read it.

This is SandAI's generic JSON-to-Markdown renderer (``inference/prompt_enhancement/pe_markdown.py``
``render_markdown``) with the flags its enhancer passes (empty values dropped, every key kept, strings neither quoted
nor folded), reproduced byte for byte:

- **Empty values go first.** ``None``, ``""``, strings that ``str.strip`` empties, ``[]`` and ``{}`` are removed at
  every depth, and so is a container left empty by that; ``0`` and ``false`` stay. Nothing left renders ``""``.
- **Root.** Each key of a root object is one section, sections separated by a blank line. Any other root renders as
  a value without a key.
- **A key's value.** A primitive is one ``key:value`` line (no space after the colon); a list of primitives is one
  ``key:a | b`` line; an object is a heading ``#``-times-depth ``key``, a blank line, then its fields one level
  deeper; any other list is a heading ``key``, a blank line, then its items.
- **List items** are titled ``<key><n>`` (``item<n>`` when the key is empty), ``n`` counting from 1 after the empty
  ones were dropped: a primitive is a ``title:value`` line; an object is a heading one level deeper than the list's,
  a blank line, its fields two levels deeper, and a blank line; a list is a heading one level deeper and its items
  rendered as a keyless list two levels deeper.
- **Field order in an object.** Primitives and lists of primitives first, then everything else, each group in the
  reply's order (root keys keep their order). A container field other than the first gets a blank line before it.
- **Headings** deeper than level 6 become ``*title*``.
- **Text.** Strings show ``\\r\\n`` and ``\\n`` as the two characters ``\\n``, ``\\r`` as ``\\r``, a tab as ``\\t``;
  nothing else is escaped. ``true`` / ``false`` / ``null`` as in JSON; other numbers as ``json.dumps`` writes them
  (an integer spelling stays an integer, a float is Python's ``repr``).
- **Lines.** Runs of blank lines become one, trailing whitespace is stripped from every line, trailing blank lines
  go, and the text ends with one ``\\n``.
"""

from __future__ import annotations

import json
from typing import Any


__all__ = ["render_enhanced_prompt"]

#: SandAI's deepest Markdown heading; deeper titles are written ``*title*``.
MAX_HEADING_LEVEL = 6
#: Separator of an inline list of primitives.
LIST_SEPARATOR = " | "

_EMPTY = object()


def _without_empty(value: Any) -> Any:
    """``value`` with empty strings, ``None`` and empty containers removed at every depth, or ``_EMPTY``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return _EMPTY
    if isinstance(value, dict):
        kept = {str(key): _without_empty(child) for key, child in value.items()}
        kept = {key: child for key, child in kept.items() if child is not _EMPTY}
        return kept if kept else _EMPTY
    if isinstance(value, list):
        kept = [item for item in map(_without_empty, value) if item is not _EMPTY]
        return kept if kept else _EMPTY
    return value


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list))


def _is_one_line(value: Any) -> bool:
    """A primitive or a list of primitives: rendered on one ``key:...`` line."""
    return not _is_container(value) or (isinstance(value, list) and not any(map(_is_container, value)))


def _text(value: Any) -> str:
    """One primitive as it appears after ``key:``."""
    if isinstance(value, str):
        return value.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    if value is True:
        return "true"
    if value is False:
        return "false"
    return json.dumps(value, ensure_ascii=False)


def _heading(level: int, title: str) -> str:
    return f"{'#' * level} {title}" if level <= MAX_HEADING_LEVEL else f"*{title}*"


class _MarkdownLines:
    """The output lines, appended in reading order."""

    def __init__(self):
        self.lines: list[str] = []

    def section(self, level: int, title: str) -> None:
        self.lines += [_heading(level, title), ""]

    def value(self, key: str | None, value: Any, level: int) -> None:
        if not _is_container(value):
            self.lines.append(_text(value) if key is None else f"{key}:{_text(value)}")
        elif isinstance(value, dict):
            if key is not None:
                self.section(level, key)
                level += 1
            self.fields(value, level)
        elif key is not None and _is_one_line(value):
            self.lines.append(f"{key}:{LIST_SEPARATOR.join(map(_text, value))}")
        else:
            if key is not None:
                self.section(level, key)
            self.items(key, value, level)

    def items(self, key: str | None, items: list, level: int) -> None:
        for number, item in enumerate(items, start=1):
            title = f"{key}{number}" if key else f"item{number}"
            if not _is_container(item):
                self.lines.append(f"{title}:{_text(item)}")
                continue
            self.section(level + 1, title)
            if isinstance(item, dict):
                self.fields(item, level + 2)
                self.lines.append("")
            else:
                self.value(None, item, level + 2)

    def fields(self, obj: dict, level: int) -> None:
        one_line = [(key, child) for key, child in obj.items() if _is_one_line(child)]
        nested = [(key, child) for key, child in obj.items() if not _is_one_line(child)]
        for index, (key, child) in enumerate(one_line + nested):
            if index and _is_container(child) and self.lines and self.lines[-1] != "":
                self.lines.append("")
            self.value(key, child, level)

    def text(self) -> str:
        out: list[str] = []
        after_blank = False
        for line in self.lines:
            if line != "":
                out.append(line.rstrip())
            elif not after_blank:
                out.append("")
            after_blank = line == ""
        while out and out[-1] == "":
            out.pop()
        return "\n".join(out) + "\n"


def render_enhanced_prompt(reply: Any) -> str:
    """The Markdown prompt MAGI-2's text encoder reads for an enhancer's reply (the module docstring's rules).

    Matches SandAI ``pe_markdown.render_markdown(reply, drop_empty=True, keep_empty_string=False,
    omit_section_leaf_keys=False, quote_strings=False, collapse_string_whitespace=False)``, the call its
    ``PromptEnhancer.enhance`` makes, byte for byte. For an I2V prompt the pipeline appends the ``<Figure 1>``
    reference afterwards (``text_encoding.add_figure_reference``).

    Args:
        reply (`dict`):
            The reply as ``json.loads`` returns it (key order as written; an integer spelling stays an ``int``).
            Any other JSON value (a list, a primitive) renders too, without a root key.

    Returns:
        `str`: The Markdown, ending in one ``"\\n"``; ``""`` when every value is empty.
    """
    value = _without_empty(reply)
    if value is _EMPTY:
        return ""
    out = _MarkdownLines()
    if isinstance(value, dict):
        for index, (key, child) in enumerate(value.items()):
            if index:
                out.lines.append("")
            out.value(key, child, 1)
    else:
        out.value(None, value, 1)
    return out.text()
