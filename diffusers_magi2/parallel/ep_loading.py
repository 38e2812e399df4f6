"""Row-sharded loading: each expert-parallel rank keeps only its rows of the head-major expert tensors.

An EP-sharded tensor is ``[H E, ...]`` (row ``h E + e``); rank ``r`` keeps rows ``[local_head_start E, +local_num_heads E)``,
zero past ``H E`` (SandAI's per-rank loading rule). :class:`RowShardedShards` hands diffusers' loader each shard with
those rows cut, so diffusers' own dtype and device handling load them unchanged. From a safetensors file the rows are
read into their own buffer (:func:`~diffusers_magi2.utils.safetensors_io.read_rows`), never through a memory map of the
whole tensor: safetensors' ``get_slice`` and ``load_file`` map (and the former materialises) the full tensor, and a
map that other loaded tensors keep alive keeps every page the slicing read resident, the full bank's share of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union

import torch

from ..utils.safetensors_io import DTYPE_TO_TORCH, read_rows, read_safetensors_header


__all__ = ["RowShard", "RowShardedShards", "take_rows"]


class RowShard(NamedTuple):
    """This rank's rows of one row-sharded tensor: ``[row_start, row_start + num_rows)`` of ``full_rows``."""

    row_start: int
    num_rows: int
    full_rows: int


def take_rows(source: Any, row_start: int, num_rows: int, name: str = "tensor") -> torch.Tensor:
    """Rows ``[row_start, row_start + num_rows)`` of ``source`` along dim 0; rows past its end are zero.

    Args:
        source: a ``torch.Tensor`` or a ``safe_open(...).get_slice(key)`` slice (safetensors may map the whole tensor
            for a slice; to read only the rows from a file use :func:`~diffusers_magi2.utils.safetensors_io.read_rows`).
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

    A safetensors shard is read key by key: the planned tensors' rows with ``read_rows`` (no full-size tensor, no
    map), the others as diffusers reads them (memory-mapped). A state dict or another file format is read whole and cut.

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
        shard = self.shards[index]
        if not isinstance(shard, Mapping) and str(shard).endswith(".safetensors"):
            return self._read_safetensors(str(shard))
        from diffusers.models.model_loading_utils import load_state_dict

        state = dict(load_state_dict(shard))
        for key in self.plan.keys() & state.keys():
            self._check_rows(key, state[key].shape[0])
            row_start, num_rows, _ = self.plan[key]
            state[key] = take_rows(state[key], row_start, num_rows, key).clone()
        return state

    def _check_rows(self, key: str, rows: int) -> None:
        """ValueError unless tensor ``key`` of the checkpoint has the planned full row count."""
        if rows != self.plan[key].full_rows:
            raise ValueError(
                f"{key}: checkpoint has {rows} rows, expected num_heads·num_experts = {self.plan[key].full_rows} "
                "(expert-parallel loading needs the unsharded checkpoint)"
            )

    def _read_safetensors(self, path: str) -> dict[str, torch.Tensor]:
        """One safetensors shard: planned tensors as this rank's rows (``read_rows``), the rest memory-mapped."""
        from safetensors import safe_open

        header = read_safetensors_header(path)
        planned = self.plan.keys() & header.tensors.keys()
        for key in planned:
            self._check_rows(key, header.tensors[key].shape[0] if header.tensors[key].shape else 0)
        with safe_open(path, framework="pt") as handle:
            state = {key: handle.get_tensor(key) for key in handle.keys() if key not in planned}
        for key in sorted(planned):
            row_start, num_rows, _ = self.plan[key]
            state[key] = read_rows(header, key, row_start, num_rows)
        return state
