"""Full-size (released) Magi2Transformer3DModel on the meta device: build time, exact parameter
counts, and every one of SandAI's 1,371 state-dict keys (through the converter's key plan) with
the same shape and dtype. Generous time limit: it guards against a slow build, not a benchmark."""

from __future__ import annotations

import time

import torch

from diffusers_magi2.loaders.key_plan import source_to_target_key
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel


def test_released_preview_on_meta_matches_sandai_state_dict(fixtures_dir):
    start = time.perf_counter()
    with torch.device("meta"):
        model = Magi2Transformer3DModel(params_dtype=torch.bfloat16)
    elapsed = time.perf_counter() - start
    assert elapsed < 30.0, f"meta build took {elapsed:.1f}s"

    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers())
    assert params == 113_934_953_520  # the router biases (2 x 12 x 256 per MoE layer) are frozen parameters
    assert params + buffers == 113_934_953_536
    assert sum(p.numel() for p in model.parameters() if p.dtype == torch.float32) == 118_975_536

    state = model.state_dict()
    rows = []
    for line in (fixtures_dir / "full_size" / "sandai_preview_state_dict.tsv").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, shape, dtype = line.split("\t")
        rows.append((name, [int(s) for s in shape.strip("[]").split(",") if s.strip()], dtype))
    assert len(rows) == 1371
    targets = {}
    for name, shape, dtype in rows:
        target = source_to_target_key(name)
        assert target not in targets, f"two SandAI keys map to {target}"
        targets[target] = (shape, dtype)
    assert set(targets) == set(state), set(targets) ^ set(state)
    for target, (shape, dtype) in targets.items():
        tensor = state[target]
        assert list(tensor.shape) == shape, (target, tuple(tensor.shape), shape)
        assert str(tensor.dtype).replace("torch.", "") == dtype, (target, tensor.dtype, dtype)
    # the released config's fp32 islands are what _keep_in_fp32_modules protects
    for target, tensor in state.items():
        assert model.is_fp32_island(target) == (tensor.dtype == torch.float32), target
