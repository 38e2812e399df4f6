"""``helpers.ep_spawn_utils.run_on_ranks`` keeps its gloo ranks between calls, and each call starts as a freshly
started worker would: the caller's environment and working directory, the worker's first RNG states, fp32 default
dtype and grad mode on, whatever the call before changed. A call that fails on one rank raises with that rank's
traceback without waiting for the others, and the next call gets working ranks again (also after a call that
destroyed the default process group)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.ep_spawn_utils import run_on_ranks
from helpers.pool_probes import change_process_state, destroy_the_group, fail_on_last_rank, read_process_state


pytestmark = pytest.mark.distributed


def test_calls_share_the_ranks_but_not_their_state(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGI2_POOL_PROBE", "first")
    first = run_on_ranks(change_process_state, 2, str(tmp_path), deadline_s=120.0)
    monkeypatch.setenv("MAGI2_POOL_PROBE", "second")
    second = run_on_ranks(read_process_state, 2, deadline_s=60.0)
    for rank, (a, b) in enumerate(zip(first, second)):
        assert a["pid"] == b["pid"]  # the same worker served both calls
        assert (a["env"], b["env"], b["left"]) == ("first", "second", None)
        assert a["cwd"] == b["cwd"] == os.getcwd() != str(tmp_path)
        assert torch.equal(a["rng"], b["rng"]) and a["random"] == b["random"]
        assert b["dtype"] == torch.float32 and b["grad"]
        assert a["world"] == 2 and a["sum"] == b["sum"] == 1.0
    assert first[0]["pid"] != first[1]["pid"]
    assert not torch.equal(first[0]["rng"], first[1]["rng"])  # seeded per worker, as separate interpreters are


def test_a_failed_call_names_its_rank_and_the_next_call_gets_new_ranks():
    before = run_on_ranks(read_process_state, 2, deadline_s=120.0)
    with pytest.raises(RuntimeError, match=r"failed on rank\(s\) \[1\][\s\S]*ValueError: rank 1 refuses"):
        run_on_ranks(fail_on_last_rank, 2, deadline_s=60.0)
    after = run_on_ranks(read_process_state, 2, deadline_s=120.0)
    assert [r["sum"] for r in after] == [1.0, 1.0]
    assert {r["pid"] for r in after}.isdisjoint(r["pid"] for r in before)
    # a call that destroys the default group returns its results; the next call gets new ranks
    ended = run_on_ranks(destroy_the_group, 2, deadline_s=60.0)
    assert ended == [r["pid"] for r in after]
    again = run_on_ranks(read_process_state, 2, deadline_s=120.0)
    assert [r["sum"] for r in again] == [1.0, 1.0] and set(ended).isdisjoint(r["pid"] for r in again)
