"""Two machines, emulated on one host: two ``accelerate launch --num_machines 2`` launchers (machine ranks 0 and 1,
two gloo processes each, one rendezvous) run ``examples/generate.py`` on the tiny default under CP 4 x EP 4 (ranks 2
and 3 live on the second machine, where the local rank is not the global rank; the tiny default's two MoE heads are
padded to four, so they hold no expert but join every exchange) and hand the encoder the same uint8 frames, bit for
bit, as one process. Only global rank 0, on the first machine, writes the mp4, which decodes to those frames' shape.
``generate_frames_script.py`` runs the example script and keeps the frames.

Bit-for-bit equality needs each rank's share of every modality to be more than a handful of tokens: CPU GEMMs
round a row differently when they multiply only a few rows (small-M kernels; MKL on an AMD EPYC: 1 to 3 rows), so a
rank holding, say, three text tokens would differ from one process in the last bits. Here the prompt is 72 tokens
and is also the negative prompt, so the two CFG segments are equal and the shards split them in video tokens. EP
equals CP for the same reason: with two EP replicas (EP 2) each expert multiplies only its replica's routes, and one
the video tokens rarely choose gets 2 of them (34 in one process), which left 7 frame values one level off.

The frames are compared before the encoder: whether x264 encodes equal frames to equal bytes depends on the CPU (its
AVX-512 code on an AMD EPYC does not for some frame widths; see ``test_ep_accelerate_launch.py``), and it quantised
those 7 values away.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.ep_spawn_utils import free_port
from helpers.launch import launch_env, multi_machine_launch


pytestmark = pytest.mark.distributed

FRAMES_SCRIPT = str(Path(__file__).with_name("generate_frames_script.py"))
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


def _decoded_shape(mp4: Path) -> tuple:
    import av

    with av.open(str(mp4)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).shape


def test_two_machines_hand_the_encoder_the_single_process_frames_bit_for_bit(tmp_path):
    single, launched = tmp_path / "single.mp4", tmp_path / "two_machines.mp4"
    port = free_port()
    commands = [[sys.executable, FRAMES_SCRIPT, *ARGS, "--output", str(single)]] + [
        multi_machine_launch(rank, port, FRAMES_SCRIPT, *ARGS, "--ep_degree", "4", "--output", str(launched))
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
    assert "expert parallel: routed experts split over 4 ranks" in machine0
    assert machine0.count("wrote ") == 1  # global rank 0 only
    assert "wrote" not in machine1  # global ranks 2 and 3 (local ranks 0 and 1) write nothing
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".mp4", ".npy")) == [
        "single.mp4",
        "single.npy",
        "two_machines.mp4",
        "two_machines.npy",
    ]
    frames, single_frames = np.load(launched.with_suffix(".npy")), np.load(single.with_suffix(".npy"))
    assert frames.dtype == single_frames.dtype == np.uint8
    assert frames.shape == single_frames.shape and frames.shape[1:] == (64, 128, 3)
    assert np.array_equal(frames, single_frames)
    assert _decoded_shape(launched) == frames.shape
