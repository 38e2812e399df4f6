"""The bridge that lets the MAGI-2 blocks run ``Magi2Pipeline``'s own steps, and the checks every block runs.

The blocks hold no second copy of the text templates, the schedules, the CFG forward or the decoders: each block
calls the classic pipeline's method on :func:`classic_steps` ``(components)``, a ``Magi2Pipeline`` over the
modular pipeline's components and config whose call state (guidance scales, ``attention_kwargs``, ``interrupt``,
the current timestep) lives on the modular pipeline, where callbacks read and set it. The blocks run on a plain
``diffusers.ModularPipeline`` too (the remote-code path ``ModularPipeline.from_pretrained(repo,
trust_remote_code=True)``), so nothing here relies on the ``Magi2ModularPipeline`` subclass.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from diffusers.modular_pipelines import ModularPipeline, ModularPipelineBlocks
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec, InputParam
from diffusers.utils import logging

from ..pipelines.modular_files import check_modular_files
from ..pipelines.pipeline_magi2 import Magi2Pipeline


logger = logging.get_logger(__name__)

__all__ = [
    "CLASSIC_COMPONENTS",
    "Magi2Block",
    "Magi2BlockChecks",
    "CALL_STATE",
    "check_component_types",
    "check_repo_files",
    "classic_config_defaults",
    "component_spec",
    "classic_steps",
    "planned_input",
    "planned_inputs",
]

#: ``Magi2Pipeline``'s components, in its ``__init__`` order.
CLASSIC_COMPONENTS = (
    "tokenizer",
    "text_encoder",
    "transformer",
    "audio_vae",
    "scheduler",
    "vae",
    "video_decoder",
    "refiner",
)

#: Per-call state kept on the modular pipeline (the names ``Magi2Pipeline`` uses; callbacks set ``_interrupt``).
CALL_STATE = (
    "_guidance_scale",
    "_audio_guidance_scale",
    "_attention_kwargs",
    "_interrupt",
    "_current_timestep",
    "_num_timesteps",
)


def component_spec(name: str) -> ComponentSpec:
    """The ``ComponentSpec`` every block declares for ``name`` (one of :data:`CLASSIC_COMPONENTS`)."""
    from diffusers import AutoencoderKLWan, AutoencoderOobleck, UniPCMultistepScheduler
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..models.transformer_magi2 import Magi2Transformer3DModel
    from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
    from ..models.turbo_vae import Magi2TurboVAEDecoder

    types = {
        "tokenizer": (PreTrainedTokenizerBase, "Qwen3.5 tokenizer"),
        "text_encoder": (PreTrainedModel, "Qwen3.5 text model (features: hidden_states[-3])"),
        "transformer": (Magi2Transformer3DModel, "the preview MoE DiT"),
        "audio_vae": (AutoencoderOobleck, "decoder of the 64-channel audio latents"),
        "scheduler": (UniPCMultistepScheduler, "flow-matching UniPC (flow_shift 7)"),
        "vae": (AutoencoderKLWan, "Wan2.2 VAE: I2V encoder, video decoder without video_decoder"),
        "video_decoder": (Magi2TurboVAEDecoder, "TurboVAED, the default video decoder"),
        "refiner": (Magi2RefinerTransformer3DModel, "the 1080p refiner DiT"),
    }
    type_hint, description = types[name]
    return ComponentSpec(name, type_hint, description=description)


def check_component_types(components, names=CLASSIC_COMPONENTS, block: str = "Magi2 blocks") -> None:
    """Raise ``ValueError`` if a present component is not an instance of its :func:`component_spec` type."""
    for name in names:
        spec = component_spec(name)
        component = getattr(components, name, None)
        if component is None or isinstance(component, spec.type_hint):
            continue
        raise ValueError(
            f"{block}: component {name!r} is a {type(component).__module__}.{type(component).__qualname__}, but its "
            f"ComponentSpec(name={name!r}, type_hint={spec.type_hint.__module__}.{spec.type_hint.__qualname__}) "
            f"requires an instance of {spec.type_hint.__qualname__} ({spec.description})"
        )


def check_repo_files(components) -> None:
    """Once per pipeline loaded from a repo: refuse modular files that disagree with its ``model_index.json``
    (:func:`~diffusers_magi2.pipelines.modular_files.check_modular_files`)."""
    path = getattr(components, "_pretrained_model_name_or_path", None)
    if path is None or components.__dict__.get("_magi2_repo_checked") == path:
        return
    from diffusers import DiffusionPipeline
    from diffusers.modular_pipelines import ModularPipelineBlocks

    loaded = []
    for cls in (DiffusionPipeline, ModularPipeline, ModularPipelineBlocks):
        try:
            loaded.append(cls.load_config(path))
        except EnvironmentError:
            loaded.append(None)
    if loaded[0] is not None and loaded[1] is not None:
        check_modular_files(*loaded)
    components.__dict__["_magi2_repo_checked"] = path


def classic_config_defaults() -> dict[str, Any]:
    """``Magi2Pipeline``'s config keys and their defaults, read from its ``__init__`` signature."""
    params = inspect.signature(Magi2Pipeline.__init__).parameters
    return {n: p.default for n, p in params.items() if n != "self" and n not in CLASSIC_COMPONENTS}


