"""Rank functions of ``tests/parallel/test_gloo_rank_pool.py``: what a call of ``run_on_ranks`` sees and leaves."""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist


def change_process_state(rank: int, world: int, cwd: str) -> dict:
    """What a call starts with, after changing what a later call must not inherit."""
    seen = {
        "pid": os.getpid(),
        "env": os.environ.get("MAGI2_POOL_PROBE"),
        "cwd": os.getcwd(),
        "rng": torch.get_rng_state(),
        "random": random.random(),
        "world": dist.get_world_size(),
        "sum": float(_all_reduce_rank(rank)),
    }
    os.environ["MAGI2_POOL_PROBE_LEFT"] = "1"
    os.chdir(cwd)
    torch.randn(5)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return seen


def read_process_state(rank: int, world: int) -> dict:
    return {
        "pid": os.getpid(),
        "env": os.environ.get("MAGI2_POOL_PROBE"),
        "left": os.environ.get("MAGI2_POOL_PROBE_LEFT"),
        "cwd": os.getcwd(),
        "rng": torch.get_rng_state(),
        "random": random.random(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "sum": float(_all_reduce_rank(rank)),
    }


def fail_on_last_rank(rank: int, world: int) -> None:
    if rank == world - 1:
        raise ValueError(f"rank {rank} refuses")
    dist.barrier()  # the other ranks wait here for the failed one


def _all_reduce_rank(rank: int) -> torch.Tensor:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t


def destroy_the_group(rank: int, world: int) -> int:
    dist.destroy_process_group()
    return os.getpid()
