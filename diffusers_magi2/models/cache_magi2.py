"""diffusers' caching hooks on both MAGI-2 models (:class:`Magi2CacheMixin`).

diffusers' hooks find modules by name, and MAGI-2's names differ from the ones they guess: a block's attention child
is ``transformer_blocks.<i>.attention`` (not ``attn``) and the output head is ``post_adapter`` (not ``proj_out``).
:meth:`Magi2CacheMixin.enable_cache` therefore

- gives a bare ``TaylorSeerCacheConfig`` the blocks' attention modules (:data:`MAGI2_ATTENTION_IDENTIFIERS`), and
  TaylorSeer's lite mode (every block skipped, the output head Taylor-predicted) our block and head names
  (:data:`MAGI2_LITE_SKIP_IDENTIFIERS`, :data:`MAGI2_LITE_CACHE_IDENTIFIERS`);
- refuses a config whose module patterns match no module of the model, naming each such pattern, and the hooks that
  cannot run on packed tokens (FasterCache) or only know other models (TextKVCache);
- makes FirstBlockCache's data-dependent skip decision the same on every context-parallel rank: each rank holds a
  shard of the first block's residual ``r`` (previous step ``r'``), so the relative change
  ``sum |r - r'| / sum |r'|`` is summed over the CP group before it is compared with the threshold (the
  single-process value; a rank skipping the remaining blocks while another enters their all-to-alls would hang).

The hooks find blocks and attention processors through diffusers' registries, where
:func:`register_block_for_caching_hooks` enters both models' blocks and the attention processors.
"""

from __future__ import annotations

import dataclasses
import re
import weakref

import torch
import torch.distributed as dist
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK, FBCHeadBlockHook
from diffusers.hooks.hooks import HookRegistry
from diffusers.models.cache_utils import CacheMixin

from .attention_magi2 import Magi2Attention


__all__ = [
    "MAGI2_ATTENTION_IDENTIFIERS",
    "MAGI2_LITE_CACHE_IDENTIFIERS",
    "MAGI2_LITE_SKIP_IDENTIFIERS",
    "Magi2CacheMixin",
    "register_block_for_caching_hooks",
]

#: Regexes (``re.fullmatch`` on module names) of the attention module of every MAGI-2 block.
MAGI2_ATTENTION_IDENTIFIERS = (r"transformer_blocks\.\d+\.attention",)
#: TaylorSeer lite mode: the blocks, skipped on predicted steps (diffusers' lite pattern ``^[^.]*block[^.]*\.[^.]+$``).
MAGI2_LITE_SKIP_IDENTIFIERS = (r"transformer_blocks\.\d+",)
#: TaylorSeer lite mode: the output head, Taylor-predicted on those steps (diffusers' lite pattern ``^proj_out$``).
MAGI2_LITE_CACHE_IDENTIFIERS = (r"post_adapter",)


def _unmatched(model: torch.nn.Module, patterns, match=re.fullmatch, kinds: tuple = (torch.nn.Module,)) -> list:
    """The ``patterns`` that match no module name of ``model`` (among modules of type ``kinds``)."""
    names = [name for name, module in model.named_modules() if name and isinstance(module, kinds)]
    return [p for p in patterns if not any(match(p, name) for name in names)]


def _refuse_unmatched(model, config, field: str, patterns, **kwargs) -> None:
    """ValueError naming the patterns of ``config.<field>`` that match no module of ``model``."""
    missing = _unmatched(model, patterns, **kwargs)
    if missing:
        raise ValueError(
            f"{type(config).__name__}.{field} pattern(s) {missing} match no module of {type(model).__name__}; its "
            f"blocks are transformer_blocks.<i> (attention: transformer_blocks.<i>.attention, output head: "
            "post_adapter)"
        )


class _Magi2FirstBlockHook(FBCHeadBlockHook):
    """diffusers' FirstBlockCache head hook with the skip decision summed over the model's CP group."""

    def __init__(self, state_manager, threshold: float, model: torch.nn.Module):
        super().__init__(state_manager, threshold)
        self._model = weakref.ref(model)

    @torch.compiler.disable
    def _should_compute_remaining_blocks(self, hidden_states_residual: torch.Tensor) -> bool:
        model = self._model()
        cp = None if model is None else getattr(model, "context_parallel_group", None)
        if cp is None:
            return super()._should_compute_remaining_blocks(hidden_states_residual)
        previous = self.state_manager.get_state().head_block_residual
        if previous is None:  # the first call of a context: every rank computes
            return True
        sums = torch.stack([(hidden_states_residual - previous).abs().sum(), previous.abs().sum()]).double()
        dist.all_reduce(sums, group=cp.group)
        return bool(sums[0] / sums[1] > self.threshold)


