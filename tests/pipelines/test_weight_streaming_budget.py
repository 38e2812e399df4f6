"""Budgets of weight streaming refused from the shipped table of planned peaks, and the table against the plan.

The table is written by ``bench_memory --write_budgets`` (minutes: it traces every stage at the released size); here
its arithmetic is checked (each peak the sum of its parts, each recipe's host memory its largest used stage's), its
weight parts against a recomputation from the released configs on the meta device, and the rows the default check
reads most (the text encoder and both previews, the largest host stage) re-planned by the plan's own code.
"""

import json
import subprocess
import sys

import pytest
from helpers import memory_plan_consumer as consumer
from helpers.memory_plan import GB
from helpers.memory_plan_consumer import (
    CONSUMER_CARDS,
    REQUIRED_STAGES,
    planned_refiner_config,
    planned_transformer_config,
)
from helpers.memory_plan_streaming import (
    PROCESS_BYTES,
    refiner_streamed_weights,
    text_encoder_streamed_weights,
)

from diffusers_magi2.pipelines.weight_streaming_budget import (
    available_host_bytes,
    check_streaming_budget,
    check_streaming_vram,
    plan_applies,
    planned_call_stages,
    planned_tiled_decodes,
    streaming_budgets,
)


TABLE = streaming_budgets()
PLENTY = 10**15  # bytes of host memory no check refuses


def _recipe(card):
    return TABLE["recipes"][str(card)]


def _need(card, name, policy="released"):
    """A stage's planned peak plus what stays resident beside it, GB."""
    row = _recipe(card)["stages"][name]
    return round(row["peak_GB"] + sum(row["co_resident_GB"][policy].values()), 2)


def _largest(card, stages=REQUIRED_STAGES, policy="released"):
    name = max(stages, key=lambda n: _need(card, n, policy))
    return name, _recipe(card)["stages"][name]["peak_GB"], _need(card, name, policy)


def test_a_budget_below_the_largest_checked_stage_is_refused_naming_that_stage_and_its_peak():
    name, peak, need = _largest(24)
    with pytest.raises(ValueError, match=rf"stage '{name}': {peak} GB, plus .* = {need} GB"):
        check_streaming_budget(need - 0.01, host_bytes=PLENTY)
    stages = ["preview_540p", "audio_decode"]
    name, peak, need = _largest(24, stages)
    assert name == "preview_540p"
    with pytest.raises(ValueError, match=rf"stage 'preview_540p': {peak} GB"):
        check_streaming_budget(need - 0.01, stages=stages, host_bytes=PLENTY)


def test_a_budget_that_fits_the_peak_alone_is_refused_naming_what_stays_resident():
    # the 1080p refiner on the 32 GB card with every streamed model held (a pipeline built in memory): the text
    # encoder's and the transformer's resident weights and rings stay on the device beside the refiner's peak (the
    # autoencoders wait in host memory for their own stages)
    row = _recipe(32)["stages"]["refiner_1080p"]
    beside = row["co_resident_GB"]["held"]
    assert set(beside) == {"text_encoder", "transformer"}
    need = _need(32, "refiner_1080p", "held")
    assert row["peak_GB"] <= 30 and 32 < need
    what = ", ".join(f"{c} {gb} GB" for c, gb in beside.items())
    with pytest.raises(ValueError, match=rf"'refiner_1080p': {row['peak_GB']} GB, plus .* \({what}; every streamed"):
        check_streaming_vram(32, ["refiner_1080p"], release_between_stages=False)
    assert check_streaming_vram(32, ["refiner_1080p"]) == {"refiner_1080p": row["peak_GB"]}  # released: alone


def test_the_budget_at_the_planned_peak_passes_and_returns_the_checked_peaks():
    name, peak, need = _largest(24)
    result = check_streaming_budget(max(need, 24), host_bytes=PLENTY)
    assert result[name] == need and set(result) == {*REQUIRED_STAGES, "host_ram_GB"}
    assert result["host_ram_GB"] == _recipe(24)["host_ram_GB"]["pinned"]


def test_the_device_half_refuses_the_same_budget_and_ignores_the_host():
    name, peak, need = _largest(24)
    with pytest.raises(ValueError, match=rf"stage '{name}': {peak} GB"):
        check_streaming_vram(need - 0.01)
    assert check_streaming_vram(24) == {n: _need(24, n) for n in REQUIRED_STAGES}