def _on_modular(name: str) -> property:
    def get(self):
        return getattr(self._modular, name, None)

    def set_(self, value):
        setattr(self._modular, name, value)

    return property(get, set_, doc=f"``{name}`` of the modular pipeline's current call.")


class _Magi2ClassicSteps(Magi2Pipeline):
    """``Magi2Pipeline`` over a modular pipeline's components; its call state is the modular pipeline's."""

    _guidance_scale = _on_modular("_guidance_scale")
    _audio_guidance_scale = _on_modular("_audio_guidance_scale")
    _attention_kwargs = _on_modular("_attention_kwargs")
    _interrupt = _on_modular("_interrupt")
    _current_timestep = _on_modular("_current_timestep")
    _num_timesteps = _on_modular("_num_timesteps")

    def __init__(self, modular, **kwargs):
        object.__setattr__(self, "_modular", weakref.proxy(modular))
        super().__init__(**kwargs)

    @property
    def _execution_device(self):
        return self._modular._execution_device


def _modular_config(components) -> dict[str, Any]:
    config = getattr(components, "config", {}) or {}
    return {name: config.get(name, default) for name, default in classic_config_defaults().items()}


def classic_steps(components) -> Magi2Pipeline:
    """The ``Magi2Pipeline`` whose methods the blocks call, over ``components``' modules and config.

    Built once per set of components and config values (cached on ``components``; rebuilt after
    ``update_components``). Construction runs ``Magi2Pipeline``'s component fit checks.

    Raises:
        ValueError: components that do not fit each other (``Magi2Pipeline`` construction).
    """
    modules = {name: getattr(components, name, None) for name in CLASSIC_COMPONENTS}
    config = _modular_config(components)
    key = (tuple(id(m) for m in modules.values()), repr(sorted(config.items())))
    cached = components.__dict__.get("_magi2_classic_steps")
    if cached is not None and cached[0] == key:
        return cached[1]
    steps = _Magi2ClassicSteps(components, **modules, **config)
    progress = getattr(components, "_progress_bar_config", None)
    if progress:
        steps.set_progress_bar_config(**progress)
    components.__dict__["_magi2_classic_steps"] = (key, steps)
    return steps


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
        names = [spec.name for spec in self.expected_components if spec.name in CLASSIC_COMPONENTS]
        check_component_types(components, names, self.__class__.__name__)


class Magi2Block(Magi2BlockChecks, ModularPipelineBlocks):
    """A MAGI-2 block: ``description`` and ``component_names`` (its ``ComponentSpec`` names) are class attributes;
    ``__call__`` checks the inputs and the components, runs :meth:`run` on the block state and writes it back."""

    model_name = "magi2"
    description = ""
    component_names: tuple[str, ...] = ()

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [component_spec(name) for name in self.component_names]

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
