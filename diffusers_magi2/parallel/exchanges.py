"""The exchanges of the parallel layers: one interface, ``dispatch`` before the local compute and ``combine`` after.

A MoE layer runs, straight through::

    local, handle = exchange.dispatch(x)        # this rank's tokens [S, H, Dh] -> what its heads serve [S', Hl, Dh]
    y_local = local_experts(local)              # routing + experts of the heads this rank owns
    y = exchange.combine(y_local, handle)       # [S', Hl, Dh] -> this rank's tokens, every head [S, H, Dh]

and an attention layer ``dispatch -> attend -> combine`` the same way: q/k/v of this rank's tokens in, every token
of this rank's query heads out (:class:`Magi2AttentionShard`), the attended heads sent back to their tokens. The
handle belongs to the exchange (token counts, layouts, and the dispatched input, which keeps a rank without real
heads in the autograd graph so its backward joins the collectives). The exchanges compose the collectives of
:mod:`.expert_parallel` and :mod:`.context_parallel`:

* :class:`Magi2LocalExpertExchange`: every token and head here; no collective.
* :class:`Magi2ExpertParallelExchange`: this EP rank's heads of tokens replicated (layout (a): one all-gather) or
  sharded by ``ep_token_counts`` (layout (b): two all-to-alls).
* :class:`Magi2ContextParallelExpertExchange`: the CP shard's tokens; EP 1 keeps them here, EP ``E | N`` sends them
  to their heads' owners (two all-to-alls).
* :class:`Magi2LocalAttentionExchange`: every token and head here; :class:`Magi2UlyssesAttentionExchange`: every
  token of this CP rank's query heads (two all-to-alls).

A MoE layer starts with :func:`expert_exchange` of its EP layout; ``enable_parallelism`` installs the context-parallel
ones. Expert parallelism enabled on a layer asks its exchange for the one of the new layout
(:meth:`Magi2ExpertExchange.for_expert_parallel`), so a context-parallel model stays context parallel and the two may
be enabled in either order.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .context_parallel import (
    Magi2ContextParallelGroup,
    Magi2SequenceShardPlan,
    Magi2UlyssesHeadLayout,
    ulysses_combine,
    ulysses_dispatch,
    ulysses_head_layout,
)
from .distributed import needs_autograd
from .expert_parallel import (
    Magi2EPHeadLayout,
    ep_combine,
    ep_dispatch,
    ep_gather_heads,
    ep_local_heads,
    ep_replica_combine,
    ep_replica_dispatch,
    ep_replica_layout,
)


__all__ = [
    "Magi2AttentionExchange",
    "Magi2AttentionShard",
    "Magi2ContextParallelExpertExchange",
    "Magi2ExpertExchange",
    "Magi2ExpertParallelExchange",
    "Magi2LocalAttentionExchange",
    "Magi2LocalExpertExchange",
    "Magi2UlyssesAttentionExchange",
    "check_expert_parallel_tiles",
    "expert_exchange",
]


@dataclasses.dataclass(frozen=True)
class _ExpertHandle:
    """What ``combine`` needs of its ``dispatch``."""

    local_input: torch.Tensor
    token_counts: Optional[tuple[int, ...]]
    autograd: bool


def _in_graph(local_output: torch.Tensor, handle: _ExpertHandle) -> torch.Tensor:
    """``local_output``, tied to the dispatched input when an idle rank's zeros left the autograd graph."""
    if handle.autograd and not local_output.requires_grad:
        return local_output + handle.local_input * 0
    return local_output


