"""Dtype names: the one place where a dtype written as a string (SandAI configs, ``--dtype``, ``--expert_dtype``)
becomes a ``torch.dtype``."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .dtype_names import DTYPE_CHOICES, EXPERT_DTYPE_CHOICES


__all__ = ["DTYPE_CHOICES", "EXPERT_DTYPE_CHOICES", "FLOAT_DTYPES", "convert_dtype", "parse_dtype"]

#: floating dtype names (a leading ``torch.`` is ignored) -> torch dtype.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: Union[str, torch.dtype], what: str = "dtype") -> torch.dtype:
    """The floating ``torch.dtype`` that ``value`` names (``"bfloat16"``, ``"bf16"``, ``"torch.float32"``, ...).

    Args:
        value: a name from :data:`FLOAT_DTYPES` or a floating ``torch.dtype`` (returned as is).
        what: what the value is, for the error message (e.g. ``"params_dtype"``).

    Raises:
        TypeError: ``value`` is neither a string nor a ``torch.dtype``.
        ValueError: an unknown name or a non-floating dtype.
    """
    if isinstance(value, torch.dtype):
        if value not in FLOAT_DTYPES.values():
            raise ValueError(f"{what} must be one of {sorted(set(map(str, FLOAT_DTYPES.values())))}; got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a dtype name or a torch.dtype; got {type(value).__name__}")
    dtype = FLOAT_DTYPES.get(value.strip().removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"{what} must be one of {sorted(FLOAT_DTYPES)}; got {value!r}")
    return dtype


def convert_dtype(choice: str) -> Optional[torch.dtype]:
    """The dtype of a ``magi2-convert --dtype`` choice: ``None`` for ``"keep"``.

    Raises:
        ValueError: ``choice`` is not one of :data:`DTYPE_CHOICES`.
    """
    if choice not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {choice!r}")
    return None if choice == "keep" else FLOAT_DTYPES[choice]
