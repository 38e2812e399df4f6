"""``Magi2ContextParallelMixin``: diffusers' ``enable_parallelism`` for both MAGI-2 transformers, on CUDA and CPU.

With ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` every rank passes the full inputs and
gets the full outputs, but runs the per-token work on its slice of the packed sequence; only the final gather is
added. As diffusers installs its parallel processors once, ``enable_parallelism`` installs the exchanges once
(:mod:`diffusers_magi2.parallel.exchanges`): the Ulysses attention on every attention module and, on every MoE
layer, the context-parallel expert exchange of its expert-parallel layout; the blocks then run unchanged, handing the
forward's shard plan to those exchanges. Expert parallelism enabled afterwards keeps them context parallel (each
exchange gives the one of the new layout), so the two may come in either order. The models pack their inputs
first, so they shard the packed sequence themselves and refuse diffusers' ``cp_plan``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..parallel.context_parallel import (
    Magi2ContextParallelGroup,
    Magi2SequenceShardPlan,
    gather_sequence_shards,
    plan_sequence_shards,
    resolve_context_parallel,
)
from ..parallel.exchanges import Magi2ContextParallelExpertExchange, Magi2UlyssesAttentionExchange


__all__ = ["Magi2ContextParallelMixin"]


class Magi2ContextParallelMixin:
    """Adds :meth:`enable_parallelism` (Ulysses context parallelism, CP x EP on the same ranks) to a MAGI-2 model."""

    _magi2_context_parallel: Optional[Magi2ContextParallelGroup] = None
    #: ``None`` (balanced contiguous split) or ``fn(num_tokens, world_size) -> per-rank token counts``, the same on
    #: every rank (uneven splits and empty ranks are allowed; e.g. to give a rank that also decodes less work).
    context_parallel_token_counts: Optional[Callable[[int, int], Sequence[int]]] = None

    def enable_parallelism(self, *, config, cp_plan=None):
        """Shard every forward's packed sequence over the ``ulysses_degree`` ranks; returns ``self``.

        Args:
            config: ``diffusers.ContextParallelConfig(ulysses_degree=N)`` (or a ``ParallelConfig`` holding one)
                with ``N`` the world size (``N = 1`` keeps the single-process forward).
            cp_plan: must be ``None`` (the model shards its packed sequence itself).

        Raises:
            TypeError: ``config`` holds no ``ContextParallelConfig``.
            ValueError: ``cp_plan`` given, tensor or ring parallelism asked for, ``N`` not the world size, or
                expert parallelism (enabled before or after) over other ranks or with a degree not dividing ``N``.
            RuntimeError: parallelism is already enabled on this model.
        """
        from diffusers import ContextParallelConfig, ParallelConfig

        if self._magi2_context_parallel is not None:
            raise RuntimeError(f"parallelism is already enabled on this {type(self).__name__}")
        if cp_plan is not None:
            raise ValueError(
                f"{type(self).__name__} shards its packed token sequence itself and takes no cp_plan; pass "
                "config=ContextParallelConfig(ulysses_degree=N) only"
            )
        if isinstance(config, ParallelConfig):
            if config.tensor_parallel_config is not None:
                raise ValueError(f"{type(self).__name__} does not support tensor parallelism")
            cp_config = config.context_parallel_config
        else:
            cp_config = config
        if not isinstance(cp_config, ContextParallelConfig):
            raise TypeError(
                "config must be a diffusers ContextParallelConfig(ulysses_degree=N) or a ParallelConfig holding one, "
                f"got {type(config).__name__}"
            )
        cp = resolve_context_parallel(cp_config)
        if cp.size > 1:
            self._install_context_parallel_exchanges(cp)
        self._magi2_context_parallel = cp
        self._parallel_config = ParallelConfig(context_parallel_config=cp_config)
        return self

    def _install_context_parallel_exchanges(self, cp: Magi2ContextParallelGroup) -> None:
        """Ulysses attention on every ``Magi2Attention``, the context-parallel expert exchange of its EP layout on
        every ``Magi2MultiHeadMoE``; all are built (and the EP groups checked) before any is installed."""
        from ..moe.layer import Magi2MultiHeadMoE
        from .attention_magi2 import Magi2Attention

        attention = Magi2UlyssesAttentionExchange(cp.group, cp.rank, cp.size)
        exchanges = {}
        for name, module in self.named_modules():
            if isinstance(module, Magi2Attention):
                exchanges[module] = attention
            elif isinstance(module, Magi2MultiHeadMoE):
                try:
                    exchanges[module] = Magi2ContextParallelExpertExchange(cp, module.ep_layout, module.ep_group)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        for module, exchange in exchanges.items():
            module.exchange = exchange

    @property
    def context_parallel_degree(self) -> int:
        """``N`` after :meth:`enable_parallelism`, else 1."""
        return 1 if self._magi2_context_parallel is None else self._magi2_context_parallel.size

    @property
    def context_parallel_group(self) -> Optional[Magi2ContextParallelGroup]:
        """The resolved CP group (``group``, ``rank``, ``size``, ``device``) after :meth:`enable_parallelism`
        with ``N > 1``, else ``None``."""
        cp = self._magi2_context_parallel
        return None if cp is None or cp.size == 1 else cp

    def _context_parallel_plan(
        self, num_tokens: int, segment_lengths: Sequence[int]
    ) -> Optional[Magi2SequenceShardPlan]:
        """The sequence split of one forward over ``num_tokens`` packed tokens, or ``None`` without CP (or ``N = 1``)."""
        cp = self._magi2_context_parallel
        if cp is None or cp.size == 1:
            return None
        counts = (
            None
            if self.context_parallel_token_counts is None
            else self.context_parallel_token_counts(num_tokens, cp.size)
        )
        return plan_sequence_shards(num_tokens, cp.size, cp.rank, segment_lengths, counts)

    def _gather_sequence_shards(self, local, plan: Magi2SequenceShardPlan):
        """Every rank's rows of a forward's output assembled into ``[T, ...]`` (the final gather)."""
        return gather_sequence_shards(local, plan, self._magi2_context_parallel.group)