class Magi2ExpertExchange(abc.ABC):
    """How a MoE layer's heads meet their tokens: :meth:`dispatch` before the local experts, :meth:`combine` after.

    Attributes:
        sync_free: the expert backend must not read the host (another rank's asynchronous exchange would stall).
    """

    sync_free: bool = False

    @abc.abstractmethod
    def dispatch(
        self,
        hidden_states: torch.Tensor,
        *,
        ep_token_counts: Optional[Sequence[int]] = None,
        shard_plan: Optional[Magi2SequenceShardPlan] = None,
    ) -> tuple[torch.Tensor, Any]:
        """This rank's tokens ``[S, H, Dh]`` -> ``(local [S', Hl, Dh], handle)``: every token this rank's heads
        serve (``Hl`` local heads, padding heads zero).

        Args:
            ep_token_counts: expert parallelism only: ``None`` (tokens replicated) or per-rank host ints (sharded).
            shard_plan: the forward's sequence split under context parallelism, else ``None``.

        Raises:
            ValueError: token counts that do not fit this exchange (before any collective).
        """

    @abc.abstractmethod
    def combine(self, local_output: torch.Tensor, handle: Any) -> torch.Tensor:
        """The local experts' ``[S', Hl, Dh]`` -> this rank's tokens ``[S, H, Dh]``."""

    def token_chunk(self, chunk_size: Optional[int]) -> Optional[int]:
        """Tokens per chunk the layer may run in: ``None`` (whole) where every rank must join each exchange once."""
        return None

    def for_expert_parallel(self, layout: Magi2EPHeadLayout, group: Any) -> "Magi2ExpertExchange":
        """The exchange of a layer with EP head layout ``layout`` over ``group``, in this exchange's setting (one
        process or context parallel).

        Raises:
            ValueError: the EP group does not fit the setting (see :func:`check_expert_parallel_tiles`).
        """
        return expert_exchange(layout, group)


class Magi2LocalExpertExchange(Magi2ExpertExchange):
    """Every head and every token on this rank: no collective.

    Args:
        sync_free: as :attr:`Magi2ExpertExchange.sync_free`.
    """

    def __init__(self, sync_free: bool = False) -> None:
        self.sync_free = sync_free

    def dispatch(self, hidden_states, *, ep_token_counts=None, shard_plan=None):
        """``(hidden_states, None)``.

        Raises:
            ValueError: ``ep_token_counts`` given but not ``[S]`` (the one rank holds all ``S`` tokens).
        """
        if ep_token_counts is not None:
            counts = list(ep_token_counts)
            if len(counts) != 1 or isinstance(counts[0], bool) or counts[0] != hidden_states.shape[0]:
                raise ValueError(
                    f"ep_token_counts must be None or [{hidden_states.shape[0]}] for a layer without expert "
                    f"parallelism (one rank holding its {hidden_states.shape[0]} tokens), got {ep_token_counts!r}"
                )
        return hidden_states, None

    def combine(self, local_output, handle):
        return local_output

    def token_chunk(self, chunk_size):
        """``chunk_size``: tokens are independent here."""
        return chunk_size


class Magi2ExpertParallelExchange(Magi2ExpertExchange):
    """Expert parallelism over ``group``: tokens replicated (layout (a): slice the local heads, all-gather back) or
    sharded with ``ep_token_counts`` (layout (b): :func:`~.expert_parallel.ep_dispatch` /
    :func:`~.expert_parallel.ep_combine`).

    Args:
        layout: this rank's :class:`~.expert_parallel.Magi2EPHeadLayout`. group: the EP process group.
    """

    def __init__(self, layout: Magi2EPHeadLayout, group: Any) -> None:
        self.layout, self.group = layout, group

    def dispatch(self, hidden_states, *, ep_token_counts=None, shard_plan=None):
        """``shard_plan`` is not read.

        Raises:
            ValueError: no process group; ``ep_token_counts`` not ``N`` ints with this rank's entry ``S``.
        """
        if self.group is None:
            raise ValueError("Magi2MultiHeadMoE with ep_size > 1 needs ep_group (a torch.distributed process group)")
        if ep_token_counts is None:
            local, counts = ep_local_heads(hidden_states, self.layout), None
        else:
            local = ep_dispatch(hidden_states, ep_token_counts, self.layout, self.group)
            counts = tuple(ep_token_counts)
        return local, _ExpertHandle(local, counts, needs_autograd(hidden_states))

    def combine(self, local_output, handle):
        out = _in_graph(local_output, handle)
        if handle.token_counts is None:
            return ep_gather_heads(out, self.layout, self.group)
        return ep_combine(out, handle.token_counts, self.layout, self.group)


