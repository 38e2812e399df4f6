"""MAGI-2 as Modular Diffusers blocks (``diffusers.modular_pipelines``): :class:`Magi2AutoBlocks` and
:class:`Magi2ModularPipeline`; the blocks own their steps, calling the public functions ``Magi2Pipeline`` calls,
and guide through diffusers guiders (:mod:`.guidance`)."""

from .before_denoise import (
    Magi2BroadcastConditioningStep,
    Magi2InputStep,
    Magi2PrepareLatentsStep,
    Magi2SetTimestepsStep,
)
from .decoders import Magi2AudioDecoderStep, Magi2VideoDecoderStep
from .denoise import (
    Magi2DenoiseLoopWrapper,
    Magi2DenoiseStep,
    Magi2LoopAfterDenoiser,
    Magi2LoopBeforeDenoiser,
    Magi2LoopDenoiser,
    Magi2RefinerDenoiseStep,
    Magi2RefinerLoopDenoiser,
)
from .encoders import Magi2ImageEncoderStep, Magi2PromptEnhancerStep, Magi2TextEncoderStep
from .modular_blocks_magi2 import (
    Magi2AutoBlocks,
    Magi2AutoImageEncoderStep,
    Magi2AutoPromptEnhancerStep,
    Magi2AutoRefinerStep,
    Magi2CoreDenoiseStep,
    Magi2DecodeStep,
)
from .modular_pipeline import Magi2ModularPipeline


__all__ = [
    "Magi2AudioDecoderStep",
    "Magi2AutoBlocks",
    "Magi2AutoImageEncoderStep",
    "Magi2AutoPromptEnhancerStep",
    "Magi2AutoRefinerStep",
    "Magi2BroadcastConditioningStep",
    "Magi2CoreDenoiseStep",
    "Magi2DecodeStep",
    "Magi2DenoiseLoopWrapper",
    "Magi2DenoiseStep",
    "Magi2ImageEncoderStep",
    "Magi2InputStep",
    "Magi2LoopAfterDenoiser",
    "Magi2LoopBeforeDenoiser",
    "Magi2LoopDenoiser",
    "Magi2ModularPipeline",
    "Magi2PrepareLatentsStep",
    "Magi2PromptEnhancerStep",
    "Magi2RefinerDenoiseStep",
    "Magi2RefinerLoopDenoiser",
    "Magi2SetTimestepsStep",
    "Magi2TextEncoderStep",
    "Magi2VideoDecoderStep",
]
