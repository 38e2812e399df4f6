"""Per-rank body of ``test_cp_first_block_cache.py``: FirstBlockCache on the tiny random transformer, alone or under
CP N, over three forwards of a two-segment batch in one cache context: the first computes every block, the second
changes segment 1 only (which, on two ranks, lies on rank 1 alone), the third repeats the second."""

from __future__ import annotations

import torch
from diffusers import ContextParallelConfig, FirstBlockCacheConfig

from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline


#: Far below the second forward's relative change of the first block's residual (~0.3) and above the third's (0).
THRESHOLD = 0.01


def first_block_cache_forwards(rank: int, world: int) -> dict:
    model = build_tiny_random_pipeline(dtype=torch.float32).transformer
    model.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))
    if world > 1:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    tail = []
    next(iter(model.transformer_blocks[-1].attention.children())).register_forward_pre_hook(lambda *_: tail.append(1))
    g = torch.Generator().manual_seed(0)
    video = torch.randn(2, 48, 2, 2, 2, generator=g)
    changed = video.clone()
    changed[1] += torch.randn(48, 2, 2, 2, generator=g)
    inputs = {
        "timestep": torch.tensor([500.0, 500.0]),
        "encoder_hidden_states": torch.randn(2, 3, 64, generator=g),
        "audio_hidden_states": torch.randn(2, 4, 64, generator=g),
    }
    result = {"video": [], "audio": [], "tail_block_ran": []}
    with torch.no_grad(), model.cache_context("cond"):
        for hidden_states in (video, changed, changed):
            tail.clear()
            out = model(hidden_states=hidden_states, **inputs)
            result["video"].append(out.sample)
            result["audio"].append(out.audio_sample)
            result["tail_block_ran"].append(bool(tail))
    return result