class Magi2CacheMixin(CacheMixin):
    """``CacheMixin`` that names MAGI-2's modules for diffusers' caching hooks (module docstring)."""

    def enable_cache(self, config) -> None:
        """``CacheMixin.enable_cache`` for MAGI-2's module names.

        Args:
            config: a diffusers cache config. ``TaylorSeerCacheConfig()`` without identifiers caches the blocks'
                attention modules; with ``use_lite_mode=True`` it skips the blocks and predicts ``post_adapter``.
                ``FirstBlockCacheConfig``, ``MagCacheConfig`` and ``PyramidAttentionBroadcastConfig`` run as in
                diffusers (FirstBlockCache decides once for all CP ranks).

        Raises:
            ValueError: a pattern of the config matches no module (the message names it); ``FasterCacheConfig``
                (its hooks split a ``[uncond; cond]`` batch and one ``sample`` output, MAGI-2 runs packed tokens of a
                ``[cond; uncond]`` batch with video and audio outputs); ``TextKVCacheConfig`` (NucleusMoE-Image only).
        """
        from diffusers.hooks import (
            FasterCacheConfig,
            FirstBlockCacheConfig,
            PyramidAttentionBroadcastConfig,
            TaylorSeerCacheConfig,
            TextKVCacheConfig,
        )
        from diffusers.models.attention import AttentionModuleMixin

        if isinstance(config, FasterCacheConfig):
            patterns = tuple(config.spatial_attention_block_identifiers) + tuple(
                config.temporal_attention_block_identifiers
            )
            missing = _unmatched(self, patterns, match=re.search, kinds=(AttentionModuleMixin,))
            raise ValueError(
                f"FasterCache cannot run on {type(self).__name__}: its attention identifiers {missing or patterns} "
                f"{'match no attention module' if missing else 'are not enough'} (ours are "
                "transformer_blocks.<i>.attention), and its hooks need what MAGI-2 does not have: a batch ordered "
                "[uncond; cond] with a single `sample` output, and attention inputs batch-first (MAGI-2 runs "
                "attention on the packed tokens of a [cond; uncond] batch and returns video and audio); use "
                "FirstBlockCacheConfig, TaylorSeerCacheConfig, MagCacheConfig or PyramidAttentionBroadcastConfig"
            )
        if isinstance(config, TextKVCacheConfig):
            raise ValueError(
                f"TextKVCacheConfig hooks NucleusMoE-Image blocks only; {type(self).__name__} has none (use "
                "FirstBlockCacheConfig, TaylorSeerCacheConfig, MagCacheConfig or PyramidAttentionBroadcastConfig)"
            )
        if isinstance(config, TaylorSeerCacheConfig):
            config = self._magi2_taylorseer_config(config)
        if isinstance(config, PyramidAttentionBroadcastConfig):
            attention = {"match": re.search, "kinds": (AttentionModuleMixin,)}
            for kind in ("spatial", "temporal", "cross"):
                field, patterns = f"{kind}_attention_block_identifiers", None
                if getattr(config, f"{kind}_attention_block_skip_range") is not None:
                    patterns = tuple(getattr(config, field))
                if patterns and len(_unmatched(self, patterns, **attention)) == len(patterns):
                    _refuse_unmatched(self, config, field, patterns, **attention)
        super().enable_cache(config)
        if isinstance(config, FirstBlockCacheConfig):
            registry = HookRegistry.check_if_exists_or_initialize(self.transformer_blocks[0])
            head = registry.get_hook(_FBC_LEADER_BLOCK_HOOK)
            registry.remove_hook(_FBC_LEADER_BLOCK_HOOK)
            registry.register_hook(
                _Magi2FirstBlockHook(head.state_manager, head.threshold, self), _FBC_LEADER_BLOCK_HOOK
            )
            HookRegistry.check_if_exists_or_initialize(self).invalidate_child_registries_cache()

    def _magi2_taylorseer_config(self, config):
        """The TaylorSeer config with MAGI-2's module names (defaults, lite mode); ValueError for unmatched patterns."""
        if config.use_lite_mode:
            if config.cache_identifiers or config.skip_predict_identifiers:
                raise ValueError(
                    "TaylorSeerCacheConfig(use_lite_mode=True) chooses its own modules (every block skipped, "
                    "post_adapter predicted); pass either use_lite_mode or cache_identifiers/skip_predict_identifiers"
                )
            return dataclasses.replace(
                config,
                use_lite_mode=False,
                skip_predict_identifiers=list(MAGI2_LITE_SKIP_IDENTIFIERS),
                cache_identifiers=list(MAGI2_LITE_CACHE_IDENTIFIERS),
            )
        if not config.cache_identifiers and not config.skip_predict_identifiers:
            return dataclasses.replace(config, cache_identifiers=list(MAGI2_ATTENTION_IDENTIFIERS))
        for field in ("cache_identifiers", "skip_predict_identifiers"):
            _refuse_unmatched(self, config, field, getattr(config, field) or [])
        return config


def _skip_magi2_attention(module, *args, **kwargs):
    """LayerSkip hooks: a skipped attention returns its input."""
    hidden_states = kwargs.get("hidden_states")
    return hidden_states if hidden_states is not None else args[0]


def register_block_for_caching_hooks(block_cls) -> None:
    """Register a block class and the processors with diffusers' hook registries (FirstBlockCache, MagCache,
    TaylorSeer; private API of diffusers 0.42)."""
    from diffusers.hooks._helpers import (
        AttentionProcessorMetadata,
        AttentionProcessorRegistry,
        TransformerBlockMetadata,
        TransformerBlockRegistry,
    )

    for processor_cls in Magi2Attention._available_processors:
        AttentionProcessorRegistry.register(
            model_class=processor_cls,
            metadata=AttentionProcessorMetadata(skip_processor_output_fn=_skip_magi2_attention),
        )
    TransformerBlockRegistry.register(
        model_class=block_cls,
        metadata=TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None),
    )
