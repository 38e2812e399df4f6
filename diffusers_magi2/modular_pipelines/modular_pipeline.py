"""``Magi2ModularPipeline``: MAGI-2 as a Modular Diffusers pipeline over :class:`~.Magi2AutoBlocks` (the blocks
run ``Magi2Pipeline``'s own steps through :func:`~.utils.classic_steps`)."""

from __future__ import annotations

import os

from diffusers.modular_pipelines import ComponentsManager, ModularPipeline
from diffusers.utils import logging

from ..loaders.lora_pipeline_magi2 import Magi2LoraLoaderMixin
from ..pipelines.modular_files import MODULAR_CONFIG_FILE, check_modular_files
from ..pipelines.pipeline_magi2 import Magi2Pipeline
from .modular_blocks_magi2 import Magi2AutoBlocks
from .utils import CLASSIC_COMPONENTS, classic_config_defaults


logger = logging.get_logger(__name__)

__all__ = ["Magi2ModularPipeline"]


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
