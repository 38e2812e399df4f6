"""Expert parallelism (EP) for the MAGI-2 multi-head MoE: group set-up, head layout and the collectives.

With ``H`` heads padded to ``Hp`` (a multiple of the EP size ``N``), rank ``r`` owns heads ``[r Hl, (r+1) Hl)``,
``Hl = Hp / N`` (SandAI ``CoreMultiHeadMoE``; a rank of padding heads idles but joins every collective). The group
comes from Accelerate and a device mesh. Tokens ``[S, H, Dh]`` are (a) replicated: each rank computes its heads,
one ``all_gather`` assembles them; or (b) sharded (context parallel): one ``all_to_all_single`` brings every
token's slice of this rank's heads, a second sends the results back. No host sync or size exchange in the layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist


__all__ = [
    "Magi2EPHeadLayout",
    "Magi2ExpertParallelConfig",
    "Magi2ExpertParallelGroup",
    "check_same_on_all_ranks",
    "ep_device",
    "ep_dispatch",
    "ep_gather_heads",
    "ep_head_layout",
    "ep_undispatch",
    "expert_exchange",
    "Magi2ExpertParallelExchange",
    "Magi2LocalExperts",
    "expert_parallel_from_launch",
    "expert_parallel_heads_forward",
    "resolve_expert_parallel",
    "warn_if_idle",
]

EP_MESH_DIM = "ep"
EP_REPLICA_MESH_DIM = "ep_replica"
# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same signature)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def _launched_world_size() -> int:
    """World size announced by a launcher (torchrun / accelerate) through the environment; 1 when absent."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _run_world_size() -> int:
    """World size of the initialised default group, else the launcher's (:func:`_launched_world_size`)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else _launched_world_size()


def _check_launch_degree(value: Any, flag: str) -> None:
    """A launch-rule degree (``--ep_degree`` / ``--ulysses_degree``) must be a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a positive int, got {value!r}")


def expert_parallel_from_launch(ep_degree: Optional[int] = None) -> Optional[Magi2ExpertParallelConfig]:
    """The ``--ep_degree`` rule of ``examples/generate.py``: a resolved EP config, or ``None`` for no EP.

    ``None`` means the world size when launched distributed (``WORLD_SIZE > 1``, set by ``accelerate launch
    --multi_gpu`` / ``torchrun``), else no EP. ``accelerate launch --cpu --num_processes 2`` starts ONE process, so
    ``--ep_degree 2`` then raises instead of running unsharded.

    Raises:
        ValueError: ``ep_degree`` is not a positive int, or does not divide the launched world size.
    """
    world = _run_world_size()
    if ep_degree is None:
        if world == 1:
            return None
        ep_degree = world
    _check_launch_degree(ep_degree, "--ep_degree")
    if world % ep_degree:
        raise ValueError(
            f"--ep_degree {ep_degree} requested but this run has {world} process(es), which it does not divide. "
            "Launch one process per rank: "
            f"`accelerate launch --multi_gpu --num_processes {ep_degree} examples/generate.py ...` (also on CPU; "
            "`accelerate launch --cpu` starts a single process) or `torchrun --nproc_per_node "
            f"{ep_degree} examples/generate.py ...`."
        )
    if ep_degree == 1:
        return None
    config = Magi2ExpertParallelConfig(ep_degree=ep_degree)
    resolve_expert_parallel(config)
    return config


