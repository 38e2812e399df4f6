"""Row-sharded loading: each expert-parallel rank keeps only its rows of the head-major expert tensors.

An EP-sharded tensor is ``[H E, ...]`` (row ``h E + e``); rank ``r`` keeps rows ``[local_head_start E, +local_num_heads E)``,
zero past ``H E`` (SandAI's per-rank loading rule). :class:`RowShardedShards` hands diffusers' loader each shard with
those rows cut (reading only them), so diffusers' own dtype and device handling load them unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union

import torch

from ..utils.safetensors_io import DTYPE_TO_TORCH


__all__ = ["RowShard", "RowShardedShards", "take_rows"]


class RowShard(NamedTuple):
    """This rank's rows of one row-sharded tensor: ``[row_start, row_start + num_rows)`` of ``full_rows``."""

    row_start: int
    num_rows: int
    full_rows: int


def take_rows(source: Any, row_start: int, num_rows: int, name: str = "tensor") -> torch.Tensor:
    """Rows ``[row_start, row_start + num_rows)`` of ``source`` along dim 0; rows past its end are zero.

    Args:
        source: a ``torch.Tensor`` or a ``safe_open(...).get_slice(key)`` slice (then only those rows are read).
        name: the tensor's name, for the error message.

    Returns:
        ``[num_rows, *shape[1:]]``: a view when every row exists (of the memory map for a slice), else a new tensor.

    Raises:
        ValueError: negative ``row_start`` or ``num_rows``.
    """
    if row_start < 0 or num_rows < 0:
        raise ValueError(f"row_start and num_rows must be >= 0, got {row_start}, {num_rows} for {name!r}")
    is_tensor = isinstance(source, torch.Tensor)
    shape = tuple(source.shape) if is_tensor else tuple(source.get_shape())
    stop = min(shape[0], row_start + num_rows)
    if stop - row_start == num_rows:
        return source[row_start:stop]
    dtype = source.dtype if is_tensor else DTYPE_TO_TORCH[source.get_dtype()]
    device = source.device if is_tensor else "cpu"
    out = torch.zeros((num_rows, *shape[1:]), dtype=dtype, device=device)
    if stop > row_start:
        out[: stop - row_start] = source[row_start:stop]
    return out


class RowShardedShards(Sequence):
    """Checkpoint shards as state dicts, each row-sharded tensor cut to this rank's rows (:func:`take_rows`).

    Stands in for the shard list of diffusers' ``_load_pretrained_model`` (``load_state_dict`` passes a dict through).

    Args:
        shards: shard file paths, or already loaded (memory-mapped) state dicts.
        plan: tensor name -> its :class:`RowShard`.

    Raises (when a shard is read):
        ValueError: a planned tensor's dim 0 is not its ``full_rows`` (e.g. an already sharded checkpoint).
    """

    def __init__(self, shards: Sequence[Union[str, Mapping[str, torch.Tensor]]], plan: Mapping[str, RowShard]):
        self.shards = list(shards)
        self.plan = dict(plan)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from diffusers.models.model_loading_utils import load_state_dict

        state = dict(load_state_dict(self.shards[index]))
        for key in self.plan.keys() & state.keys():
            row_start, num_rows, full_rows = self.plan[key]
            if state[key].shape[0] != full_rows:
                raise ValueError(
                    f"{key}: checkpoint has {state[key].shape[0]} rows, expected num_heads·num_experts = {full_rows} "
                    "(expert-parallel loading needs the unsharded checkpoint)"
                )
            state[key] = take_rows(state[key], row_start, num_rows, key).clone()
        return state
