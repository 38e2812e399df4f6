"""The embedded tiny default and the main job ``examples/generate.py`` (small settings here; the README
command runs it at the tiny default's own resolution and step count)."""

from __future__ import annotations

import importlib.util
from fractions import Fraction

import pytest
import torch

from conftest import REPO_ROOT

from diffusers_magi2.pipelines.text_encoding import has_cjk_pre_tokenizer_split
from diffusers_magi2.pipelines.tiny_default import TINY_DEFAULT_CONFIG, build_tiny_default_pipeline, build_tiny_tokenizer
from diffusers_magi2.utils.export import probe_streams


def load_generate():
    spec = importlib.util.spec_from_file_location("magi2_generate", REPO_ROOT / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_tokenizer_is_deterministic_and_offline():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    text = "A red fox trots through fresh snow, 你好, <Figure 1>"
    assert a(text)["input_ids"] == b(text)["input_ids"]
    assert a.pad_token_id == 0 and len(a) == TINY_DEFAULT_CONFIG["tokenizer"]["vocab_size"]
    assert a.convert_ids_to_tokens(a("A red fox")["input_ids"]) == ["A", "Ġred", "Ġfox"]  # merges learned


def test_tiny_default_pipeline_structure_and_determinism():
    pipe = build_tiny_default_pipeline()
    assert has_cjk_pre_tokenizer_split(pipe.tokenizer)
    assert pipe.num_channels_latents == 48 and pipe.num_channels_audio_latents == 64
    assert pipe.num_latent_frames() == 32 and pipe.num_audio_latents() == 250
    assert pipe.vae_scale_factor_spatial == 16
    call = pipe.tiny_call_defaults
    assert call["height"] % 16 == 0 and call["width"] % 16 == 0 and call["num_inference_steps"] >= 1
    again = build_tiny_default_pipeline()
    for (name, p), (_, q) in zip(pipe.transformer.state_dict().items(), again.transformer.state_dict().items()):
        assert torch.equal(p, q), name
    assert all(torch.isfinite(p).all() for p in pipe.transformer.parameters())


def test_generate_main_job_writes_a_10s_clip(tmp_path, capsys):
    generate = load_generate()
    out = tmp_path / "tiny.mp4"
    rc = generate.main(["--prompt", "A red fox trots through fresh snow at dawn", "--output", str(out),
                        "--height", "32", "--width", "48", "--num_inference_steps", "1", "--seed", "3"])
    assert rc == 0
    info = probe_streams(out)
    assert info["video_frames"] == 125 and info["fps"] == Fraction(25, 2)
    assert info["audio_sample_rate"] == 44_100 and info["audio_channels"] == 2
    assert abs(info["audio_stream_duration_s"] - 10.0) <= 0.08 and abs(info["video_stream_duration_s"] - 10.0) <= 0.08
    printed = capsys.readouterr().out
    assert "main job wall time:" in printed and "tiny default" in printed


def test_generate_rejects_bad_size_before_work(tmp_path):
    generate = load_generate()
    with pytest.raises(ValueError, match="multiple of 16"):
        generate.main(["--prompt", "x", "--output", str(tmp_path / "x.mp4"), "--height", "30"])
    assert not (tmp_path / "x.mp4").exists()


def _transformer_island_dtypes(transformer):
    """``{name: dtype}`` for every floating parameter/buffer the transformer names an fp32 island."""
    named = list(transformer.named_parameters()) + list(transformer.named_buffers())
    return {n: t.dtype for n, t in named if t.is_floating_point() and transformer.is_fp32_island(n)}


def test_tiny_default_bf16_keeps_transformer_fp32_islands():
    """C02: building the tiny default in bf16 must not downcast the fp32 islands (``ModelMixin.to``
    would); the other transformer weights become bf16, the Wan2.2 VAE and Oobleck stay fp32."""
    pipe = build_tiny_default_pipeline(dtype=torch.bfloat16)
    islands = _transformer_island_dtypes(pipe.transformer)
    # every island family of the spec is present, so the check covers them
    for family in ("pre_adapter", "post_adapter", "sinks", "router", "mhc_norm", "q_norm"):
        assert any(family in n.split(".") for n in islands), family
    assert not {n: d for n, d in islands.items() if d != torch.float32}
    others = [p.dtype for n, p in pipe.transformer.named_parameters() if not pipe.transformer.is_fp32_island(n)]
    assert others and set(others) == {torch.bfloat16}
    assert pipe.text_encoder.dtype == torch.bfloat16 and pipe.video_decoder.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.float32 and pipe.audio_vae.dtype == torch.float32


def test_tiny_default_rejects_non_float_dtype():
    with pytest.raises(ValueError, match="floating-point torch.dtype"):
        build_tiny_default_pipeline(dtype=torch.int8)


def test_pipeline_from_pretrained_bf16_keeps_transformer_fp32_islands(tmp_path):
    """C02 at pipeline level: save a tiny pipeline, reload it with ``dtype=torch.bfloat16``; the
    transformer's ``_keep_in_fp32_modules`` must keep every island fp32 through ``from_pretrained``."""
    from diffusers_magi2 import Magi2Pipeline

    build_tiny_default_pipeline().save_pretrained(tmp_path / "saved")
    loaded = Magi2Pipeline.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    islands = _transformer_island_dtypes(loaded.transformer)
    assert islands and not {n: d for n, d in islands.items() if d != torch.float32}
    assert loaded.transformer.residual_dtype == torch.bfloat16
