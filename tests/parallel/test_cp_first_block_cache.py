"""FirstBlockCache under context parallelism (2 gloo ranks): the skip decision is the single-process one on every
rank, also when only one rank's tokens changed (each rank deciding on its own shard would skip on rank 0 and enter
the remaining blocks' all-to-alls on rank 1, a hang)."""

from __future__ import annotations

import pytest
import torch
from helpers.cp_cache_workers import first_block_cache_forwards
from helpers.ep_spawn_utils import run_on_ranks


pytestmark = pytest.mark.distributed


def test_first_block_cache_decides_once_for_all_ranks():
    single = first_block_cache_forwards(0, 1)
    assert single["tail_block_ran"] == [True, True, False]  # computed, computed (segment 1 changed), cached
    ranks = run_on_ranks(first_block_cache_forwards, 2, deadline_s=120.0)
    for rank in ranks:
        assert rank["tail_block_ran"] == single["tail_block_ran"]
        for key in ("video", "audio"):
            for got, want in zip(rank[key], single[key]):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
