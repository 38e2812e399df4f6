"""Keep other variants' shards when a model is saved into a folder that holds several variants (C05).

diffusers 0.42.1 ``ModelMixin.save_pretrained`` "cleans the folder from a previous save" by deleting
every file that starts with the weights name and looks like a shard
(``modeling_utils.py``: ``filename.startswith("diffusion_pytorch_model")`` and
``-\\d{5}-of-\\d{5}``). Saving the default variant therefore also deletes
``diffusion_pytorch_model.bf16-0000i-of-0000n.safetensors`` while keeping the bf16 index, which
then points at missing files (diffusers issue #14719). :func:`save_pretrained_keeping_variants`
moves the other variants' shard files aside for the duration of the save and puts them back.
Callers wrap ``save_pretrained`` with it explicitly (no model class's ``save_pretrained`` calls it yet).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

__all__ = ["other_variant_shards", "save_pretrained_keeping_variants"]

_VARIANT_SHARD = re.compile(r"^(?P<stem>[^.]+)\.(?P<variant>[^.]+)-\d{5}-of-\d{5}\.(?:safetensors|bin)$")


def other_variant_shards(folder: str | os.PathLike, variant: str | None) -> list[Path]:
    """Shard files in ``folder`` that belong to a variant other than ``variant`` (``None`` = default)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.iterdir()):
        m = _VARIANT_SHARD.match(p.name)
        if p.is_file() and m and m.group("variant") != variant:
            out.append(p)
    return out


def save_pretrained_keeping_variants(save_fn, save_directory: str | os.PathLike, *args, variant: str | None = None, **kwargs):
    """Call ``save_fn(save_directory, *args, variant=variant, **kwargs)`` without losing other variants.

    Args:
        save_fn: the bound ``ModelMixin.save_pretrained`` (e.g. ``super().save_pretrained``).
        save_directory: target folder.
        variant: the variant being saved (``None`` for the default weights).

    Returns:
        whatever ``save_fn`` returns. The set-aside files are restored even if it raises.
    """
    keep = other_variant_shards(save_directory, variant)
    stash = Path(save_directory) / f".keep-variants-{uuid.uuid4().hex[:8]}"
    moved: list[tuple[Path, Path]] = []
    if keep:
        stash.mkdir()
    try:
        for p in keep:
            dst = stash / p.name
            os.rename(p, dst)
            moved.append((dst, p))
        return save_fn(save_directory, *args, variant=variant, **kwargs)
    finally:
        for dst, original in moved:
            os.replace(dst, original)
        if keep:
            stash.rmdir()
