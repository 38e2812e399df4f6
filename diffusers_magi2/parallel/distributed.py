"""What expert and context parallelism share: the process-group resolution, the collectives and the autograd switch.

Groups come from the initialised default ``torch.distributed`` group (or a mesh the caller gives): the library never
reads a launcher's environment; the examples initialise the group (``examples/launch_rules.py``). A degree-``d``
group is one dimension of a ``(world / d, d)`` device mesh, so consecutive ranks form each group. Every collective
here takes host split sizes that all ranks derive from the same inputs; under autograd it is the differentiable
functional collective of ``torch.distributed._functional_collectives`` (:func:`needs_autograd` chooses), so the
backward runs the transposed exchange on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


__all__ = [
    "Magi2MeshGroup",
    "Magi2PendingExchange",
    "all_gather_rows",
    "all_to_all",
    "first_failure_on_any_rank",
    "first_message_of_ranks",
    "mesh_device_type",
    "needs_autograd",
    "resolve_mesh_group",
    "world_size",
]

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same signature)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def needs_autograd(t: torch.Tensor) -> bool:
    """Whether ``t`` takes part in an autograd graph being recorded (then collectives must be differentiable)."""
    return torch.is_grad_enabled() and t.requires_grad


def world_size() -> int:
    """Size of the initialised default process group, 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mesh_device_type() -> str:
    """``"cuda"`` when the default group runs NCCL on a machine with CUDA, else ``"cpu"`` (gloo)."""
    return "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class Magi2MeshGroup:
    """One resolved dimension of a device mesh: its process group (``None`` when ``size == 1``), this rank's index
    in it, its size, the device this rank computes on and the mesh (``None`` when ``size == 1``)."""

    group: Optional[Any]
    rank: int
    size: int
    device: torch.device
    mesh: Optional[Any] = None


def resolve_mesh_group(degree: int, dim: str, outer_dim: str, mesh: Optional[Any] = None) -> Magi2MeshGroup:
    """The group of mesh dimension ``dim``: of ``mesh`` when given, else of a new ``(world / degree, degree)`` mesh
    ``(outer_dim, dim)`` over the initialised default group (consecutive ranks form each group).

    The device is ``cuda:<current device>`` on an NCCL group (the launcher or the caller sets the current device,
    e.g. accelerate's ``PartialState``), else CPU.

    Raises:
        ValueError: ``degree > 1`` without an initialised process group, or ``degree`` not dividing the world size.
    """
    if mesh is not None:
        sub = mesh[dim]
        device_type = sub.device_type
    elif degree == 1:
        return Magi2MeshGroup(None, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"a {dim!r} group of {degree} ranks needs an initialised torch.distributed process group, but this "
                "process runs alone: launch one process per rank (`accelerate launch --multi_gpu --num_processes "
                f"{degree} ...`, also on CPU, or `torchrun --nproc_per_node {degree} ...`) and initialise the group "
                "first (`torch.distributed.init_process_group`, or accelerate's `PartialState()`)"
            )
        world = dist.get_world_size()
        if world % degree:
            raise ValueError(f"a {dim!r} group of {degree} ranks must divide the world size ({world})")
        from torch.distributed.device_mesh import init_device_mesh

        device_type = mesh_device_type()
        mesh = init_device_mesh(device_type, (world // degree, degree), mesh_dim_names=(outer_dim, dim))
        sub = mesh[dim]
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return Magi2MeshGroup(sub.get_group(), sub.get_local_rank(), sub.size(), device, mesh)


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


def all_to_all(send: torch.Tensor, out_splits: list, in_splits: list, group: Any, async_op: bool = False):
    """``all_to_all_single`` of a 1-D buffer with element splits; returns ``(work or None, receive buffer)``.

    The one all-to-all of both parallelisms. Under autograd the differentiable functional collective is used
    (``work`` is then ``None``).
    """
    if needs_autograd(send):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return None, all_to_all_single_autograd(send, out_splits, in_splits, group)
    recv = send.new_empty(sum(out_splits))
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group, async_op=async_op
    )
    return work, recv


def all_gather_rows(local: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Every rank's ``[R, ...]`` (the same ``R`` on all ``size`` ranks) stacked along dim 0 -> ``[size R, ...]``."""
    local = local.contiguous()
    if needs_autograd(local):
        from torch.distributed import _functional_collectives as funcol

        # torch >= 2.13 names it all_gather_single_autograd and deprecates the older name
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        return gather(local, 0, group)
    gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))
    _all_gather_single(gathered, local, group=group)
    return gathered


def first_failure_on_any_rank(message: Optional[str], group: Any, device: torch.device) -> Optional[str]:
    """The first (rank order) non-``None`` ``message`` of the ranks of ``group``, the same on every rank: one
    all-reduce of a flag on ``device``, and only when a rank failed one ``all_gather_object`` of the messages. Each
    rank calls it at the same point, failed or not, so all raise together and the group stays usable."""
    flag = torch.tensor([int(message is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    if not int(flag.item()):
        return None
    return first_message_of_ranks(message, group)


def first_message_of_ranks(message: Optional[str], group: Any) -> Optional[str]:
    """The first (rank order) non-``None`` ``message`` of the ranks of ``group`` (one ``all_gather_object``; every
    rank calls it), ``message`` itself without a group."""
    if group is None:
        return message
    messages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, message, group=group)
    return next((m for m in messages if m is not None), None)
