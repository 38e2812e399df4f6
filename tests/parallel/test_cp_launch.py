"""``accelerate launch --multi_gpu --num_processes 2`` on CPU (gloo) runs the tiny default pipeline under CP2 x EP2
(the launch default): its decoded uint8 frames, before any encoding, equal the single-process frames within one
level, and only rank 0 writes. Rank 0 alone runs the text encoder (prompt and negative prompt; the other rank
receives them by broadcast) and the video and audio decoders; the other rank gets no frames and no audio. The same
launch shows what the launcher and ``PartialState(cpu=True)`` (done by the product) give: 2 processes, gloo, an EP
group of 2, each rank holding half of the expert rows."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.launch import launch_env, multi_cpu_launch


pytestmark = pytest.mark.distributed


SCRIPT = str(Path(__file__).with_name("cp_frames_script.py"))


def _calls(stdout: str) -> dict:
    """``{rank: {"text_encoder": n, ..., "frames": "array" | "none", "audio": ...}}`` from the CP_CALLS lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("CP_CALLS "):
            fields = dict(item.split("=") for item in line.split()[1:])
            rank = int(fields.pop("rank"))
            out[rank] = {k: (int(v) if v.isdigit() else v) for k, v in fields.items()}
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The script under ``accelerate launch --multi_gpu --num_processes 2``: its output and rank 0's frames."""
    work = tmp_path_factory.mktemp("cp_launch")
    parallel = work / "parallel.npy"
    res = subprocess.run(
        multi_cpu_launch(SCRIPT, "--out", str(parallel)),
        cwd=work,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res, parallel


def test_ep_accelerate_multi_gpu_on_cpu_gives_two_gloo_ranks(launched):
    res, _ = launched
    probes = [json.loads(line.split(" ", 1)[1]) for line in res.stdout.splitlines() if line.startswith("EP_PROBE ")]
    assert sorted(p["rank"] for p in probes) == [0, 1]
    for p in probes:
        assert p["world_size"] == 2 and p["ep_group_size"] == 2 and p["backend"] == "gloo"
        assert p["distributed_type"] == "DistributedType.MULTI_CPU"
        assert p["local_expert_rows"] * 2 == p["full_expert_rows"]


def test_cp2_ep2_launch_frames_equal_single_process(launched, tmp_path, monkeypatch, capsys):
    # the script alone (no launcher, nothing parallel), run in this process: no new interpreter needed
    single = tmp_path / "single.npy"
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--out", str(single)])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runpy.run_path(SCRIPT, run_name="__main__")
    stdout = capsys.readouterr().out
    assert "CP_FRAMES cp=1" in stdout and "EP_PROBE" not in stdout
    single_calls = _calls(stdout)[0]
    assert single_calls["text_encoder"] == 2 and single_calls["video_decoder"] == single_calls["audio_decoder"] == 1
    res, parallel = launched
    assert res.stdout.count("CP_FRAMES cp=2") == 1  # rank 0 alone reports and writes
    calls = _calls(res.stdout)
    assert calls[0] == {**single_calls, "frames": "array", "audio": "array"}, calls
    assert calls[1] == {"text_encoder": 0, "video_decoder": 0, "audio_decoder": 0, "frames": "none", "audio": "none"}
    a, b = np.load(single), np.load(parallel)
    assert a.dtype == b.dtype == np.uint8 and a.shape == b.shape
    assert np.abs(a.astype(np.int16) - b.astype(np.int16)).max() <= 1
