"""Starting scripts under ``accelerate launch`` on CPU for the tests: a clean launcher environment (no inherited
rank variables, one thread, offline, Triton interpreted, no CUDA; ``MAGI2_FIXTURES`` passes through) and the
two-process ``--multi_gpu`` command that gives gloo ranks on a CPU machine, and one machine's command of a two-machine
launch on this host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .ep_spawn_utils import free_port
from .fixtures import REPO_ROOT


ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
PROBE = str(REPO_ROOT / "tests" / "parallel" / "ep_probe_script.py")
GENERATE = str(REPO_ROOT / "examples" / "generate.py")
LAUNCH_RULES = REPO_ROOT / "examples" / "launch_rules.py"
SMOKE_ARGS = ["--prompt", "a cat on a piano", "--num_inference_steps", "1", "--height", "64", "--width", "64"]


def _load_script(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_launch_rules():
    """``examples/launch_rules.py`` (the example scripts' launch rules) as a module."""
    return _load_script("magi2_launch_rules", LAUNCH_RULES)


def load_generate():
    """``examples/generate.py`` (the main job) as a module: ``load_generate().main(argv)`` runs it in this process."""
    return _load_script("magi2_generate", Path(GENERATE))


def load_tiny_training(name: str):
    """``examples/tiny/<name>.py`` (the tiny model's training scripts and their shared module) as a module."""
    return _load_script(f"magi2_tiny_{name}", REPO_ROOT / "examples" / "tiny" / f"{name}.py")


def launch_env() -> dict:
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def multi_cpu_launch(*script_args: str) -> list[str]:
    return ACCELERATE + [
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        *script_args,
    ]


def multi_machine_launch(machine_rank: int, port: int, *script_args: str, processes_per_machine: int = 2) -> list:
    """One machine's ``accelerate launch`` of a two-machine run on this host (``127.0.0.1:port`` rendezvous)."""
    return ACCELERATE + [
        "--multi_gpu",
        "--num_machines",
        "2",
        "--machine_rank",
        str(machine_rank),
        "--num_processes",
        str(2 * processes_per_machine),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        *script_args,
    ]


def run_launched(cmd: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=launch_env(), capture_output=True, text=True, timeout=timeout)
