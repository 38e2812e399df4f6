"""The 24 GB recipe's host memory from loading on, at reduced width, in a fresh process: ``from_pretrained`` of a repo
stored as the recipe's (bf16 text encoder, int4 experts and FP8-stored dense weights) holds its weights as views of
the files' memory maps, so neither loading nor enabling adds anonymous memory, and each stage holds what the plan says
within 10 %, in either host memory mode (:mod:`helpers.recipe_host_memory`)."""

from __future__ import annotations

import json
import os

import pytest

from diffusers_magi2.pipelines.weight_streaming_pipeline import STREAMED_COMPONENTS


_SAVE = "import sys; from helpers.recipe_host_memory import save_recipe_repo; save_recipe_repo(sys.argv[1])"
_MEASURE = "import sys; from helpers.recipe_host_memory import main; main(*sys.argv[1:])"


@pytest.mark.slow  # the session's host-memory checks, if this test asks first: ~40 s of CPU
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")
@pytest.mark.host_memory_checks(
    {"recipe_save": (_SAVE, ["{folder}"]), "recipe_measure": (_MEASURE, ["{folder}", "pinned", "disk"])}
)
def test_loading_adds_nothing_and_every_stage_holds_its_planned_host_memory(host_memory_checks):
    for name in ("recipe_save", "recipe_measure"):
        assert host_memory_checks[name].returncode == 0, host_memory_checks[name].stderr[-3000:]
    out = host_memory_checks["recipe_measure"]
    for mode, measured in json.loads(out.stdout.strip().splitlines()[-1]).items():
        print(mode, {k: round(v / 1e6, 1) for k, v in measured.items()}, "MB")
        largest = max(measured[f"planned_{stage}"] for stage in STREAMED_COMPONENTS)
        # loading and enabling: the weights stay views of the files (file-backed pages, read as they are touched,
        # reported apart); the loaders' copies of every component at once (diffusers' casts of the FP8 weights and
        # their round trip back) were 1.75 x the largest stage here
        assert measured["load"] <= 0.10 * largest and measured["enable"] <= 0.10 * largest
        # each stage holds its own model's buffers alone, as the plan counts them: the models run before it are
        # released with their rings (every model's rings at once would put the disk mode's last stage 2 x over)
        for stage in STREAMED_COMPONENTS:
            planned = measured[f"planned_{stage}"]
            assert abs(measured[stage] - planned) <= 0.10 * planned, (mode, stage, measured[stage], planned)
