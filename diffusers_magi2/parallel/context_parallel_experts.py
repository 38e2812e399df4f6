"""Routed experts on sequence-sharded tokens when the EP degree divides the CP degree (EP groups with replicas).

``R = N / E`` EP groups tile the ``N`` CP ranks; rank ``r = g E + p`` owns the heads of EP position ``p``
(:func:`~.expert_parallel.ep_head_layout`), the ``R`` ranks of a position being replicas. Each rank cuts its ``S_q``
tokens into ``R`` parts (``floor(S_q / R)``, the rest round-robin, so replica loads differ by at most one token) and
sends part ``g`` to rank ``g E + p``: no rank idles. One ``all_to_all_single`` over the CP group goes in, one comes
back, ``S_r Hp Dh`` elements each way; ``E = N`` is :func:`~.expert_parallel.ep_dispatch` (layout (b)).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import torch

from .context_parallel import Magi2PendingExchange, flat_all_to_all, needs_autograd
from .expert_parallel import Magi2EPHeadLayout, ep_head_layout


__all__ = [
    "Magi2EPReplicaLayout",
    "ep_replica_layout",
    "replica_token_parts",
    "ep_replica_dispatch",
    "ep_replica_undispatch",
    "ep_replica_heads_forward",
    "Magi2ShardedTokenExperts",
]


@dataclasses.dataclass(frozen=True)
class Magi2EPReplicaLayout:
    """EP groups with replicas inside one CP group of ``N`` ranks.

    Attributes:
        world_size: CP degree ``N``. rank: this rank ``r``. ep_size: EP degree ``E`` (divides ``N``).
        heads: the MoE heads this rank owns (:class:`~.expert_parallel.Magi2EPHeadLayout` of position ``r mod E``).
    """

    world_size: int
    rank: int
    ep_size: int
    heads: Magi2EPHeadLayout

    @property
    def num_replicas(self) -> int:
        """``R = N/E``."""
        return self.world_size // self.ep_size

    @property
    def replica(self) -> int:
        """This rank's EP group ``g = r // E``."""
        return self.rank // self.ep_size


