"""The registry of routed-expert formats: a config's ``expert_dtype``, or a raw weight tensor, to its
:class:`~diffusers_magi2.moe.expert_storage.ExpertStorage`.

The MoE layer picks its storage once from ``expert_dtype`` (:func:`expert_storage`); the expert paths, which take
raw tensors (the seed functions, the custom op), look theirs up from ``w_gate`` (:func:`storage_of`); the loader
asks which format a checkpoint tensor is stored in (:func:`stored_format`). This is the only code that asks a
weight its dtype. A new format is one ``expert_storage_<name>.py`` (an :class:`ExpertStorage` subclass) and its
row in the two tables below.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .expert_storage import ExpertStorage
from .expert_storage_fp8 import Fp8ExpertStorage
from .expert_storage_int4 import Int4ExpertStorage
from .expert_storage_unquantized import UNQUANTIZED_DTYPES, UnquantizedExpertStorage
from .quantize import FP8_DTYPE, INT4, parse_expert_dtype
from .quantize_int4 import INT4_GROUP_SIZE, INT4_PACKED_DTYPE


__all__ = ["WEIGHT_DTYPES", "check_weight_dtype", "expert_storage", "storage_of", "stored_format"]

#: a stored bank's dtype -> its format
_BY_WEIGHT_DTYPE: dict[torch.dtype, type[ExpertStorage]] = {
    **dict.fromkeys(UNQUANTIZED_DTYPES, UnquantizedExpertStorage),
    FP8_DTYPE: Fp8ExpertStorage,
    INT4_PACKED_DTYPE: Int4ExpertStorage,
}
#: the dtypes an expert bank may be stored in
WEIGHT_DTYPES = tuple(_BY_WEIGHT_DTYPE)


def expert_storage(
    expert_dtype: Union[None, str, torch.dtype] = None,
    params_dtype: torch.dtype = torch.float32,
    int4_group_size: int = INT4_GROUP_SIZE,
) -> ExpertStorage:
    """The storage of a layer built with ``expert_dtype`` (``None``: unquantized in ``params_dtype``; FP8; int4 at
    ``int4_group_size``).

    Raises:
        ValueError: an unknown ``expert_dtype`` (the message lists the allowed ones).
    """
    expert_dtype = parse_expert_dtype(expert_dtype)
    if expert_dtype is None:
        return UnquantizedExpertStorage(params_dtype)
    if expert_dtype == INT4:
        return Int4ExpertStorage(int4_group_size)
    return Fp8ExpertStorage()


def storage_of(weights: Sequence[Tensor], scales: Optional[Sequence[Tensor]] = None) -> ExpertStorage:
    """The storage of the banks ``weights = (w_gate, w_up, w_down)`` (an int4 group size read from the
    ``w_gate`` scale's shape).

    Raises:
        ValueError: ``w_gate`` is in no expert format's dtype.
    """
    w_gate = weights[0]
    cls = _BY_WEIGHT_DTYPE.get(w_gate.dtype)
    if cls is None:
        raise ValueError(f"w_gate dtype must be one of {WEIGHT_DTYPES}; got {w_gate.dtype}")
    if cls is UnquantizedExpertStorage:
        return UnquantizedExpertStorage(w_gate.dtype)
    if cls is Int4ExpertStorage:
        return Int4ExpertStorage.of_scale(None if scales is None else scales[0], w_gate.shape[1])
    return cls()


def check_weight_dtype(name: str, weight: Tensor) -> None:
    """Refuse an expert bank ``name`` in a dtype no format stores.

    Raises:
        ValueError: naming the bank and the allowed dtypes.
    """
    if weight.dtype not in _BY_WEIGHT_DTYPE:
        raise ValueError(f"{name} dtype must be one of {WEIGHT_DTYPES}; got {weight.dtype}")


def stored_format(
    name: str, dtype: torch.dtype, keys: Container[str], own: ExpertStorage
) -> Optional[type[ExpertStorage]]:
    """The format checkpoint bank ``name`` of ``dtype`` is stored in, for a model whose experts are ``own``: a
    quantized format's dtype, else another quantized format whose scale (``name`` + its suffix) is among ``keys``,
    else unquantized for a float dtype of two bytes or more, else ``None``."""
    cls = _BY_WEIGHT_DTYPE.get(dtype)
    if cls is not None and cls is not UnquantizedExpertStorage:
        return cls
    for quantized in (Fp8ExpertStorage, Int4ExpertStorage):
        if not isinstance(own, quantized) and f"{name}{quantized.scale_suffix}" in keys:
            return quantized
    return UnquantizedExpertStorage if dtype.is_floating_point and dtype.itemsize >= 2 else None
