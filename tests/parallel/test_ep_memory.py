"""Expert-parallel ranks hold only their slice of the routed experts at every step of loading (2 gloo ranks).

A tiny transformer whose expert banks dominate its size is loaded on each rank, by every path that can shard it:
``from_pretrained(expert_parallel=...)`` from a sharded bf16 repo, a single-file bf16 repo, an FP8 repo, a bf16 repo
quantized at load to FP8, an int4 repo, a bf16 repo quantized at load to int4,
``from_original_checkpoint(expert_parallel=...)`` from a SandAI-layout checkpoint, and ``enable_expert_parallel`` on
a model in memory (bf16 and int4 experts). Per path and rank:

* a ``TorchDispatchMode`` sees every tensor an ATen op returns while loading: none is a new storage (an allocation,
  not a view of an input) as large as one full bank ``[H E, Dh, De]`` in the checkpoint's dtype (int4: its packed
  codes; this rank's bank is half of it);
* each routed-expert tensor of the loaded model has its own storage of exactly this rank's rows, and they equal the
  full model's rows;
* the pages of the checkpoint files mapped into the process and resident (``/proc/self/smaps``) stay below the
  files' non-expert bytes plus half this rank's expert bytes: no bank was read through a memory map that the loaded
  model keeps alive (diffusers maps a single-file checkpoint whole; that map may exist, but its expert pages must
  stay untouched);
* after ``enable_expert_parallel`` nothing holds the full layers' tensors any more (they are freed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.ep_memory_workers import (
    CONFIG,
    EXPERT_KEYS,
    FULL_BANK_NUMEL,
    INT4,
    _ep_memory_worker,
    _expert_tensors,
    in_memory_model,
)
from helpers.ep_spawn_utils import run_on_ranks
from helpers.fixtures import golden
from safetensors.torch import save_file

from diffusers_magi2.loaders.key_plan import target_to_source_key
from diffusers_magi2.loaders.original_checkpoint import build_meta_model, expected_specs_from_model, original_format
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.utils.safetensors_io import read_safetensors_header


# the SandAI config of the same shapes (the tiny fixture's, with the MoE sizes above)
SANDAI_MOE = {
    "num_experts": 64,
    "expert_intermediate_size": 128,
    "shared_expert_intermediate_size": 16,
    "modality_specific_expert_intermediate_size": 16,
}


def _non_expert_file_bytes(folder: Path) -> int:
    return sum(
        t.nbytes
        for f in folder.glob("*.safetensors")
        for name, t in read_safetensors_header(f).tensors.items()
        if not name.endswith(EXPERT_KEYS)
    )


def _write_sandai_checkpoint(folder: Path) -> None:
    """A random SandAI-layout checkpoint (``model.safetensors`` + its ``magi2_preview.json``) of the test's shapes."""
    folder.mkdir()
    sandai = golden("magi2_tiny/preview_h4/sandai_checkpoint/magi2_preview.json")
    sandai["arch_config"]["moe_config"].update(SANDAI_MOE)
    sandai["arch_config"]["intermediate_factor"] = 1
    (folder / "magi2_preview.json").write_text(json.dumps(sandai))
    fmt = original_format(Magi2Transformer3DModel)
    meta = build_meta_model(Magi2Transformer3DModel, fmt.model_kwargs(fmt.resolve_config(sandai)[0]))
    g = torch.Generator().manual_seed(1)
    state = {
        target_to_source_key(k): (torch.randn(spec.shape, generator=g) * 0.02).to(
            torch.float32 if spec.fp32_island else torch.bfloat16
        )
        for k, spec in expected_specs_from_model(meta).items()
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """``(folders, {folder: the full model's expert tensors}, {folder: its non-expert bytes})``."""
    root = tmp_path_factory.mktemp("ep_memory")
    model = in_memory_model()
    experts = sum(t.numel() * t.element_size() for t in _expert_tensors(model).values())
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert experts > 0.8 * total, "the test model's expert banks must dominate its size"
    model.save_pretrained(root / "bf16_sharded", max_shard_size="5MB")  # shards mix banks and other tensors
    model.save_pretrained(root / "bf16_single")
    assert len(list((root / "bf16_sharded").glob("*.safetensors"))) > 1
    assert not list((root / "bf16_single").glob("*.index.json"))
    fp8 = Magi2Transformer3DModel.from_pretrained(root / "bf16_sharded", expert_dtype="float8_e4m3fn")
    fp8.save_pretrained(root / "fp8", max_shard_size="5MB")
    int4 = Magi2Transformer3DModel.from_pretrained(root / "bf16_sharded", **INT4)
    int4.save_pretrained(root / "int4", max_shard_size="5MB")
    _write_sandai_checkpoint(root / "sandai")
    sandai = Magi2Transformer3DModel.from_original_checkpoint(root / "sandai")
    assert sandai.transformer_blocks[1].mlp.moe_mlp.W_up.numel() == FULL_BANK_NUMEL
    names = ("bf16_sharded", "bf16_single", "fp8", "int4", "sandai")
    full = {"bf16_sharded": model, "bf16_single": model, "fp8": fp8, "int4": int4, "sandai": sandai}
    full["int4_in_memory"] = in_memory_model(**INT4)
    return (
        {k: str(root / k) for k in names},
        {k: _expert_tensors(m) for k, m in full.items()},
        {k: _non_expert_file_bytes(root / k) for k in names},
    )


FOLDER = {
    "bf16_sharded": "bf16_sharded",
    "bf16_single_file": "bf16_single",
    "fp8_repo": "fp8",
    "quantize_at_load": "fp8",  # its rows equal the FP8 repo's (quantized by the same rule)
    "int4_repo": "int4",
    "int4_quantize_at_load": "int4",  # its rows equal the int4 repo's (quantized by the same rule)
    "original_checkpoint": "sandai",
    "enable_expert_parallel": "bf16_sharded",  # the same seed, in memory
    "int4_enable_expert_parallel": "int4_in_memory",
}


@pytest.mark.distributed
def test_ep2_ranks_never_hold_a_full_expert_bank_and_keep_only_their_rows(repos):
    folders, full, non_expert_bytes = repos
    per_rank = run_on_ranks(_ep_memory_worker, 2, folders, deadline_s=300)
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            where = f"rank {rank}, {name}"
            assert r["seen"] == [], f"{where}: a tensor of a full expert bank's size was made: {r['seen'][:3]}"
            assert r["storage_bytes"] == r["local_bytes"], f"{where}: expert storages are not this rank's slice"
            local = sum(r["local_bytes"].values())
            print(f"\n{where}: expert bytes {local}, checkpoint pages mapped and resident {r['mapped_resident']}")
            if not name.endswith("enable_expert_parallel"):
                assert r["mapped_resident"] <= non_expert_bytes[FOLDER[name]] + 0.5 * local, where
            for key, rows in r["rows"].items():
                start = r["head_start"][key.rsplit(".", 1)[0]] * CONFIG["moe_num_experts"]
                want = full[FOLDER[name]][key][start : start + rows.shape[0]]
                if rows.dtype == torch.float8_e4m3fn:
                    rows, want = rows.view(torch.uint8), want.view(torch.uint8)
                assert torch.equal(rows, want), f"{where}: {key} is not this rank's rows of the full bank"
        for name in ("enable_expert_parallel", "int4_enable_expert_parallel"):
            assert res[name]["full_freed"], f"rank {rank}, {name}: the full banks were not freed"
