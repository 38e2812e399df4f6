"""``Magi2Pipeline.from_pretrained(..., expert_parallel=...)``: the transformer loaded EP-sharded, the rest as usual."""

from __future__ import annotations

import os
from typing import Any, Union

import torch

from ..models.transformer_magi2 import Magi2Transformer3DModel
from ..parallel.expert_parallel import Magi2ExpertParallelConfig, ep_device


__all__ = ["load_pipeline_with_expert_parallel"]


def load_pipeline_with_expert_parallel(
    pipeline_cls: type,
    pretrained_model_name_or_path: Union[str, os.PathLike],
    *,
    expert_parallel: Magi2ExpertParallelConfig,
    **kwargs: Any,
):
    """Load the transformer with only this rank's routed experts, on this rank's device, then the pipeline around it
    (same dtype, variant and Hub arguments; no rank builds the full expert bank).

    Raises:
        ValueError: a ``transformer`` component was passed too (shard it with ``enable_expert_parallel``
            instead), or any error of the transformer's expert-parallel loading.
    """
    if kwargs.get("transformer") is not None:
        raise ValueError(
            "pass either transformer=... or expert_parallel=..., not both (call transformer.enable_expert_parallel)"
        )
    shared = ("torch_dtype", "dtype", "variant", "revision", "cache_dir", "token", "local_files_only")
    transformer_kwargs = {k: kwargs[k] for k in shared if kwargs.get(k) is not None}
    for key in ("torch_dtype", "dtype"):
        if isinstance(transformer_kwargs.get(key), dict):
            table = transformer_kwargs[key]
            transformer_kwargs[key] = table.get("transformer", table.get("default", torch.float32))
    transformer = Magi2Transformer3DModel.from_pretrained(
        pretrained_model_name_or_path,
        subfolder="transformer",
        expert_parallel=expert_parallel,
        device_map=ep_device(expert_parallel),
        **transformer_kwargs,
    )
    return pipeline_cls.from_pretrained(pretrained_model_name_or_path, transformer=transformer, **kwargs)
