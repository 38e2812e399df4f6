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
    # the released model on one card (planned stages): tiled where the recipe needs it, the whole refined frames'
    # planned need (with what stays resident, the models released) above the card; otherwise (no planned figures:
    # another model, a launched parallel run) any refining call with --vram_gb tiles. A 540p call, or one without
    # --vram_gb, never tiles
    from types import SimpleNamespace

    from diffusers_magi2 import Magi2Pipeline
    from diffusers_magi2.pipelines.weight_streaming_budget import streaming_budgets

    tile = load_generate().tile_streamed_refined_decode
    config = SimpleNamespace(preview_height=512, preview_width=896)
    turned_on = []
    decoder = SimpleNamespace(enable_tiling=lambda: turned_on.append(1))
    pipe = SimpleNamespace(config=config, video_decoder=decoder)
    pipe.stage_sizes = lambda h, w: Magi2Pipeline.stage_sizes(pipe, h, w)
    row = streaming_budgets()["recipes"]["32"]["stages"]["turbovae_decode_1080p"]
    whole = row["whole_frames_peak_GB"] + sum(row["co_resident_GB"]["released"].values())
    assert 32 < whole < 80

    def tiles(vram_gb, planned: bool, size=(1088, 1920)) -> bool:
        stages = ["refiner_1080p", "turbovae_decode_1080p"] if planned else None
        args = SimpleNamespace(vram_gb=vram_gb, planned_stages=stages)
        before = len(turned_on)
        tiled = tile(pipe, args, *size)
        assert len(turned_on) == before + tiled  # enable_tiling called exactly when it says so
        return tiled

    for planned in (True, False):
        assert not tiles(32, planned, size=(512, 896)) and not tiles(None, planned)
    assert tiles(32, True) and tiles(whole - 0.01, True)  # the 1080p preset, refined from 512 x 896
    assert not tiles(whole, True) and not tiles(80, True)  # the whole frames fit
    assert tiles(32, False) and tiles(whole, False) and tiles(80, False)  # no plan: no figures to spare it
