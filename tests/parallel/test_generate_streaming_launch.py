"""``examples/generate.py --vram_gb`` under ``accelerate launch --multi_gpu --num_processes 2`` (gloo ranks on CPU,
CP2 x EP2) with the memory plan applying to the saved pipeline (``generate_planned_script.py``). The plan's figures
are a single card's, so a launched run is not checked against them. Each rank's transformer, loaded by
``from_pretrained(expert_parallel=...)``, holds only its experts' rows, so it cannot be re-read from its files
(``enable_weight_streaming(release_between_stages=True)`` refuses it); the run streams with
``release_between_stages=None`` (that transformer held), writes the clip, and prints no single-card figures as a
rank's."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import SMOKE_ARGS, multi_cpu_launch, run_launched


pytestmark = pytest.mark.distributed

PLANNED_SCRIPT = str(Path(__file__).with_name("generate_planned_script.py"))


def test_a_launched_expert_parallel_run_streams_the_planned_model_with_its_transformer_held(tmp_path):
    from diffusers_magi2.pipelines.tiny_default import build_tiny_default_pipeline

    model_dir = tmp_path / "tiny_pipe"
    build_tiny_default_pipeline().save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = run_dir / "out.mp4"
    argv = [*SMOKE_ARGS, "--model", str(model_dir), "--dtype", "float32", "--vram_gb", "80", "--output", str(out)]
    res = run_launched(multi_cpu_launch(PLANNED_SCRIPT, *argv), run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    streaming = [line for line in res.stdout.splitlines() if line.startswith("weight streaming:")]
    assert streaming == [  # rank 0 alone; other lines are the launcher's and gloo's (torch 2.10's gloo prints some)
        "weight streaming: host_memory pinned, a ring of 2 device buffers per streamed model; each rank's transformer "
        "held between stages; the memory plan's figures are a single card's, running the whole call, not a rank's "
        "under expert parallelism over 2 ranks and context parallelism over 2 ranks: no planned peaks"
    ]
    assert res.stdout.count("wrote ") == 1 and out.stat().st_size > 0
