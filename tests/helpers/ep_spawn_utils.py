"""Helpers for the expert-parallel tests: run a function on N gloo ranks with ``torch.multiprocessing.spawn``.

Each worker joins ``init_method=tcp://127.0.0.1:<free port>`` with a short process-group timeout, runs
``fn(rank, world_size, *args)`` and saves its return value to ``<tmp>/rank{r}.pt``; the parent kills every worker if
the whole run exceeds ``deadline_s`` (a hung collective fails the test instead of hanging the suite).
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


PG_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world: int, *args: Any, deadline_s: float = 90.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results (rank order).

    Raises ``RuntimeError`` with the failing ranks' tracebacks, or when ``deadline_s`` passes.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.spawn(_worker, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=False)
        t_end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > t_end:
                    raise RuntimeError(f"EP workers still running after {deadline_s} s (hang?)")
        except Exception as exc:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            errs = "\n".join(
                f"--- rank {r} ---\n" + Path(out_dir, f"rank{r}.err").read_text()
                for r in range(world)
                if Path(out_dir, f"rank{r}.err").exists()
            )
            raise RuntimeError(f"{exc}\n{errs}") from None
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