def check_expert_parallel_tiles(cp: Magi2ContextParallelGroup, layout: Magi2EPHeadLayout, ep_group: Any) -> None:
    """Expert parallelism fits context parallelism when its groups are consecutive CP ranks and its degree divides
    the CP degree (rank ``g E + p`` at EP position ``p``).

    Raises:
        ValueError: the EP degree does not divide the CP degree, or the EP group is not this rank's tile.
    """
    ep = layout.ep_size
    if ep == 1:
        return
    if cp.size % ep:
        raise ValueError(
            f"the expert-parallel degree ({ep}) divides neither the context-parallel degree ({cp.size}) nor into "
            f"whole EP groups of it; use an EP degree that divides {cp.size} (e.g. EP {cp.size}, or one that also "
            f"divides the {layout.num_heads} MoE heads, with replicas)"
        )
    cp_ranks = dist.get_process_group_ranks(cp.group) if cp.group is not None else [0]
    g, p = divmod(cp.rank, ep)
    expected = cp_ranks[g * ep : (g + 1) * ep]
    ep_ranks = dist.get_process_group_ranks(ep_group) if ep_group is not None else []
    if ep_ranks != expected or layout.ep_rank != p:
        raise ValueError(
            f"expert parallelism runs over ranks {ep_ranks} (EP rank {layout.ep_rank}) but context-parallel rank "
            f"{cp.rank} needs EP group {expected} at position {p}: set up EP with Magi2ExpertParallelConfig over the "
            "same ranks (consecutive groups of ep_degree ranks)"
        )


class Magi2ContextParallelExpertExchange(Magi2ExpertExchange):
    """A context-parallel rank's routed experts: its tokens are its sequence shard. EP degree 1 keeps them here; EP
    degree ``E | N`` sends them to their heads' owners, the replicas sharing the work
    (:func:`~.expert_parallel.ep_replica_dispatch` / :func:`~.expert_parallel.ep_replica_combine`; ``E = N`` is
    layout (b)). The backend runs without host reads.

    Args:
        cp: the CP group. layout: the layer's EP head layout. ep_group: its EP process group (``None`` for EP 1).

    Raises:
        ValueError: the EP group does not tile the CP ranks (:func:`check_expert_parallel_tiles`).
    """

    sync_free = True

    def __init__(self, cp: Magi2ContextParallelGroup, layout: Magi2EPHeadLayout, ep_group: Any) -> None:
        check_expert_parallel_tiles(cp, layout, ep_group)
        self.cp = cp
        self.layout = ep_replica_layout(layout.num_heads, cp.size, layout.ep_size, cp.rank)

    def dispatch(self, hidden_states, *, ep_token_counts=None, shard_plan=None):
        """The token counts come from ``shard_plan``.

        Raises:
            ValueError: ``ep_token_counts`` given (the shard plan holds the counts under context parallelism).
        """
        if ep_token_counts is not None:
            raise ValueError(
                "ep_token_counts must be None under context parallelism: the forward's shard plan gives every rank's "
                f"token count; got {ep_token_counts!r}"
            )
        if self.layout.ep_size == 1:
            return hidden_states, None
        counts = shard_plan.token_counts
        local = ep_replica_dispatch(hidden_states, counts, self.layout, self.cp.group, async_op=True).wait()
        return local, _ExpertHandle(local, counts, needs_autograd(hidden_states))

    def combine(self, local_output, handle):
        if handle is None:
            return local_output
        out = _in_graph(local_output, handle)
        return ep_replica_combine(out, handle.token_counts, self.layout, self.cp.group, async_op=True).wait()

    def token_chunk(self, chunk_size):
        """``chunk_size`` for EP degree 1 (no exchange), else ``None``."""
        return chunk_size if self.layout.ep_size == 1 else None

    def for_expert_parallel(self, layout, group):
        return Magi2ContextParallelExpertExchange(self.cp, layout, group)


