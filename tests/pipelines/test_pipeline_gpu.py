"""GPU-only pipeline checks (skipped without CUDA): scheduler step on device, model CPU offload."""

from __future__ import annotations

import pytest
import torch

from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_schedule_and_step_on_cuda():
    pipe = build_tiny_random_pipeline()
    video, audio, timesteps = pipe.prepare_timesteps(100, "cuda")
    assert timesteps[:5].tolist() == [999, 998, 996, 995, 993] and timesteps[-3:].tolist() == [177, 124, 65]
    sample = torch.randn(1, 48, 2, 2, 3, device="cuda")
    out = video.step(torch.randn_like(sample), timesteps[0], sample, return_dict=False)[0]
    assert out.device.type == "cuda" and torch.isfinite(out).all()
    a = torch.randn(1, 5, 64, device="cuda")
    assert audio.step(torch.randn_like(a), timesteps[0], a, return_dict=False)[0].device.type == "cuda"


def test_model_cpu_offload_runs_and_returns_components_to_cpu():
    pipe = build_tiny_random_pipeline()
    pipe.enable_model_cpu_offload()
    out = pipe(
        "a red fox in the snow", height=32, width=48, num_inference_steps=2, generator=torch.Generator().manual_seed(0)
    )
    assert out.frames.shape == (1, 125, 32, 48, 3) and out.audio.shape == (1, 2, 441_000)
    for name in ("text_encoder", "transformer", "video_decoder", "vae", "audio_vae"):
        assert getattr(pipe, name).device.type == "cpu", name
