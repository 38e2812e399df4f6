"""Rank functions of the LoRA training tests (imported by the spawned gloo workers; not a test module)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def load_train_script():
    """``examples/train_lora.py`` as a module."""
    path = Path(__file__).resolve().parents[2] / "examples" / "train_lora.py"
    spec = importlib.util.spec_from_file_location("train_lora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_on_rank(rank: int, world: int, argv: list[str]) -> dict:
    """Run the training script on this gloo rank (CP over all ranks, EP as ``argv`` says); returns its losses, the
    context-parallel degree and the MoE layers' EP sizes it ran with."""
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE

    # what torchrun sets (the group itself is already initialised by the spawn helper)
    os.environ.update(
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
    )
    script = load_train_script()
    losses, pipe = script.train(script.parse_args(argv))
    transformer = pipe.transformer
    config = getattr(transformer, "_parallel_config", None)
    cp = config.context_parallel_config if config is not None else None
    return {
        "losses": losses,
        "ulysses_degree": getattr(cp, "ulysses_degree", 1) if cp is not None else 1,
        "ep_sizes": sorted({m.ep_size for m in transformer.modules() if isinstance(m, Magi2MultiHeadMoE)}),
    }
