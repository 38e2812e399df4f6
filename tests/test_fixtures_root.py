"""The golden fixtures are found through ``MAGI2_FIXTURES`` in the test process and in the processes it starts.

A context-parallel model worker (2 gloo ranks, ``helpers.ep_spawn_utils``) runs with ``MAGI2_FIXTURES``
pointing at a symlink to the fixtures in another folder and must reproduce the fixture's output; pointed at an
empty folder it must fail naming that folder (a worker that ignored the variable would still find the default
root and pass).
"""

from __future__ import annotations

import pytest
import torch
from helpers.cp_model_workers import cp_preview_h4_worker
from helpers.ep_spawn_utils import run_on_ranks
from helpers.fixtures import DEFAULT_FIXTURES, fixtures_root, golden, golden_path


FIXTURE_ATOL = 1e-4  # the CP model tests' bound against the SandAI fixture


def test_golden_reads_the_root_from_the_environment_on_every_call(tmp_path, monkeypatch):
    monkeypatch.delenv("MAGI2_FIXTURES", raising=False)
    assert fixtures_root() == DEFAULT_FIXTURES
    monkeypatch.setenv("MAGI2_FIXTURES", str(tmp_path))
    assert fixtures_root() == tmp_path
    with pytest.raises(FileNotFoundError, match="MAGI2_FIXTURES"):
        golden_path("magi2_tiny")
    (tmp_path / "a.json").write_text('{"x": 1}')
    (tmp_path / "b.tsv").write_text("x\n")
    assert golden("a.json") == {"x": 1}
    with pytest.raises(ValueError, match="golden_path"):
        golden("b.tsv")


@pytest.mark.distributed
def test_cp_model_worker_uses_magi2_fixtures(fixtures_dir, tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere" / "fixtures"
    moved.parent.mkdir()
    moved.symlink_to(fixtures_dir.resolve(), target_is_directory=True)
    empty = tmp_path / "empty"
    empty.mkdir()

    monkeypatch.setenv("MAGI2_FIXTURES", str(empty))
    with pytest.raises(RuntimeError, match=f"not found under {empty}"):
        run_on_ranks(cp_preview_h4_worker, 1, deadline_s=120.0)

    monkeypatch.setenv("MAGI2_FIXTURES", str(moved))
    expected = golden("magi2_tiny/preview_h4/fp32/transformer_case.safetensors")["model.out"]
    for rank in run_on_ranks(cp_preview_h4_worker, 2, deadline_s=180.0):
        assert rank["out"].shape == expected.shape
        assert (rank["out"] - expected).abs().max().item() <= FIXTURE_ATOL
    assert torch.isfinite(expected).all()
