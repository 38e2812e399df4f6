"""A non-finite router input under context parallelism alone (2 gloo ranks): the NaN tokens lie on one rank, yet
every rank raises the same ``ValueError`` at the same step (the routers only record it; the pipeline's step check
agrees over the CP group), and the group then serves the next request, bit for bit as before."""

from __future__ import annotations

import pytest
import torch
from helpers.cp_non_finite_workers import calls_around_a_non_finite_prompt
from helpers.ep_spawn_utils import run_on_ranks


pytestmark = pytest.mark.distributed


def test_a_nan_on_one_rank_is_refused_on_every_rank_at_the_same_step_and_the_group_serves_on():
    ranks = run_on_ranks(calls_around_a_non_finite_prompt, 2, deadline_s=120.0)
    errors = [r["error"] for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "router inputs are not finite at step index 0" in errors[0] and "no weight up to that layer" in errors[0]
    for r in ranks:
        assert torch.isfinite(r["before"]).all() and torch.equal(r["after"], r["before"])