def expert_exchange(layout: Magi2EPHeadLayout, group: Any) -> Magi2ExpertExchange:
    """The exchange of a layer of EP head ``layout`` in one process group: local for EP 1, else
    :class:`Magi2ExpertParallelExchange`."""
    return Magi2LocalExpertExchange() if layout.ep_size == 1 else Magi2ExpertParallelExchange(layout, group)


class Magi2AttentionShard(NamedTuple):
    """What an attention exchange's ``dispatch`` gives the attention: q ``[T', Hq', D]``, k/v ``[T', Hkv', D]`` and
    the global ids of the query heads (``None``: all)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    heads: Optional[range]


class Magi2AttentionExchange(abc.ABC):
    """How an attention layer meets its tokens: :meth:`dispatch` before the attention, :meth:`combine` after."""

    @abc.abstractmethod
    def dispatch(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        shard_plan: Optional[Magi2SequenceShardPlan] = None,
    ) -> tuple[Magi2AttentionShard, Any]:
        """This rank's q ``[S, Hq, D]``, k/v ``[S, Hkv, D]`` (one dtype) -> ``(shard, handle)``: the tokens and
        heads this rank attends over."""

    @abc.abstractmethod
    def combine(self, output: torch.Tensor, handle: Any) -> torch.Tensor:
        """The attention output of the shard's heads -> this rank's tokens ``[S, Hq, D]`` (the q/k/v dtype)."""

    def token_chunk(self, chunk_size: Optional[int]) -> Optional[int]:
        """Query tokens per chunk the layer may attend in: ``None`` (whole) where every rank must join each exchange
        once."""
        return None


class Magi2LocalAttentionExchange(Magi2AttentionExchange):
    """Every token here: the attention sees all query heads."""

    def token_chunk(self, chunk_size):
        """``chunk_size``: every key is here."""
        return chunk_size

    def dispatch(self, query, key, value, shard_plan=None):
        """``shard_plan`` is not read."""
        return Magi2AttentionShard(query, key, value, None), None

    def combine(self, output, handle):
        return output


@dataclasses.dataclass(frozen=True)
class _UlyssesHandle:
    layout: Magi2UlyssesHeadLayout
    plan: Magi2SequenceShardPlan
    query: torch.Tensor  # [T, |Q_r|, D], returned by a rank without query heads so its backward joins the exchange


class Magi2UlyssesAttentionExchange(Magi2AttentionExchange):
    """Ulysses attention over the CP group: :func:`~.context_parallel.ulysses_dispatch` (q, k, v in one all-to-all)
    brings every token of this rank's heads, :func:`~.context_parallel.ulysses_combine` sends the output back. The
    head layouts are host arithmetic, built once per ``(Hq, Hkv)``.

    Args:
        group: the CP process group. rank: this rank in it. world_size: its size ``N``.
    """

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self._layouts: dict = {}

    def dispatch(self, query, key, value, shard_plan=None):
        """k/v come matched one-to-one to the query heads unless those form plain GQA groups."""
        heads = (query.shape[1], key.shape[1])
        if heads not in self._layouts:
            self._layouts[heads] = ulysses_head_layout(*heads, self.world_size, self.rank)
        layout = self._layouts[heads]
        q, k, v = ulysses_dispatch(query, key, value, layout, shard_plan, self.group, async_op=True).wait()
        local_heads = layout.local_query_heads
        if len(local_heads):
            index = layout.local_kv_index()
            nq, nkv = len(local_heads), k.shape[1]
            if nq % nkv or index != tuple(i // (nq // nkv) for i in range(nq)):
                idx = torch.tensor(index, device=k.device)
                k, v = k.index_select(1, idx), v.index_select(1, idx)
        return Magi2AttentionShard(q, k, v, local_heads), _UlyssesHandle(layout, shard_plan, q)

    def combine(self, output, handle):
        """Sent back in the q/k/v dtype on every rank (an upcasting attention would otherwise send fp32 while a rank
        without query heads sends its empty shard in bf16: the receive splits would disagree)."""
        if not len(handle.layout.local_query_heads):
            output = handle.query  # [T, 0, D]
        return ulysses_combine(
            output.to(handle.query.dtype), handle.layout, handle.plan, self.group, async_op=True
        ).wait()
