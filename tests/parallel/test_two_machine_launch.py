"""Two machines, emulated on one host: two ``accelerate launch --num_machines 2`` launchers (machine ranks 0 and 1,
two gloo processes each, one rendezvous) run ``examples/generate.py`` on the tiny default under CP 4 x EP 2 (two EP
replicas; ranks 2 and 3 live on the second machine, where the local rank is not the global rank), and write the
same mp4, bit for bit, as one process. Only global rank 0, on the first machine, writes.

Bit-for-bit equality needs each rank's share of every modality to be more than a handful of tokens: CPU GEMMs
round a row differently when they multiply only a few rows (small-M kernels), so a rank holding, say, three text
tokens would differ from one process in the last bits. Here the prompt is 72 tokens and is also the negative prompt,
so the two CFG segments are equal and the shards split them in video tokens. The frames are 128 pixels wide:
x264's AVX-512 code does not encode narrower frames deterministically.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.ep_spawn_utils import free_port
from helpers.launch import GENERATE, launch_env, multi_machine_launch


pytestmark = pytest.mark.distributed

PROMPT = " ".join(["a red fox trots through fresh snow at dawn"] * 8)
ARGS = [
    "--prompt",
    PROMPT,
    "--negative_prompt",
    PROMPT,
    "--num_inference_steps",
    "1",
    "--height",
    "64",
    "--width",
    "128",
]


def test_two_machines_write_the_single_process_mp4_bit_for_bit(tmp_path):
    single, launched = tmp_path / "single.mp4", tmp_path / "two_machines.mp4"
    port = free_port()
    commands = [[sys.executable, GENERATE, *ARGS, "--output", str(single)]] + [
        multi_machine_launch(rank, port, GENERATE, *ARGS, "--ep_degree", "2", "--output", str(launched))
        for rank in (0, 1)
    ]
    runs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd in commands
    ]
    try:
        outputs = [run.communicate(timeout=600) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    for run, (_, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-3000:]
    machine0, machine1 = outputs[1][0], outputs[2][0]
    assert "context parallel: packed sequence split over 4 ranks" in machine0
    assert "expert parallel: routed experts split over 2 ranks" in machine0
    assert "wrote" not in machine1  # global ranks 2 and 3 write nothing
    assert launched.read_bytes() == single.read_bytes()
