"""``Magi2LoraLoaderMixin``: diffusers' pipeline LoRA API (``WanLoraLoaderMixin`` / ``LTX2LoraLoaderMixin``) for
``Magi2Pipeline``'s two transformers, ``transformer`` (the Preview) and ``refiner``.

A file's keys decide its layout (:mod:`.lora_conversion_magi2`: diffusers, PEFT, and the three layouts of
seruva19/mirai); diffusers-layout keys name their component (``transformer.`` / ``refiner.``), the others go into
the transformer, or the refiner with ``load_into_refiner=True``. Each model validates the whole adapter before
injecting it (``Magi2ModelMixin.load_lora_adapter``), and every component is validated before any is loaded.
``fuse_lora`` / ``unfuse_lora`` restore the weights bit for bit; the LoRA scale of one call is
``pipe(..., attention_kwargs={"scale": s})``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch
from diffusers.loaders.lora_base import LoraBaseMixin

from .lora_conversion_magi2 import (
    COMPONENTS,
    DEFAULT_WEIGHT_NAME,
    MIRAI_SCALE,
    convert_lora_state_dict,
    detect_lora_layout,
    read_lora_state_dict,
)


__all__ = ["Magi2LoraLoaderMixin"]


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
        """The LoRA in diffusers keys (``transformer.`` / ``refiner.`` prefixed).

        Args:
            pretrained_model_name_or_path_or_dict: a state dict, a ``.safetensors`` / ``.pt`` file, or a folder or
                Hub repo (``weight_name``, ``subfolder``, ``revision``, ...).
            load_into_refiner: put the keys of a layout without component names under ``refiner.``.
            mirai_scale: scale of a mirai layout's ``B @ A`` (1.0, what mirai trains at; its ``.alpha`` of 1.0 is
                not ``alpha / rank``); ``None`` reads the file's alpha the Kohya way.
            return_lora_metadata: also return the saved adapter config (or ``None``).

        Returns:
            ``state_dict`` or ``(state_dict, metadata)``.

        Raises:
            ValueError: an unknown layout (the first keys are named), non-tensor values, an unreadable file.
        """
        state_dict, metadata = read_lora_state_dict(pretrained_model_name_or_path_or_dict, **kwargs)
        layout = detect_lora_layout(state_dict)
        component = cls.refiner_name if load_into_refiner else cls.transformer_name
        state_dict = convert_lora_state_dict(state_dict, layout, component, mirai_scale)
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
            hotswap: not supported (raises).
            kwargs: file lookup (``weight_name``, ``subfolder``, ...); ``low_cpu_mem_usage`` is accepted and unused.

        Raises:
            ValueError: an unknown layout or keys (the layout and the first unmatched keys named), target shapes or
                ranks that do not fit (e.g. a refiner LoRA into the preview), non-tensor values, a missing
                refiner, a used adapter name, or ``hotswap=True``; nothing is loaded then, into any component.
        """
        if hotswap:
            raise ValueError("hotswap is not supported for MAGI-2 LoRA adapters; unload and load instead")
        kwargs.pop("low_cpu_mem_usage", None)
        raw, metadata = read_lora_state_dict(pretrained_model_name_or_path_or_dict, **kwargs)
        layout = detect_lora_layout(raw)
        component = self.refiner_name if load_into_refiner else self.transformer_name
        state_dict = convert_lora_state_dict(raw, layout, component, mirai_scale)
        stray = [k for k in state_dict if k.split(".", 1)[0] not in COMPONENTS]
        if stray:
            raise ValueError(f"LoRA ({layout} layout): keys outside {list(COMPONENTS)}, e.g. {sorted(stray)[:5]}")
        parts = {}
        for name in COMPONENTS:
            head = f"{name}."
            part = {k[len(head) :]: v for k, v in state_dict.items() if k.startswith(head)}
            if not part:
                continue
            model = getattr(self, name, None)
            if model is None:
                raise ValueError(f"the LoRA has {name} keys but this pipeline has no {name}; nothing was loaded")
            meta = None
            if metadata:
                meta = {k[len(head) :]: v for k, v in metadata.items() if k.startswith(head)} or None
            parts[name] = (model, part, meta)
        if adapter_name is None:
            from diffusers.utils.peft_utils import get_adapter_name

            adapter_name = get_adapter_name(next(iter(parts.values()))[0])
        for model, part, meta in parts.values():  # every component is checked before any is loaded
            model.check_lora_adapter(part, adapter_name, metadata=meta, layout=layout)
        loaded = []
        try:
            for model, part, meta in parts.values():
                model.load_lora_adapter(part, prefix=None, adapter_name=adapter_name, metadata=meta, layout="peft")
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
        is written under a temporary name and renamed.

        Args:
            transformer_lora_layers, refiner_lora_layers: ``peft.get_peft_model_state_dict(model)`` of each.
            transformer_lora_adapter_metadata, refiner_lora_adapter_metadata: ``model.peft_config[name].to_dict()``.
            Others: as diffusers' ``save_lora_weights``.

        Raises:
            ValueError: neither component given, or ``save_directory`` is a file.
        """
        layers, metadata = {}, {}
        for name, part, meta in (
            (cls.transformer_name, transformer_lora_layers, transformer_lora_adapter_metadata),
            (cls.refiner_name, refiner_lora_layers, refiner_lora_adapter_metadata),
        ):
            if part:
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
        """Merge the adapters into the weights of ``components`` (missing ones skipped); :meth:`unfuse_lora` undoes
        it bit for bit."""
        super().fuse_lora(
            components=components,
            lora_scale=lora_scale,
            safe_fusing=safe_fusing,
            adapter_names=adapter_names,
            **kwargs,
        )

    def unfuse_lora(self, components: list[str] = list(COMPONENTS), **kwargs) -> None:
        """Give ``components`` their unfused weights back, bit for bit (each model's ``unfuse_lora``).

        Raises:
            ValueError: a component that takes no LoRA.
        """
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name in components:
            if name not in self._lora_loadable_modules:
                raise ValueError(f"{name} is not one of {self._lora_loadable_modules}")
            model = getattr(self, name, None)
            if model is not None:
                model.unfuse_lora()
        remaining = set()
        for name in self._lora_loadable_modules:
            model = getattr(self, name, None)
            if isinstance(model, torch.nn.Module):
                for module in model.modules():
                    if isinstance(module, BaseTunerLayer):
                        remaining.update(module.merged_adapters)
        self._merged_adapters = self._merged_adapters & remaining


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
