"""FP8-stored dense projections through diffusers' loading: a ``--dense_storage_dtype fp8_e4m3`` repo's e4m3
``weight`` codes placed as the files store them.

diffusers 0.42 casts every floating checkpoint tensor to the load dtype, so an FP8 ``weight`` would come in as a
copy in the load dtype (bf16: twice its bytes, in anonymous memory) and go back to FP8 in a second copy once loaded.
Taken out of each shard here and placed in its own dtype, it stays what safetensors read: on the CPU a view of the
shard's memory map (file-backed pages, read when first touched). The per-channel ``weight_scale`` rows are fp32
islands, which the loader does not cast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

import torch
import torch.nn as nn

from ..moe.quantize import FP8_DTYPE
from .quantized_experts import place_as_stored


__all__ = ["StoredFP8Shards"]


class StoredFP8Shards(Sequence):
    """Checkpoint shards as diffusers' loader reads them, the FP8 ``weights`` of ``names`` taken out and placed in
    ``model`` as stored (module docstring); the rest handed on as read.

    Args:
        shards: shard paths or state dicts (possibly another loader's wrapper).
        model: the model being loaded (on meta), its FP8-stored projections' weights already FP8.
        names: state-dict names of those weights.
        device_map: the ``device_map`` diffusers loads with (``None``: CPU).
    """

    def __init__(
        self,
        shards: Sequence[Union[str, Mapping[str, torch.Tensor]]],
        model: nn.Module,
        names: set[str],
        device_map=None,
    ):
        self.shards, self.model, self.names, self.device_map = shards, model, names, device_map

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from diffusers.models.model_loading_utils import load_state_dict

        state = dict(load_state_dict(self.shards[index]))
        for name in [k for k, v in state.items() if k in self.names and v.dtype == FP8_DTYPE]:
            place_as_stored(self.model, name, state.pop(name), self.device_map, "FP8-stored dense weights")
        return state
