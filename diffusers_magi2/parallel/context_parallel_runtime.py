"""Context parallelism at run time: the process group behind a ``ContextParallelConfig``.

:func:`resolve_context_parallel` builds the group on CUDA and CPU alike (diffusers 0.42's own resolution divides
by the accelerator count); the CP degree is the world size, no ring attention.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .expert_parallel import _check_launch_degree, _launched_world_size, _run_world_size


__all__ = [
    "Magi2ContextParallelGroup",
    "broadcast_from_first_rank",
    "context_parallel_from_launch",
    "resolve_context_parallel",
]


@dataclasses.dataclass(frozen=True)
class Magi2ContextParallelGroup:
    """Resolved CP group (``group`` is ``None`` only when ``size == 1``)."""

    group: Optional[Any]
    rank: int
    size: int
    device: torch.device


def resolve_context_parallel(config: Any) -> Magi2ContextParallelGroup:
    """The Ulysses group of a diffusers ``ContextParallelConfig`` (``config.setup`` is called, as diffusers does).

    Accelerate's ``PartialState`` initialises the default group if a launcher started several processes; the mesh is
    ``config.mesh`` or a new ``(1, N)`` ``("ring", "ulysses")`` mesh.

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
    if not dist.is_initialized() and _launched_world_size() > 1:
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available())
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if n != world:
        raise ValueError(
            f"the context-parallel degree (ulysses_degree={n}) must equal the world size ({world}): launch one "
            f"process per rank, e.g. `accelerate launch --multi_gpu --num_processes {n} ...` (also on CPU) or "
            f"`torchrun --nproc_per_node {n} ...`"
        )
    if world == 1:
        return Magi2ContextParallelGroup(None, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    device_type = "cuda" if on_gpu else "cpu"
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        if on_gpu
        else (torch.device("cpu"))
    )
    mesh = config.mesh or config._mesh  # a config already set up (e.g. shared by the preview and the refiner)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (1, world), mesh_dim_names=("ring", "ulysses"))
    if config._mesh is None:
        config.setup(rank, world, device, mesh)
    ulysses = mesh["ulysses"]
    return Magi2ContextParallelGroup(ulysses.get_group(), ulysses.get_local_rank(), ulysses.size(), device)


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


def context_parallel_from_launch(ulysses_degree: Optional[int] = None, ep_degree: Optional[int] = None):
    """The ``--ulysses_degree`` rule of ``examples/generate.py``: a resolved ``ContextParallelConfig`` or ``None``.

    ``None`` means the world size when launched distributed, else no CP; checked before any model is built.

    Raises:
        ValueError: a degree that is not a positive int, differs from the world size, or that ``ep_degree``
            does not divide.
    """
    from diffusers import ContextParallelConfig

    world = _run_world_size()
    degree = world if ulysses_degree is None else ulysses_degree
    _check_launch_degree(degree, "--ulysses_degree")
    if degree != world:
        raise ValueError(
            f"--ulysses_degree {degree} requested but this run has {world} process(es); the context-parallel degree "
            f"must equal the number of processes (`accelerate launch --multi_gpu --num_processes {degree} ...`)"
        )
    if ep_degree is not None and degree % ep_degree:
        raise ValueError(
            f"--ep_degree {ep_degree} must divide the context-parallel degree {degree} (EP groups tile the CP ranks)"
        )
    if degree == 1:
        return None
    config = ContextParallelConfig(ulysses_degree=degree)
    resolve_context_parallel(config)
    return config
