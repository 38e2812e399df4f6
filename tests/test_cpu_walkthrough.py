"""The README's CPU walk-through, run verbatim: write the tiny SandAI-layout release, convert it with
``magi2-convert``, generate a clip from the converted repo with ``examples/generate.py``; and what the release
writer guarantees (the SandAI layout, names that convert back, nothing left behind on bad input)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from helpers.fixtures import REPO_ROOT

from diffusers_magi2.conversion.repo import RELEASE_LAYOUT
from diffusers_magi2.utils.export import probe_streams


def readme_block(marker: str) -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    return readme.split(f"<!-- {marker} -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """Run the README block in a fresh folder that has the repository's ``examples/`` and this venv as ``.venv``."""
    work = tmp_path_factory.mktemp("walkthrough")
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (work / "examples").symlink_to(REPO_ROOT / "examples", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_block("cpu-walkthrough")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return work, res


@pytest.mark.slow  # the walk-through's three fresh interpreters (module fixture)
def test_readme_walkthrough_converts_and_generates_a_clip(walkthrough):
    work, res = walkthrough
    release = work / "magi2-tiny-release"
    for part in RELEASE_LAYOUT.values():
        assert (release / part).exists(), part
    index = json.loads((work / "magi2-tiny-diffusers" / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers_magi2.models.transformer_magi2", "Magi2Transformer3DModel"]
    assert index["refiner"][1] == "Magi2RefinerTransformer3DModel"
    info = probe_streams(work / "tiny.mp4")
    assert info["video_frames"] == 125 and info["fps"] == Fraction(25, 2)
    assert info["audio_sample_rate"] == 44_100 and info["audio_channels"] == 2
    assert "model magi2-tiny-diffusers" in res.stdout


@pytest.mark.slow  # the walk-through's three fresh interpreters (module fixture)
def test_release_holds_sandai_names_and_the_release_dtypes(walkthrough):
    from safetensors import safe_open

    release = walkthrough[0] / "magi2-tiny-release"
    with safe_open(str(next((release / "preview").glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert any(k.startswith("block.layers.0.") for k in keys)
    assert any(k.startswith("block.layers.1.") and k.endswith("router.expert_bias_ema") for k in keys)
    assert not any(k.startswith("transformer_blocks.") for k in keys)
    assert dtypes == {"BF16", "F32"}
    sao = json.loads((release / "stable-audio-open-1.0" / "model_config.json").read_text())
    enc = sao["model"]["pretransform"]["config"]["encoder"]["config"]
    assert enc["channels"] == enc["latent_dim"]  # representable: the converter needs no zero-encoder option


def test_release_writer_refuses_a_non_empty_folder_and_leaves_nothing(tmp_path, capsys):
    """The command's ``main`` (its ``python -m`` entry runs in the walk-through) exits 2 after one ``error:`` line."""
    from diffusers_magi2.conversion.tiny_release import main

    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc = main([str(out)])
    stderr = capsys.readouterr().err
    assert rc == 2 and stderr.startswith("error: ") and "not an empty folder" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


#: run in a fresh process with HF_HUB_OFFLINE=1: the converted repo as remote code, one call per path
REMOTE_CODE_SCRIPT = """
import sys, json, numpy as np, torch
from diffusers.modular_pipelines import ModularPipeline
folder, calls, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
pipe = ModularPipeline.from_pretrained(folder, trust_remote_code=True)
pipe.load_components()
pipe.set_progress_bar_config(disable=True)
results = {"class": np.array(type(pipe).__name__ + "/" + type(pipe.blocks).__name__)}
for name, call in calls.items():
    state = pipe(prompt="A red fox trots through fresh snow", generator=torch.Generator().manual_seed(3), **call)
    results[name + "_frames"], results[name + "_audio"] = state.get("videos"), state.get("audio")
np.savez(out, **results)
print("ok")
"""


@pytest.mark.slow  # the walk-through's three fresh interpreters (module fixture)
def test_converted_release_loads_as_remote_code_offline_and_equals_magi2_pipeline(walkthrough, tmp_path):
    """The walk-through's converted repo, loaded with plain diffusers' ``ModularPipeline.from_pretrained(...,
    trust_remote_code=True)`` in a fresh ``HF_HUB_OFFLINE=1`` process, gives ``Magi2Pipeline.from_pretrained``'s
    frames and audio bit for bit (same seed), on the one-stage path and through the converted refiner."""
    import numpy as np
    import torch
    from helpers.modular_testing_utils import run_fresh_offline

    from diffusers_magi2 import Magi2Pipeline

    repo = walkthrough[0] / "magi2-tiny-diffusers"
    calls = {
        "t2v": {"height": 32, "width": 32, "num_inference_steps": 1},
        "two_stage": {"height": 64, "width": 64, "preview_height": 32, "preview_width": 32,
                      "num_inference_steps": 1, "refiner_num_inference_steps": 1},
    }  # fmt: skip
    results = run_fresh_offline(REMOTE_CODE_SCRIPT, [repo, json.dumps(calls)], tmp_path)
    assert str(results["class"]) == "ModularPipeline/Magi2AutoBlocks"
    pipe = Magi2Pipeline.from_pretrained(repo)
    pipe.set_progress_bar_config(disable=True)
    for name, call in calls.items():
        ref = pipe("A red fox trots through fresh snow", generator=torch.Generator().manual_seed(3), **call)
        assert results[name + "_frames"].shape == ref.frames.shape and ref.frames.std() > 0, name
        assert np.array_equal(results[name + "_frames"], ref.frames), name
        assert np.array_equal(results[name + "_audio"], ref.audio), name
