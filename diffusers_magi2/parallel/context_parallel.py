"""Context parallelism (CP) for MAGI-2: the sequence-shard plan of one packed token sequence.

Every rank gets the full inputs and keeps rows ``[o_r, o_r + S_r)`` of the ``T`` packed tokens, ``o_r = S_0 + ... +
S_{r-1}``; by default ``S_r = floor(T/N) + [r < T mod N]``, but any non-negative counts summing to ``T`` work. The
counts are host integers every rank derives from the same inputs, so the plan is built once per forward and no
layer exchanges sizes. Features, coordinates, modality ids and time embedding are sliced with the tokens;
attention runs on whole segments (:mod:`.context_parallel_attention`). SandAI's ``magi2_preview.py`` (``psm`` CP
groups) instead pads to a multiple of 48 and needs equal shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .expert_parallel import _all_gather_single


__all__ = [
    "Magi2PendingExchange",
    "flat_all_to_all",
    "needs_autograd",
    "Magi2SequenceShardPlan",
    "balanced_token_counts",
    "plan_sequence_shards",
    "gather_sequence_shards",
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
    local = local.contiguous()
    if needs_autograd(local):
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        gathered = all_gather_tensor_autograd(local, 0, group)
    else:
        gathered = local.new_empty((plan.world_size * width, *local.shape[1:]))
        _all_gather_single(gathered, local, group=group)
    gathered = gathered.view(plan.world_size, width, *local.shape[1:])
    return torch.cat([gathered[q, :c] for q, c in enumerate(plan.token_counts)])


class Magi2PendingExchange:
    """A started exchange: :meth:`wait` blocks until it is done and returns its result (once)."""

    def __init__(self, work: Optional[Any], finish: Callable[[], Any]) -> None:
        self._work = work
        self._finish = finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish()


def needs_autograd(t: torch.Tensor) -> bool:
    """Whether ``t`` takes part in an autograd graph being recorded."""
    return torch.is_grad_enabled() and t.requires_grad


def flat_all_to_all(send: torch.Tensor, out_splits: list, in_splits: list, group: Any, async_op: bool = False):
    """``all_to_all_single`` of a 1-D buffer with element splits; returns ``(work or None, receive buffer)``.

    Under autograd the differentiable functional collective is used (``work`` is then ``None``).
    """
    if needs_autograd(send):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return None, all_to_all_single_autograd(send, out_splits, in_splits, group)
    recv = send.new_empty(sum(out_splits))
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group, async_op=async_op
    )
    return work, recv
