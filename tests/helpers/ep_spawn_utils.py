"""Run a function on N gloo ranks for the distributed tests: ``run_on_ranks(fn, world, *args)``.

Starting a Python process that imports torch and diffusers costs seconds of CPU, so the ranks are started once per
test process: a ``torch.multiprocessing`` forkserver imports the package once (``PRELOAD``) and forks, for each world
size, a pool of ``world`` workers that join one gloo group over ``tcp://127.0.0.1:<free port>`` (short process-group
timeout) and run the functions sent to them one after another. Each call runs ``fn(rank, world, *args)`` on every
rank and returns the ranks' return values (saved with ``torch.save`` to a temporary folder, loaded in rank order).

Each call starts from the state of a freshly started worker: the caller's environment and working directory, the
worker's RNG states (torch, ``random``, numpy; seeded per worker, as in a new interpreter), default dtype, grad
mode, warning filters, diffusers' default attention backend and empty accelerate state singletons. A call that fails
or overruns ``deadline_s`` on any rank ends that pool (its group may be out of step), and so does ``IDLE_CLOSE_S``
without a call; the next call starts a new one.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import os
import pickle
import queue
import random
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


PG_TIMEOUT_S = 30
#: how often an idle worker checks that the process that started it is still alive
_POLL_S = 1.0
#: a pool unused for this long is ended (its workers hold ~0.4 GB each)
IDLE_CLOSE_S = 120.0
#: imported once by the forkserver, so no worker imports them again
PRELOAD = [
    "helpers.ep_spawn_utils",
    "diffusers_magi2",
    "diffusers_magi2.pipelines",
    "diffusers_magi2.modular_pipelines",
    "accelerate",
    "peft",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FreshState:
    """What a call may change in a worker, as it was when the worker started; ``restore`` puts it back."""

    def __init__(self) -> None:
        import numpy as np

        torch.seed()  # a forked worker would otherwise start from the forkserver's RNG states
        random.seed()
        np.random.seed()
        self.torch_rng = torch.get_rng_state()
        self.random_rng = random.getstate()
        self.numpy_rng = np.random.get_state()
        self.dtype = torch.get_default_dtype()
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()

    def restore(self, environ: dict | None = None, cwd: str | None = None) -> None:
        import numpy as np

        torch.set_rng_state(self.torch_rng)
        random.setstate(self.random_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        os.environ.clear()
        os.environ.update(self.environ if environ is None else environ)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.chdir(self.cwd if cwd is None else cwd)
        if "diffusers.models.attention_dispatch" in sys.modules:
            from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
            from diffusers.utils.constants import DIFFUSERS_ATTN_BACKEND

            _AttentionBackendRegistry.set_active_backend(AttentionBackendName(DIFFUSERS_ATTN_BACKEND))
        if "accelerate.state" in sys.modules:
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def _serve(rank: int, world: int, port: int, tasks, results) -> None:
    """A pool worker: join the group, then run each task sent to it until told to stop or the forkserver is gone
    (it ends with the test process)."""
    forkserver = os.getppid()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    fresh = _FreshState()
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != forkserver:
                break
            continue
        if task is None:
            break
        task_id, fn, args, environ, cwd, out_dir = task
        fresh.restore(environ, cwd)
        error = None
        try:
            with warnings.catch_warnings():
                result = fn(rank, world, *args)
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
            del result
        except BaseException:
            error = traceback.format_exc()
        fresh.restore()
        gc.collect()
        results.put((task_id, rank, error, dist.is_initialized()))
        if not dist.is_initialized():  # the call ended the group: this worker cannot serve another
            break
    results.close()
    results.join_thread()  # the last report is sent before os._exit
    # skip interpreter finalisation: gloo groups that built a device mesh can abort at exit (pytorch PR #179291)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _RankPool:
    """``world`` started workers in one gloo group (see the module docstring)."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.processes = [
            ctx.Process(target=_serve, args=(r, world, port, self.tasks[r], self.results), daemon=False)
            for r in range(world)
        ]
        for p in self.processes:
            p.start()
        self._ids = itertools.count()

    def run(self, fn: Callable, args: tuple, deadline_s: float) -> list:
        pickle.dumps((fn, args))  # fail here, not in the queue's feeder thread
        task_id = next(self._ids)
        t_end = time.monotonic() + deadline_s
        with tempfile.TemporaryDirectory() as out_dir:
            for q in self.tasks:
                q.put((task_id, fn, args, dict(os.environ), os.getcwd(), out_dir))
            errors: dict[int, str] = {}
            done: set[int] = set()
            all_usable = True
            while len(done) < self.world:
                try:
                    got_id, rank, error, usable = self.results.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.processes) if not p.is_alive() and r not in done]
                    if dead:
                        self.close()
                        raise RuntimeError(f"gloo rank(s) {dead} died (exit codes {self.exit_codes()})") from None
                    if time.monotonic() > t_end:
                        self.close()
                        raise RuntimeError(f"gloo ranks still running after {deadline_s} s (hang?)") from None
                    continue
                if got_id != task_id:  # a report of a call that ended the pool; cannot happen on a live pool
                    continue
                done.add(rank)
                all_usable &= usable
                if error is not None:
                    errors[rank] = error
                    break  # the other ranks may wait in a collective for this one: end the pool now
            if errors:
                self.close()
                text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                raise RuntimeError(f"{fn.__name__} failed on rank(s) {sorted(errors)}\n{text}")
            results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(self.world)]
            if not all_usable:  # a rank's call destroyed the default group
                self.close()
            return results

    def exit_codes(self) -> list:
        return [p.exitcode for p in self.processes]

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        t_end = time.monotonic() + 5.0
        for p in self.processes:
            p.join(timeout=max(0.0, t_end - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()
        _POOLS.pop(self.world, None)


_POOLS: dict[int, _RankPool] = {}


_LOCK = threading.Lock()
_LAST_USED: dict[int, float] = {}
_REAPER: threading.Thread | None = None


def _close_idle_pools() -> None:
    while True:
        time.sleep(IDLE_CLOSE_S / 4)
        with _LOCK:
            for world, pool in list(_POOLS.items()):
                if time.monotonic() - _LAST_USED.get(world, 0.0) > IDLE_CLOSE_S:
                    pool.close()


def run_on_ranks(fn: Callable, world: int, *args: Any, deadline_s: float = 90.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results (rank order).

    ``fn`` and ``args`` must be picklable (a module-level function of ``helpers``). Raises ``RuntimeError`` with the
    failing ranks' tracebacks, or when ``deadline_s`` passes (the first call of a world size also starts its ranks).
    """
    global _REAPER
    with _LOCK:
        if _REAPER is None:
            _REAPER = threading.Thread(target=_close_idle_pools, name="close-idle-gloo-ranks", daemon=True)
            _REAPER.start()
        if world not in _POOLS:
            _POOLS[world] = _RankPool(world)
        try:
            return _POOLS[world].run(fn, args, deadline_s)
        finally:
            _LAST_USED[world] = time.monotonic()


def close_rank_pools() -> None:
    """End every started pool of gloo ranks."""
    with _LOCK:
        for pool in list(_POOLS.values()):
            pool.close()


def _at_exit() -> None:
    close_rank_pools()
    # reap the forkserver (it would end on its own), so its CPU time counts as this process's children's
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


atexit.register(_at_exit)