def ep_replica_layout(num_heads: int, world_size: int, ep_size: int, rank: int) -> Magi2EPReplicaLayout:
    """Head ownership of ``rank`` when EP degree ``ep_size`` divides CP degree ``world_size``.

    Raises:
        TypeError: a non-int argument. ValueError: non-positive sizes, ``rank`` outside ``[0, N)``, or ``E ∤ N``.
    """
    for name, value in (("num_heads", num_heads), ("world_size", world_size), ("ep_size", ep_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or ep_size < 1:
        raise ValueError(f"world_size and ep_size must be >= 1, got {world_size} and {ep_size}")
    if world_size % ep_size:
        raise ValueError(
            f"the expert-parallel degree ({ep_size}) must divide the context-parallel degree ({world_size}): EP groups "
            "tile the CP group, with world_size // ep_size replicas"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return Magi2EPReplicaLayout(world_size, rank, ep_size, ep_head_layout(num_heads, ep_size, rank % ep_size))


def replica_token_parts(token_counts: Sequence[int], num_replicas: int) -> tuple[tuple[int, ...], ...]:
    """``parts[q][g]``: how many of rank ``q``'s tokens (a contiguous run, in ``g`` order) go to replica ``g``."""
    parts, carried = [], 0
    for s in token_counts:
        base, rem = divmod(s, num_replicas)
        parts.append(tuple(base + (1 if (g - carried) % num_replicas < rem else 0) for g in range(num_replicas)))
        carried += rem
    return tuple(parts)


def _check_counts(token_counts: Sequence[int], layout: Magi2EPReplicaLayout, rows: int) -> tuple[int, ...]:
    counts = tuple(token_counts)
    if len(counts) != layout.world_size or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(
            f"token_counts must be {layout.world_size} non-negative host ints (one per CP rank), got {token_counts!r}"
        )
    if counts[layout.rank] != rows:
        raise ValueError(f"token_counts[{layout.rank}] = {counts[layout.rank]} but this rank holds {rows} tokens")
    return counts


def ep_replica_dispatch(
    x: torch.Tensor,
    token_counts: Sequence[int],
    layout: Magi2EPReplicaLayout,
    group: Any,
    async_op: bool = False,
):
    """This rank's ``[S_r, H, Dh]`` → the tokens this rank routes for its heads, ``[Σ_q n_{q,g}, Hl, Dh]``.

    Rows arrive in source-rank order (rank 0's part first). Padded heads are zeros. One ``all_to_all_single``.

    Raises:
        ValueError: ``x`` is not ``[S_r, H, Dh]`` or ``token_counts`` is not ``N`` ints with ``S_r`` at this rank.
    """
    heads = layout.heads
    counts = _check_counts(token_counts, layout, x.shape[0])
    if x.dim() != 3 or x.shape[1] != heads.num_heads:
        raise ValueError(f"expected x of shape [S, {heads.num_heads}, Dh], got {tuple(x.shape)}")
    s, h, dh = x.shape
    E, Hl = layout.ep_size, heads.local_num_heads
    if heads.padded_num_heads != h:
        x = torch.cat([x, x.new_zeros(s, heads.padded_num_heads - h, dh)], dim=1)
    if layout.world_size == 1:
        return Magi2PendingExchange(None, lambda: x) if async_op else x
    parts = replica_token_parts(counts, layout.num_replicas)
    xp = x.view(s, E, Hl, dh)
    pieces, start = [], 0
    for n in parts[layout.rank]:
        pieces.append(xp[start : start + n].transpose(0, 1).reshape(-1))  # [E, n, Hl, Dh]: destinations g·E + p
        start += n
    send = torch.cat(pieces)
    in_splits = [n * Hl * dh for n in parts[layout.rank] for _ in range(E)]
    mine = [p[layout.replica] for p in parts]
    out_splits = [n * Hl * dh for n in mine]
    work, recv = flat_all_to_all(send, out_splits, in_splits, group, async_op)
    pending = Magi2PendingExchange(work, lambda: recv.view(sum(mine), Hl, dh))
    return pending if async_op else pending.wait()


def ep_replica_undispatch(
    y: torch.Tensor,
    token_counts: Sequence[int],
    layout: Magi2EPReplicaLayout,
    group: Any,
    async_op: bool = False,
):
    """Inverse of :func:`ep_replica_dispatch`: ``[Σ_q n_{q,g}, Hl, Dh]`` → this rank's ``[S_r, H, Dh]``."""
    heads = layout.heads
    counts = tuple(token_counts)
    E, Hl, dh = layout.ep_size, heads.local_num_heads, y.shape[-1]
    if layout.world_size == 1:
        out = y[:, : heads.num_heads]
        return Magi2PendingExchange(None, lambda: out) if async_op else out
    parts = replica_token_parts(counts, layout.num_replicas)
    mine = [p[layout.replica] for p in parts]
    if y.shape[:2] != (sum(mine), Hl):
        raise ValueError(f"expected expert outputs of shape [{sum(mine)}, {Hl}, Dh], got {tuple(y.shape)}")
    send = y.contiguous().reshape(-1)
    in_splits = [n * Hl * dh for n in mine]
    out_splits = [n * Hl * dh for n in parts[layout.rank] for _ in range(E)]
    work, recv = flat_all_to_all(send, out_splits, in_splits, group, async_op)

    def finish():
        blocks, start = [], 0
        for n in parts[layout.rank]:
            size = E * n * Hl * dh
            block = recv[start : start + size].view(E, n, Hl, dh).transpose(0, 1)
            blocks.append(block.reshape(n, heads.padded_num_heads, dh))
            start += size
        return torch.cat(blocks)[:, : heads.num_heads]

    pending = Magi2PendingExchange(work, finish)
    return pending if async_op else pending.wait()


def ep_replica_heads_forward(
    x: torch.Tensor,
    compute_local_heads: Callable[[torch.Tensor], torch.Tensor],
    layout: Magi2EPReplicaLayout,
    group: Any,
    token_counts: Sequence[int],
) -> torch.Tensor:
    """Dispatch, ``compute_local_heads`` (``[S', Hl, Dh] → [S', Hl, Dh]``, zeros for padded heads), undispatch.

    Returns ``[S_r, H, Dh]``, as on one device; both exchanges are asynchronous.
    """
    local_in = ep_replica_dispatch(x, token_counts, layout, group, async_op=True).wait()
    out = compute_local_heads(local_in)
    if needs_autograd(x) and not out.requires_grad:
        out = out + local_in * 0  # keep an idle owner in the graph so its backward joins the collectives
    return ep_replica_undispatch(out, token_counts, layout, group, async_op=True).wait()


class Magi2ShardedTokenExperts:
    """The routed-expert exchange of a context-parallel rank whose tokens are its sequence shard, EP degree ``E``
    dividing the CP degree (:func:`ep_replica_heads_forward`; ``E = N`` is layout (b)). Installed on every MoE layer
    by ``enable_parallelism`` when the model is expert-parallel.

    Args:
        num_heads: MoE heads ``H``. ep_size: ``E``. group / rank / world_size: the CP group, this rank, ``N``.
    """

    def __init__(self, num_heads: int, ep_size: int, group: Any, rank: int, world_size: int) -> None:
        self.layout = ep_replica_layout(num_heads, world_size, ep_size, rank)
        self.group = group

    def __call__(self, x, compute_local_heads, ep_token_counts=None, shard_plan=None) -> torch.Tensor:
        """``[S_r, H, Dh]`` -> ``[S_r, H, Dh]``, the token counts read from ``shard_plan`` (``ep_token_counts`` is
        not read)."""
        local_heads = functools.partial(compute_local_heads, sync_free=True)
        return ep_replica_heads_forward(x, local_heads, self.layout, self.group, shard_plan.token_counts)

    def token_chunk(self, chunk_size):
        """``None``: every rank joins each exchange once per layer, so the layer runs unchunked."""
        return None
