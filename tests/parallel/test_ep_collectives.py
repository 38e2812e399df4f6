"""Expert-parallel head layout, set-up errors and checkpoint row slicing, in one process (no process group).

The multi-rank checks (collectives, MoE layer, transformer) are in ``test_ep_parity.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open

from diffusers_magi2.loaders.expert_parallel_loading import RowShard, RowShardedShards
from diffusers_magi2.parallel.expert_parallel import (
    Magi2ExpertParallelConfig,
    ep_head_layout,
    resolve_expert_parallel,
    warn_if_idle,
)
from diffusers_magi2.utils.safetensors_io import take_rows


def test_ep_head_layout_padding_and_idle_rank():
    # H = 12 on 8 ranks: padded to 16, 2 heads per rank, ranks 6 and 7 idle (SandAI CoreMultiHeadMoE padding)
    layouts = [ep_head_layout(12, 8, r) for r in range(8)]
    assert {lay.padded_num_heads for lay in layouts} == {16}
    assert [lay.local_head_start for lay in layouts] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [lay.num_real_local_heads for lay in layouts] == [2, 2, 2, 2, 2, 2, 0, 0]
    # H = 3 on 2 ranks: rank 1 holds one real and one padding head
    lay = ep_head_layout(3, 2, 1)
    assert (lay.padded_num_heads, lay.local_num_heads, lay.local_head_start, lay.num_real_local_heads) == (4, 2, 2, 1)
    with pytest.warns(UserWarning, match="EP rank 2 of 3 owns only padding heads"):
        warn_if_idle(ep_head_layout(4, 3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_idle(ep_head_layout(4, 3, 1))
    with pytest.raises(ValueError, match="ep_rank must be in"):
        ep_head_layout(4, 2, 2)


def test_ep_config_errors_without_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="ep_degree must be an int >= 1"):
        Magi2ExpertParallelConfig(ep_degree=0)
    # EP asked for, but this process runs alone -> error, never a silent single-process run
    with pytest.raises(ValueError, match=r"ep_degree=2 needs an initialised torch.distributed process group"):
        resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=2))
    single = resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=1))
    assert (single.group, single.rank, single.size) == (None, 0, 1)


def test_take_rows_reads_only_this_ranks_rows_padded_heads_zero(tmp_path):
    """Row slicing with explicit ranks: H=3, E=4 saved to safetensors, ep=2 (padded to 4 heads) and ep=4 (rank 3 empty)."""
    from safetensors.torch import save_file

    w = torch.randn(12, 64, 64)
    save_file({"W_gate": w, "bias": torch.arange(12.0)}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as h:
        r0 = take_rows(h.get_slice("W_gate"), 0, 8)
        r1 = take_rows(h.get_slice("W_gate"), 8, 8)
        assert r0.shape == r1.shape == (8, 64, 64)
        assert torch.equal(r0, w[:8]) and torch.equal(r1[:4], w[8:]) and not r1[4:].any()
        r3 = take_rows(h.get_slice("W_gate"), 12, 4)  # start == dim 0: never sliced past the end
        assert r3.shape == (4, 64, 64) and not r3.any()
        assert take_rows(h.get_slice("bias"), 12, 4).tolist() == [0.0] * 4
        assert take_rows(h.get_slice("bias"), 4, 4).tolist() == [4.0, 5.0, 6.0, 7.0]
        with pytest.raises(ValueError, match="row_start and num_rows must be >= 0"):
            take_rows(h.get_slice("bias"), -1, 4)
    # the same rows from an in-memory tensor
    assert torch.equal(take_rows(w, 8, 8)[:4], w[8:]) and not take_rows(w, 8, 8)[4:].any()


def test_row_sharded_shards_cut_planned_tensors_and_reject_sharded_checkpoints(tmp_path):
    """The loader hook: each shard comes back as a state dict, planned tensors cut to this rank's rows."""
    from safetensors.torch import save_file

    w, other = torch.randn(12, 8), torch.randn(5, 3)
    save_file({"moe.W_gate": w, "other": other}, str(tmp_path / "a.safetensors"))
    save_file({"moe.bias": torch.arange(12.0)}, str(tmp_path / "b.safetensors"))
    shards = RowShardedShards(
        [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")],
        {"moe.W_gate": RowShard(8, 8, 12), "moe.bias": RowShard(8, 8, 12)},
    )
    assert len(shards) == 2
    first, second = list(shards)
    assert torch.equal(first["moe.W_gate"][:4], w[8:]) and not first["moe.W_gate"][4:].any()
    assert torch.equal(first["other"], other)
    assert second["moe.bias"].tolist() == [8.0, 9.0, 10.0, 11.0, 0.0, 0.0, 0.0, 0.0]
    wrong = RowShardedShards([str(tmp_path / "a.safetensors")], {"moe.W_gate": RowShard(0, 4, 16)})
    with pytest.raises(ValueError, match="expert-parallel loading needs the unsharded checkpoint"):
        wrong[0]


def test_ep_loading_names_a_truncated_or_missing_shard_before_building_the_model(tmp_path, monkeypatch):
    """A shard cut short (or gone) is reported as a ValueError naming the file, before any model is built."""
    import json

    from diffusers_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline

    build_tiny_random_pipeline().transformer.save_pretrained(tmp_path, max_shard_size="200KB")
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = tmp_path / sorted(set(index["weight_map"].values()))[1]
    data = shard.read_bytes()

    def no_model(*args, **kwargs):
        raise AssertionError("the shard check must come before the model is built")

    monkeypatch.setattr(Magi2Transformer3DModel, "from_config", no_model)
    config = Magi2ExpertParallelConfig(ep_degree=1)
    for broken, message in (
        (data[:-100], "is not a complete safetensors file"),
        (data[:5], "is not a complete safetensors file"),
        (None, "does not exist, named by diffusion_pytorch_model.safetensors.index.json"),
    ):
        if broken is None:
            shard.unlink()
        else:
            shard.write_bytes(broken)
        with pytest.raises(ValueError, match=message) as err:
            Magi2Transformer3DModel.from_pretrained(tmp_path, expert_parallel=config)
        assert str(shard) in str(err.value)
