"""diffusers-magi2: SandAI's MAGI-2 Preview as a first-class Hugging Face Diffusers model.

Importing it registers the modules ``model_index.json`` names (public format: they never move). Typical use::

    import torch
    from diffusers_magi2 import Magi2Pipeline, export_to_video_with_audio

    pipe = Magi2Pipeline.from_pretrained("path/or/repo-id", dtype=torch.bfloat16)
    out = pipe("A red fox trots through fresh snow")
    export_to_video_with_audio(out.frames[0], "clip.mp4", audio=out.audio[0], fps=out.fps,
                               audio_sample_rate=out.audio_sample_rate)
"""

from __future__ import annotations


__version__ = "0.1.0.dev0"

from .utils.third_party_messages import install_third_party_message_filters


# transformers' CUDA-kernel advice where there is no CUDA, torch's weight_norm deprecation inside diffusers' Oobleck
install_third_party_message_filters()

from .loaders.lora_pipeline_magi2 import Magi2LoraLoaderMixin
from .models.transformer_magi2 import Magi2Transformer3DModel, Magi2TransformerOutput
from .models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel, Magi2RefinerTransformerOutput
from .models.turbo_vae import Magi2TurboVAEDecoder
from .modular_pipelines import Magi2AutoBlocks, Magi2ModularPipeline
from .moe.activation import swiglu7, swiglu7_pair
from .moe.experts import torch_mh_moe_forward
from .moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from .moe.routing import ExpertRoutes, RoutingScore, compute_topk_probs_and_indices, global_sort_routes
from .parallel.expert_parallel import Magi2ExpertParallelConfig
from .pipelines.pipeline_magi2 import Magi2Pipeline
from .pipelines.pipeline_output import Magi2PipelineOutput
from .pipelines.tiny_default import build_tiny_default_pipeline
from .utils.export import export_to_video_with_audio


__all__ = [
    "ExpertRoutes",
    "Magi2AutoBlocks",
    "Magi2ExpertParallelConfig",
    "Magi2LoraLoaderMixin",
    "Magi2ModularPipeline",
    "Magi2MultiHeadMoE",
    "Magi2MultiHeadMoEConfig",
    "Magi2Pipeline",
    "Magi2PipelineOutput",
    "Magi2RefinerTransformer3DModel",
    "Magi2RefinerTransformerOutput",
    "Magi2Transformer3DModel",
    "Magi2TransformerOutput",
    "Magi2TurboVAEDecoder",
    "RoutingScore",
    "build_tiny_default_pipeline",
    "compute_topk_probs_and_indices",
    "export_to_video_with_audio",
    "global_sort_routes",
    "swiglu7",
    "swiglu7_pair",
    "torch_mh_moe_forward",
    "triton_mh_moe_forward",
]


def __getattr__(name: str):
    # Triton is a Linux-only dependency: the fused kernel is imported on first use, so the package (and its
    # torch expert path) imports on machines without Triton. ``set_backend("triton")`` raises there.
    if name == "triton_mh_moe_forward":
        from .moe.experts_triton import triton_mh_moe_forward

        return triton_mh_moe_forward
    raise AttributeError(f"module 'diffusers_magi2' has no attribute {name!r}")
