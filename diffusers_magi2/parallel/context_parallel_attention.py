"""Ulysses attention for context parallelism: trade the token shard for a head shard and back.

Rank ``r`` holds ``q [S_r, Hq, D]``, ``k, v [S_r, Hkv, D]``. One ``all_to_all_single`` (q, k, v in one buffer)
gives every rank all ``T = sum S_q`` tokens for its heads, attention runs per segment as in one process, and a
second exchange sends the rows back. Query heads are padded to ``Hp = ceil(Hq/N) N``; rank ``j`` owns
``[j Hl, (j+1) Hl)`` and only its real heads ``[a, b)`` travel; it receives the kv heads ``[floor(a/rep),
floor((b-1)/rep)]`` they read (replicated when ``Hkv < N``). Elements sent per layer: ``S_r D sum_j (|Q_j| + 2|K_j|)``
in, ``T D |Q_r|`` back. SandAI's ``magi2_fa3_with_sink_cp`` does the same with equal shards and ``N | Hq``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .context_parallel import Magi2PendingExchange, Magi2SequenceShardPlan, flat_all_to_all


__all__ = [
    "Magi2UlyssesHeadLayout",
    "ulysses_head_layout",
    "ulysses_scatter_heads",
    "ulysses_gather_heads",
    "ulysses_attention",
    "Magi2LocalAttention",
    "Magi2UlyssesAttention",
]


@dataclasses.dataclass(frozen=True)
class Magi2UlyssesHeadLayout:
    """Which query and key/value heads each of the ``N`` Ulysses ranks computes (host integers).

    Attributes:
        num_heads: ``Hq``. num_kv_heads: ``Hkv`` (divides ``Hq``). world_size: ``N``. rank: this rank.
        query_ranges: per rank ``(a, b)``: the real query heads ``[a, b)`` it owns (``a == b`` when all padding).
        kv_ranges: per rank ``(c, d)``: the kv heads ``[c, d)`` those query heads read.
    """

    num_heads: int
    num_kv_heads: int
    world_size: int
    rank: int
    query_ranges: tuple[tuple[int, int], ...]
    kv_ranges: tuple[tuple[int, int], ...]

    @property
    def padded_num_heads(self) -> int:
        """``Hp = ⌈Hq/N⌉·N``."""
        return -(-self.num_heads // self.world_size) * self.world_size

    @property
    def local_num_heads(self) -> int:
        """``Hl = Hp/N`` (padded heads included)."""
        return self.padded_num_heads // self.world_size

    @property
    def local_query_heads(self) -> range:
        """Global ids of the real query heads this rank computes."""
        return range(*self.query_ranges[self.rank])

    @property
    def local_kv_heads(self) -> range:
        """Global ids of the kv heads this rank receives."""
        return range(*self.kv_ranges[self.rank])

    def widths(self) -> tuple[int, ...]:
        """Heads per destination in the fused exchange: ``|Q_j| + 2|K_j|``."""
        return tuple((b - a) + 2 * (d - c) for (a, b), (c, d) in zip(self.query_ranges, self.kv_ranges))

    def local_kv_index(self) -> tuple[int, ...]:
        """For each local query head, the position of its kv head among :attr:`local_kv_heads`."""
        rep = self.num_heads // self.num_kv_heads
        c = self.kv_ranges[self.rank][0]
        return tuple(h // rep - c for h in self.local_query_heads)

    def send_elements(self, plan: Magi2SequenceShardPlan, head_dim: int) -> tuple[int, int]:
        """Elements this rank sends ``(into attention, back from attention)`` per layer (self-sends included)."""
        s = plan.num_local_tokens
        into = s * head_dim * sum(self.widths())
        back = plan.num_tokens * head_dim * len(self.local_query_heads)
        return into, back


def ulysses_head_layout(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> Magi2UlyssesHeadLayout:
    """The :class:`Magi2UlyssesHeadLayout` of ``rank`` (host arithmetic).

    Raises:
        TypeError: a non-int argument. ValueError: non-positive head counts or world size, ``Hkv ∤ Hq``, or
            ``rank`` outside ``[0, N)``.
    """
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    local = -(-num_heads // world_size)
    rep = num_heads // num_kv_heads
    q_ranges, kv_ranges = [], []
    for j in range(world_size):
        a = min(num_heads, j * local)
        b = min(num_heads, (j + 1) * local)
        q_ranges.append((a, b))
        kv_ranges.append((a // rep, (b - 1) // rep + 1) if b > a else (0, 0))
    return Magi2UlyssesHeadLayout(num_heads, num_kv_heads, world_size, rank, tuple(q_ranges), tuple(kv_ranges))


def _check_shard(name: str, t: torch.Tensor, rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    if t.dim() != 3 or tuple(t.shape) != (rows, heads, head_dim):
        raise ValueError(f"{name} must be [{rows}, {heads}, {head_dim}] on this rank, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"q, k and v must share one dtype for the fused exchange; {name} is {t.dtype}, q is {dtype}")


def ulysses_scatter_heads(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Magi2UlyssesHeadLayout,
    plan: Magi2SequenceShardPlan,
    group: Any,
    async_op: bool = False,
):
    """Token shard → head shard for q, k and v in one ``all_to_all_single``.

    Args:
        query: ``[S_r, Hq, D]``; key, value: ``[S_r, Hkv, D]``, this rank's tokens, one dtype (the dtype sent).
        layout: this rank's :class:`Magi2UlyssesHeadLayout`. plan: the sequence split. group: the CP group.
        async_op: return a :class:`Magi2PendingExchange` instead of the result.

    Returns:
        ``(q [T, |Q_r|, D], k [T, |K_r|, D], v [T, |K_r|, D])``: every packed token for this rank's query heads
        :attr:`~Magi2UlyssesHeadLayout.local_query_heads` and kv heads :attr:`~Magi2UlyssesHeadLayout.local_kv_heads`.

    Raises:
        ValueError: shapes or dtypes that do not match the layout and plan (before any collective).
    """
    s, d = plan.num_local_tokens, query.shape[-1]
    _check_shard("query", query, s, layout.num_heads, d, query.dtype)
    _check_shard("key", key, s, layout.num_kv_heads, d, query.dtype)
    _check_shard("value", value, s, layout.num_kv_heads, d, query.dtype)
    nq = len(layout.local_query_heads)
    nkv = len(layout.local_kv_heads)

    def finish(recv: torch.Tensor):
        local = recv.view(plan.num_tokens, nq + 2 * nkv, d)
        return local[:, :nq], local[:, nq : nq + nkv], local[:, nq + nkv :]

    if layout.world_size == 1:
        result = (query, key, value)
        return Magi2PendingExchange(None, lambda: result) if async_op else result
    chunks = [
        torch.cat([query[:, a:b], key[:, c:e], value[:, c:e]], dim=1)
        for (a, b), (c, e) in zip(layout.query_ranges, layout.kv_ranges)
    ]
    send = torch.cat([chunk.reshape(-1) for chunk in chunks])
    in_splits = [s * w * d for w in layout.widths()]
    w_me = layout.widths()[layout.rank]
    out_splits = [c * w_me * d for c in plan.token_counts]
    work, recv = flat_all_to_all(send, out_splits, in_splits, group, async_op)
    pending = Magi2PendingExchange(work, lambda: finish(recv))
    return pending if async_op else pending.wait()


def ulysses_gather_heads(
    local_out: torch.Tensor,
    layout: Magi2UlyssesHeadLayout,
    plan: Magi2SequenceShardPlan,
    group: Any,
    async_op: bool = False,
):
    """Head shard → token shard: ``[T, |Q_r|, D]`` attention outputs → this rank's ``[S_r, Hq, D]``.

    One ``all_to_all_single``.

    Raises:
        ValueError: ``local_out`` is not ``[T, |Q_r|, D]``.
    """
    nq, d = len(layout.local_query_heads), local_out.shape[-1]
    if local_out.dim() != 3 or tuple(local_out.shape[:2]) != (plan.num_tokens, nq):
        raise ValueError(
            f"attention output must be [{plan.num_tokens}, {nq}, D] on this rank, got {tuple(local_out.shape)}"
        )
    if layout.world_size == 1:
        return Magi2PendingExchange(None, lambda: local_out) if async_op else local_out
    s = plan.num_local_tokens
    heads = [b - a for a, b in layout.query_ranges]
    send = local_out.contiguous().reshape(-1)
    in_splits = [c * nq * d for c in plan.token_counts]
    out_splits = [s * h * d for h in heads]
    work, recv = flat_all_to_all(send, out_splits, in_splits, group, async_op)

    def finish():
        parts = torch.split(recv, out_splits)
        return torch.cat([p.view(s, h, d) for p, h in zip(parts, heads)], dim=1)

    pending = Magi2PendingExchange(work, finish)
    return pending if async_op else pending.wait()


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, range], torch.Tensor],
    layout: Magi2UlyssesHeadLayout,
    plan: Magi2SequenceShardPlan,
    group: Any,
) -> torch.Tensor:
    """Scatter heads, run ``attention_fn`` on every token of this rank's heads, gather back: ``[S_r, Hq, D]``.

    ``attention_fn(q, k, v, query_heads)`` gets this rank's heads (k/v matched one-to-one to the query heads unless
    they form plain GQA groups; ``query_heads`` are global ids); its output is sent back in the q/k/v dtype, on
    every rank whatever its head count. Both exchanges are asynchronous.
    """
    pending = ulysses_scatter_heads(query, key, value, layout, plan, group, async_op=True)
    heads = layout.local_query_heads
    q_l, k_l, v_l = pending.wait()
    if len(heads) == 0:
        out = q_l  # [T, 0, D], still in the autograd graph so the backward joins the exchanges
    else:
        index = layout.local_kv_index()
        nq, nkv = len(heads), k_l.shape[1]
        if nq % nkv or index != tuple(i // (nq // nkv) for i in range(nq)):
            idx = torch.tensor(index, device=k_l.device)
            k_l, v_l = k_l.index_select(1, idx), v_l.index_select(1, idx)
        # back in the exchange dtype on every rank (an upcasting attention_fn would otherwise send fp32 while
        # a rank without query heads sends its empty bf16 shard: the receive splits would disagree)
        out = attention_fn(q_l, k_l, v_l, heads).to(q_l.dtype)
    return ulysses_gather_heads(out, layout, plan, group, async_op=True).wait()


class Magi2LocalAttention:
    """The attention exchange of one process: every token is here, ``attention_fn`` sees all query heads."""

    def __call__(self, query, key, value, attention_fn, shard_plan=None) -> torch.Tensor:
        """``attention_fn(query, key, value, None)``; ``shard_plan`` is not read."""
        return attention_fn(query, key, value, None)


class Magi2UlyssesAttention:
    """The attention exchange of a context-parallel rank: :func:`ulysses_attention` over ``group``.

    Installed on every attention module by ``enable_parallelism``; the head layouts are host arithmetic, built once
    per ``(Hq, Hkv)``.

    Args:
        group: the CP process group. rank: this rank in it. world_size: its size ``N``.
    """

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self._layouts: dict = {}

    def __call__(self, query, key, value, attention_fn, shard_plan: Magi2SequenceShardPlan) -> torch.Tensor:
        """This rank's ``[S_r, H, D]`` q/k/v attended over every token of ``shard_plan`` -> ``[S_r, Hq, D]``."""
        heads = (query.shape[1], key.shape[1])
        if heads not in self._layouts:
            self._layouts[heads] = ulysses_head_layout(*heads, self.world_size, self.rank)
        return ulysses_attention(query, key, value, attention_fn, self._layouts[heads], shard_plan, self.group)