def resolve_expert_parallel(config: Magi2ExpertParallelConfig) -> Magi2ExpertParallelGroup:
    """Turn a config into an EP group (cached on the config, so every model sharing it shares the group).

    Without ``config.mesh``, Accelerate's ``PartialState`` initialises the default group if a launcher started
    several processes, then ``init_device_mesh`` builds the mesh. Call it on every rank.

    Raises:
        ValueError: EP requested but no process group could be initialised, or ``ep_degree`` does not divide the
            world size.
    """
    cached = getattr(config, "_resolved", None)
    if cached is not None:
        return cached
    if config.mesh is not None:
        sub = config.mesh[EP_MESH_DIM]
        resolved = Magi2ExpertParallelGroup(
            group=sub.get_group(), rank=sub.get_local_rank(), size=sub.size(), device_type=sub.device_type, mesh=sub
        )
    elif config.ep_degree == 1:
        resolved = Magi2ExpertParallelGroup(group=None, rank=0, size=1)
    else:
        if not dist.is_initialized() and _launched_world_size() > 1:
            from accelerate import PartialState

            PartialState(cpu=not torch.cuda.is_available())
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"expert parallelism with ep_degree={config.ep_degree} needs an initialised torch.distributed process "
                f"group, but this process runs alone (world size {_launched_world_size()}). Launch one process per "
                f"rank, e.g. `accelerate launch --multi_gpu --num_processes {config.ep_degree} ...` (on CPU too: "
                "`accelerate launch --cpu` starts only ONE process), or `torchrun --nproc_per_node "
                f"{config.ep_degree} ...`."
            )
        world = dist.get_world_size()
        if world % config.ep_degree:
            raise ValueError(
                f"ep_degree={config.ep_degree} must divide the world size ({world}) of the default process group "
                "(EP groups of consecutive ranks tile the world, with world // ep_degree replicas); other layouts "
                "need a mesh with an 'ep' dimension (Magi2ExpertParallelConfig(mesh=...))."
            )
        from torch.distributed.device_mesh import init_device_mesh

        backend = str(dist.get_backend())
        device_type = "cuda" if ("nccl" in backend and torch.cuda.is_available()) else "cpu"
        if config.ep_degree == world:
            mesh = init_device_mesh(device_type, (world,), mesh_dim_names=(EP_MESH_DIM,))
        else:
            shape = (world // config.ep_degree, config.ep_degree)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=(EP_REPLICA_MESH_DIM, EP_MESH_DIM))
        resolved = Magi2ExpertParallelGroup(
            group=mesh.get_group(EP_MESH_DIM),
            rank=mesh.get_local_rank(EP_MESH_DIM),
            size=config.ep_degree,
            device_type=device_type,
            mesh=mesh,
        )
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


def _needs_autograd(t: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and t.requires_grad


def _all_to_all(send: torch.Tensor, out_shape: tuple, out_splits: list, in_splits: list, group: Any) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 with uneven splits; the autograd-aware functional variant under grad."""
    if _needs_autograd(send):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        out = all_to_all_single_autograd(send, out_splits, in_splits, group)
        return out.view(out_shape) if out.shape != torch.Size(out_shape) else out
    recv = send.new_empty(out_shape)
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return recv


def ep_gather_heads(local_out: torch.Tensor, layout: Magi2EPHeadLayout, group: Any) -> torch.Tensor:
    """Layout (a): every rank's ``[S, Hl, Dh]`` -> ``[S, H, Dh]`` (one all-gather, padding heads dropped)."""
    if layout.ep_size == 1:
        return local_out[:, : layout.num_heads]
    S, Hl, Dh = local_out.shape
    if _needs_autograd(local_out):
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        gathered = all_gather_tensor_autograd(local_out.contiguous(), 0, group)
    else:
        gathered = local_out.new_empty((layout.ep_size * S, Hl, Dh))
        _all_gather_single(gathered, local_out.contiguous(), group=group)
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
    return _all_to_all(send, (sum(counts), Hl, Dh), counts, [S] * N, group)


def ep_undispatch(y: torch.Tensor, token_counts: Sequence[int], layout: Magi2EPHeadLayout, group: Any) -> torch.Tensor:
    """Inverse of :func:`ep_dispatch`: ``[ΣS, Hl, Dh]`` local-head results → this rank's ``[S_r, H, Dh]``."""
    counts = list(token_counts)
    N, Hl = layout.ep_size, layout.local_num_heads
    S = counts[layout.ep_rank]
    Dh = y.shape[-1]
    if N == 1:
        return y[:, : layout.num_heads]
    back = _all_to_all(y.contiguous(), (N * S, Hl, Dh), [S] * N, counts, group)
    out = back.view(N, S, Hl, Dh).transpose(0, 1).reshape(S, layout.padded_num_heads, Dh)
    return out[:, : layout.num_heads]


def expert_parallel_heads_forward(
    x: torch.Tensor,
    compute_local_heads: Callable[[torch.Tensor], torch.Tensor],
    layout: Magi2EPHeadLayout,
    group: Any,
    token_counts: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Run the routed experts of ``x`` ``[S, H, Dh]`` with the heads spread over the EP group.

    Args:
        x: ``[S, H, Dh]`` per-head hidden states of this rank's tokens.
        compute_local_heads: ``[S', Hl, Dh]`` -> ``[S', Hl, Dh]`` for the local heads (zeros for padding heads).
        layout: this rank's :class:`Magi2EPHeadLayout`. group: the EP process group (``None`` when ``N = 1``).
        token_counts: ``None`` for layout (a); per-rank host ints for layout (b).

    Returns:
        ``[S, H, Dh]`` (differentiable; every rank then runs the same backward).
    """
    if token_counts is None:
        start, Hl = layout.local_head_start, layout.local_num_heads
        local_in = x[:, start : start + Hl]
        if local_in.shape[1] < Hl:  # partially or fully padded rank
            pad = x.new_zeros(x.shape[0], Hl - local_in.shape[1], x.shape[2])
            local_in = torch.cat([local_in, pad], dim=1)
        return ep_gather_heads(_local(compute_local_heads, local_in, x), layout, group)
    local_in = ep_dispatch(x, token_counts, layout, group)
    return ep_undispatch(_local(compute_local_heads, local_in, x), token_counts, layout, group)


def _local(compute_local_heads: Callable, local_in: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    out = compute_local_heads(local_in)
    if _needs_autograd(x) and not out.requires_grad:
        # an idle rank's zeros must stay in the graph, or its backward skips the collectives the others wait in
        out = out + local_in * 0
    return out


def ep_device(config: Optional[Magi2ExpertParallelConfig]) -> torch.device:
    """The device of this EP rank: ``cuda:<LOCAL_RANK>`` when the group runs on GPUs, else CPU."""
    if config is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ep = resolve_expert_parallel(config)
    if ep.device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


class Magi2LocalExperts:
    """The routed-expert exchange of a layer holding every head for its own tokens: no collective.

    Args:
        sync_free: ask the expert backend for a path without host synchronisation (context parallelism: a host
            read would stall the other ranks' asynchronous exchanges).
    """

    def __init__(self, sync_free: bool = False) -> None:
        self.sync_free = sync_free

    def __call__(self, x, compute_local_heads, ep_token_counts=None, shard_plan=None) -> torch.Tensor:
        """``compute_local_heads(x)``; the token counts are not read."""
        return compute_local_heads(x, sync_free=self.sync_free)

    def token_chunk(self, chunk_size):
        """``chunk_size``: tokens are independent here, the layer may run in chunks."""
        return chunk_size


class Magi2ExpertParallelExchange:
    """The routed-expert exchange of an expert-parallel layer (:func:`expert_parallel_heads_forward`): tokens
    replicated over the EP group (layout (a)), or sharded with ``ep_token_counts`` (layout (b)).

    Args:
        layout: this rank's :class:`Magi2EPHeadLayout`. group: the EP process group.
    """

    def __init__(self, layout: Magi2EPHeadLayout, group: Any) -> None:
        self.layout, self.group = layout, group

    def __call__(self, x, compute_local_heads, ep_token_counts=None, shard_plan=None) -> torch.Tensor:
        """``[S, H, Dh]`` -> ``[S, H, Dh]`` (``shard_plan`` is not read).

        Raises:
            ValueError: no process group; ``ep_token_counts`` not ``N`` ints with this rank's entry ``S``.
        """
        if self.group is None:
            raise ValueError("Magi2MultiHeadMoE with ep_size > 1 needs ep_group (a torch.distributed process group)")
        return expert_parallel_heads_forward(x, compute_local_heads, self.layout, self.group, ep_token_counts)

    def token_chunk(self, chunk_size):
        """``None``: every rank joins each exchange once per layer, so the layer runs unchunked."""
        return None


def expert_exchange(layout: Magi2EPHeadLayout, group: Any):
    """The exchange a MoE layer of ``layout`` starts with: :class:`Magi2LocalExperts` for one rank, else
    :class:`Magi2ExpertParallelExchange`."""
    return Magi2LocalExperts() if layout.ep_size == 1 else Magi2ExpertParallelExchange(layout, group)
