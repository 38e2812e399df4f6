"""``Magi2ModelMixin``: what both MAGI-2 transformers add to diffusers' ``ModelMixin``.

* **fp32 islands through dtype moves.** ``from_pretrained(dtype=...)`` keeps every ``_keep_in_fp32_modules``
  tensor fp32; ``ModelMixin.to(dtype)`` (and ``half()``, ``bfloat16()``, ``DiffusionPipeline.to(dtype)``)
  would cast them. Every one of these ends in ``nn.Module._apply(fn)``, so the mixin's ``_apply`` routes the
  islands (see :func:`~diffusers_magi2.utils.fp32_islands.is_fp32_island`): when ``fn`` changes a tensor's
  dtype, an island only follows its device move and stays fp32. Device-only moves (``.to("cuda")``,
  ``enable_model_cpu_offload``, group offload) keep every dtype as it is.
* **Saving next to other variants.** diffusers 0.42.1 ``ModelMixin.save_pretrained`` removes every file
  that looks like a shard of the weights name from the target folder, other variants' shards included
  (``diffusion_pytorch_model.bf16-00001-of-00002.safetensors`` goes when the default weights are saved, and
  the ``bf16`` index then points at missing files). :meth:`Magi2ModelMixin.save_pretrained` sets those
  shards aside for the duration of the save and puts them back.
* **Layerwise casting.** :meth:`Magi2ModelMixin.enable_layerwise_casting` is diffusers', with two changes:
  ``_keep_in_fp32_modules`` entries skip a module only when they equal a component of its name (the rule
  of :func:`~diffusers_magi2.utils.fp32_islands.is_fp32_island`; diffusers searches them as substrings,
  so ``"gate"`` would skip every ``up_gate_proj``), and the modality-grouped linears are cast too.
* **LoRA.** diffusers' ``PeftAdapterMixin``: every ``nn.Linear`` in ``transformer_blocks`` (the
  single-modality projections) takes an adapter. The modality-grouped projections of the multimodal layers
  hold one weight block per modality and are not ``nn.Linear``: targeting one raises ``ValueError``.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin

from ..utils.fp32_islands import is_fp32_island
from .modality import Magi2ModalityGroupedLinear

__all__ = ["Magi2ModelMixin", "other_variant_shards"]

_VARIANT_SHARD = re.compile(r"^(?P<stem>[^.]+)\.(?P<variant>[^.]+)-\d{5}-of-\d{5}\.(?:safetensors|bin)$")


def other_variant_shards(folder: str | os.PathLike, variant: str | None) -> list[Path]:
    """Shard files in ``folder`` that belong to a variant other than ``variant`` (``None`` = the default weights)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.iterdir()):
        match = _VARIANT_SHARD.match(path.name)
        if path.is_file() and match and match.group("variant") != variant:
            found.append(path)
    return found


