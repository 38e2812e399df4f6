"""``accelerate launch --multi_gpu --num_processes 2`` on CPU (gloo) runs the tiny default pipeline under CP2 x EP2
(the launch default): its decoded uint8 frames, before any encoding, equal the single-process frames within one
level, and only rank 0 writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from test_ep_accelerate_launch import _env, _multi_cpu

SCRIPT = str(Path(__file__).with_name("cp_frames_script.py"))


def test_cp2_ep2_launch_frames_equal_single_process(tmp_path):
    single = tmp_path / "single.npy"
    res = subprocess.run([sys.executable, SCRIPT, "--out", str(single)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "CP_FRAMES cp=1" in res.stdout
    parallel = tmp_path / "parallel.npy"
    res = subprocess.run(_multi_cpu(SCRIPT, "--out", str(parallel)), cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("CP_FRAMES cp=2") == 1  # rank 0 alone reports and writes
    a, b = np.load(single), np.load(parallel)
    assert a.dtype == b.dtype == np.uint8 and a.shape == b.shape
    assert np.abs(a.astype(np.int16) - b.astype(np.int16)).max() <= 1
