"""diffusers-magi2: SandAI's MAGI-2 Preview as a first-class Hugging Face Diffusers model.

Public names are listed in ``_PUBLIC`` (name -> defining submodule). They are resolved on first
access, so ``import diffusers_magi2`` stays cheap; ``from diffusers_magi2 import X`` imports the
module that defines ``X``. Defining module paths are part of the on-disk format (``model_index.json``
stores them), so they never move.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

_PUBLIC: dict[str, str] = {
    # multi-head MoE core
    "compute_topk_probs_and_indices": "diffusers_magi2.moe.routing",
    "global_sort_routes": "diffusers_magi2.moe.routing",
    "swiglu7_pair": "diffusers_magi2.moe.experts",
    "torch_mh_moe_forward": "diffusers_magi2.moe.experts",
    "triton_mh_moe_forward": "diffusers_magi2.moe.experts_triton",
    "Magi2MultiHeadMoEConfig": "diffusers_magi2.moe.layer",
    "Magi2MultiHeadMoE": "diffusers_magi2.moe.layer",
    # models
    "Magi2Transformer3DModel": "diffusers_magi2.models.transformer_magi2",
    "Magi2TransformerOutput": "diffusers_magi2.models.transformer_magi2",
    "Magi2RefinerTransformer3DModel": "diffusers_magi2.models.transformer_magi2_refiner",
    "Magi2TurboVAEDecoder": "diffusers_magi2.models.turbo_vae",
    # expert parallelism
    "Magi2ExpertParallelConfig": "diffusers_magi2.parallel.expert_parallel",
    # pipelines
    "Magi2Pipeline": "diffusers_magi2.pipelines.pipeline_magi2",
    "Magi2PipelineOutput": "diffusers_magi2.pipelines.pipeline_output",
    "export_to_video_with_audio": "diffusers_magi2.utils.export",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'diffusers_magi2' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
