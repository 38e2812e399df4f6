"""Expert parallelism under ``accelerate launch`` on CPU (gloo): the launched world size decides
expert parallelism, and the README's CPU smoke run.

* ``accelerate launch --cpu --num_processes 2`` starts ONE process; asking for ``--ep_degree 2`` must exit
  non-zero with an error naming the world size, never run unsharded (probe script and ``examples/generate.py``).
* ``accelerate launch --multi_gpu --num_processes 2`` + ``PartialState(cpu=True)`` (done by the product)
  gives 2 processes, gloo, an EP group of 2, each rank holding half of the expert rows: ``test_cp_launch.py``
  reads it from its launch.
* Smoke run: ``examples/generate.py`` on the tiny default under ``--multi_gpu --num_processes 2`` (CP2 x EP2, the
  script's default under a launcher): exit 0, rank 0 alone writes the mp4, the frames it hands to the encoder equal
  the single-process run's within one uint8 level, and the mp4 holds them within the encoder's loss; once with the
  in-memory tiny default (``enable_expert_parallel``), once from a saved pipeline folder
  (``Magi2Pipeline.from_pretrained(..., expert_parallel=...)``). ``generate_frames_script.py`` runs the example
  script and keeps those frames.

The frames are compared before the encoder because x264's AVX-512 code (e.g. on an AMD EPYC with AVX-512) does not
encode these 64-pixel-wide frames deterministically: the same frames encoded 20 times in one process gave 3 to 5
different bitstreams, and two single-process runs with bit-identical frames wrote mp4s whose first frames differ by
up to 10 levels (x264's macroblock tree sets the intra-coded first frame's quantisers from its lookahead over the
later frames, so no encoded frame is exempt). With ``asm=0``, or without AVX-512, the same encodes are identical.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
from helpers.launch import ACCELERATE, GENERATE, PROBE, SMOKE_ARGS, load_generate, multi_cpu_launch, run_launched


pytestmark = pytest.mark.distributed

FRAMES_SCRIPT = str(Path(__file__).with_name("generate_frames_script.py"))


def test_ep_accelerate_cpu_flag_starts_one_process_and_ep_errors(tmp_path):
    res = run_launched(ACCELERATE + ["--cpu", "--num_processes", "2", PROBE, "--ep_degree", "2"], tmp_path)
    assert res.returncode != 0
    assert "EP_PROBE" not in res.stdout  # nothing ran with ep = 1 while claiming EP
    assert "ep_degree=2 needs an initialised torch.distributed process group" in res.stderr
    assert "world size 1" in res.stderr

    out = tmp_path / "never.mp4"
    res = run_launched(
        ACCELERATE
        + ["--cpu", "--num_processes", "2", GENERATE, *SMOKE_ARGS, "--ep_degree", "2", "--output", str(out)],
        tmp_path,
    )
    assert res.returncode != 0 and not out.exists()
    assert "--ep_degree 2 requested but this run has 1 process(es)" in res.stderr


def _frames(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _written(mp4: Path) -> tuple[np.ndarray, np.ndarray]:
    """What a run wrote: the uint8 frames it handed to the encoder, and its mp4's decoded frames."""
    return np.load(mp4.with_suffix(".npy")), _frames(mp4)


def _assert_same_video(run: tuple, single: tuple) -> None:
    (frames, mp4), (single_frames, _) = run, single
    assert frames.dtype == single_frames.dtype == np.uint8
    assert frames.shape == single_frames.shape and frames.shape[1:3] == (64, 64)
    # Both configurations give bit-identical float frames on an AMD EPYC (in-memory and saved-folder pipelines,
    # single process and CP2 x EP2); one level lets a value on a rounding boundary flip where another CPU's kernels
    # sum the split shards in another order (the bar of test_cp_launch.py).
    assert np.abs(frames.astype(np.int16) - single_frames.astype(np.int16)).max() <= 1
    # The mp4 holds these frames: x264 at crf 18 loses 2.7 levels on average on them (2.71 to 2.74 over 5
    # differing bitstreams), the frames of another seed are 19.2 levels away.
    assert mp4.shape == frames.shape
    assert np.abs(mp4.astype(np.int16) - frames.astype(np.int16)).mean() <= 6.0


@pytest.fixture(scope="module")
def single_process_video(tmp_path_factory) -> tuple:
    """The same command without a launcher, run in this process (one process; no new interpreter needed)."""
    import diffusers_magi2

    out = tmp_path_factory.mktemp("ep_single") / "out.mp4"
    keeping_frames = runpy.run_path(FRAMES_SCRIPT)["keeping_frames"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            diffusers_magi2, "export_to_video_with_audio", keeping_frames(diffusers_magi2.export_to_video_with_audio)
        )
        assert load_generate().main([*SMOKE_ARGS, "--output", str(out)]) == 0
    return _written(out)


def _ep_generate(out_dir: Path, *extra: str) -> tuple:
    out = out_dir / "out.mp4"
    res = run_launched(multi_cpu_launch(FRAMES_SCRIPT, *SMOKE_ARGS, *extra, "--output", str(out)), out_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "expert parallel: routed experts split over 2 ranks" in res.stdout
    assert "context parallel: packed sequence split over 2 ranks (Ulysses)" in res.stdout  # CP2 x EP2 by default
    assert res.stdout.count("wrote ") == 1  # rank 0 only
    assert sorted(p.name for p in out_dir.iterdir() if p.suffix in (".mp4", ".npy")) == ["out.mp4", "out.npy"]
    return _written(out)


def test_ep_cpu_smoke_run_generate_tiny_default(tmp_path, single_process_video):
    """README CPU smoke run: the in-memory tiny default, sharded with ``transformer.enable_expert_parallel``."""
    _assert_same_video(_ep_generate(tmp_path), single_process_video)


def test_ep_cpu_smoke_run_generate_saved_pipeline(tmp_path, single_process_video):
    """``--model <saved folder>``: ``Magi2Pipeline.from_pretrained(..., expert_parallel=...)`` loads per-rank slices."""
    from diffusers_magi2.pipelines.tiny_default import build_tiny_default_pipeline

    model_dir = tmp_path / "tiny_pipe"
    build_tiny_default_pipeline().save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _assert_same_video(_ep_generate(run_dir, "--model", str(model_dir), "--dtype", "float32"), single_process_video)
