"""What the MAGI-2 blocks share: the component specs (the models and the two guiders), the pipeline config a block
reads, the block base with its input and component checks, and the repo-file check.

The blocks call the same public functions as ``Magi2Pipeline`` (:mod:`~diffusers_magi2.pipelines.sampling_magi2`,
``text_conditioning``, ``decoding_magi2``, ``refiner_stage``, ``validation_magi2``) with explicit arguments, and
keep the call state (``_interrupt``, ``_current_timestep`` ...) on the pipeline they run on, where callbacks read
and set it. They run on a plain ``diffusers.ModularPipeline`` too (the remote-code path
``ModularPipeline.from_pretrained(repo, trust_remote_code=True)``), so nothing here relies on the
``Magi2ModularPipeline`` subclass.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.modular_pipelines import ModularPipeline, ModularPipelineBlocks
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec, ConfigSpec, InputParam
from diffusers.utils import logging

from ..pipelines.geometry_magi2 import Magi2LatentGeometry, latent_geometry
from ..pipelines.modular_files import check_modular_files
from ..pipelines.pipeline_magi2 import Magi2Pipeline
from ..pipelines.presets_magi2 import COMPONENT_NAMES


logger = logging.get_logger(__name__)

__all__ = [
    "CALL_STATE",
    "GUIDER_SCALES",
    "Magi2Block",
    "Magi2BlockChecks",
    "check_component_types",
    "check_repo_files",
    "component_spec",
    "config_defaults",
    "config_specs",
    "pipeline_components",
    "pipeline_config",
    "pipeline_geometry",
    "planned_input",
    "planned_inputs",
]

#: Per-call state kept on the pipeline the blocks run on (the names ``Magi2Pipeline`` uses; callbacks set
#: ``_interrupt``).
CALL_STATE = ("_attention_kwargs", "_interrupt", "_current_timestep", "_num_timesteps")

#: The guiders every MAGI-2 pipeline has, with the default guidance scale of each (SandAI's 5 video, 7 audio).
GUIDER_SCALES = {"guider": 5.0, "audio_guider": 7.0}


def component_spec(name: str) -> ComponentSpec:
    """The ``ComponentSpec`` every block declares for ``name`` (a :data:`COMPONENT_NAMES` model or a guider of
    :data:`GUIDER_SCALES`: diffusers' ``ClassifierFreeGuidance``, created from its config, so nothing loads)."""
    if name in GUIDER_SCALES:
        from diffusers.guiders import ClassifierFreeGuidance

        return ComponentSpec(
            name,
            ClassifierFreeGuidance,
            config=FrozenDict({"guidance_scale": GUIDER_SCALES[name]}),
            default_creation_method="from_config",
            description=f"guidance of the {'audio' if name == 'audio_guider' else 'video'} latents",
        )
    from diffusers import AutoencoderKLWan, AutoencoderOobleck, UniPCMultistepScheduler
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..models.transformer_magi2 import Magi2Transformer3DModel
    from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
    from ..models.turbo_vae import Magi2TurboVAEDecoder
    from ..pipelines.prompt_enhancement import Magi2PromptEnhancer

    types = {
        "tokenizer": (PreTrainedTokenizerBase, "Qwen3.5 tokenizer"),
        "text_encoder": (PreTrainedModel, "Qwen3.5 text model (features: hidden_states[-3])"),
        "transformer": (Magi2Transformer3DModel, "the preview MoE DiT"),
        "audio_vae": (AutoencoderOobleck, "decoder of the 64-channel audio latents"),
        "scheduler": (UniPCMultistepScheduler, "flow-matching UniPC (flow_shift 7)"),
        "vae": (AutoencoderKLWan, "Wan2.2 VAE: I2V encoder, video decoder without video_decoder"),
        "video_decoder": (Magi2TurboVAEDecoder, "TurboVAED, the default video decoder"),
        "refiner": (Magi2RefinerTransformer3DModel, "the 1080p refiner DiT"),
        "prompt_enhancer": (Magi2PromptEnhancer, "rewrites each prompt (enable_prompt_enhancement)"),
    }
    type_hint, description = types[name]
    return ComponentSpec(name, type_hint, description=description)


def check_component_types(components, names=COMPONENT_NAMES, block: str = "Magi2 blocks") -> None:
    """Raise ``ValueError`` if a present component is not an instance of its :func:`component_spec` type."""
    for name in names:
        spec = component_spec(name)
        component = getattr(components, name, None)
        if component is None or isinstance(component, spec.type_hint):
            continue
        if name in GUIDER_SCALES:
            from diffusers.guiders import BaseGuidance

            if isinstance(component, BaseGuidance):
                continue  # any diffusers guider may stand in for ClassifierFreeGuidance
        raise ValueError(
            f"{block}: component {name!r} is a {type(component).__module__}.{type(component).__qualname__}, but its "
            f"ComponentSpec(name={name!r}, type_hint={spec.type_hint.__module__}.{spec.type_hint.__qualname__}) "
            f"requires an instance of {spec.type_hint.__qualname__} ({spec.description})"
        )


def pipeline_components(components) -> dict[str, Any]:
    """The MAGI-2 models the pipeline's blocks declare, by name (``None`` where not loaded): what
    :func:`~diffusers_magi2.pipelines.validation_magi2.check_call_inputs` checks a call against."""
    declared = set(getattr(components, "component_names", COMPONENT_NAMES))
    return {name: getattr(components, name, None) for name in COMPONENT_NAMES if name in declared}


def check_repo_files(components) -> None:
    """Once per pipeline loaded from a repo: refuse modular files that disagree with its ``model_index.json``
    (:func:`~diffusers_magi2.pipelines.modular_files.check_modular_files`)."""
    path = getattr(components, "_pretrained_model_name_or_path", None)
    if path is None or components.__dict__.get("_magi2_repo_checked") == path:
        return
    from diffusers import DiffusionPipeline

    loaded = []
    for cls in (DiffusionPipeline, ModularPipeline, ModularPipelineBlocks):
        try:
            loaded.append(cls.load_config(path))
        except EnvironmentError:
            loaded.append(None)
    if loaded[0] is not None and loaded[1] is not None:
        check_modular_files(*loaded)
    components.__dict__["_magi2_repo_checked"] = path


def config_defaults() -> dict[str, Any]:
    """The pipeline config keys and their defaults, read from ``Magi2Pipeline.__init__``'s signature."""
    params = inspect.signature(Magi2Pipeline.__init__).parameters
    return {n: p.default for n, p in params.items() if n != "self" and n not in COMPONENT_NAMES}


def config_specs(*names: str) -> list[ConfigSpec]:
    """``ConfigSpec`` of each named config value, with its default."""
    defaults = config_defaults()
    return [ConfigSpec(name, defaults[name]) for name in names]


def pipeline_config(components) -> dict[str, Any]:
    """The pipeline's config values (the defaults for keys its blocks do not declare)."""
    config = getattr(components, "config", {}) or {}
    return {name: config.get(name, default) for name, default in config_defaults().items()}


def pipeline_geometry(components) -> Magi2LatentGeometry:
    """The call's latent sizes from the components and config the pipeline holds
    (:func:`~diffusers_magi2.pipelines.geometry_magi2.latent_geometry`)."""
    config = pipeline_config(components)
    return latent_geometry(
        *(getattr(components, name, None) for name in ("vae", "video_decoder", "audio_vae")),
        duration_s=config["duration_s"],
        fps=config["fps"],
        audio_latent_fps=config["audio_latent_fps"],
    )


class Magi2BlockChecks:
    """Checks every MAGI-2 block runs first: its required inputs (the error names the block) and the types of
    the components it declares (the error names the ``ComponentSpec``)."""

    def get_block_state(self, state):
        for param in self.inputs:
            if param.name and param.required and state.get(param.name) is None and param.default is None:
                raise ValueError(
                    f"{self.__class__.__name__}: required input {param.name!r} is missing"
                    + (f" ({param.description})" if param.description else "")
                )
        return super().get_block_state(state)

    def check_components(self, components) -> None:
        """Raise ``ValueError`` if a component this block declares is present with the wrong type."""
        known = (*COMPONENT_NAMES, *GUIDER_SCALES)
        names = [spec.name for spec in self.expected_components if spec.name in known]
        check_component_types(components, names, self.__class__.__name__)


class Magi2Block(Magi2BlockChecks, ModularPipelineBlocks):
    """A MAGI-2 block: ``description``, ``component_names`` (its ``ComponentSpec`` names) and ``config_names``
    (the config values it reads) are class attributes; ``__call__`` checks the inputs and the components, runs
    :meth:`run` on the block state and writes it back."""

    model_name = "magi2"
    description = ""
    component_names: tuple[str, ...] = ()
    config_names: tuple[str, ...] = ()

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [component_spec(name) for name in self.component_names]

    @property
    def expected_configs(self) -> list[ConfigSpec]:
        return config_specs(*self.config_names)

    def run(self, components, block_state) -> None:
        """The block's work on ``block_state`` (set its outputs as attributes)."""
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, components, state):
        block_state = self.get_block_state(state)
        self.check_components(components)
        self.run(components, block_state)
        self.set_block_state(state, block_state)
        return components, state


def planned_input(name: str, type_hint=int, required: bool = True) -> InputParam:
    """An input that the input step plans (``num_videos``, ``denoise_height``, ``refiner_config`` ...)."""
    return InputParam(name, required=required, type_hint=type_hint, description="from the input step")


def planned_inputs(*names: str, **kwargs) -> list[InputParam]:
    """:func:`planned_input` for each name, with the same options."""
    return [planned_input(name, **kwargs) for name in names]
