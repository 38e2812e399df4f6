"""``examples/generate.py --vram_gb``: the plan's stages a call at the asked size runs are checked against the card
before any weight moves (the released model; the plan's table shipped in the package)."""

from __future__ import annotations

import importlib.util
import types

import PIL.Image
import pytest
from helpers.fixtures import REPO_ROOT

from diffusers_magi2 import Magi2Pipeline
from diffusers_magi2.pipelines import weight_streaming_budget


def load_generate():
    spec = importlib.util.spec_from_file_location("magi2_generate_stages", REPO_ROOT / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(generate, tmp_path, *argv):
    PIL.Image.new("RGB", (8, 8)).save(tmp_path / "ref.png")
    argv = [str(tmp_path / a) if a == "ref.png" else a for a in argv]
    return generate.parse_args(["--prompt", "p", "--output", str(tmp_path / "clip.mp4"), *argv])


TURBO, WAN = types.SimpleNamespace(video_decoder=object()), types.SimpleNamespace(video_decoder=None)


@pytest.mark.parametrize(
    "argv, pipe, stages",
    [
        (["--resolution", "540p"], TURBO, ["text_encode", "preview_540p", "turbovae_decode_540p", "audio_decode"]),
        (
            ["--resolution", "1080p"],
            TURBO,
            ["text_encode", "preview_540p", "refiner_1080p", "turbovae_decode_1080p", "audio_decode"],
        ),
        (
            ["--resolution", "272p", "--image", "ref.png"],
            WAN,
            ["text_encode", "image_encode_540p", "preview_272p", "wan_decode_540p", "audio_decode"],
        ),
    ],
)
def test_the_stages_of_a_call_are_the_plans_names(tmp_path, argv, pipe, stages):
    generate = load_generate()
    args = _args(generate, tmp_path, *argv)
    size = generate.call_size(args, {"height": 512, "width": 896})
    assert generate.planned_stages(pipe, args, *size) == stages
    assert set(stages) <= set(weight_streaming_budget.streaming_budgets()["recipes"]["32"]["stages"])


def test_a_card_too_small_for_the_asked_resolution_is_refused_before_streaming(tmp_path, monkeypatch):
    # 540p on 24 GB and 1080p on 32 GB pass; 1080p on 24 GB (the refiner is not in that recipe) and 540p on a 12 GB
    # card are refused naming the stage, before enable_weight_streaming moves anything
    generate = load_generate()
    monkeypatch.setattr(weight_streaming_budget, "plan_applies", lambda config: True)
    enabled = []
    pipe = types.SimpleNamespace(
        transformer=types.SimpleNamespace(config={}),
        video_decoder=object(),
        enable_weight_streaming=lambda **kwargs: enabled.append(kwargs["vram_gb"]),
    )
    monkeypatch.setattr(Magi2Pipeline, "from_pretrained", classmethod(lambda cls, *a, **k: pipe))
    for vram_gb, resolution, refused in (
        (24, "540p", None),
        (32, "1080p", None),
        (24, "1080p", "refiner_1080p"),
        (12, "540p", "preview_540p"),
    ):
        args = _args(generate, tmp_path, "--model", "org/repo", "--resolution", resolution, "--vram_gb", str(vram_gb))
        if refused is None:
            generate.load_pipeline(args)
            assert enabled[-1] == vram_gb
        else:
            with pytest.raises(ValueError, match=refused):
                generate.load_pipeline(args)
            assert enabled[-1] != vram_gb or len(enabled) == 2
