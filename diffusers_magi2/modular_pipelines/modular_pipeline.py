"""``Magi2ModularPipeline``: MAGI-2 as a Modular Diffusers pipeline over :class:`~.Magi2AutoBlocks` (the blocks call
the public functions ``Magi2Pipeline`` calls; the guidance is its ``guider`` and ``audio_guider``)."""

from __future__ import annotations

import os

from diffusers.modular_pipelines import ComponentsManager, ModularPipeline
from diffusers.utils import logging

from ..loaders.lora_pipeline_magi2 import Magi2LoraLoaderMixin
from ..pipelines.geometry_magi2 import Magi2LatentGeometry, Magi2LatentGeometryMixin
from ..pipelines.loading_magi2 import enable_context_parallel
from ..pipelines.modular_files import MODULAR_CONFIG_FILE, check_modular_files, unsourced_components
from ..pipelines.pipeline_magi2 import Magi2Pipeline
from ..pipelines.presets_magi2 import CALLBACK_TENSOR_INPUTS, COMPONENT_NAMES
from .modular_blocks_magi2 import Magi2AutoBlocks
from .utils import config_defaults, pipeline_geometry


logger = logging.get_logger(__name__)

__all__ = ["Magi2ModularPipeline"]


def _call_state(name: str, doc: str) -> property:
    return property(lambda self: getattr(self, f"_{name}", None), doc=doc)


class Magi2ModularPipeline(Magi2LatentGeometryMixin, ModularPipeline, Magi2LoraLoaderMixin):
    r"""MAGI-2 Preview as a Modular Diffusers pipeline (default blocks :class:`~.Magi2AutoBlocks`).

    Same components, config and outputs as :class:`~diffusers_magi2.Magi2Pipeline`, bit for bit with the same
    seed, plus two guiders: ``guider`` guides the video latents and ``audio_guider`` the audio latents
    (diffusers' ``ClassifierFreeGuidance`` at 5 and 7 by default; the refiner stage runs ``guider``'s method at
    ``refiner_guidance_scale``). The call takes ``Magi2Pipeline.__call__``'s arguments but the two guidance
    scales, which are the guiders' (``pipe.update_components(guider=pipe.guider.new(guidance_scale=4.0))``, or
    another diffusers guider), and returns a ``PipelineState`` (``output="videos"``, ``["videos", "audio"]``, ...
    picks values). Callbacks get this pipeline as ``pipe`` and may set ``pipe._interrupt = True``. ::

        pipe = Magi2ModularPipeline.from_pretrained(repo)
        pipe.load_components(dtype={"default": torch.bfloat16, "vae": torch.float32, "audio_vae": torch.float32})
        out = pipe(prompt="A red fox trots through fresh snow", output=["videos", "audio"])

    Without ``blocks`` the pipeline builds :class:`~.Magi2AutoBlocks` (diffusers' own lookup of
    ``default_blocks_name`` only searches the ``diffusers`` namespace). LoRA: ``Magi2LoraLoaderMixin``'s API, as on
    ``Magi2Pipeline`` (``load_lora_weights``, ``set_adapters``, ``fuse_lora``, ``attention_kwargs={"scale": s}``).
    """

    default_blocks_name = "Magi2AutoBlocks"
    _callback_tensor_inputs = list(CALLBACK_TENSOR_INPUTS)

    num_timesteps = _call_state("num_timesteps", "Steps of the stage being (or last) denoised.")
    current_timestep = _call_state(
        "current_timestep", "The timestep being denoised (0-d tensor, 0-1000 scale), ``None`` outside the loops."
    )
    interrupt = _call_state("interrupt", "``True`` once a callback set ``pipe._interrupt = True``.")
    attention_kwargs = _call_state("attention_kwargs", "The ``attention_kwargs`` of the current/last call.")

    @property
    def guidance_scale(self) -> float | None:
        """The video guider's scale (``guider.guidance_scale``)."""
        return getattr(getattr(self, "guider", None), "guidance_scale", None)

    @property
    def audio_guidance_scale(self) -> float | None:
        """The audio guider's scale (``audio_guider.guidance_scale``)."""
        return getattr(getattr(self, "audio_guider", None), "guidance_scale", None)

    def __init__(self, blocks=None, *args, **kwargs):
        if blocks is None:
            blocks = Magi2AutoBlocks()
        super().__init__(blocks, *args, **kwargs)

    def __call__(self, state=None, output=None, **kwargs):
        """``ModularPipeline.__call__`` (the blocks' inputs by keyword; ``output`` picks values of the state), but a
        name that no block takes is refused rather than ignored with diffusers' warning.

        Raises:
            ValueError: an argument no block declares, listing the inputs; ``guidance_scale`` or
                ``audio_guidance_scale``, which the guiders carry, naming the update that sets them (the input step's
                refusal, which diffusers' own ``ModularPipeline`` runs too).
        """
        declared = {param.name for param in self._blocks.inputs} | {
            param.kwargs_type for param in self._blocks.inputs if param.kwargs_type
        }
        unknown = sorted(set(kwargs) - declared)
        if unknown:
            raise ValueError(
                f"{type(self).__name__} got {unknown}, which none of its blocks takes (diffusers' ModularPipeline "
                f"would ignore them with a warning); its inputs are {sorted(n for n in declared if n)}"
            )
        return super().__call__(state, output, **kwargs)

    def latent_geometry(self) -> Magi2LatentGeometry:
        """The latent sizes of a ``config.duration_s`` clip with this pipeline's components (the config defaults
        for keys its blocks do not declare)."""
        return pipeline_geometry(self)

    def enable_context_parallel(self, config) -> None:
        """``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` on the transformer and the refiner."""
        enable_context_parallel(self, config)

    def set_progress_bar_config(self, **kwargs) -> None:
        """Progress-bar options (e.g. ``disable=True``) for the loops of every block, nested ones included."""
        self._progress_bar_config = dict(kwargs)

        def visit(block):
            if hasattr(block, "set_progress_bar_config"):
                block.set_progress_bar_config(**kwargs)
            for sub in block.sub_blocks.values():
                visit(sub)

        visit(self._blocks)

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
            ValueError: the repo's modular files disagree with its ``model_index.json`` (both named), or a Hub id
                whose index names its components by subfolder only (saved without ``repo_id``).
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
            unsourced = unsourced_components(modular_index)
            if unsourced and not os.path.isdir(str(pretrained_model_name_or_path)):
                raise ValueError(
                    f"{pretrained_model_name_or_path}'s {cls.config_name} names components {unsourced} by subfolder "
                    "only (its writer knew no Hub id), so they load from a local copy alone: pass "
                    "huggingface_hub.snapshot_download(repo_id), or rewrite the modular files with the id "
                    "(write_modular_files(folder, repo=repo_id), magi2-convert --repo_id)"
                )
        pipe = cls(
            blocks=blocks,
            pretrained_model_name_or_path=pretrained_model_name_or_path,
            components_manager=components_manager,
            collection=collection,
            modular_config_dict=modular_index,
            config_dict=None if modular_index is not None else model_index,
            **kwargs,
        )
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
        present = {name: getattr(pipe, name, None) for name in COMPONENT_NAMES}
        declared = set(modular.component_names)
        modular.update_components(**{n: m for n, m in present.items() if m is not None and n in declared})
        config = {name: pipe.config[name] for name in config_defaults() if name in modular.config}
        modular.update_components(**config)
        return modular
