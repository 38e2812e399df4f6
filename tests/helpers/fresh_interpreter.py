"""Several fresh-interpreter checks for the price of one interpreter start: one new process imports the third-party
stack (torch, diffusers, transformers; never ``diffusers_magi2``) and forks one child per check, so each check runs
in a process where nothing of the package is imported yet and no test state exists, as ``python -c script`` would,
without importing torch and diffusers again. Environment variables read at import (``HF_HUB_OFFLINE``,
``HF_HUB_CACHE``, ``HF_HOME``) are the parent's, so the checks of one call share them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


_DRIVER = r"""
import json, os, sys, traceback
import torch
from diffusers import DiffusionPipeline, ModelMixin
from transformers import PreTrainedModel
assert not [m for m in sys.modules if m.split(".")[0] == "diffusers_magi2"], "the package was imported before a check"
checks, out = json.loads(sys.argv[1]), sys.argv[2]
codes = {}
for name, (script, argv) in checks.items():
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, suffix in ((1, "out"), (2, "err")):
            target = os.open(os.path.join(out, name + "." + suffix), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = [name, *argv]
        code = 0
        try:
            exec(compile(script, "<" + name + ">", "exec"), {"__name__": "__main__"})
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    codes[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


def run_fresh_checks(
    checks: dict[str, tuple[str, list]], cwd: Path, env: dict[str, str], timeout: int = 600
) -> dict[str, subprocess.CompletedProcess]:
    """Run each ``name: (script, argv)`` as ``python -c script *argv`` would (``sys.argv[1:]`` is ``argv``), each in
    its own child of one fresh interpreter started with ``env``; returns each check's exit status and output."""
    out = Path(cwd) / "fresh_checks"
    out.mkdir()
    spec = {name: (script, [str(a) for a in argv]) for name, (script, argv) in checks.items()}
    res = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(spec), str(out)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **env},
        timeout=timeout,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    codes = json.loads(res.stdout.strip().splitlines()[-1])
    return {
        name: subprocess.CompletedProcess(
            name, codes[name], (out / f"{name}.out").read_text(), (out / f"{name}.err").read_text()
        )
        for name in checks
    }


#: the host-memory checks' environment: glibc with no dynamic mmap threshold (every freed allocation over 64 KiB goes
#: back to the OS, so a freed tensor leaves ``RssAnon``), one thread, no Hub
#: Host-memory workers' shared lines: ``anon()`` (the process's anonymous RSS) and ``forward(model)`` (one no-grad
#: forward of the small transformer the streaming checks build, fixed inputs: the warm-up and the measured call).
RSS_WORKER_PRELUDE = """
def anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))
def forward(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(hidden_states=torch.randn(1, 16, 1, 4, 4, generator=g), timestep=torch.tensor([500.0]),
              encoder_hidden_states=torch.randn(1, 3, 64, generator=g),
              audio_hidden_states=torch.randn(1, 2, 16, generator=g))
"""
HOST_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_host_memory_checks(items, work: Path) -> dict[str, subprocess.CompletedProcess]:
    """Run, in one call of :func:`run_fresh_checks` with :data:`HOST_MEMORY_ENV`, every check that the
    ``host_memory_checks({name: (script, argv)})`` marks of ``items`` name, in the items' order; ``{folder}`` in an
    argv is a folder of the mark's own, shared by its checks (a save, then a measurement). Each script measures from
    a baseline it reads after its own imports: the child's resident pages inherited from the interpreter it forks
    from are in every reading alike. It reads it after a warm-up, too: the forwards it measures, run once on a model
    of the same shapes and weights (so the same MoE routing), dropped. The CPU's matmul library keeps state per
    shape for the life of the process, made in the first forward: on a CPU with AVX512-BF16, torch's bf16 matmuls
    run oneDNN's kernels, whose primitive cache (a 512 KiB buffer per shape) and scratchpad added 15.6 MB to the
    disk mode's 129 MB check and 16.5 MB to the recipe's 63 MB pinned transformer stage; with AVX2 kernels
    (``ONEDNN_MAX_CPU_ISA=AVX2``), 1.4 MB and 0.9 MB. That is the compute's memory, not the plan's, and its size
    is the CPU's."""
    checks = {}
    for item in items:
        mark = item.get_closest_marker("host_memory_checks")
        if mark is None or set(mark.args[0]) <= set(checks):
            continue
        folder = work / next(iter(mark.args[0]))  # named after the mark's first check
        folder.mkdir()
        for name, (script, argv) in mark.args[0].items():
            checks[name] = (script, [str(a).replace("{folder}", str(folder)) for a in argv])
    tests = str(Path(__file__).resolve().parents[1])  # the checks import ``helpers``
    env = {**HOST_MEMORY_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    return run_fresh_checks(checks, work, env) if checks else {}
