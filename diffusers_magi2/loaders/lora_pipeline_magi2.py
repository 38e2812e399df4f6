"""``Magi2LoraLoaderMixin``: diffusers' pipeline LoRA API (``WanLoraLoaderMixin`` / ``LTX2LoraLoaderMixin``) for
``Magi2Pipeline``'s two transformers, ``transformer`` (the Preview) and ``refiner``.

One load path, diffusers': ``load_lora_weights`` reads the file once through ``lora_state_dict``, which converts
any layout of :mod:`.lora_conversion_magi2` (diffusers, PEFT, ComfyUI, and the three layouts of seruva19/mirai) to
plain PEFT keys with the scales folded into the factors; each component's part then goes to that model's
``load_lora_adapter``. Diffusers-layout keys name their component (``transformer.`` / ``refiner.``), the others
go into the transformer, or the refiner with ``load_into_refiner=True``. Every component checks its part before
any is loaded. ``fuse_lora`` / ``unfuse_lora`` are diffusers' (``safe_fusing`` checks every target of every
component first); the LoRA scale of one call is ``pipe(..., attention_kwargs={"scale": s})``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

from diffusers.loaders.lora_base import LoraBaseMixin

from ..utils.safetensors_io import sort_metadata
from .lora_conversion_magi2 import (
    COMPONENTS,
    DEFAULT_WEIGHT_NAME,
    MIRAI_SCALE,
    check_lora_load_options,
    convert_lora_state_dict,
    read_lora_state_dict,
    split_component,
)


__all__ = ["Magi2LoraLoaderMixin"]

_OWN_OPTIONS = ("adapter_name", "load_into_refiner", "mirai_scale")


class Magi2LoraLoaderMixin(LoraBaseMixin):
    r"""Load, save, fuse and switch LoRA adapters of ``transformer`` and ``refiner`` (module docstring).

    The rest of diffusers' API comes from ``LoraBaseMixin``: ``unload_lora_weights``, ``set_adapters(names,
    adapter_weights)``, ``delete_adapters``, ``disable_lora`` / ``enable_lora``, ``get_active_adapters``,
    ``get_list_adapters``, ``set_lora_device``.
    """

    _lora_loadable_modules = list(COMPONENTS)
    transformer_name = "transformer"
    refiner_name = "refiner"

    @classmethod
    def lora_state_dict(
        cls,
        pretrained_model_name_or_path_or_dict,
        load_into_refiner: bool = False,
        mirai_scale: Optional[float] = MIRAI_SCALE,
        return_lora_metadata: bool = False,
        **kwargs,
    ):
        """The LoRA in plain PEFT keys prefixed ``transformer.`` / ``refiner.``, every scale folded into the
        factors (no ``.alpha`` key).

        Args:
            pretrained_model_name_or_path_or_dict: a state dict, a ``.safetensors`` / ``.pt`` file, or a folder or
                Hub repo (``weight_name``, ``subfolder``, ``use_safetensors``, ``revision``, ``token``, ...).
            load_into_refiner: put the keys of a layout without component names under ``refiner.``.
            mirai_scale: scale of a mirai layout's ``B @ A`` (1.0, what mirai trains at; its ``.alpha`` of 1.0 is
                not ``alpha / rank``); ``None`` reads the file's alpha the Kohya way.
            return_lora_metadata: also return the saved adapter config, its fields prefixed like the keys (or
                ``None``).

        Returns:
            ``state_dict`` or ``(state_dict, metadata)``.

        Raises:
            ValueError: a missing or unreadable file (its path named), an unknown layout (the first keys named),
                non-tensor values.
            TypeError: an option diffusers' loaders do not have.
        """
        lookup = check_lora_load_options(
            False, kwargs, own=("load_into_refiner", "mirai_scale", "return_lora_metadata")
        )
        state_dict, metadata = read_lora_state_dict(pretrained_model_name_or_path_or_dict, **lookup)
        component = cls.refiner_name if load_into_refiner else cls.transformer_name
        state_dict = convert_lora_state_dict(state_dict, None, component, mirai_scale)
        if metadata and not any(k.split(".", 1)[0] in COMPONENTS for k in metadata):
            metadata = {f"{component}.{k}": v for k, v in metadata.items()}  # a save_lora_adapter file's config
        return (state_dict, metadata) if return_lora_metadata else state_dict

    def load_lora_weights(
        self,
        pretrained_model_name_or_path_or_dict,
        adapter_name: Optional[str] = None,
        hotswap: bool = False,
        load_into_refiner: bool = False,
        mirai_scale: Optional[float] = MIRAI_SCALE,
        **kwargs,
    ) -> None:
        """Load a LoRA into the transformer and/or the refiner as adapter ``adapter_name``.

        Args:
            pretrained_model_name_or_path_or_dict, load_into_refiner, mirai_scale: see :meth:`lora_state_dict`.
            adapter_name: name of the new adapter in every component it loads into (default ``default_{n}``).
            hotswap: only ``False`` (``True`` raises).
            kwargs: file lookup (``weight_name``, ``subfolder``, ``use_safetensors``, ``revision``, ...);
                ``low_cpu_mem_usage`` only ``False``.

        Raises:
            ValueError: a missing or unreadable file (its path named); an unknown layout or keys (the first ones
                named); NaN or inf values (the keys named); target shapes or ranks that do not fit (e.g. a refiner
                LoRA into the preview); unknown adapter config fields; a missing refiner; a used adapter name;
                ``hotswap=True`` or ``low_cpu_mem_usage=True``. Nothing is loaded then, into any component.
            TypeError: an option diffusers' loaders do not have.
        """
        check_lora_load_options(hotswap, dict(kwargs), own=_OWN_OPTIONS)
        state_dict, metadata = self.lora_state_dict(
            pretrained_model_name_or_path_or_dict,
            load_into_refiner=load_into_refiner,
            mirai_scale=mirai_scale,
            return_lora_metadata=True,
            **kwargs,
        )
        parts = {}
        for name in COMPONENTS:
            part, meta = split_component(state_dict, metadata, name)
            if not part:
                continue
            model = getattr(self, name, None)
            if model is None:
                raise ValueError(f"the LoRA has {name} keys but this pipeline has no {name}; nothing was loaded")
            parts[name] = (model, part, meta)
        if adapter_name is None:
            from diffusers.utils.peft_utils import get_adapter_name

            adapter_name = get_adapter_name(next(iter(parts.values()))[0])
        for model, part, meta in parts.values():  # every component is checked before any is loaded
            model.check_lora_adapter(part, adapter_name, metadata=meta)
        loaded = []
        try:
            for model, part, meta in parts.values():
                model.load_lora_adapter(part, prefix=None, adapter_name=adapter_name, metadata=meta)
                loaded.append(model)
        except Exception:
            for model in loaded:
                model.delete_adapters(adapter_name)
            raise

    @classmethod
    def save_lora_weights(
        cls,
        save_directory: str | os.PathLike,
        transformer_lora_layers: Optional[dict] = None,
        refiner_lora_layers: Optional[dict] = None,
        is_main_process: bool = True,
        weight_name: Optional[str] = None,
        save_function: Optional[Callable] = None,
        safe_serialization: bool = True,
        transformer_lora_adapter_metadata: Optional[dict] = None,
        refiner_lora_adapter_metadata: Optional[dict] = None,
    ) -> None:
        """Write the LoRA layers of the transformer and/or the refiner to ``save_directory/weight_name``
        (``pytorch_lora_weights.safetensors``) in diffusers keys, with each adapter's config as metadata; the file
        is written under a temporary name and renamed (safetensors: its metadata keys sorted, so the same LoRA
        writes the same bytes).

        Args:
            transformer_lora_layers, refiner_lora_layers: ``peft.get_peft_model_state_dict(model, adapter_name=name)``
                of each.
            transformer_lora_adapter_metadata, refiner_lora_adapter_metadata: ``model.peft_config[name].to_dict()``
                of each component saved: the adapter's ranks and alphas, without which it would reload at scale 1.
            Others: as diffusers' ``save_lora_weights``.

        Raises:
            ValueError: neither component given, a component's layers without its adapter metadata, or
                ``save_directory`` is a file.
        """
        layers, metadata = {}, {}
        for name, part, meta in (
            (cls.transformer_name, transformer_lora_layers, transformer_lora_adapter_metadata),
            (cls.refiner_name, refiner_lora_layers, refiner_lora_adapter_metadata),
        ):
            if part:
                if not meta:
                    raise ValueError(
                        f"{name}_lora_layers needs {name}_lora_adapter_metadata=pipe.{name}.peft_config[adapter_name]"
                        ".to_dict(): without the adapter's config (lora_alpha, rank_pattern, ...) it would reload at "
                        "scale 1; nothing was saved"
                    )
                layers[name] = part
                metadata[name] = _json_ready(meta)
        if not layers:
            raise ValueError("pass transformer_lora_layers and/or refiner_lora_layers")
        if os.path.isfile(save_directory):
            raise ValueError(f"save_directory {str(save_directory)!r} is a file, not a folder")
        if not is_main_process:
            return
        weight_name = weight_name or (DEFAULT_WEIGHT_NAME if safe_serialization else "pytorch_lora_weights.bin")
        os.makedirs(save_directory, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".lora-", dir=save_directory)
        try:
            options = {
                "weight_name": weight_name,
                "save_function": save_function,
                "safe_serialization": safe_serialization,
            }
            cls._save_lora_weights(staging, layers, metadata, **options)
            if safe_serialization and save_function is None:
                sort_metadata(Path(staging, weight_name))
            os.replace(Path(staging, weight_name), Path(save_directory, weight_name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def fuse_lora(
        self,
        components: list[str] = list(COMPONENTS),
        lora_scale: float = 1.0,
        safe_fusing: bool = False,
        adapter_names: Optional[list[str]] = None,
        **kwargs,
    ) -> None:
        """diffusers' ``fuse_lora`` over ``components`` (missing ones skipped); with ``safe_fusing`` every target of
        every component is checked first, so a broken adapter fuses nowhere.

        Raises:
            ValueError: a component that takes no LoRA; ``safe_fusing`` and a merged weight would not be finite
                (the module and adapter named; nothing is fused then).
        """
        if safe_fusing:
            for name in components:
                model = getattr(self, name, None) if name in self._lora_loadable_modules else None
                if model is not None:
                    model.check_lora_fusable(lora_scale, adapter_names)
        super().fuse_lora(
            components=components,
            lora_scale=lora_scale,
            safe_fusing=safe_fusing,
            adapter_names=adapter_names,
            **kwargs,
        )

    def unfuse_lora(self, components: list[str] = list(COMPONENTS), **kwargs) -> None:
        """diffusers' ``unfuse_lora`` over ``components``: PEFT subtracts each fused delta again, which restores the
        weights up to fp32 rounding."""
        super().unfuse_lora(components=components, **kwargs)


def _json_ready(config: Optional[dict]) -> Optional[dict]:
    """A ``LoraConfig.to_dict()`` with sets as sorted lists and private fields dropped (safetensors metadata)."""
    if not config:
        return None
    out = {}
    for key, value in config.items():
        if key.startswith("_"):
            continue
        out[key] = sorted(value) if isinstance(value, set) else value
    return out