class _DropFp32CastWarning(logging.Filter):
    """Drops ``ModelMixin.to``'s "should be kept in float32" warning, which this mixin makes untrue."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32" not in record.getMessage()


@contextmanager
def _without_fp32_cast_warning():
    """Silence the warning above on diffusers' ``modeling_utils`` logger for the duration of the block."""
    logger = logging.getLogger(ModelMixin.__module__)
    drop = _DropFp32CastWarning()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class Magi2ModelMixin(ModelMixin, PeftAdapterMixin):
    r"""``ModelMixin`` + ``PeftAdapterMixin`` whose dtype moves keep the fp32 islands, whose saves keep other
    variants and whose layerwise casting reaches every dense projection (see the module docstring).

    Subclasses list their islands in ``_keep_in_fp32_modules``; :meth:`is_fp32_island` answers for one name.
    """

    @property
    def hidden_size(self) -> int:
        """Model width ``C = num_attention_heads * attention_head_dim``."""
        return self.config.num_attention_heads * self.config.attention_head_dim

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype the blocks compute in (bf16 released, fp32 for exact checks): the block linears' weight dtype, or
        the compute dtype of layerwise casting (never its storage dtype)."""
        return self.transformer_blocks[0].attention.compute_dtype

    def is_fp32_island(self, name: str) -> bool:
        """Whether the parameter/buffer ``name`` stays fp32 whatever the model dtype (``_keep_in_fp32_modules``)."""
        return is_fp32_island(name, self._keep_in_fp32_modules)

    def _apply(self, fn, recurse=True):
        # ``fn`` sees the tensor objects themselves (parameters, their grads, buffers), so islands are told apart by
        # identity; ``islands`` keeps them alive so that their ids stay unique for the whole call.
        islands = []
        for name, param in self.named_parameters():
            if param.is_floating_point() and self.is_fp32_island(name):
                islands += [param] if param.grad is None else [param, param.grad]
        islands += [b for n, b in self.named_buffers() if b.is_floating_point() and self.is_fp32_island(n)]
        if not islands:
            return super()._apply(fn, recurse)
        island_ids = {id(t) for t in islands}

        def keep_islands(tensor):
            out = fn(tensor)
            if id(tensor) in island_ids and out.dtype != tensor.dtype:
                return tensor.to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(keep_islands, recurse)

    def to(self, *args, **kwargs):
        """``ModelMixin.to``; a dtype in the arguments leaves the fp32 islands fp32 (so no "kept in float32" warning)."""
        with _without_fp32_cast_warning():
            return super().to(*args, **kwargs)

    def to_compute_dtype(self, dtype: torch.dtype):
        """Same as ``.to(dtype)`` (which keeps the fp32 islands); kept for callers written before it did. Returns self."""
        return self.to(dtype)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        save_function: Callable | None = None,
        safe_serialization: bool = True,
        variant: str | None = None,
        max_shard_size: int | str = "10GB",
        push_to_hub: bool = False,
        **kwargs,
    ):
        """``ModelMixin.save_pretrained`` that keeps other variants' shards in ``save_directory``.

        Args: as ``ModelMixin.save_pretrained`` (``variant``, ``safe_serialization``, ``max_shard_size`` are
        named, so ``DiffusionPipeline.save_pretrained`` forwards them). The other variants' shard files are
        moved into a hidden folder inside ``save_directory`` and back, also when the save raises.

        Raises:
            ValueError: the model is expert-parallel (each rank holds only its routed experts, so the files
                would pass for a full checkpoint).
        """
        from ..moe.layer import Magi2MultiHeadMoE

        if any(isinstance(m, Magi2MultiHeadMoE) and m.ep_size > 1 for m in self.modules()):
            raise ValueError(
                "this model is expert-parallel (each rank holds only its routed experts); save a single-process "
                "model instead"
            )
        keep = other_variant_shards(save_directory, variant) if is_main_process else []
        stash = Path(save_directory) / f".keep-variants-{uuid.uuid4().hex[:8]}"
        moved: list[tuple[Path, Path]] = []
        if keep:
            stash.mkdir()
        try:
            for path in keep:
                aside = stash / path.name
                os.rename(path, aside)
                moved.append((aside, path))
            return super().save_pretrained(
                save_directory,
                is_main_process=is_main_process,
                save_function=save_function,
                safe_serialization=safe_serialization,
                variant=variant,
                max_shard_size=max_shard_size,
                push_to_hub=push_to_hub,
                **kwargs,
            )
        finally:
            for aside, original in moved:
                os.replace(aside, original)
            if keep:
                stash.rmdir()

    # ------------------------------------------------------------------------------------------ layerwise casting

    def enable_layerwise_casting(
        self,
        storage_dtype: torch.dtype = torch.float8_e4m3fn,
        compute_dtype: torch.dtype | None = None,
        skip_modules_pattern: tuple[str, ...] | None = None,
        skip_modules_classes: tuple[type, ...] | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Store the dense projections in ``storage_dtype`` and run each in ``compute_dtype`` (diffusers' hooks).

        As ``ModelMixin.enable_layerwise_casting``, except that the fp32 islands are matched as name components
        and the modality-grouped linears of the multimodal layers are cast like the ``nn.Linear`` s. The islands,
        ``_skip_layerwise_casting_patterns``, the routed experts (not a linear layer) and PEFT's adapter layers
        keep their dtype; activations run in ``compute_dtype``.

        Args:
            storage_dtype: dtype the weights are kept in between calls (e.g. ``torch.float8_e4m3fn``).
            compute_dtype: dtype each layer's weights are cast to for its call; ``None`` = :attr:`dtype`.
            skip_modules_pattern: regexes of module names to leave alone, replacing the defaults (diffusers'
                default patterns, the islands, ``_skip_layerwise_casting_patterns``, PEFT adapter layers).
            skip_modules_classes, non_blocking: as in diffusers.
        """
        import re

        from diffusers.hooks.layerwise_casting import (
            DEFAULT_SKIP_MODULES_PATTERN,
            apply_layerwise_casting,
            apply_layerwise_casting_hook,
        )
        from diffusers.utils import is_peft_available

        if skip_modules_pattern is None:
            patterns = list(DEFAULT_SKIP_MODULES_PATTERN)
            patterns += [rf"(^|\.){re.escape(m)}(\.|$)" for m in self._keep_in_fp32_modules or ()]
            patterns += list(self._skip_layerwise_casting_patterns or ())
            if is_peft_available():
                from peft.tuners.lora.layer import LoraLayer

                patterns += list(LoraLayer.adapter_layer_names)
            skip_modules_pattern = tuple(dict.fromkeys(patterns))
        if compute_dtype is None:
            compute_dtype = self.dtype
        apply_layerwise_casting(
            self, storage_dtype, compute_dtype, skip_modules_pattern, skip_modules_classes, non_blocking
        )
        for name, module in self.named_modules():
            skipped = any(re.search(p, name) for p in skip_modules_pattern) or (
                skip_modules_classes is not None and isinstance(module, skip_modules_classes)
            )
            if isinstance(module, Magi2ModalityGroupedLinear) and not skipped:
                apply_layerwise_casting_hook(module, storage_dtype, compute_dtype, non_blocking)

    # ------------------------------------------------------------------------------------------ LoRA

    def modality_grouped_linear_names(self) -> list[str]:
        """Names of the modality-grouped projections (one weight block per modality; they take no LoRA)."""
        return [name for name, module in self.named_modules() if isinstance(module, Magi2ModalityGroupedLinear)]

    @staticmethod
    def _grouped_lora_error(names: list[str] | None) -> ValueError:
        what = "the modality-grouped projection(s) " + (
            ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
            if names
            else "of the multimodal layers"
        )
        return ValueError(
            f"LoRA cannot target {what}: they hold one weight block per modality (video, audio, text) and are not "
            "nn.Linear. Target the single-modality projections only, e.g. add "
            "exclude_modules=model.modality_grouped_linear_names() to the LoraConfig."
        )

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """``PeftAdapterMixin.add_adapter``, checked first: the config must not target a modality-grouped projection.

        Raises:
            ValueError: ``adapter_config`` matches a name of :meth:`modality_grouped_linear_names` (all listed).
        """
        from peft.tuners.tuners_utils import check_target_module_exists

        targeted = [name for name in self.modality_grouped_linear_names() if check_target_module_exists(adapter_config, name)]
        if targeted:
            raise self._grouped_lora_error(targeted)
        return super().add_adapter(adapter_config, adapter_name)

    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap: bool = False, **kwargs):
        """``PeftAdapterMixin.load_lora_adapter`` (files written by ``save_lora_adapter`` carry no prefix: pass
        ``prefix=None``).

        Raises:
            ValueError: the adapter targets a modality-grouped projection (nothing is loaded).
        """
        try:
            return super().load_lora_adapter(pretrained_model_name_or_path_or_dict, prefix=prefix, hotswap=hotswap, **kwargs)
        except ValueError as error:
            # PEFT names the module it cannot wrap by its repr; turn that into the error above
            if Magi2ModalityGroupedLinear.__name__ in str(error):
                raise self._grouped_lora_error(None) from error
            raise
