"""``Magi2ModelMixin``: what both MAGI-2 models add to diffusers' ``ModelMixin``; ``Magi2TransformerBase``: the
mixins and forward pieces both MAGI-2 transformers are built from.

* dtype moves (``to``, ``half``, a pipeline's ``to(dtype)``) keep the fp32 islands fp32 (the FP8 experts' and the
  FP8-stored projections' scales included; FP8 banks keep their dtype in ``Magi2MultiHeadMoE._apply``, FP8-stored
  projection weights here): they all end in ``_apply(fn)``, which lets an island follow only its device move;
* ``save_pretrained`` keeps other variants' shards, which diffusers 0.42's save deletes;
* ``enable_layerwise_casting`` matches islands as name components (diffusers matches substrings, so ``"gate"``
  would skip ``up_gate_proj``) and casts the modality-grouped linears too; ``enable_fp8_storage`` stores the same
  projections as e4m3 with per-channel scales (:mod:`.fp8_storage_magi2`), and ``from_pretrained`` keeps a repo
  stored so as it is;
* LoRA (``PeftAdapterMixin``) on every projection and router gate (:mod:`.lora_magi2`): PEFT's layers, ours for
  the modality-grouped projections; one load path for every file layout; ``safe_fusing`` is all or nothing.
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
from diffusers.configuration_utils import ConfigMixin
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.attention import AttentionMixin
from diffusers.models.modeling_utils import ModelMixin

from ..loaders.dense_fp8_loading import StoredFP8Shards
from ..loaders.original_checkpoint import FromOriginalCheckpointMixin
from ..utils.fp32_islands import is_fp32_island
from .attention_magi2 import check_attention_kwargs, check_transformer_geometry
from .cache_magi2 import Magi2CacheMixin
from .context_parallel_magi2 import Magi2ContextParallelMixin
from .fp8_storage_magi2 import fp8_storage_compute_dtype
from .modality import Magi2ModalityGroupedLinear
from .weight_streaming import Magi2WeightStreamingMixin


__all__ = ["Magi2ModelMixin", "Magi2TransformerBase", "checkpoint_with_inputs_on_host", "other_variant_shards"]

_VARIANT_SHARD = re.compile(r"^(?P<stem>[^.]+)\.(?P<variant>[^.]+)-\d{5}-of-\d{5}\.(?:safetensors|bin)$")


def other_variant_shards(folder: str | os.PathLike, variant: str | None) -> list[Path]:
    """Shard files in ``folder`` of a variant other than ``variant`` (``None`` = the default weights)."""
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
    """Drops ``ModelMixin.to``'s "should be kept in float32" warning, untrue here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32" not in record.getMessage()


