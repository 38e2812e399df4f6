"""``Magi2ModularPipeline`` and the bridge that lets the blocks run ``Magi2Pipeline``'s own steps.

The blocks hold no second copy of the text templates, the schedules, the CFG forward or the decoders: each block
calls the classic pipeline's method on :func:`classic_steps` ``(components)``, a ``Magi2Pipeline`` over the
modular pipeline's components and config whose call state (guidance scales, ``attention_kwargs``, ``interrupt``,
the current timestep) lives on the modular pipeline, where callbacks read and set it. The blocks run on a plain
``diffusers.ModularPipeline`` too (the remote-code path ``ModularPipeline.from_pretrained(repo,
trust_remote_code=True)``), so nothing here relies on the ``Magi2ModularPipeline`` subclass.
"""

from __future__ import annotations

import inspect
import os
import weakref
from typing import Any

from diffusers.modular_pipelines import ComponentsManager, ModularPipeline
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec
from diffusers.utils import logging

from ..loaders.lora_pipeline_magi2 import Magi2LoraLoaderMixin
from ..pipelines.modular_files import MODULAR_CONFIG_FILE, check_modular_files
from ..pipelines.pipeline_magi2 import Magi2Pipeline


logger = logging.get_logger(__name__)

__all__ = [
    "CLASSIC_COMPONENTS",
    "Magi2BlockChecks",
    "CALL_STATE",
    "Magi2ModularPipeline",
    "check_component_types",
    "check_repo_files",
    "classic_config_defaults",
    "component_spec",
    "classic_steps",
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


class Magi2ModularPipeline(ModularPipeline, Magi2LoraLoaderMixin):
    r"""MAGI-2 Preview as a Modular Diffusers pipeline (default blocks :class:`~.Magi2AutoBlocks`).

    Same components, config and outputs as :class:`~diffusers_magi2.Magi2Pipeline`, bit for bit with the same
    seed; the call returns a ``PipelineState`` (``output="videos"``, ``["videos", "audio"]``, ... picks values).
    Callbacks get this pipeline as ``pipe`` and may set ``pipe._interrupt = True``. ::

        pipe = Magi2ModularPipeline.from_pretrained(repo)
        pipe.load_components(dtype={"default": torch.bfloat16, "vae": torch.float32, "audio_vae": torch.float32})
        out = pipe(prompt="A red fox trots through fresh snow", output=["videos", "audio"])

    Without ``blocks`` the pipeline builds :class:`~.Magi2AutoBlocks` (diffusers' own lookup of
    ``default_blocks_name`` only searches the ``diffusers`` namespace). LoRA: ``Magi2LoraLoaderMixin``'s API, as on
    ``Magi2Pipeline`` (``load_lora_weights``, ``set_adapters``, ``fuse_lora``, ``attention_kwargs={"scale": s}``).
    """

    default_blocks_name = "Magi2AutoBlocks"
    _callback_tensor_inputs = Magi2Pipeline._callback_tensor_inputs

    guidance_scale = Magi2Pipeline.guidance_scale
    audio_guidance_scale = Magi2Pipeline.audio_guidance_scale
    do_classifier_free_guidance = Magi2Pipeline.do_classifier_free_guidance
    num_timesteps = Magi2Pipeline.num_timesteps
    current_timestep = Magi2Pipeline.current_timestep
    interrupt = Magi2Pipeline.interrupt
    attention_kwargs = Magi2Pipeline.attention_kwargs
    vae_scale_factor_spatial = Magi2Pipeline.vae_scale_factor_spatial
    vae_scale_factor_temporal = Magi2Pipeline.vae_scale_factor_temporal
    num_channels_latents = Magi2Pipeline.num_channels_latents
    num_channels_audio_latents = Magi2Pipeline.num_channels_audio_latents
    audio_sample_rate = Magi2Pipeline.audio_sample_rate
    _video_latent_geometry = Magi2Pipeline._video_latent_geometry
    enable_context_parallel = Magi2Pipeline.enable_context_parallel

    def __init__(self, blocks=None, *args, **kwargs):
        if blocks is None:
            from .modular_blocks_magi2 import Magi2AutoBlocks

            blocks = Magi2AutoBlocks()
        super().__init__(blocks, *args, **kwargs)

    def set_progress_bar_config(self, **kwargs) -> None:
        """Progress-bar options (e.g. ``disable=True``) for every block's bars and the classic steps' bars."""
        self._progress_bar_config = dict(kwargs)

        def visit(block):
            if hasattr(block, "set_progress_bar_config"):
                block.set_progress_bar_config(**kwargs)
            for sub in block.sub_blocks.values():
                visit(sub)

        visit(self._blocks)
        components_steps = self.__dict__.get("_magi2_classic_steps")
        if components_steps is not None:
            components_steps[1].set_progress_bar_config(**kwargs)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        components_manager: ComponentsManager | None = None,
        collection: str | None = None,
        blocks=None,
        **kwargs,
    ) -> "Magi2ModularPipeline":
        """The pipeline of a MAGI-2 repo (local folder or Hub id), components not loaded yet
        (``load_components``), as ``ModularPipeline.from_pretrained`` but with our blocks and no remote code.

        Args:
            pretrained_model_name_or_path: a folder or Hub id with ``model_index.json`` (and the modular files
                that ``Magi2Pipeline.save_pretrained`` / ``magi2-convert`` write; without them the components are
                read from ``model_index.json``).
            components_manager, collection: as diffusers' ``ModularPipeline``.
            blocks: other blocks (default :class:`~.Magi2AutoBlocks`).
            kwargs: hub options (``cache_dir``, ``revision``, ``local_files_only``, ``token``, ...).

        Raises:
            ValueError: the repo's modular files disagree with its ``model_index.json`` (both named).
        """
        from diffusers import DiffusionPipeline
        from diffusers.modular_pipelines import ModularPipelineBlocks

        hub = {
            k: kwargs.pop(k) for k in ("cache_dir", "force_download", "proxies", "token", "revision") if k in kwargs
        }
        hub["local_files_only"] = kwargs.pop("local_files_only", False)
        model_index = DiffusionPipeline.load_config(pretrained_model_name_or_path, **hub)
        try:
            modular_index = ModularPipeline.load_config(pretrained_model_name_or_path, **hub)
        except EnvironmentError:
            modular_index = None
        if modular_index is not None:
            try:
                modular_config = ModularPipelineBlocks.load_config(pretrained_model_name_or_path, **hub)
            except EnvironmentError:
                modular_config = None
                logger.warning(f"{pretrained_model_name_or_path} has no {MODULAR_CONFIG_FILE}: no remote-code entry")
            check_modular_files(model_index, modular_index, modular_config)
        pipe = cls(
            blocks=blocks,
            pretrained_model_name_or_path=pretrained_model_name_or_path,
            components_manager=components_manager,
            collection=collection,
            modular_config_dict=modular_index,
            config_dict=None if modular_index is not None else model_index,
            **kwargs,
        )
        if not os.path.isdir(str(pretrained_model_name_or_path)):
            # a repo saved without repo_id and uploaded records its writer's folder: load from the Hub id instead
            for spec in pipe._component_specs.values():
                path = spec.pretrained_model_name_or_path
                if isinstance(path, str) and os.path.isabs(path) and not os.path.isdir(path):
                    spec.pretrained_model_name_or_path = str(pretrained_model_name_or_path)
        return pipe

    @classmethod
    def from_classic(cls, pipe: Magi2Pipeline, blocks=None, **kwargs) -> "Magi2ModularPipeline":
        """A modular pipeline sharing ``pipe``'s components (no copies) and config values.

        Args:
            pipe: a :class:`~diffusers_magi2.Magi2Pipeline` (e.g. ``build_tiny_default_pipeline()``).
            blocks: other blocks (default :class:`~.Magi2AutoBlocks`).
            kwargs: ``components_manager``, ``collection``.
        """
        modular = cls(blocks=blocks, **kwargs)
        present = {name: getattr(pipe, name, None) for name in CLASSIC_COMPONENTS}
        modular.update_components(**{name: module for name, module in present.items() if module is not None})
        config = {name: pipe.config[name] for name in classic_config_defaults() if name in pipe.config}
        modular.update_components(**config)
        return modular
