"""Context parallelism (CP) for MAGI-2: the sequence-shard plan of one packed token sequence, Ulysses attention over
it, and the CP group behind a diffusers ``ContextParallelConfig``.

**Plan.** Every rank gets the full inputs and keeps rows ``[o_r, o_r + S_r)`` of the ``T`` packed tokens, ``o_r =
S_0 + ... + S_{r-1}``; by default ``S_r = floor(T/N) + [r < T mod N]``, but any non-negative counts summing to ``T``
work. The counts are host integers every rank derives from the same inputs, so the plan is built once per forward
and no layer exchanges sizes. Features, coordinates, modality ids and time embedding are sliced with the tokens.
SandAI's ``magi2_preview.py`` (``psm`` CP groups) instead pads to a multiple of 48 and needs equal shards.

**Ulysses attention.** Rank ``r`` holds ``q [S_r, Hq, D]``, ``k, v [S_r, Hkv, D]``. One ``all_to_all_single`` (q, k,
v in one buffer) gives every rank all ``T`` tokens for its heads, attention runs per segment as in one process, and
a second exchange sends the rows back. Query heads are padded to ``Hp = ceil(Hq/N) N``; rank ``j`` owns ``[j Hl, (j+1)
Hl)`` and only its real heads ``[a, b)`` travel; it receives the kv heads ``[floor(a/rep), floor((b-1)/rep)]`` they
read (replicated when ``Hkv < N``). Elements sent per layer: ``S_r D sum_j (|Q_j| + 2|K_j|)`` in, ``T D |Q_r|`` back.
SandAI's ``magi2_fa3_with_sink_cp`` does the same with equal shards and ``N | Hq``. :func:`ulysses_dispatch` and
:func:`ulysses_combine` are the two exchanges; the attention layers hold them as an exchange object
(:mod:`.exchanges`).

**Group.** :func:`resolve_context_parallel` builds the group on CUDA and CPU alike (diffusers 0.42's own resolution
divides by the accelerator count); the CP degree is the world size, no ring attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .distributed import Magi2PendingExchange, all_gather_rows, all_to_all, resolve_mesh_group, world_size


__all__ = [
    "Magi2ContextParallelGroup",
    "Magi2SequenceShardPlan",
    "Magi2UlyssesHeadLayout",
    "balanced_token_counts",
    "broadcast_from_first_rank",
    "gather_sequence_shards",
    "plan_sequence_shards",
    "resolve_context_parallel",
    "ulysses_combine",
    "ulysses_dispatch",
    "ulysses_head_layout",
]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def balanced_token_counts(num_tokens: int, world_size: int) -> tuple[int, ...]:
    """``S_r = ⌊T/N⌋ + [r < T mod N]`` for ``r < N``: the default contiguous split (ranks may get 0 when ``T < N``)."""
    _check_int("num_tokens", num_tokens, 0)
    _check_int("world_size", world_size, 1)
    base, extra = divmod(num_tokens, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


@dataclasses.dataclass(frozen=True)
class Magi2SequenceShardPlan:
    """Which contiguous slice of the packed sequence each CP rank holds (host integers, identical on every rank).

    Attributes:
        token_counts: ``(S_0, ..., S_{N-1})``.
        rank: this rank ``r``.
        segment_lengths: packed sample lengths, summing to ``T``.
    """

    token_counts: tuple[int, ...]
    rank: int
    segment_lengths: tuple[int, ...]

    @property
    def world_size(self) -> int:
        """CP degree ``N``."""
        return len(self.token_counts)

    @property
    def num_tokens(self) -> int:
        """Packed sequence length ``T``."""
        return sum(self.token_counts)

    @property
    def offsets(self) -> tuple[int, ...]:
        """``(o_0, …, o_N)``: rank ``q`` holds ``[o_q, o_{q+1})``."""
        out = [0]
        for c in self.token_counts:
            out.append(out[-1] + c)
        return tuple(out)

    @property
    def start(self) -> int:
        """First packed row of this rank."""
        return self.offsets[self.rank]

    @property
    def num_local_tokens(self) -> int:
        """``S_r``."""
        return self.token_counts[self.rank]

    def shard(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's rows ``[o_r, o_r + S_r)`` of ``tensor`` along ``dim`` (a view; ``dim`` must have ``T`` rows).

        Raises:
            ValueError: ``tensor.shape[dim] != T``.
        """
        if tensor.shape[dim] != self.num_tokens:
            raise ValueError(
                f"cannot shard a tensor with {tensor.shape[dim]} rows along dim {dim}: the plan covers "
                f"{self.num_tokens} packed tokens"
            )
        return tensor.narrow(dim, self.start, self.num_local_tokens)

    def local_segment_lengths(self, rank: Optional[int] = None) -> tuple[int, ...]:
        """Tokens of each packed sample that rank ``rank`` (default: this rank) holds, one entry per sample."""
        rank = self.rank if rank is None else rank
        lo, hi = self.offsets[rank], self.offsets[rank + 1]
        out, seg_start = [], 0
        for length in self.segment_lengths:
            seg_end = seg_start + length
            out.append(max(0, min(hi, seg_end) - max(lo, seg_start)))
            seg_start = seg_end
        return tuple(out)


