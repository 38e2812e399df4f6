"""The two-stage (refiner) pipeline end to end through ``Magi2Pipeline.__call__`` on real-format models.

Preview DiT: ``magi2_tiny/preview_h4`` and refiner: ``magi2_tiny/refiner``, both built from the SandAI
checkpoints with ``from_original_checkpoint`` (fp32); tiny text encoder, TurboVAE decoder and Oobleck
built in code with matching channel counts (video 12, audio 16, text 48). Preview at 16x32 (latent
1x2, 32 latents), refined output 32x64 (latent 2x4, 63 latents) -> 249 frames at 25 fps with the
preview's 10 s soundtrack (what is checked does not depend on the frame size, so the frames are small).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers.pipeline_stubs import refine_directly, tiny_two_stage_pipeline

from diffusers_magi2 import Magi2Pipeline, export_to_video_with_audio  # noqa: E402
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel  # noqa: E402
from diffusers_magi2.utils.export import probe_streams  # noqa: E402


PROMPT = "A red fox trots through fresh snow at dawn, wind howling"
TWO_STAGE = {"height": 32, "width": 64, "preview_height": 16, "preview_width": 32, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def pipe(fixtures_dir):
    return tiny_two_stage_pipeline(fixtures_dir)


def test_two_stage_call_writes_25fps_mp4_with_audio(pipe, tmp_path):
    calls = []
    hook = pipe.refiner.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(
            (
                kwargs["hidden_states"].shape,
                kwargs["encoder_hidden_states"].shape[1],
                kwargs.get("audio_hidden_states"),
            )
        ),
        with_kwargs=True,
    )
    try:
        out = pipe(PROMPT, **TWO_STAGE, generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    # 5 refiner steps x two batch-1 forwards (cond, then the built-in negative prompt), no audio tokens
    cond_len = pipe.encode_text([PROMPT], "cpu")[0].shape[1]
    neg_len = pipe.encode_text([pipe.config.negative_prompt], "cpu")[0].shape[1]
    assert cond_len != neg_len  # so the order cond -> uncond is visible in the calls
    assert calls == [((1, 12, 63, 2, 4), cond_len, None), ((1, 12, 63, 2, 4), neg_len, None)] * 5

    T = 32
    frames = 4 * (2 * T - 1 - 1) + 1
    assert out.frames.shape == (1, frames, 32, 64, 3) and frames == 249
    assert np.isfinite(out.frames).all() and 0.0 <= out.frames.min() and out.frames.max() <= 1.0
    assert out.fps == 25.0 and out.audio_sample_rate == 44_100
    assert out.audio.shape == (1, 2, 441_000) and np.isfinite(out.audio).all()

    path = export_to_video_with_audio(
        out.frames[0],
        tmp_path / "clip_two_stage.mp4",
        audio=out.audio[0],
        fps=out.fps,
        audio_sample_rate=out.audio_sample_rate,
    )
    info = probe_streams(path)
    one_frame = 1 / 25
    assert info["video_frames"] == frames and info["fps"] == Fraction(25)
    assert info["audio_sample_rate"] == 44_100 and info["audio_channels"] == 2
    assert abs(info["video_stream_duration_s"] - frames / 25) <= one_frame
    assert abs(info["audio_stream_duration_s"] - 10.0) <= one_frame
    assert abs(info["video_stream_duration_s"] - info["audio_stream_duration_s"]) <= one_frame
    assert [p.name for p in tmp_path.iterdir()] == ["clip_two_stage.mp4"]


def test_two_stage_latents_equal_a_direct_refiner_stage_call(pipe):
    """Through ``__call__`` the refined latent is bit-identical to the refiner stage run directly on the
    preview-only result with the generator state the preview leaves behind."""
    two = pipe(PROMPT, **TWO_STAGE, generator=torch.Generator().manual_seed(5), output_type="latent")
    assert two.frames.shape == (1, 12, 63, 2, 4) and two.audio.shape == (1, 250, 16)

    g = torch.Generator().manual_seed(5)
    preview = pipe(PROMPT, height=16, width=32, num_inference_steps=2, generator=g, output_type="latent")
    assert torch.equal(preview.audio, two.audio)
    cond, cond_mask, _ = pipe.encode_text([PROMPT], "cpu")
    neg, neg_mask, _ = pipe.encode_text([pipe.config.negative_prompt], "cpu")
    direct = refine_directly(
        pipe.refiner,
        preview.frames,
        cond,
        neg,
        pipe.scheduler,
        pipe.refiner_stage_config(),
        height=32,
        width=64,
        prompt_attention_mask=cond_mask,
        negative_prompt_attention_mask=neg_mask,
        generator=g,
    )
    assert torch.isfinite(direct).all()
    assert torch.equal(direct, two.frames)
    # and the refiner really moved the latent away from its re-noised input
    assert (
        direct - torch.nn.functional.interpolate(preview.frames, size=(63, 2, 4), mode="trilinear", align_corners=True)
    ).abs().max() > 1e-3


def test_save_load_keeps_the_refiner_and_two_stage_config(pipe, tmp_path):
    """A saved two-stage pipeline reloads with its refiner; the preview size of the 1080p preset is a
    pipeline-config value (512x896 released) that a repo of another model size can override."""
    pipe.save_pretrained(tmp_path / "saved")
    loaded = Magi2Pipeline.from_pretrained(tmp_path / "saved", preview_height=32, preview_width=48)
    assert isinstance(loaded.refiner, Magi2RefinerTransformer3DModel)
    assert (pipe.config.preview_height, pipe.config.preview_width) == (512, 896)
    assert (loaded.config.preview_height, loaded.config.preview_width) == (32, 48)
    assert loaded.config.refiner_num_inference_steps == 5 and loaded.config.refiner_guidance_scale == 2.0
    assert loaded.config.refiner_shift == 5.0 and loaded.config.refiner_noise_value == 220
    assert loaded.stage_sizes(1088, 1920) == (True, 32, 48)
    a, b = pipe.refiner.state_dict(), loaded.refiner.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_stage_on_cuda_with_model_cpu_offload_matches_cpu(pipe):
    """For the refiner: with model CPU offload the refiner (in ``model_cpu_offload_seq``) runs on
    the GPU and returns to the CPU; the refined latent matches the CPU run (same CPU generator)."""
    kwargs = dict(prompt=PROMPT, **TWO_STAGE, output_type="latent")
    cpu = pipe(**kwargs, generator=torch.Generator().manual_seed(9))
    pipe.enable_model_cpu_offload()
    try:
        gpu = pipe(**kwargs, generator=torch.Generator().manual_seed(9))
        assert gpu.frames.device.type == "cuda"
        for name in ("text_encoder", "transformer", "refiner", "video_decoder", "audio_vae"):
            assert getattr(pipe, name).device.type == "cpu", name
    finally:
        pipe.remove_all_hooks()
        pipe.to("cpu")
    rel = ((gpu.frames.cpu().double() - cpu.frames.double()).norm() / cpu.frames.double().norm()).item()
    assert rel <= 1e-3