@contextmanager
def _without_fp32_cast_warning():
    """Silence that warning for the block."""
    logger = logging.getLogger(ModelMixin.__module__)
    drop = _DropFp32CastWarning()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class Magi2ModelMixin(ModelMixin, PeftAdapterMixin):
    r"""``ModelMixin`` + ``PeftAdapterMixin`` with the changes of the module docstring; subclasses list their fp32
    islands in ``_keep_in_fp32_modules``."""

    @property
    def hidden_size(self) -> int:
        """Model width ``C = num_attention_heads * attention_head_dim``."""
        return self.config.num_attention_heads * self.config.attention_head_dim

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype the blocks compute in (under layerwise casting its compute dtype, not the storage dtype)."""
        return self.transformer_blocks[0].attention.compute_dtype

    def is_fp32_island(self, name: str) -> bool:
        """Whether the parameter/buffer ``name`` stays fp32 whatever the model dtype (``_keep_in_fp32_modules``)."""
        return is_fp32_island(name, self._keep_in_fp32_modules)

    def _apply(self, fn, recurse=True):
        # islands (and FP8-stored weights) are told apart by identity; the dict keeps them alive so ids stay unique
        kept = {}
        for name, param in self.named_parameters():
            if param.is_floating_point() and self.is_fp32_island(name):
                kept |= {id(t): (t, torch.float32) for t in (param, param.grad) if t is not None}
        kept |= {
            id(b): (b, torch.float32)
            for n, b in self.named_buffers()
            if b.is_floating_point() and self.is_fp32_island(n)
        }
        for module in self.modules():
            if fp8_storage_compute_dtype(module) is not None:
                kept[id(module.weight)] = (module.weight, module.weight.dtype)
        if not kept:
            return super()._apply(fn, recurse)

        def keep_dtypes(tensor):
            out = fn(tensor)
            if id(tensor) in kept and out.dtype != tensor.dtype:
                return tensor.to(device=out.device, dtype=kept[id(tensor)][1])
            return out

        return super()._apply(keep_dtypes, recurse)

    @property
    def dtype(self) -> torch.dtype:
        """``ModelMixin.dtype``; with FP8-stored dense weights (:meth:`enable_fp8_storage`) their compute dtype."""
        for module in self.modules():
            compute = fp8_storage_compute_dtype(module)
            if compute is not None:
                return compute
        return super().dtype

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, resolved_model_file, *args, **kwargs):
        # diffusers' per-shard loading step (the model on meta): FP8-stored dense weights placed as stored, not cast
        # to the load dtype and back (:mod:`~diffusers_magi2.loaders.dense_fp8_loading`)
        names = {f"{n}.weight" for n, m in model.named_modules() if fp8_storage_compute_dtype(m) is not None}
        if names:
            shards = [state_dict] if state_dict is not None else resolved_model_file
            resolved_model_file = StoredFP8Shards(shards, model, names, kwargs.get("device_map"))
            state_dict, kwargs["is_parallel_loading_enabled"] = None, False  # one shard at a time, placed here
        return super()._load_pretrained_model(model, state_dict, resolved_model_file, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``ModelMixin.from_pretrained``; a repo whose config records ``dense_storage_dtype="float8_e4m3fn"``
        keeps its stored FP8 weights and scales as they are (placed as stored, not cast) and computes in
        ``torch_dtype``."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if isinstance(model, Magi2ModelMixin) and model.config.get("dense_storage_dtype") is not None:
            dtype = kwargs.get("torch_dtype", kwargs.get("dtype"))
            model.enable_fp8_storage(dtype if isinstance(dtype, torch.dtype) else torch.float32)
        return loaded

    def to(self, *args, **kwargs):
        """``ModelMixin.to``; a dtype leaves the fp32 islands fp32."""
        with _without_fp32_cast_warning():
            return super().to(*args, **kwargs)

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

        Args: as ``ModelMixin.save_pretrained``. The other variants' shards are moved aside and back, also on error.

        Raises:
            ValueError: the model is expert-parallel (a rank holds only its routed experts).
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

    def enable_layerwise_casting(
        self,
        storage_dtype: torch.dtype = torch.float8_e4m3fn,
        compute_dtype: torch.dtype | None = None,
        skip_modules_pattern: tuple[str, ...] | None = None,
        skip_modules_classes: tuple[type, ...] | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Store the dense projections in ``storage_dtype`` and run each in ``compute_dtype`` (diffusers' hooks).

        The islands, ``_skip_layerwise_casting_patterns``, the routed experts and PEFT's adapter layers keep
        their dtype.

        Args:
            storage_dtype: dtype the weights are kept in between calls.
            compute_dtype: dtype of each layer's call; ``None`` = :attr:`dtype`.
            skip_modules_pattern: regexes of module names to leave alone, replacing the defaults.
            skip_modules_classes, non_blocking: as in diffusers.
        """
        from diffusers.hooks.layerwise_casting import apply_layerwise_casting, apply_layerwise_casting_hook

        if skip_modules_pattern is None:
            skip_modules_pattern = self._default_skip_patterns()
        if compute_dtype is None:
            compute_dtype = self.dtype
        apply_layerwise_casting(
            self, storage_dtype, compute_dtype, skip_modules_pattern, skip_modules_classes, non_blocking
        )
        for _, module in self._dense_projections(skip_modules_pattern, skip_modules_classes):
            if isinstance(module, Magi2ModalityGroupedLinear):
                apply_layerwise_casting_hook(module, storage_dtype, compute_dtype, non_blocking)

    def enable_fp8_storage(self, compute_dtype: torch.dtype | None = None) -> None:
        """Store the dense projections in FP8 with one fp32 scale per output channel and run each in
        ``compute_dtype`` (:mod:`.fp8_storage_magi2`; a hook per projection, on diffusers' ``HookRegistry``).

        The projections are those :meth:`enable_layerwise_casting` stores (the islands, the routed experts and PEFT's
        adapter layers keep their dtype); each ``weight [O, I]`` becomes ``float8_e4m3fn`` beside a ``weight_scale
        [O]`` (fp32). The config records ``dense_storage_dtype="float8_e4m3fn"``, so ``save_pretrained`` writes the
        stored tensors and ``from_pretrained`` restores them as they are. Calling it again only changes the compute
        dtype. The model keeps working with ``.to()``, ``enable_model_cpu_offload``, group offload and LoRA; unlike
        layerwise casting, ``.to(dtype)`` leaves the stored weights in FP8.

        Args:
            compute_dtype: dtype of each projection's call; ``None``: the dtype the model computes in now.

        Raises:
            ValueError: a weight holds a NaN or inf (naming it); nothing is stored then.
        """
        from .fp8_storage_magi2 import apply_fp8_storage, quantize_rows_fp8

        compute_dtype = compute_dtype or self.compute_dtype
        targets = [(name, module) for name, module in self._dense_projections() if module.weight.numel()]
        for name, module in targets:  # every weight checked before the first is replaced
            if "weight_scale" not in module._buffers and not module.weight.is_meta:
                quantize_rows_fp8(module.weight, f"{name}.weight")
        for name, module in targets:
            apply_fp8_storage(module, compute_dtype, f"{name}.weight")
        self.register_to_config(dense_storage_dtype="float8_e4m3fn")

    def _default_skip_patterns(self) -> tuple[str, ...]:
        """The module-name regexes layerwise casting and FP8 storage leave alone: diffusers' defaults, the islands
        (as name components), ``_skip_layerwise_casting_patterns`` and PEFT's adapter layers."""
        from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN
        from diffusers.utils import is_peft_available

        patterns = list(DEFAULT_SKIP_MODULES_PATTERN)
        patterns += [rf"(^|\.){re.escape(m)}(\.|$)" for m in self._keep_in_fp32_modules or ()]
        patterns += list(self._skip_layerwise_casting_patterns or ())
        if is_peft_available():
            from peft.tuners.lora.layer import LoraLayer

            patterns += list(LoraLayer.adapter_layer_names)
        return tuple(dict.fromkeys(patterns))

    def _dense_projections(self, skip_modules_pattern=None, skip_modules_classes=None) -> list:
        """``[(name, module)]`` of the linear and modality-grouped projections outside the skip patterns."""
        patterns = self._default_skip_patterns() if skip_modules_pattern is None else skip_modules_pattern
        return [
            (name, module)
            for name, module in self.named_modules()
            if isinstance(module, (torch.nn.Linear, Magi2ModalityGroupedLinear))
            and not any(re.search(p, name) for p in patterns)
            and not (skip_modules_classes is not None and isinstance(module, skip_modules_classes))
        ]

    def modality_grouped_linear_names(self) -> list[str]:
        """Names of the modality-grouped projections (LoRA wraps them with ``Magi2GroupedLoraLinear``)."""
        return [name for name, module in self.named_modules() if isinstance(module, Magi2ModalityGroupedLinear)]

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """``PeftAdapterMixin.add_adapter``; the grouped projections take :mod:`.lora_magi2`'s LoRA layer and the
        router gates PEFT's ``target_parameters`` (``"mlp.moe_mlp.gate"``)."""
        from .lora_magi2 import register_magi2_lora_layers

        return super().add_adapter(register_magi2_lora_layers(adapter_config), adapter_name)

    def load_lora_adapter(
        self, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap: bool = False, **kwargs
    ):
        """Load a LoRA adapter into this model: diffusers' ``PeftAdapterMixin.load_lora_adapter`` for any layout of
        :mod:`~diffusers_magi2.loaders.lora_conversion_magi2` (converted to PEFT keys, scales folded into the
        factors), injected by PEFT (:func:`~.lora_magi2.load_magi2_lora_adapter`).

        Args:
            pretrained_model_name_or_path_or_dict: a state dict, a LoRA file, or a folder/repo (``weight_name``).
            prefix: component prefix of diffusers-layout keys to keep, and the component the other layouts load as
                (``None``: the keys are the model's own).
            hotswap: only ``False`` (``True`` raises).
            adapter_name: name of the new adapter (default ``default_{n}``).
            metadata: the adapter's ``LoraConfig`` fields (read from a saved file when not given).
            mirai_scale: scale of a mirai layout's ``B @ A`` (default 1.0; ``None``: the file's ``alpha / rank``).
            weight_name, subfolder, use_safetensors, revision, token, cache_dir, force_download, proxies,
                local_files_only: diffusers' file lookup.

        Raises:
            ValueError: a missing or unreadable file (its path named), unknown keys, shapes or ranks that do not
                fit, NaN or inf values (the keys named), unknown adapter config fields, non-tensor values, a used
                adapter name; ``hotswap=True``, ``low_cpu_mem_usage=True`` or ``network_alphas``. Nothing is
                loaded then.
            TypeError: an option diffusers' loaders do not have.
        """
        from ..loaders.lora_conversion_magi2 import (
            MIRAI_SCALE,
            check_lora_load_options,
            convert_lora_state_dict,
            detect_lora_layout,
            read_lora_state_dict,
            split_component,
        )
        from .lora_magi2 import load_magi2_lora_adapter

        adapter_name = kwargs.pop("adapter_name", None)
        metadata = kwargs.pop("metadata", None)
        mirai_scale = kwargs.pop("mirai_scale", MIRAI_SCALE)
        lookup = check_lora_load_options(hotswap, kwargs, own=("prefix", "adapter_name", "metadata", "mirai_scale"))
        state_dict, file_metadata = read_lora_state_dict(pretrained_model_name_or_path_or_dict, **lookup)
        component = prefix or "transformer"
        layout = detect_lora_layout(state_dict)
        state_dict = convert_lora_state_dict(state_dict, layout, component, mirai_scale)
        state_dict, metadata = split_component(
            state_dict, metadata if metadata is not None else file_metadata, component
        )
        if not state_dict:
            raise ValueError(f"the LoRA has no keys for the component {component!r}")
        if adapter_name is None:
            from diffusers.utils.peft_utils import get_adapter_name

            adapter_name = get_adapter_name(self)
        load_magi2_lora_adapter(self, state_dict, adapter_name, metadata=metadata, layout=layout)

    def check_lora_adapter(self, state_dict: dict, adapter_name: str, metadata=None, layout=None) -> None:
        """Check a LoRA in PEFT keys of this model (``<module>.lora_A.weight`` ...) without loading it.

        Raises:
            ValueError: what :meth:`load_lora_adapter` would raise for it (``layout`` is named in the message).
        """
        from .lora_magi2 import check_magi2_lora_adapter

        check_magi2_lora_adapter(self, state_dict, adapter_name, metadata, layout)

    def check_lora_fusable(self, lora_scale: float = 1.0, adapter_names=None) -> None:
        """Raise ``ValueError`` (the module and adapter named) if fusing ``adapter_names`` at ``lora_scale`` would
        leave a weight with NaN or inf values (:func:`~.lora_magi2.check_lora_fusable`); changes nothing."""
        from .lora_magi2 import check_lora_fusable

        check_lora_fusable(self, lora_scale, adapter_names)

    def fuse_lora(self, lora_scale=1.0, safe_fusing=False, adapter_names=None):
        """``PeftAdapterMixin.fuse_lora``; with ``safe_fusing`` every target is checked first
        (:meth:`check_lora_fusable`), so a broken adapter fuses nowhere. ``unfuse_lora`` (diffusers') restores
        the weights up to fp32 rounding.

        Raises:
            ValueError: ``safe_fusing`` and a merged weight would not be finite, or the dense weights are stored in
                FP8 (:meth:`enable_fp8_storage`); nothing is fused then.
        """
        if any(fp8_storage_compute_dtype(m) is not None for m in self.modules()):
            raise ValueError(
                "fuse_lora into FP8-stored dense weights (enable_fp8_storage) is not supported: the LoRA runs beside "
                "them unfused; fuse it before enable_fp8_storage"
            )
        if safe_fusing:
            self.check_lora_fusable(lora_scale, adapter_names)
        return super().fuse_lora(lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names)

    def enable_lora_hotswap(self, **kwargs) -> None:
        """Not supported for MAGI-2 LoRA adapters.

        Raises:
            ValueError: always (load another adapter under a new name instead).
        """
        raise ValueError(
            "LoRA hotswapping is not supported for MAGI-2 adapters: load the new one under another adapter_name "
            "(then set_adapters / delete_adapters)"
        )


