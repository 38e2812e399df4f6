"""Non-finite values under context parallelism alone (2 gloo ranks). A NaN router input whose tokens lie on one rank:
every rank raises the same ``ValueError`` at the same step (the routers only record it; the router check agrees
over the CP group), and the group then serves the next request, bit for bit as before. A NaN weight no router sees
(the last MoE layer's experts, the final projection, the refiner): a 1-step call of either pipeline raises the same
error on both ranks, naming that weight (the stage-result check), and the group serves on."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.cp_non_finite_workers import calls_around_a_non_finite_prompt, errors_of_non_finite_weights
from helpers.ep_spawn_utils import run_on_ranks
from helpers.non_finite_cases import CASES


pytestmark = pytest.mark.distributed


def test_a_nan_on_one_rank_is_refused_on_every_rank_at_the_same_step_and_the_group_serves_on():
    ranks = run_on_ranks(calls_around_a_non_finite_prompt, 2, deadline_s=120.0)
    errors = [r["error"] for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert (
        "router inputs are not finite at step index 0" in errors[0]
        and "no weight of the model is NaN/inf" in errors[0]
    )
    for r in ranks:
        assert torch.isfinite(r["before"]).all() and torch.equal(r["after"], r["before"])


def test_a_nan_weight_no_router_sees_is_named_on_every_rank_by_both_pipelines():
    ranks = run_on_ranks(errors_of_non_finite_weights, 2, deadline_s=240.0)
    for case, (*_, expected) in CASES.items():
        for kind in ("classic", "modular"):
            errors = [r["errors"][case, kind] for r in ranks]
            assert errors[0] is not None and errors[0] == errors[1], (case, kind, errors)
            assert re.match(expected, errors[0]), (case, kind, errors[0])
    for r in ranks:
        assert torch.isfinite(r["after"]).all()
