"""Shared set-up of the modular tests: the tiny random pipeline (with a tiny refiner for the two-stage path)
and its ``Magi2ModularPipeline`` over the same components."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from diffusers_magi2 import Magi2RefinerTransformer3DModel, build_tiny_random_pipeline
from diffusers_magi2.modular_pipelines import Magi2ModularPipeline
from diffusers_magi2.pipelines.tiny_default import TINY_DEFAULT_CONFIG, init_tiny_weights


PROMPT = "a cat on a piano"
IMAGE = np.random.default_rng(0).integers(0, 256, (40, 64, 3), dtype=np.uint8)
T2V = {"height": 32, "width": 32, "num_inference_steps": 2}
#: preview 32x32 (latent 2x2), refined 64x64 (latent 4x4), 2 refiner steps
TWO_STAGE = {
    "height": 64,
    "width": 64,
    "preview_height": 32,
    "preview_width": 32,
    "num_inference_steps": 2,
    "refiner_num_inference_steps": 2,
}


def tiny_refiner() -> Magi2RefinerTransformer3DModel:
    """A two-layer refiner with the tiny random model's widths (video 48, audio 64, text 64 channels)."""
    cfg = TINY_DEFAULT_CONFIG["transformer"]
    refiner = Magi2RefinerTransformer3DModel(
        num_layers=2,
        num_attention_heads=cfg["num_attention_heads"],
        attention_head_dim=cfg["attention_head_dim"],
        num_key_value_heads=cfg["num_key_value_heads"],
        in_channels=cfg["in_channels"],
        audio_in_channels=cfg["audio_in_channels"],
        text_in_channels=cfg["text_in_channels"],
        multimodal_layers=[0],
        mlp_intermediate_size=64,
    )
    return init_tiny_weights(refiner, torch.Generator().manual_seed(5)).eval()


def tiny_pipelines(with_refiner: bool = False, duration_s: float = 2.0):
    """``(Magi2Pipeline, Magi2ModularPipeline)`` sharing the tiny random model's components and config (no progress
    bars); a ``duration_s`` clip (2 s: 7 latent frames, 50 audio latents) keeps the calls short."""
    pipe = build_tiny_random_pipeline()
    pipe.register_to_config(duration_s=duration_s)
    if with_refiner:
        pipe.register_modules(refiner=tiny_refiner())
    pipe.set_progress_bar_config(disable=True)
    modular = Magi2ModularPipeline.from_classic(pipe)
    modular.set_progress_bar_config(disable=True)
    return pipe, modular


def run_fresh_offline(script: str, args: list, tmp_path: Path, **env: str):
    """Run ``python -c script *args OUT`` in a fresh process with ``HF_HUB_OFFLINE=1``, its own ``HF_HOME`` and one
    thread (``env`` adds variables); the script saves its arrays to ``OUT`` (``.npz``) and prints ``ok`` last.
    Returns the loaded arrays."""
    out = tmp_path / "out.npz"
    environ = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "home"), **env)
    res = subprocess.run(
        [sys.executable, "-c", script, *map(str, args), str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environ,
        timeout=600,
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-4000:]
    return np.load(out)