class Magi2TransformerBase(
    Magi2WeightStreamingMixin,
    Magi2ContextParallelMixin,
    Magi2ModelMixin,
    ConfigMixin,
    FromOriginalCheckpointMixin,
    AttentionMixin,
    Magi2CacheMixin,
):
    r"""Base of both MAGI-2 transformers: :class:`Magi2ModelMixin` with diffusers' config, attention-processor and
    cache mixins, ``enable_parallelism`` (context parallelism) and ``from_original_checkpoint``, plus what both
    forwards share (the ``attention_kwargs`` check, a block call under gradient checkpointing). A subclass builds
    ``pre_adapter``, ``transformer_blocks`` and ``post_adapter`` and lists its fp32 islands in
    ``_keep_in_fp32_modules``."""

    _supports_gradient_checkpointing = True
    _skip_layerwise_casting_patterns = ["pre_adapter", "post_adapter", "norm"]
    #: ``attention_kwargs`` keys the forwards take: ``"scale"``, the LoRA scale (diffusers' ``apply_lora_scale``);
    #: kernels are chosen with ``set_attention_backend`` / ``set_attn_processor``.
    supported_attention_kwargs: tuple = ("scale",)

    def check_attention_kwargs(self, attention_kwargs) -> None:
        """Raise ``ValueError`` unless ``attention_kwargs`` is ``None`` or a dict of :attr:`supported_attention_kwargs`
        keys."""
        check_attention_kwargs(type(self).__name__, attention_kwargs, self.supported_attention_kwargs)

    def _check_geometry(self, *layer_lists: str) -> None:
        """:func:`~.attention_magi2.check_transformer_geometry` on this model's config; ``layer_lists`` name its
        per-layer index lists (``"multimodal_layers"``, ...)."""
        c = self.config
        lists = {name: c[name] for name in layer_lists}
        check_transformer_geometry(
            c.num_layers, c.num_attention_heads, c.num_key_value_heads, c.attention_head_dim, **lists
        )

    def enable_gradient_checkpointing(
        self, gradient_checkpointing_func: Callable | None = None, *, offload_block_inputs: bool = False
    ) -> None:
        """diffusers' gradient checkpointing: each block's activations are recomputed in backward, its input kept.

        Args:
            gradient_checkpointing_func: as in diffusers (default: torch's non-reentrant checkpoint).
            offload_block_inputs: keep each block's saved input in host memory until its backward
                (:func:`checkpoint_with_inputs_on_host`), so that the device holds one layer's input instead of
                every layer's (the preview's ``[N, n*C]`` residual: 14.8 GB over 40 layers at 272p).

        Raises:
            ValueError: both a ``gradient_checkpointing_func`` and ``offload_block_inputs``.
        """
        if offload_block_inputs:
            if gradient_checkpointing_func is not None:
                raise ValueError("pass gradient_checkpointing_func or offload_block_inputs=True, not both")
            gradient_checkpointing_func = checkpoint_with_inputs_on_host
        super().enable_gradient_checkpointing(gradient_checkpointing_func)

    def _run_block(self, block: torch.nn.Module, hidden_states: torch.Tensor, context) -> torch.Tensor:
        """``block(hidden_states, context)``, recomputed in backward when gradient checkpointing is on."""
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(self._checkpointed_block(block), hidden_states, context)
        return block(hidden_states, context)


def _to_host(tensor: torch.Tensor):
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor)
    return tensor.device, host


def _to_device(packed) -> torch.Tensor:
    device, host = packed
    return host.to(device, non_blocking=True)


def checkpoint_with_inputs_on_host(block: torch.nn.Module, *args):
    """torch's non-reentrant checkpoint of ``block(*args)``, whose saved inputs wait for the backward as host copies
    (pinned on a GPU; the device's are freed once nothing else holds them); a ``gradient_checkpointing_func``."""
    with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
