"""Expert parallelism (EP) for the MAGI-2 multi-head MoE: the EP group, head layouts, and the collectives that bring
each rank's heads their tokens (dispatch) and the results back (combine).

With ``H`` heads padded to ``Hp`` (a multiple of the EP size ``N``), rank ``r`` owns heads ``[r Hl, (r+1) Hl)``,
``Hl = Hp / N`` (SandAI ``CoreMultiHeadMoE``; a rank of padding heads idles but joins every collective). Tokens
``[S, H, Dh]`` are (a) replicated: each rank computes its heads, one ``all_gather`` assembles them; or (b) sharded:
one ``all_to_all_single`` brings every token's slice of this rank's heads, a second sends the results back. No host
sync or size exchange in the layer.

Under context parallelism (``N_cp`` ranks, each holding its sequence shard) with the EP degree ``E`` dividing
``N_cp``, ``R = N_cp / E`` EP groups tile the CP ranks; rank ``r = g E + p`` owns the heads of EP position ``p``, the
``R`` ranks of a position being replicas. Each rank cuts its ``S_q`` tokens into ``R`` parts (``floor(S_q / R)``, the
rest round-robin, so replica loads differ by at most one token) and sends part ``g`` to rank ``g E + p``: no rank
idles. One ``all_to_all_single`` over the CP group goes in, one comes back, ``S_r Hp Dh`` elements each way; ``E =
N_cp`` is layout (b).

The exchange objects a MoE layer holds compose these (:mod:`.exchanges`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .distributed import (
    Magi2MeshGroup,
    Magi2PendingExchange,
    all_gather_rows,
    all_to_all,
    resolve_mesh_group,
    world_size,
)


__all__ = [
    "Magi2EPHeadLayout",
    "Magi2EPReplicaLayout",
    "Magi2ExpertParallelConfig",
    "Magi2ExpertParallelGroup",
    "check_same_on_all_ranks",
    "ep_combine",
    "ep_device",
    "ep_dispatch",
    "ep_gather_heads",
    "ep_head_layout",
    "ep_local_heads",
    "ep_replica_combine",
    "ep_replica_dispatch",
    "ep_replica_layout",
    "replica_token_parts",
    "resolve_expert_parallel",
    "warn_if_idle",
]

EP_MESH_DIM = "ep"
EP_REPLICA_MESH_DIM = "ep_replica"


@dataclasses.dataclass
class Magi2ExpertParallelConfig:
    """User-facing expert-parallel request.

    Args:
        ep_degree (`int`, defaults to 1): ranks the routed experts are split over; it divides the world size
            (consecutive groups of ``ep_degree`` ranks each hold every expert once).
        mesh (`torch.distributed.device_mesh.DeviceMesh`, *optional*): a mesh with an ``"ep"`` dimension of size
            ``ep_degree``; default: an ``("ep",)`` (or ``("ep_replica", "ep")``) mesh over all ranks.

    Raises:
        ValueError: ``ep_degree`` is not a positive int, or ``mesh`` has no ``"ep"`` dimension of that size.
    """

    ep_degree: int = 1
    mesh: Optional[Any] = None

    def __post_init__(self) -> None:
        if isinstance(self.ep_degree, bool) or not isinstance(self.ep_degree, int) or self.ep_degree < 1:
            raise ValueError(f"Magi2ExpertParallelConfig.ep_degree must be an int >= 1, got {self.ep_degree!r}")
        if self.mesh is not None:
            names = tuple(getattr(self.mesh, "mesh_dim_names", None) or ())
            if EP_MESH_DIM not in names:
                raise ValueError(
                    f"Magi2ExpertParallelConfig.mesh must have a dimension named {EP_MESH_DIM!r}; got dims {names}"
                )
            if self.mesh[EP_MESH_DIM].size() != self.ep_degree:
                raise ValueError(
                    f"mesh[{EP_MESH_DIM!r}] has size {self.mesh[EP_MESH_DIM].size()} but ep_degree={self.ep_degree}"
                )


@dataclasses.dataclass(frozen=True)
class Magi2ExpertParallelGroup:
    """Resolved EP group: ``group`` is ``None`` only for the single-device case (``size == 1``)."""

    group: Optional[Any]
    rank: int
    size: int
    device_type: str = "cpu"
    mesh: Optional[Any] = None


@dataclasses.dataclass(frozen=True)
class Magi2EPHeadLayout:
    """Which MoE heads (and flattened expert rows) one EP rank owns.

    Attributes:
        num_heads: ``H``. ep_size / ep_rank: ``N`` / ``r``.
        padded_num_heads: ``Hp = ceil(H / N) N``. local_num_heads: ``Hl``.
        local_head_start: ``r Hl``.
        num_real_local_heads: how many local heads are real.
    """

    num_heads: int
    ep_size: int
    ep_rank: int
    padded_num_heads: int
    local_num_heads: int
    local_head_start: int
    num_real_local_heads: int

    @property
    def has_real_heads(self) -> bool:
        """Whether this rank owns a real (non-padding) head."""
        return self.num_real_local_heads > 0


def ep_head_layout(num_heads: int, ep_size: int, ep_rank: int) -> Magi2EPHeadLayout:
    """Head padding and ownership for one rank (SandAI ``CoreMultiHeadMoE.__init__`` padding rule).

    Raises:
        ValueError: non-positive ``num_heads``/``ep_size`` or ``ep_rank`` outside ``[0, ep_size)``.
    """
    if num_heads < 1 or ep_size < 1:
        raise ValueError(f"num_heads and ep_size must be >= 1, got num_heads={num_heads}, ep_size={ep_size}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
    padded = -(-num_heads // ep_size) * ep_size
    local = padded // ep_size
    start = ep_rank * local
    real = max(0, min(num_heads, start + local) - start)
    return Magi2EPHeadLayout(num_heads, ep_size, ep_rank, padded, local, start, real)


def _ep_group(resolved: Magi2MeshGroup) -> Magi2ExpertParallelGroup:
    """The EP record of a resolved mesh dimension."""
    return Magi2ExpertParallelGroup(
        resolved.group,
        resolved.rank,
        resolved.size,
        resolved.device.type if resolved.size > 1 else "cpu",
        resolved.mesh,
    )


def resolve_expert_parallel(config: Magi2ExpertParallelConfig) -> Magi2ExpertParallelGroup:
    """Turn a config into an EP group (cached on the config, so every model sharing it shares the group).

    Without ``config.mesh`` the EP dimension of a new ``(world / E, E)`` mesh over the initialised default process
    group (the examples initialise it from the launcher's environment). Call it on every rank.

    Raises:
        ValueError: EP requested without an initialised process group, or ``ep_degree`` not dividing the world size.
    """
    cached = getattr(config, "_resolved", None)
    if cached is not None:
        return cached
    if config.mesh is not None:
        resolved = _ep_group(resolve_mesh_group(config.ep_degree, EP_MESH_DIM, EP_REPLICA_MESH_DIM, config.mesh))
    elif config.ep_degree == 1:
        resolved = Magi2ExpertParallelGroup(group=None, rank=0, size=1)
    else:
        world = world_size()
        if world == 1:
            raise ValueError(
                f"expert parallelism with ep_degree={config.ep_degree} needs an initialised torch.distributed process "
                f"group, but this process runs alone (world size 1). Launch one process per rank, e.g. `accelerate "
                f"launch --multi_gpu --num_processes {config.ep_degree} ...` (on CPU too: `accelerate launch --cpu` "
                f"starts only ONE process), or `torchrun --nproc_per_node {config.ep_degree} ...`, and initialise the "
                "group first (accelerate's `PartialState()` or `torch.distributed.init_process_group`)."
            )
        if world % config.ep_degree:
            raise ValueError(
                f"ep_degree={config.ep_degree} must divide the world size ({world}) of the default process group "
                "(EP groups of consecutive ranks tile the world, with world // ep_degree replicas); other layouts "
                "need a mesh with an 'ep' dimension (Magi2ExpertParallelConfig(mesh=...))."
            )
        resolved = _ep_group(resolve_mesh_group(config.ep_degree, EP_MESH_DIM, EP_REPLICA_MESH_DIM))
    object.__setattr__(config, "_resolved", resolved)
    return resolved


def check_same_on_all_ranks(value: Any, ep: Magi2ExpertParallelGroup, what: str) -> None:
    """Check with one ``all_gather_object`` (set-up time only) that a small JSON-able ``value`` is the same on every EP rank.

    Raises:
        ValueError: on every rank, naming the ranks whose ``what`` differs from rank 0's and (for dicts) the keys.
    """
    if ep.size == 1:
        return
    mine = json.loads(json.dumps(value, sort_keys=True, default=str))
    gathered: list = [None] * ep.size
    dist.all_gather_object(gathered, mine, group=ep.group)
    bad = [r for r, v in enumerate(gathered) if v != gathered[0]]
    if bad:
        detail = ""
        if isinstance(gathered[0], dict):
            keys = sorted(
                {
                    k
                    for r in bad
                    for k in set(gathered[r]) | set(gathered[0])
                    if gathered[r].get(k) != gathered[0].get(k)
                }
            )
            detail = f" (differing entries: {keys[:10]})"
        raise ValueError(
            f"expert-parallel ranks disagree on the {what}: ranks {bad} differ from rank 0{detail}; every rank must "
            "load the same checkpoint with the same config."
        )


def warn_if_idle(layout: Magi2EPHeadLayout) -> None:
    """Warn (once per layout) that a rank owns only padding heads: it joins the collectives but computes nothing."""
    if not layout.has_real_heads:
        warnings.warn(
            f"EP rank {layout.ep_rank} of {layout.ep_size} owns only padding heads "
            f"[{layout.local_head_start}, {layout.local_head_start + layout.local_num_heads}) of {layout.num_heads} "
            "real MoE heads: it idles in the routed experts (choose an ep_degree that divides the head count to "
            "avoid idle ranks).",
            stacklevel=2,
        )


def _all_to_all_rows(send: torch.Tensor, out_shape: tuple, out_rows: list, in_rows: list, group: Any) -> torch.Tensor:
    """:func:`~.distributed.all_to_all` along dim 0 with row splits: ``send [sum in_rows, ...]`` -> ``out_shape``."""
    inner = math.prod(send.shape[1:])
    _, recv = all_to_all(send.reshape(-1), [r * inner for r in out_rows], [r * inner for r in in_rows], group)
    return recv.view(out_shape)


def ep_local_heads(x: torch.Tensor, layout: Magi2EPHeadLayout) -> torch.Tensor:
    """Layout (a): this rank's heads ``[S, Hl, Dh]`` of replicated tokens ``[S, H, Dh]`` (zeros for padding heads)."""
    start, Hl = layout.local_head_start, layout.local_num_heads
    local = x[:, start : start + Hl]
    if local.shape[1] < Hl:  # partially or fully padded rank
        local = torch.cat([local, x.new_zeros(x.shape[0], Hl - local.shape[1], x.shape[2])], dim=1)
    return local


def ep_gather_heads(local_out: torch.Tensor, layout: Magi2EPHeadLayout, group: Any) -> torch.Tensor:
    """Layout (a): every rank's ``[S, Hl, Dh]`` -> ``[S, H, Dh]`` (one all-gather, padding heads dropped)."""
    if layout.ep_size == 1:
        return local_out[:, : layout.num_heads]
    S, Hl, Dh = local_out.shape
    gathered = all_gather_rows(local_out, group, layout.ep_size)
    out = gathered.view(layout.ep_size, S, Hl, Dh).permute(1, 0, 2, 3).reshape(S, layout.padded_num_heads, Dh)
    return out[:, : layout.num_heads]


def _validate_token_counts(token_counts: Sequence[int], layout: Magi2EPHeadLayout, num_local_tokens: int) -> list:
    counts = list(token_counts)
    if len(counts) != layout.ep_size or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(
            f"ep_token_counts must be {layout.ep_size} non-negative host ints (one per EP rank), got {token_counts!r}"
        )
    if counts[layout.ep_rank] != num_local_tokens:
        raise ValueError(
            f"ep_token_counts[{layout.ep_rank}] = {counts[layout.ep_rank]} but this rank holds {num_local_tokens} tokens"
        )
    return counts


def ep_dispatch(x: torch.Tensor, token_counts: Sequence[int], layout: Magi2EPHeadLayout, group: Any) -> torch.Tensor:
    """Layout (b): this rank's ``[S_r, H, Dh]`` -> all tokens of this rank's heads ``[sum S, Hl, Dh]``, global token
    order (SandAI ``ep_dispatch``, without its equal-``S_r`` requirement)."""
    counts = _validate_token_counts(token_counts, layout, x.shape[0])
    S, H, Dh = x.shape
    if H != layout.num_heads:
        raise ValueError(f"ep_dispatch expects {layout.num_heads} heads, got x of shape {tuple(x.shape)}")
    N, Hl = layout.ep_size, layout.local_num_heads
    if layout.padded_num_heads != H:
        x = torch.cat([x, x.new_zeros(S, layout.padded_num_heads - H, Dh)], dim=1)
    if N == 1:
        return x
    send = x.view(S, N, Hl, Dh).transpose(0, 1).reshape(N * S, Hl, Dh)
    return _all_to_all_rows(send, (sum(counts), Hl, Dh), counts, [S] * N, group)


def ep_combine(y: torch.Tensor, token_counts: Sequence[int], layout: Magi2EPHeadLayout, group: Any) -> torch.Tensor:
    """Inverse of :func:`ep_dispatch`: ``[ΣS, Hl, Dh]`` local-head results → this rank's ``[S_r, H, Dh]``."""
    counts = list(token_counts)
    N, Hl = layout.ep_size, layout.local_num_heads
    S = counts[layout.ep_rank]
    Dh = y.shape[-1]
    if N == 1:
        return y[:, : layout.num_heads]
    back = _all_to_all_rows(y.contiguous(), (N * S, Hl, Dh), [S] * N, counts, group)
    out = back.view(N, S, Hl, Dh).transpose(0, 1).reshape(S, layout.padded_num_heads, Dh)
    return out[:, : layout.num_heads]


def ep_device(config: Optional[Magi2ExpertParallelConfig]) -> torch.device:
    """The device of this EP rank: the current CUDA device when the group runs on GPUs (the launcher or the caller
    sets it, e.g. accelerate's ``PartialState``), else CPU."""
    if config is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ep = resolve_expert_parallel(config)
    if ep.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Magi2EPReplicaLayout:
    """EP groups with replicas inside one CP group of ``N`` ranks.

    Attributes:
        world_size: CP degree ``N``. rank: this rank ``r``. ep_size: EP degree ``E`` (divides ``N``).
        heads: the MoE heads this rank owns (:class:`Magi2EPHeadLayout` of position ``r mod E``).
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
    work, recv = all_to_all(send, out_splits, in_splits, group, async_op)
    pending = Magi2PendingExchange(work, lambda: recv.view(sum(mine), Hl, dh))
    return pending if async_op else pending.wait()


def ep_replica_combine(
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
    work, recv = all_to_all(send, out_splits, in_splits, group, async_op)

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
