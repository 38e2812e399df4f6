"""``Magi2Pipeline.from_pretrained(..., expert_parallel=..., context_parallel=...)``: the degrees checked before any
weight loads, the transformer loaded EP-sharded, the rest as usual; context parallelism enabled on both DiTs."""

from __future__ import annotations

import glob
import os
from typing import Any, Union

import torch

from ..models.transformer_magi2 import Magi2Transformer3DModel
from ..parallel.context_parallel import resolve_context_parallel
from ..parallel.expert_parallel import Magi2ExpertParallelConfig, ep_device
from ..utils.safetensors_io import LOADED_FILES_ATTR, record_loaded_files
from .enhancement_magi2 import PROMPT_ENHANCER, pop_prompt_enhancer


__all__ = [
    "Magi2PipelineLoadingMixin",
    "check_parallel_degrees",
    "enable_context_parallel",
    "load_pipeline_with_expert_parallel",
]


def check_parallel_degrees(expert_parallel: Magi2ExpertParallelConfig | None, context_parallel) -> None:
    """A context-parallel degree that fits the process group and is a multiple of ``ep_degree``.

    Raises:
        ValueError: a bad degree (:func:`~diffusers_magi2.parallel.context_parallel.resolve_context_parallel`),
            or ``ep_degree`` not dividing it.
    """
    if context_parallel is None:
        return
    cp = resolve_context_parallel(context_parallel)
    if expert_parallel is not None and cp.size % expert_parallel.ep_degree:
        raise ValueError(f"ep_degree={expert_parallel.ep_degree} must divide the context-parallel degree {cp.size}")


def enable_context_parallel(pipe, config) -> None:
    """``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` on ``pipe``'s transformer and refiner
    (either may be absent)."""
    for model in (getattr(pipe, "transformer", None), getattr(pipe, "refiner", None)):
        if model is not None:
            model.enable_parallelism(config=config)


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


def _record_text_encoder_files(pipe) -> None:
    """Record the text encoder's safetensors files as just loaded (transformers records none; diffusers models record
    theirs while loading), so the disk mode of weight streaming refuses them if they change afterwards."""
    model = getattr(pipe, "text_encoder", None)
    folder = getattr(model, "name_or_path", None)
    if folder and os.path.isdir(folder) and not getattr(model, LOADED_FILES_ATTR, None):
        record_loaded_files(model, sorted(glob.glob(os.path.join(folder, "*.safetensors"))))


class Magi2PipelineLoadingMixin:
    """``Magi2Pipeline``'s ``from_pretrained`` (parallel options, the prompt enhancer) and ``enable_context_parallel``."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``DiffusionPipeline.from_pretrained`` with two parallel options.

        Args:
            expert_parallel: ``Magi2ExpertParallelConfig(ep_degree=E)``: load only this rank's routed experts.
            context_parallel: ``diffusers.ContextParallelConfig(ulysses_degree=N)`` (N = world size, ``E | N``):
                :meth:`enable_context_parallel` after loading.
            prompt_enhancer: a ``Magi2PromptEnhancer`` or ``None`` (default: the repo's, if it saved one).

        Raises:
            ValueError: a bad degree, before the weights load.
        """
        expert_parallel = kwargs.pop("expert_parallel", None)
        context_parallel = kwargs.pop("context_parallel", None)
        check_parallel_degrees(expert_parallel, context_parallel)  # before any weight loads
        enhancer = pop_prompt_enhancer(cls, pretrained_model_name_or_path, kwargs)
        if expert_parallel is not None:
            pipe = load_pipeline_with_expert_parallel(
                cls, pretrained_model_name_or_path, expert_parallel=expert_parallel, **kwargs
            )
        else:
            pipe = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        _record_text_encoder_files(pipe)
        if enhancer is not None:
            pipe.register_modules(**{PROMPT_ENHANCER: enhancer})
        if context_parallel is not None:
            pipe.enable_context_parallel(context_parallel)
        return pipe

    def enable_context_parallel(self, config) -> None:
        """``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` on the transformer and the refiner."""
        enable_context_parallel(self, config)
