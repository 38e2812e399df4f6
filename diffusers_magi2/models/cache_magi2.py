"""diffusers' caching hooks on both models: TaylorSeer's built-in identifiers do not match a MAGI-2 block's
``attention`` child, so :class:`Magi2CacheMixin` names it."""

from __future__ import annotations

import dataclasses

from diffusers.models.cache_utils import CacheMixin


__all__ = ["MAGI2_ATTENTION_IDENTIFIERS", "Magi2CacheMixin"]

#: Regexes (``re.fullmatch`` on module names) of the attention module of every MAGI-2 block.
MAGI2_ATTENTION_IDENTIFIERS = (r"transformer_blocks\.\d+\.attention",)


class Magi2CacheMixin(CacheMixin):
    """``CacheMixin`` whose TaylorSeer default approximates the blocks' attention modules."""

    def enable_cache(self, config) -> None:
        """``CacheMixin.enable_cache``; a bare ``TaylorSeerCacheConfig`` gets :data:`MAGI2_ATTENTION_IDENTIFIERS`."""
        from diffusers.hooks import TaylorSeerCacheConfig

        if (
            isinstance(config, TaylorSeerCacheConfig)
            and not config.cache_identifiers
            and not config.skip_predict_identifiers
            and not config.use_lite_mode
        ):
            config = dataclasses.replace(config, cache_identifiers=list(MAGI2_ATTENTION_IDENTIFIERS))
        super().enable_cache(config)