def test_the_table_records_the_geometry_it_was_planned_for():
    released = planned_transformer_config()
    assert TABLE["planned_for"]["transformer"] == released and released["num_layers"] == 40
    assert plan_applies({**released, "moe_layers": tuple(released["moe_layers"])})  # a config's tuples match
    assert not plan_applies({**released, "num_layers": 4})
    assert not plan_applies({})
    refiner = planned_refiner_config()
    assert TABLE["planned_for"]["refiner"] == refiner and refiner["num_layers"] == 30
    assert plan_applies(released, {**refiner, "window_radius": (2, 2, 2)})
    assert not plan_applies(released, {**refiner, "window_radius": [3, 3, 3]})  # a refiner of another geometry


def test_a_stage_the_recipe_skips_is_refused():
    with pytest.raises(ValueError, match=r"the 24 GB recipe does not run \['refiner_1080p'\]"):
        check_streaming_budget(24, stages=["refiner_1080p"], host_bytes=PLENTY)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vram_gb": 0}, "vram_gb must be a positive number"),
        ({"vram_gb": True}, "vram_gb must be a positive number"),
        ({"vram_gb": float("nan")}, "vram_gb must be a positive number"),
        ({"vram_gb": 24, "host_memory": "swap"}, "host_memory must be one of"),
        ({"vram_gb": 24, "stages": ["preview_720p"]}, "unknown stages"),
        (
            {"vram_gb": 24, "stages": ["turbovae_decode_1080p"]},
            r"the 24 GB recipe does not run \['turbovae_decode_1080p'\]$",
        ),
        ({"vram_gb": 24, "stages": "preview_272p"}, "non-empty list of stage names"),
        ({"vram_gb": 24, "stages": []}, "non-empty list of stage names"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_streaming_budget(host_bytes=PLENTY, **kwargs)


def test_a_host_short_of_the_pinned_mode_is_told_about_the_disk_mode():
    need = _recipe(24)["host_ram_GB"]["pinned"]
    with pytest.raises(ValueError, match=rf"host_memory='pinned' needs {need} GB.*host_memory='disk'"):
        check_streaming_budget(24, "pinned", host_bytes=int((need - 1) * GB))
    check_streaming_budget(24, "disk", host_bytes=int((need - 1) * GB))  # the disk mode fits that host


def test_a_host_short_of_the_disk_mode_is_refused_naming_the_disk_mode():
    need = _recipe(24)["host_ram_GB"]["disk"]
    with pytest.raises(ValueError, match=r"host_memory='disk' needs .* the disk mode is the smallest"):
        check_streaming_budget(24, "disk", host_bytes=int((need - 1) * GB))


def test_the_host_memory_is_read_from_the_os():
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    expected = int(fields["MemAvailable"].split()[0]) * 1024
    assert abs(available_host_bytes() - expected) < 0.05 * expected  # (the OS's figure moves while we read it)


def test_the_budget_module_imports_no_torch():
    code = "import sys, diffusers_magi2.pipelines.weight_streaming_budget as m; m.streaming_budgets(); "
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------- the table against the plan


@pytest.mark.parametrize("card", [24, 32])
def test_each_planned_peak_is_resident_plus_ring_plus_activations_and_the_host_peak_the_largest_stage(card):
    recipe = _recipe(card)
    for name, row in recipe["stages"].items():
        parts = row["resident_GB"] + row["ring_GB"] + row["activations_GB"]
        assert abs(row["peak_GB"] - parts) <= 0.015, name
    # a LoRA run's rows (caching, training) are a process of their own, not the generation's
    used = [row for name, row in recipe["stages"].items() if row["used"] and not name.startswith(consumer.LORA_RUN)]
    assert recipe["host_ram_GB"]["pinned"] == max(r["host_GB"] for r in used)
    assert recipe["host_ram_GB"]["disk"] == max(r["host_disk_mode_GB"] for r in used)


@pytest.mark.parametrize("card", [24, 32])
def test_every_used_stage_meets_the_card_target(card):
    # the targets: <= 22 GB on a 24 GB card, <= 30 GB on a 32 GB card (its 1080p refiner token-chunked)
    recipe = _recipe(card)
    for name, row in recipe["stages"].items():
        assert not row["used"] or row["peak_GB"] <= card - 2, (name, row["peak_GB"])
    assert all(recipe["stages"][n]["used"] for n in REQUIRED_STAGES)


@pytest.mark.parametrize("card", [24, 32])
def test_what_stays_resident_is_the_plan_arithmetic_on_the_shipped_rows(card):
    # each stage's co_resident_GB recomputed from the table's own rows (components, their resident weights and rings)
    rows = [{"stage": name, **row} for name, row in _recipe(card)["stages"].items()]
    assert consumer.co_resident(rows) == {r["stage"]: r["co_resident_GB"] for r in rows}
    stages = _recipe(card)["stages"]
    # released: a streamed stage alone on the device (the autoencoders in host memory), an autoencoder's stage
    # beside one streamed model (the one run last, counted as the largest) and no other autoencoder
    for name in ("text_encode", "preview_272p", "preview_540p"):
        assert stages[name]["co_resident_GB"]["released"] == {}, name
    beside = stages["audio_decode"]["co_resident_GB"]["released"]
    assert len(beside) == 1 and set(beside) <= {"text_encoder", "transformer", "refiner"}
    assert not set(stages["preview_540p"]["co_resident_GB"]["held"]) & {"vae", "video_decoder", "audio_vae"}
    assert stages["lora_train_272p"]["co_resident_GB"] == {"released": {}, "held": {}}
    # caching for a LoRA run streams the text encoder alone: its share stays beside each autoencoder's encode
    text = stages["text_encode"]
    share = round(text["resident_GB"] + text["ring_GB"], 2)
    assert stages["lora_cache_272p"]["co_resident_GB"] == {p: {"text_encoder": share} for p in consumer.POLICIES}


@pytest.mark.parametrize("card", CONSUMER_CARDS)
def test_caching_for_a_lora_run_holds_the_text_encoder_and_the_autoencoders_and_less_than_training(card):
    # train_lora.py --cache: the streamed text encoder's host memory plus both autoencoders' weights, in each mode;
    # released before training loads, so the run's host peak is the training step's in both modes
    stages = _recipe(card)["stages"]
    cache, train, text = stages["lora_cache_272p"], stages["lora_train_272p"], stages["text_encode"]
    autoencoders = stages["image_encode_540p"]["resident_GB"] + stages["audio_decode"]["resident_GB"]
    for key in ("host_GB", "host_disk_mode_GB"):
        assert abs(cache[key] - (text[key] + autoencoders)) <= 0.015
        assert cache[key] < train[key]
    assert cache["used"] and train["used"]  # on both cards (a 64 GB host: the disk mode)


@pytest.mark.parametrize("card", CONSUMER_CARDS)
def test_each_recipe_fits_its_target_with_what_stays_resident_when_streamed_models_are_released(card):
    # the 32 GB card's 1080p refiner and its decode included: <= 30 GB beside what stays on the device
    for name, row in _recipe(card)["stages"].items():
        assert not row["used"] or _need(card, name) <= card - 2, (name, _need(card, name))


def test_a_calls_stages_are_the_plans_names_and_a_call_it_does_not_cover_is_refused():
    assert planned_call_stages(True, 512, 896, image=True) == [
        "text_encode", "image_encode_540p", "preview_540p", "refiner_1080p", "turbovae_decode_1080p", "audio_decode",
    ]  # fmt: skip
    assert planned_call_stages(False, 256, 448, turbovae=False) == [
        "text_encode", "preview_272p", "wan_decode_540p", "audio_decode",
    ]  # fmt: skip
    assert planned_call_stages(True, 256, 448, decode=False) == ["text_encode", "preview_272p", "refiner_1080p"]
    assert planned_call_stages(True, 512, 896, height=1088, width=1920)[-2] == "turbovae_decode_1080p"
    assert planned_call_stages(False, 256, 448, duration_s=5.0)[1] == "preview_272p"  # a shorter clip: fewer tokens
    for kwargs, match in (
        ({"denoise_height": 512, "denoise_width": 912}, "a 512x912 preview is larger than the plan's 540p stage"),
        ({"height": 1088, "width": 1936}, "a 1088x1936 refined output is larger than the plan's 1080p refiner stage"),
        ({"batch_size": 2}, "one video per call; this call generates 2"),
        ({"duration_s": 10.5}, r"a 10.5 s clip is longer than the plan's 10.0 s"),
    ):
        with pytest.raises(ValueError, match=match):
            planned_call_stages(**{"refine": True, "denoise_height": 512, "denoise_width": 896, **kwargs})


def test_a_refined_decode_is_tiled_exactly_below_its_whole_frames_need():
    # the 32 GB recipe tiles its 1080p TurboVAE decode because the whole frames (plus what stays resident) exceed the
    # card, and tiling is what brings it under; a larger budget decodes whole frames, with either release policy
    row = _recipe(32)["stages"]["turbovae_decode_1080p"]
    assert row["tiled"] and row["peak_GB"] < row["whole_frames_peak_GB"]
    for policy, released in (("released", True), ("held", False)):
        whole = row["whole_frames_peak_GB"] + sum(row["co_resident_GB"][policy].values())
        assert 32 < whole
        assert planned_tiled_decodes(32, released) == {"turbovae_decode_1080p": row["peak_GB"]}
        assert planned_tiled_decodes(whole - 0.01, released) == {"turbovae_decode_1080p": row["peak_GB"]}
        assert planned_tiled_decodes(whole, released) == {}
    assert planned_tiled_decodes(24) == {}  # the 24 GB recipe does not refine


def test_the_24gb_recipe_host_memory_meets_its_targets():
    host = _recipe(24)["host_ram_GB"]
    assert host["pinned"] <= 80 and host["disk"] <= 32


def test_text_encoder_and_refiner_weight_parts_equal_a_recomputation():
    # the streamed weights of the table, recomputed from the released refiner's meta build and the text encoder's
    # estimate: the ring (RING_DEPTH x the largest block) and the pinned host bytes (arenas, power-of-two rounding)
    text = text_encoder_streamed_weights()
    refiner = refiner_streamed_weights()
    for card in (24, 32):
        stages = _recipe(card)["stages"]
        assert stages["text_encode"]["ring_GB"] == round(text.ring / GB, 2)
        assert stages["refiner_1080p"]["ring_GB"] == round(refiner.ring / GB, 2)
        assert stages["refiner_1080p"]["resident_GB"] == round(refiner.resident / GB, 2)
    assert _recipe(32)["stages"]["refiner_1080p"]["host_GB"] == round((PROCESS_BYTES + refiner.host_pinned) / GB, 2)


@pytest.mark.parametrize("card", CONSUMER_CARDS)
def test_the_shipped_text_and_preview_rows_equal_the_plan(card):
    # re-planned at the released size (fake tensors; the previews' traces are shared by both cards): every figure
    # the table ships for these rows, as bench_memory --write_budgets rounds it; a change to the model or the plan
    # that moves them fails here until the table is written again
    replanned = [consumer._text_stage(card), *(consumer._preview_stage(res, card) for res in ("272p", "540p"))]
    for stage in replanned:
        planned, shipped = stage.as_json(), _recipe(card)["stages"][stage.name]
        common = set(planned) & set(shipped)
        assert {k: planned[k] for k in common} == {k: shipped[k] for k in common}, stage.name
        assert set(shipped) - common == {"co_resident_GB"}, stage.name  # the recipe's arithmetic, checked above


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_bench_memory_prints_the_consumer_plan_as_a_table_or_json(monkeypatch, capsys, json_flag):
    # the plan itself is stood in (tracing it at the released size takes minutes); the printing is what is checked
    from tests.benchmarks import bench_memory

    stages = [{"stage": "text_encode", "used": True, "fits": True}, {"stage": "audio_decode", "used": True}]
    monkeypatch.setattr(bench_memory, "consumer_result", lambda gb: {"stages": stages, "all_used_stages_fit": True})
    monkeypatch.setattr(bench_memory, "consumer_markdown", lambda result: "| stage |")
    assert bench_memory.main(["--gpu_gb", "24", *json_flag]) == 0
    out = capsys.readouterr().out
    if json_flag:
        assert json.loads(out)["stages"] == stages
    else:
        assert out.splitlines()[0] == "| stage |" and "planned 2 stages in" in out
