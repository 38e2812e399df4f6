"""Row-sharded loading: each expert-parallel rank keeps only its rows of the head-major expert tensors.

An EP-sharded tensor is ``[H·E, ...]`` (row ``h·E + e``). Rank ``r`` keeps rows ``[s, s + n)`` with
``s = local_head_start·E`` and ``n = local_num_heads·E``; rows at or past ``H·E`` (padded heads of the last
ranks) are zero. This is SandAI's per-rank loading rule, written once: :func:`take_rows` slices a tensor or a
``safe_open`` slice (so only those rows are read), and :class:`RowShardedShards` is the per-parameter slicing
hook handed to diffusers' loader: it yields each checkpoint shard as a state dict whose planned tensors are
already this rank's rows, so diffusers' own dtype, fp32-module and device handling load them unchanged.
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
        ``[num_rows, *shape[1:]]`` in ``source``'s dtype: a view when every row exists (of the file's memory map
        for a slice: ``.clone()`` it to own the memory), else a new tensor. A range wholly past the end never
        slices ``source`` (safetensors refuses an out-of-range start).

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

    diffusers' ``ModelMixin._load_pretrained_model`` iterates its shard list and reads each item with
    ``load_state_dict``, which passes a dict through unchanged; this sequence stands in for that list. A shard
    is memory-mapped (safetensors), so only the planned rows of its sharded tensors are ever read; they are
    copied out (the rest stays lazy until diffusers reads it) before the shard is handed on.

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