def plan_sequence_shards(
    num_tokens: int,
    world_size: int,
    rank: int,
    segment_lengths: Optional[Sequence[int]] = None,
    token_counts: Optional[Sequence[int]] = None,
) -> Magi2SequenceShardPlan:
    """Plan the contiguous CP split of a packed sequence of ``num_tokens`` tokens.

    Args:
        num_tokens: ``T`` (the same on every rank).
        world_size: CP degree ``N``. rank: this rank.
        segment_lengths: per-sample lengths summing to ``T``; ``None`` = one sample.
        token_counts: per-rank counts summing to ``T``; ``None`` = balanced.

    Returns:
        :class:`Magi2SequenceShardPlan`.

    Raises:
        TypeError: a non-int size. ValueError: negative sizes, ``rank`` outside ``[0, N)``, counts of the wrong
            length or sum, or segment lengths that do not sum to ``T``.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if token_counts is None:
        counts = balanced_token_counts(num_tokens, world_size)
    else:
        counts = tuple(token_counts)
        for i, c in enumerate(counts):
            _check_int(f"token_counts[{i}]", c, 0)
        if len(counts) != world_size or sum(counts) != num_tokens:
            raise ValueError(
                f"token_counts must be {world_size} non-negative ints summing to num_tokens={num_tokens}, "
                f"got {list(counts)}"
            )
    if segment_lengths is None:
        segments = (num_tokens,)
    else:
        segments = tuple(segment_lengths)
        for i, s in enumerate(segments):
            _check_int(f"segment_lengths[{i}]", s, 0)
        if sum(segments) != num_tokens:
            raise ValueError(f"segment_lengths {list(segments)} sum to {sum(segments)}, expected {num_tokens}")
    return Magi2SequenceShardPlan(counts, rank, segments)


def gather_sequence_shards(local: torch.Tensor, plan: Magi2SequenceShardPlan, group: Any) -> torch.Tensor:
    """Assemble every rank's ``[S_q, ...]`` rows into the full ``[T, ...]`` tensor on every rank.

    One all-gather padded to ``max S_q`` rows: the final gather of a CP forward, never inside a layer.

    Raises:
        ValueError: ``local`` does not hold this rank's ``S_r`` rows.
    """
    if local.shape[0] != plan.num_local_tokens:
        raise ValueError(f"rank {plan.rank} holds {local.shape[0]} rows but its plan says {plan.num_local_tokens}")
    if plan.world_size == 1:
        return local
    width = max(plan.token_counts)
    if width == 0:
        return local
    if local.shape[0] < width:
        local = torch.cat([local, local.new_zeros((width - local.shape[0], *local.shape[1:]))])
    gathered = all_gather_rows(local, group, plan.world_size)
    gathered = gathered.view(plan.world_size, width, *local.shape[1:])
    return torch.cat([gathered[q, :c] for q, c in enumerate(plan.token_counts)])


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


def ulysses_dispatch(
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
    work, recv = all_to_all(send, out_splits, in_splits, group, async_op)
    pending = Magi2PendingExchange(work, lambda: finish(recv))
    return pending if async_op else pending.wait()


def ulysses_combine(
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
    work, recv = all_to_all(send, out_splits, in_splits, group, async_op)

    def finish():
        parts = torch.split(recv, out_splits)
        return torch.cat([p.view(s, h, d) for p, h in zip(parts, heads)], dim=1)

    pending = Magi2PendingExchange(work, finish)
    return pending if async_op else pending.wait()


@dataclasses.dataclass(frozen=True)
class Magi2ContextParallelGroup:
    """Resolved CP group (``group`` is ``None`` only when ``size == 1``)."""

    group: Optional[Any]
    rank: int
    size: int
    device: torch.device


def resolve_context_parallel(config: Any) -> Magi2ContextParallelGroup:
    """The Ulysses group of a diffusers ``ContextParallelConfig`` (``config.setup`` is called, as diffusers does).

    The default process group must be initialised (the examples do it from the launcher's environment); the mesh is
    ``config.mesh`` or a new ``(1, N)`` ``("ring", "ulysses")`` mesh. On GPUs this rank computes on the current CUDA
    device (accelerate's ``PartialState`` sets it; under ``torchrun`` call ``torch.cuda.set_device``).

    Raises:
        TypeError: ``config`` is not a ``ContextParallelConfig``.
        ValueError: ``ring_degree != 1``; a ``ulysses_degree`` other than the world size; no process group
            while ``ulysses_degree > 1``.
    """
    from diffusers import ContextParallelConfig

    if not isinstance(config, ContextParallelConfig):
        raise TypeError(f"expected a diffusers ContextParallelConfig, got {type(config).__name__}")
    if (config.ring_degree or 1) != 1:
        raise ValueError(
            f"ring attention is not supported by the MAGI-2 models (ring_degree={config.ring_degree}); use "
            "ContextParallelConfig(ulysses_degree=N) with N the world size"
        )
    n = config.ulysses_degree or 1
    world = world_size()
    if n != world:
        raise ValueError(
            f"the context-parallel degree (ulysses_degree={n}) must equal the world size ({world}): launch one "
            f"process per rank, e.g. `accelerate launch --multi_gpu --num_processes {n} ...` (also on CPU) or "
            f"`torchrun --nproc_per_node {n} ...`, and initialise torch.distributed first (accelerate's "
            "`PartialState()` or `torch.distributed.init_process_group`)"
        )
    # a config already set up (e.g. shared by the preview and the refiner) keeps its mesh
    ulysses = resolve_mesh_group(n, "ulysses", "ring", config.mesh or config._mesh)
    if world > 1 and config._mesh is None:
        config.setup(dist.get_rank(), world, ulysses.device, ulysses.mesh)
    return Magi2ContextParallelGroup(ulysses.group, ulysses.rank, ulysses.size, ulysses.device)


def broadcast_from_first_rank(
    tensors: Sequence[Optional[torch.Tensor]], cp: Magi2ContextParallelGroup, device: torch.device
) -> list[Optional[torch.Tensor]]:
    """CP rank 0's ``tensors`` on every rank of ``cp`` (e.g. text encoded once instead of ``N`` times).

    One ``broadcast_object_list`` of shapes and dtypes, then one ``broadcast`` per tensor (outside the blocks).

    Args:
        tensors: on rank 0, the tensors to share (any device); elsewhere placeholders of the same length.
        cp: the resolved CP group. device: where the received tensors are allocated (rank 0's are moved there).

    Returns:
        The tensors, on ``device``, equal on every rank (``cp.size == 1``: ``tensors`` unchanged).
    """
    if cp.size == 1:
        return list(tensors)
    src = dist.get_global_rank(cp.group, 0)
    meta = [None if t is None else (tuple(t.shape), t.dtype) for t in tensors] if cp.rank == 0 else [None]
    holder = [meta]
    dist.broadcast_object_list(holder, src=src, group=cp.group)
    out = []
    for i, entry in enumerate(holder[0]):
        if entry is None:
            out.append(None)
            continue
        shape, dtype = entry
        if cp.rank == 0:
            t = tensors[i].to(device).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        wire = t.view(torch.uint8) if dtype == torch.bool else t  # bool travels as bytes on every backend
        dist.broadcast(wire, src=src, group=cp.group)
        out.append(t)
    return out
