"""Launch rules of the example scripts: from a launcher's environment to the library's parallel configs.

The library reads no launcher environment: it uses the initialised ``torch.distributed`` group and the configs it is
given. These helpers are the scripts' side: :func:`init_distributed_from_launch` initialises the default group
(accelerate's ``PartialState``, which also sets this rank's CUDA device) when ``accelerate launch --multi_gpu`` or
``torchrun`` started several processes (``WORLD_SIZE > 1``); :func:`expert_parallel_from_launch` and
:func:`context_parallel_from_launch` turn ``--ep_degree`` / ``--ulysses_degree`` (``None``: the number of processes)
into a ``Magi2ExpertParallelConfig`` / ``ContextParallelConfig``, or ``None`` when nothing is parallel.

``accelerate launch --cpu --num_processes 2`` starts ONE process, so ``--ep_degree 2`` then raises instead of running
unsharded. Importing this module does not import torch.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional


__all__ = [
    "check_launch_degree",
    "end_distributed_run",
    "context_parallel_from_launch",
    "expert_parallel_from_launch",
    "init_distributed_from_launch",
    "launch_degrees",
    "launched_world_size",
]


def launched_world_size() -> int:
    """The world size a launcher (torchrun / accelerate) announces through ``WORLD_SIZE``; 1 when absent."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init_distributed_from_launch() -> None:
    """Initialise the default process group when launched with several processes and none exists yet (gloo on CPU,
    NCCL on GPUs; accelerate also sets this rank's CUDA device). Does nothing for a single process."""
    import torch
    import torch.distributed as dist

    if launched_world_size() > 1 and not dist.is_initialized():
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available())


def _run_world_size() -> int:
    """World size of the initialised default group, else the launcher's (:func:`launched_world_size`)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else launched_world_size()


def check_launch_degree(value: Any, flag: str) -> None:
    """A launch degree (``--ep_degree`` / ``--ulysses_degree``) must be a positive int.

    Raises:
        ValueError: otherwise, naming ``flag``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a positive int, got {value!r}")


_LAUNCH = "`accelerate launch --multi_gpu --num_processes {n} examples/generate.py ...` (`--cpu` starts one process)"


def launch_degrees(ep_degree: Optional[int], ulysses_degree: Optional[int], world: Optional[int] = None):
    """``(ep, cp)`` degrees of a run of ``world`` processes (default: the launcher's ``WORLD_SIZE``): ``None`` asks
    for ``world``; host arithmetic only, so a script checks it before importing torch.

    Raises:
        ValueError: a degree that is not a positive int; ``ep_degree`` not dividing the world size (the CP degree);
            ``ulysses_degree`` other than the world size.
    """
    world = launched_world_size() if world is None else world
    ep = world if ep_degree is None else ep_degree
    check_launch_degree(ep, "--ep_degree")
    if world % ep:
        raise ValueError(
            f"--ep_degree {ep} requested but this run has {world} process(es), which it does not divide; launch one "
            f"process per rank: {_LAUNCH.format(n=ep)}"
        )
    cp = world if ulysses_degree is None else ulysses_degree
    check_launch_degree(cp, "--ulysses_degree")
    if cp != world:
        raise ValueError(
            f"--ulysses_degree {cp} requested but this run has {world} process(es); the context-parallel degree "
            f"must equal the number of processes: {_LAUNCH.format(n=cp)}"
        )
    return ep, cp  # ep divides the world size, which is the CP degree: EP groups tile the CP ranks


def expert_parallel_from_launch(ep_degree: Optional[int] = None):
    """The ``--ep_degree`` rule (:func:`launch_degrees`): a resolved ``Magi2ExpertParallelConfig``, or ``None`` for
    no EP. Call :func:`init_distributed_from_launch` first.

    Raises:
        ValueError: as :func:`launch_degrees`.
    """
    from diffusers_magi2.parallel import expert_parallel

    ep, _ = launch_degrees(ep_degree, None, _run_world_size())
    if ep == 1:
        return None
    config = expert_parallel.Magi2ExpertParallelConfig(ep_degree=ep)
    expert_parallel.resolve_expert_parallel(config)
    return config


def context_parallel_from_launch(ulysses_degree: Optional[int] = None, ep_degree: Optional[int] = None):
    """The ``--ulysses_degree`` rule (:func:`launch_degrees`): a resolved ``ContextParallelConfig``, or ``None`` for
    no CP. Call :func:`init_distributed_from_launch` first.

    Raises:
        ValueError: as :func:`launch_degrees`.
    """
    from diffusers import ContextParallelConfig

    from diffusers_magi2.parallel import context_parallel

    _, cp = launch_degrees(ep_degree, ulysses_degree, _run_world_size())
    if cp == 1:
        return None
    config = ContextParallelConfig(ulysses_degree=cp)
    context_parallel.resolve_context_parallel(config)
    return config


def end_distributed_run(exit_code: int = 0) -> None:
    """End a distributed run cleanly: barrier, destroy the default process group, then on CPU ``os._exit``.

    gloo runs that built a device mesh sometimes abort at interpreter exit (``terminate called without an active
    exception``, SIGABRT) after all work is done (pytorch PR #179291); skipping interpreter finalisation with
    ``os._exit`` on CPU avoids it. Does nothing without a process group, and returns normally on GPU.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        on_cpu = "nccl" not in str(dist.get_backend())
        dist.barrier()
        dist.destroy_process_group()
        if on_cpu:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)
