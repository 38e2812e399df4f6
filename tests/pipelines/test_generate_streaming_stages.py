"""``examples/generate.py --vram_gb``: the plan's stages a call at the asked size runs are checked against the card
from the repo's configs, before any weight loads (the released model; the plan's table shipped in the package), and
once streaming is on, rank 0 prints the mode, the ring and the plan's figures for those stages."""

from __future__ import annotations

import importlib.util
import types

import PIL.Image
import pytest
from helpers.fixtures import REPO_ROOT

from diffusers_magi2 import Magi2Pipeline
from diffusers_magi2.pipelines import weight_streaming_budget


def load_example(name: str = "generate"):
    """``examples/<name>.py``, loaded by path."""
    spec = importlib.util.spec_from_file_location(f"magi2_{name}_stages", REPO_ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(generate, tmp_path, *argv):
    PIL.Image.new("RGB", (8, 8)).save(tmp_path / "ref.png")
    argv = [str(tmp_path / a) if a == "ref.png" else a for a in argv]
    return generate.parse_args(["--prompt", "p", "--output", str(tmp_path / "clip.mp4"), *argv])


def _fake_repo(monkeypatch, released: bool, enable_weight_streaming, turbovae: bool = True):
    """``from_pretrained`` returns a stand-in pipeline, and the repo's configs read a transformer and a refiner that
    the plan covers when ``released`` (both read) and a TurboVAE ``video_decoder`` when ``turbovae``; ``loaded`` lists
    the from_pretrained calls."""
    from diffusers import DiffusionPipeline

    from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel

    def plan_applies(config, refiner_config=None):
        return released and config == {"repo": 1} and refiner_config == {"refiner": 1}

    monkeypatch.setattr(weight_streaming_budget, "plan_applies", plan_applies)
    monkeypatch.setattr(Magi2Transformer3DModel, "load_config", classmethod(lambda cls, *a, **k: {"repo": 1}))
    monkeypatch.setattr(
        Magi2RefinerTransformer3DModel, "load_config", classmethod(lambda cls, *a, **k: {"refiner": 1})
    )
    index = {
        "video_decoder": ["diffusers_magi2", "Magi2TurboVAEDecoder"] if turbovae else [None, None],
        "refiner": ["diffusers_magi2", "Magi2RefinerTransformer3DModel"],
    }
    monkeypatch.setattr(DiffusionPipeline, "load_config", classmethod(lambda cls, *a, **k: index))
    pipe = types.SimpleNamespace(enable_weight_streaming=enable_weight_streaming, loaded=[])
    monkeypatch.setattr(
        Magi2Pipeline, "from_pretrained", classmethod(lambda cls, *a, **k: pipe.loaded.append(a) or pipe)
    )
    return pipe


@pytest.mark.parametrize(
    "argv, turbovae, stages",
    [
        (["--resolution", "540p"], True, ["text_encode", "preview_540p", "turbovae_decode_540p", "audio_decode"]),
        (
            ["--resolution", "1080p"],
            True,
            ["text_encode", "preview_540p", "refiner_1080p", "turbovae_decode_1080p", "audio_decode"],
        ),
        (
            ["--resolution", "272p", "--image", "ref.png"],
            False,
            ["text_encode", "image_encode_540p", "preview_272p", "wan_decode_540p", "audio_decode"],
        ),
    ],
)
def test_the_stages_of_a_call_are_the_plans_names(tmp_path, monkeypatch, argv, turbovae, stages):
    generate = load_example()
    args = _args(generate, tmp_path, "--model", "org/repo", "--vram_gb", "32", *argv)
    _fake_repo(monkeypatch, True, lambda **kwargs: None, turbovae)
    assert (
        load_example("generate_streaming").planned_stages(args, *generate.call_size(args, {}), turbovae=turbovae)
        == stages
    )
    assert set(stages) <= set(weight_streaming_budget.streaming_budgets()["recipes"]["32"]["stages"])
    if turbovae:  # read from the repo's configs
        assert generate.repo_streamed_stages(args, *generate.call_size(args, {})) == stages
    else:  # the streamed recipes decode with the TurboVAE
        with pytest.raises(ValueError, match=r"does not run \['wan_decode_540p'\]"):
            generate.repo_streamed_stages(args, *generate.call_size(args, {}))


def test_a_card_too_small_for_the_asked_resolution_is_refused_before_streaming(tmp_path, monkeypatch):
    # 540p on 24 GB and 1080p on 32 GB pass; 1080p on 24 GB (the refiner is not in that recipe) and 540p on a 12 GB
    # card are refused naming the stage, before enable_weight_streaming moves anything
    generate = load_example()
    enabled = []
    pipe = _fake_repo(monkeypatch, True, lambda **k: enabled.append((k["vram_gb"], k["release_between_stages"])))
    for vram_gb, resolution, refused in (
        (24, "540p", None),
        (32, "1080p", None),
        (
            24,
            "1080p",
            r"the 24 GB recipe does not run \['refiner_1080p', 'turbovae_decode_1080p'\] \(the 24 GB recipe",
        ),
        (12, "540p", r"vram_gb=12 is below the planned peak of stage 'preview_540p'"),
    ):
        args = _args(generate, tmp_path, "--model", "org/repo", "--resolution", resolution, "--vram_gb", str(vram_gb))
        if refused is None:
            generate.load_pipeline(args)
            assert enabled[-1] == (vram_gb, True)  # the released model streams as the recipes plan it
        else:
            loaded = len(pipe.loaded)
            with pytest.raises(ValueError, match=refused):
                generate.load_pipeline(args)
            assert len(pipe.loaded) == loaded  # refused before from_pretrained loads any weight


@pytest.mark.parametrize(
    "argv, recipe, mode",
    [
        (["--resolution", "540p", "--vram_gb", "24", "--host_memory", "disk"], "24", "disk"),
        (["--resolution", "1080p", "--vram_gb", "32"], "32", "pinned"),
    ],
)
def test_streaming_prints_the_mode_ring_and_the_plans_peak_and_host_memory(
    tmp_path, monkeypatch, capsys, argv, recipe, mode
):
    # one line on rank 0 once streaming is on: the largest checked stage's planned peak plus what stays resident
    # (recomputed from the shipped table), the mode's planned host memory; another rank prints nothing
    generate = load_example()
    _fake_repo(monkeypatch, True, lambda **kwargs: None)
    args = _args(generate, tmp_path, "--model", "org/repo", *argv)
    generate.load_pipeline(args)
    (line,) = capsys.readouterr().out.splitlines()
    table = weight_streaming_budget.streaming_budgets()["recipes"][recipe]
    stages = load_example("generate_streaming").planned_stages(args, *generate.call_size(args, {}), turbovae=True)
    assert args.planned_stages == stages  # carried to the call (the refined decode's tiling)
    need = {
        s: round(table["stages"][s]["peak_GB"] + sum(table["stages"][s]["co_resident_GB"]["released"].values()), 2)
        for s in stages
    }
    peak = max(need, key=need.get)
    assert peak == ("preview_540p" if recipe == "24" else "refiner_1080p")
    assert f"host_memory {mode}, a ring of 2 device buffers" in line
    assert f"planned device peak {need[peak]} GB ({peak}," in line
    assert f"host memory {table['host_ram_GB'][mode]} GB, over the stages {', '.join(stages)}" in line
    monkeypatch.setenv("RANK", "1")
    generate.load_pipeline(args)
    assert capsys.readouterr().out == ""


def test_streaming_a_model_the_plan_does_not_cover_says_so(tmp_path, monkeypatch, capsys):
    generate = load_example()
    modes = []
    _fake_repo(
        monkeypatch, False, lambda **k: modes.append((k["host_memory"], k["ring_size"], k["release_between_stages"]))
    )
    args = _args(generate, tmp_path, "--model", "org/repo", "--vram_gb", "24")
    generate.load_pipeline(args)
    assert modes == [("pinned", 2, None)]  # released where the models can be re-read, else held
    assert args.planned_stages is None
    assert capsys.readouterr().out.splitlines() == [
        "weight streaming: host_memory pinned, a ring of 2 device buffers per streamed model; the memory plan does not "
        "apply (not the released Preview's config): no planned peaks"
    ]


def _fake_launch(generate, monkeypatch, ep_degree: int, ulysses_degree: int):
    """``load_pipeline``'s launch rules as in a run launched with ``ep_degree`` expert-parallel and ``ulysses_degree``
    context-parallel ranks (a degree of 1: none), without a process group; the argument checks stay one process's."""
    ep = types.SimpleNamespace(ep_degree=ep_degree) if ep_degree > 1 else None
    cp = types.SimpleNamespace(ulysses_degree=ulysses_degree) if ulysses_degree > 1 else None
    rules = types.SimpleNamespace(
        launch_degrees=generate.launch_rules().launch_degrees,
        init_distributed_from_launch=lambda: None,
        expert_parallel_from_launch=lambda degree: ep,
        context_parallel_from_launch=lambda degree, ep_degree: cp,
    )
    monkeypatch.setattr(generate, "launch_rules", lambda: rules)


@pytest.mark.parametrize(
    "ep_degree, ulysses_degree, parallel",
    [
        (2, 2, "; each rank's transformer held between stages; the memory plan's figures are a single card's, "
         "running the whole call, not a rank's under expert parallelism over 2 ranks and context parallelism over 2 "
         "ranks: no planned peaks"),
        (2, 1, "; each rank's transformer held between stages; the memory plan's figures are a single card's, "
         "running the whole call, not a rank's under expert parallelism over 2 ranks: no planned peaks"),
        (1, 2, "; the memory plan's figures are a single card's, running the whole call, not a rank's under "
         "context parallelism over 2 ranks: no planned peaks"),
    ],
)  # fmt: skip
def test_a_launched_run_is_not_checked_against_single_card_figures(
    tmp_path, monkeypatch, capsys, ep_degree, ulysses_degree, parallel
):
    # the plan's figures are a single card's running the whole call: a launched run's ranks are not held to them (an
    # 8 x 24 GB box runs the CP8 refiner resident at 1080p, which the single 24 GB card's recipe does not run); it
    # streams automatically (an expert-parallel rank's transformer, holding only its experts' rows, cannot be
    # re-read from its files and stays held) and prints no planned figures as its ranks'
    generate = load_example()
    _fake_launch(generate, monkeypatch, ep_degree, ulysses_degree)
    enabled = []
    pipe = _fake_repo(monkeypatch, True, lambda **k: enabled.append(k["release_between_stages"]))
    args = _args(
        generate, tmp_path, "--model", "org/repo", "--device", "cpu", "--resolution", "1080p", "--vram_gb", "24"
    )
    with pytest.raises(ValueError, match=r"the 24 GB recipe does not run \['refiner_1080p'"):
        generate.repo_streamed_stages(args, *generate.call_size(args, {}))  # what one 24 GB card would be told
    generate.load_pipeline(args)
    assert pipe.loaded and enabled == [None] and args.planned_stages is None
    line = "weight streaming: host_memory pinned, a ring of 2 device buffers per streamed model" + parallel
    assert capsys.readouterr().out.splitlines() == [line]
