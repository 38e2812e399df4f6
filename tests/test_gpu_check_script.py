"""``tests/benchmarks/gpu_check.sh`` stays runnable without a GPU: its syntax, its interpreter choice, and its
``--dry-run`` (the CPU-sized parts of every section) end to end."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "OUT", "WHEELS")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_gpu_check_stops_with_a_clear_message_when_the_interpreter_lacks_the_package(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], env=_env(PYTHON=str(fake)), capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "cannot import torch" in proc.stderr and "WHEELS" in proc.stderr
    assert not (tmp_path / "out" / "summary.txt").exists()  # stopped before any step


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_cpu_section(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(out)],
        env=_env(PYTHON=sys.executable, GPU_CHECK_SKIP="bench_moe"),  # bench_moe has its own smoke test
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    for name in ("environment", "attention_sinks", "bench_moe_int4", "gpu_block", "preview_step", "streaming_24gb"):
        line = next(line for line in summary.splitlines() if line.startswith(name))
        assert " ok " in line, line
    assert "skipped (GPU_CHECK_SKIP)" in next(line for line in summary.splitlines() if line.startswith("bench_moe "))
    int4 = json.loads((out / "bench_moe_int4.json").read_text())["cpu"]
    assert int4["int4_experts_full_forward_s"] > 0 and int4["int4_estimate"]["one_head_bf16_GB"] > 0.5
    sinks = json.loads((out / "attention_sinks.json").read_text())
    assert sinks["backends"]["native"]["max_abs_err_vs_padded"] < 1e-5
    recipes = json.loads((out / "preview_step.json").read_text())["recipes"]
    assert set(recipes) == {"fp8", "80gb"}  # the 141 GB and the 80 GB recipe
    assert all(abs(r["planned_over_measured"] - 1) <= 0.10 for r in recipes.values()), recipes
    streaming = json.loads((out / "streaming_24gb.json").read_text())  # the CPU ring: same output, planned peak
    assert streaming["bit_equal"] and not streaming["failures"], streaming
