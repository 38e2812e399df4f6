"""``examples/generate.py`` flags of the two-stage path: ``--resolution`` and ``--output_height/--output_width``."""

from __future__ import annotations

import importlib.util

import av
import pytest
from helpers.fixtures import REPO_ROOT

from diffusers_magi2.utils.export import probe_streams


def load_generate():
    spec = importlib.util.spec_from_file_location("magi2_generate_refiner", REPO_ROOT / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resolution_and_size_flags_conflict(tmp_path):
    with pytest.raises(ValueError, match="either --resolution or --height/--width"):
        load_generate().main(
            ["--prompt", "x", "--output", str(tmp_path / "x.mp4"), "--resolution", "1080p", "--height", "512"]
        )
    assert not (tmp_path / "x.mp4").exists()


def test_1080p_without_a_refiner_raises_before_work(tmp_path):
    """The tiny default has no refiner: ``--resolution 1080p`` is refused with a pointer to it."""
    with pytest.raises(ValueError, match="needs the `refiner` component"):
        load_generate().main(["--prompt", "x", "--output", str(tmp_path / "x.mp4"), "--resolution", "1080p"])
    assert not (tmp_path / "x.mp4").exists()


def test_output_size_flags_resize_the_written_frames(tmp_path):
    out = tmp_path / "resized.mp4"
    rc = load_generate().main(
        [
            "--prompt",
            "A red fox in snow",
            "--output",
            str(out),
            "--height",
            "32",
            "--width",
            "48",
            "--num_inference_steps",
            "1",
            "--output_height",
            "40",
            "--output_width",
            "70",
        ]
    )
    assert rc == 0
    info = probe_streams(out)
    assert info["video_frames"] == 25  # the trained tiny default's 2 s at 12.5 fps
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.height, stream.codec_context.width) == (40, 70)


def test_a_streamed_refining_call_tiles_the_turbovae_decode():
    from types import SimpleNamespace

    from diffusers_magi2 import Magi2Pipeline

    tile = load_generate().tile_streamed_refined_decode
    config = SimpleNamespace(preview_height=512, preview_width=896)
    turned_on = []
    decoder = SimpleNamespace(enable_tiling=lambda: turned_on.append(1))
    pipe = SimpleNamespace(config=config, video_decoder=decoder)
    pipe.stage_sizes = lambda h, w: Magi2Pipeline.stage_sizes(pipe, h, w)
    streamed, resident = SimpleNamespace(vram_gb=32), SimpleNamespace(vram_gb=None)
    assert not tile(pipe, streamed, 512, 896) and not tile(pipe, resident, 1088, 1920) and turned_on == []
    assert tile(pipe, streamed, 1088, 1920) and turned_on == [1]  # the 1080p preset, refined from 512 x 896
    assert not tile(pipe, SimpleNamespace(vram_gb=80), 1088, 1920) and turned_on == [1]  # whole frames fit 80 GB
