"""diffusers-magi2: SandAI's MAGI-2 Preview as a first-class Hugging Face Diffusers model.

Typical use::

    import torch
    from diffusers_magi2 import Magi2Pipeline, export_to_video_with_audio

    pipe = Magi2Pipeline.from_pretrained("path/or/repo-id", dtype=torch.bfloat16)
    out = pipe("A red fox trots through fresh snow")
    export_to_video_with_audio(out.frames[0], "clip.mp4", audio=out.audio[0], fps=out.fps,
                               audio_sample_rate=out.audio_sample_rate)

Importing the package is cheap, as importing diffusers is: each public name below is imported on first use, so
a command line such as ``magi2-convert`` parses its arguments before torch is imported. The pipeline classes import
every module that ``model_index.json`` names (public format: they never move), so diffusers' loader, which looks
those modules up in ``sys.modules``, finds them once ``Magi2Pipeline`` or ``Magi2ModularPipeline`` is imported.
"""

from __future__ import annotations

import importlib


__version__ = "0.1.0.dev0"

from .utils.third_party_messages import install_third_party_message_filters


# transformers' CUDA-kernel advice where there is no CUDA, torch's weight_norm deprecation inside diffusers' Oobleck
install_third_party_message_filters()

#: public name -> the module that defines it (imported on first use). Triton is a Linux-only dependency, so
#: ``triton_mh_moe_forward`` is imported only when asked for, and the package (and its torch expert path) imports on
#: machines without Triton; ``set_backend("triton")`` raises there.
_PUBLIC_NAMES = {
    "ExpertRoutes": ".moe.routing",
    "Magi2AutoBlocks": ".modular_pipelines",
    "Magi2ExpertParallelConfig": ".parallel.expert_parallel",
    "Magi2LoraLoaderMixin": ".loaders.lora_pipeline_magi2",
    "Magi2ModularPipeline": ".modular_pipelines",
    "Magi2MultiHeadMoE": ".moe.layer",
    "Magi2MultiHeadMoEConfig": ".moe.layer",
    "Magi2Pipeline": ".pipelines.pipeline_magi2",
    "Magi2PipelineOutput": ".pipelines.pipeline_output",
    "Magi2PromptEnhancer": ".pipelines.prompt_enhancement",
    "Magi2RefinerTransformer3DModel": ".models.transformer_magi2_refiner",
    "Magi2RefinerTransformerOutput": ".models.transformer_magi2_refiner",
    "Magi2Transformer3DModel": ".models.transformer_magi2",
    "Magi2TransformerOutput": ".models.transformer_magi2",
    "Magi2TurboVAEDecoder": ".models.turbo_vae",
    "RoutingScore": ".moe.routing",
    "apply_router_input_check": ".models.finite_checks_magi2",
    "build_tiny_default_pipeline": ".pipelines.tiny_default",
    "build_tiny_random_pipeline": ".pipelines.tiny_default",
    "check_router_inputs_finite": ".models.finite_checks_magi2",
    "clear_router_input_flags": ".models.finite_checks_magi2",
    "compute_topk_probs_and_indices": ".moe.routing",
    "export_to_video_with_audio": ".utils.export",
    "global_sort_routes": ".moe.routing",
    "swiglu7": ".moe.activation",
    "swiglu7_pair": ".moe.activation",
    "torch_mh_moe_forward": ".moe.experts",
    "triton_mh_moe_forward": ".moe.experts_triton",
}

__all__ = sorted(_PUBLIC_NAMES)


def __getattr__(name: str):
    module = _PUBLIC_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'diffusers_magi2' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC_NAMES))
