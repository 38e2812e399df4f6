"""The embedded tiny default and the main job ``examples/generate.py`` (small settings here; the README
command runs it at the tiny default's own resolution and step count)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from helpers.launch import load_generate

from diffusers_magi2.pipelines.text_encoding import has_cjk_pre_tokenizer_split
from diffusers_magi2.pipelines.tiny_default import (
    TINY_DEFAULT_CONFIG,
    TINY_TRAINED_CONFIG,
    TINY_WEIGHTS,
    build_tiny_default_pipeline,
    build_tiny_random_pipeline,
    build_tiny_tokenizer,
)
from diffusers_magi2.utils.export import probe_streams


def test_tiny_tokenizer_is_deterministic_and_offline():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    text = "A red fox trots through fresh snow, 你好, <Figure 1>"
    assert a(text)["input_ids"] == b(text)["input_ids"]
    assert a.pad_token_id == 0 and len(a) == TINY_DEFAULT_CONFIG["tokenizer"]["vocab_size"]
    assert a.convert_ids_to_tokens(a("A red fox")["input_ids"]) == ["A", "Ġred", "Ġfox"]  # merges learned


def test_tiny_random_pipeline_structure_and_determinism():
    pipe = build_tiny_random_pipeline()
    assert has_cjk_pre_tokenizer_split(pipe.tokenizer)
    assert pipe.num_channels_latents == 48 and pipe.num_channels_audio_latents == 64
    assert pipe.num_latent_frames() == 32 and pipe.num_audio_latents() == 250
    assert pipe.vae_scale_factor_spatial == 16
    call = pipe.tiny_call_defaults
    assert call["height"] % 16 == 0 and call["width"] % 16 == 0 and call["num_inference_steps"] >= 1
    again = build_tiny_random_pipeline()
    for (name, p), (_, q) in zip(pipe.transformer.state_dict().items(), again.transformer.state_dict().items()):
        assert torch.equal(p, q), name
    assert all(torch.isfinite(p).all() for p in pipe.transformer.parameters())


def test_generate_main_job_writes_the_trained_tiny_models_2s_clip(tmp_path, capsys):
    generate = load_generate()
    out = tmp_path / "tiny.mp4"
    rc = generate.main(
        [
            "--prompt",
            "a red circle moves right",
            "--output",
            str(out),
            "--height",
            "32",
            "--width",
            "48",
            "--num_inference_steps",
            "1",
            "--seed",
            "3",
        ]
    )
    assert rc == 0
    info = probe_streams(out)  # 2 s: 7 latent frames, 4 (7 - 1) + 1 = 25 video frames at 12.5 fps
    assert info["video_frames"] == 25 and info["fps"] == Fraction(25, 2)
    assert info["audio_sample_rate"] == 44_100 and info["audio_channels"] == 2
    assert abs(info["audio_stream_duration_s"] - 2.0) <= 0.08 and abs(info["video_stream_duration_s"] - 2.0) <= 0.08
    printed = capsys.readouterr().out
    assert "main job wall time:" in printed and "tiny default" in printed


def test_generate_main_job_writes_a_5s_clip_with_audio_cut_to_the_video(tmp_path, monkeypatch):
    """duration_s = 5: 61 frames (4.88 s at 12.5 fps, as SandAI's latent lengths give) against 5.0 s of audio;
    the main job cuts the audio to the video's duration instead of failing the export's duration check."""
    generate = load_generate()
    load = generate.load_pipeline

    def load_5s(args):
        pipe, defaults = load(args)
        pipe.register_to_config(duration_s=5.0)
        return pipe, defaults

    monkeypatch.setattr(generate, "load_pipeline", load_5s)
    out = tmp_path / "tiny_5s.mp4"
    rc = generate.main(
        [
            "--prompt",
            "A red fox",
            "--output",
            str(out),
            "--height",
            "32",
            "--width",
            "48",
            "--num_inference_steps",
            "1",
        ]
    )
    assert rc == 0
    info = probe_streams(out)
    assert info["video_frames"] == 61 and info["fps"] == Fraction(25, 2)
    assert abs(info["audio_stream_duration_s"] - 61 / 12.5) <= 0.08  # AAC frames pad by < 1024 samples


def test_generate_rejects_bad_size_before_work(tmp_path, capsys):
    generate = load_generate()
    with pytest.raises(SystemExit) as exit_info:  # argparse's one-line usage error, exit status 2
        generate.main(["--prompt", "x", "--output", str(tmp_path / "x.mp4"), "--height", "30"])
    assert exit_info.value.code == 2
    assert "multiple of 16" in capsys.readouterr().err
    assert not (tmp_path / "x.mp4").exists()


def _transformer_island_dtypes(transformer):
    """``{name: dtype}`` for every floating parameter/buffer the transformer names an fp32 island."""
    named = list(transformer.named_parameters()) + list(transformer.named_buffers())
    return {n: t.dtype for n, t in named if t.is_floating_point() and transformer.is_fp32_island(n)}


def test_tiny_default_bf16_keeps_transformer_fp32_islands():
    """Building the tiny default in bf16 must not downcast the fp32 islands (``ModelMixin.to``
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
    for weights in TINY_WEIGHTS:
        with pytest.raises(ValueError, match="floating-point torch.dtype"):
            build_tiny_default_pipeline(dtype=torch.int8, weights=weights)


def test_tiny_default_refuses_bad_weights_before_building(monkeypatch, tmp_path):
    import diffusers_magi2.pipelines.tiny_default as tiny_default

    with pytest.raises(ValueError, match=r"weights must be one of \('trained', 'random'\), got 'noise'"):
        build_tiny_default_pipeline(weights="noise")
    with pytest.raises(ValueError, match="weights='trained' takes no config"):
        build_tiny_default_pipeline(config={"seed": 1}, weights="trained")
    monkeypatch.setattr(tiny_default, "TINY_TRAINED_DIR", tmp_path / "tiny_trained")
    with pytest.raises(
        FileNotFoundError, match=r"trained tiny pipeline is not in this installation .*weights='random'"
    ):
        build_tiny_default_pipeline(weights="trained")


def test_tiny_default_loads_the_trained_folder_and_overrides_build_the_random_model(monkeypatch, tmp_path):
    """``weights="trained"`` loads the pipeline folder at ``TINY_TRAINED_DIR`` (here one saved from the random model
    at the trained shapes) with the trained call defaults; a ``config`` or ``weights="random"`` builds the seeded
    random model."""
    import diffusers_magi2.pipelines.tiny_default as tiny_default

    saved = build_tiny_random_pipeline(TINY_TRAINED_CONFIG)
    saved.save_pretrained(tmp_path / "tiny_trained")
    monkeypatch.setattr(tiny_default, "TINY_TRAINED_DIR", tmp_path / "tiny_trained")
    loaded = build_tiny_default_pipeline(weights="trained")
    assert (
        loaded.tiny_call_defaults
        == TINY_TRAINED_CONFIG["call"]
        == {"height": 32, "width": 32, "num_inference_steps": 16}
    )
    assert loaded.config.trained_resolutions == [[32, 32]] and loaded.config.duration_s == 2.0
    for name in ("transformer", "text_encoder", "vae", "video_decoder", "audio_vae"):
        want, got = getattr(saved, name).state_dict(), getattr(loaded, name).state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    bf16 = build_tiny_default_pipeline(dtype=torch.bfloat16, weights="trained")
    assert bf16.text_encoder.dtype == torch.bfloat16 and bf16.audio_vae.dtype == torch.float32

    override = build_tiny_default_pipeline(config={"seed": 7}, weights="random")
    reference = build_tiny_random_pipeline({"seed": 7})
    assert override.tiny_call_defaults == TINY_DEFAULT_CONFIG["call"]
    assert torch.equal(
        override.transformer.post_adapter.final_linear_video.weight,
        reference.transformer.post_adapter.final_linear_video.weight,
    )


def test_pipeline_from_pretrained_bf16_keeps_transformer_fp32_islands(tmp_path):
    """At pipeline level: save a tiny pipeline, reload it with ``dtype=torch.bfloat16``; the
    transformer's ``_keep_in_fp32_modules`` must keep every island fp32 through ``from_pretrained``."""
    from diffusers_magi2 import Magi2Pipeline

    build_tiny_default_pipeline().save_pretrained(tmp_path / "saved")
    loaded = Magi2Pipeline.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    islands = _transformer_island_dtypes(loaded.transformer)
    assert islands and not {n: d for n, d in islands.items() if d != torch.float32}
    assert loaded.transformer.residual_dtype == torch.bfloat16

    # the per-component dict examples/generate.py passes (diffusers 0.42.1 accepts it)
    split = Magi2Pipeline.from_pretrained(tmp_path / "saved", dtype=load_generate().pretrained_dtype("bfloat16"))
    islands = _transformer_island_dtypes(split.transformer)
    assert islands and not {n: d for n, d in islands.items() if d != torch.float32}
    assert split.transformer.residual_dtype == torch.bfloat16 and split.text_encoder.dtype == torch.bfloat16
    assert split.vae.dtype == torch.float32 and split.audio_vae.dtype == torch.float32


@pytest.mark.parametrize(
    "name, message",
    [
        ("clip.avi", "must be an .mp4 file path"),
        ("clip", "must be an .mp4 file path"),
        ("folder.mp4", "is an existing directory"),
        ("a_file.txt/clip.mp4", "parent folder cannot be created"),
    ],
)
def test_generate_rejects_bad_output_before_building_anything(tmp_path, monkeypatch, name, message):
    import diffusers_magi2.pipelines.tiny_default as tiny_default

    (tmp_path / "folder.mp4").mkdir()
    (tmp_path / "a_file.txt").write_text("x")
    built = []
    monkeypatch.setattr(tiny_default, "build_tiny_default_pipeline", lambda **kw: built.append(kw))
    generate = load_generate()
    with pytest.raises(ValueError, match=message):
        generate.main(["--prompt", "x", "--output", str(tmp_path / name)])
    assert built == []


def test_generate_accepts_output_in_a_creatable_folder(tmp_path):
    generate = load_generate()
    args = generate.parse_args(["--prompt", "x", "--output", str(tmp_path / "new" / "deeper" / "clip.MP4")])
    assert args.output.endswith("clip.MP4") and not (tmp_path / "new").exists()  # checked, not created


class _Stop(Exception):
    pass


def test_generate_dtype_reaches_the_tiny_default(tmp_path, monkeypatch):
    """``--dtype`` without ``--model`` builds the tiny default in that dtype (it used to be ignored)."""
    import diffusers_magi2.pipelines.tiny_default as tiny_default

    seen = []

    def fake_build(**kwargs):
        seen.append(kwargs)
        raise _Stop

    monkeypatch.setattr(tiny_default, "build_tiny_default_pipeline", fake_build)
    generate = load_generate()
    for flag, expected in ((["--dtype", "bfloat16"], torch.bfloat16), ([], torch.float32)):
        with pytest.raises(_Stop):
            generate.main(["--prompt", "x", "--output", str(tmp_path / "x.mp4"), *flag])
        assert seen.pop()["dtype"] == expected


def test_generate_loads_a_repo_with_dtype_not_torch_dtype(tmp_path, monkeypatch):
    """``--model`` loads with ``dtype=`` (``torch_dtype=`` is deprecated in diffusers 0.42.1): a
    per-component dict in bf16 (Wan2.2 VAE and Oobleck fp32), the plain dtype in fp32."""
    from diffusers_magi2 import Magi2Pipeline

    seen = []

    def fake_from_pretrained(path, **kwargs):
        seen.append(kwargs)
        raise _Stop

    monkeypatch.setattr(Magi2Pipeline, "from_pretrained", fake_from_pretrained)
    generate = load_generate()
    (tmp_path / "model_index.json").write_text("{}")  # generate.py checks --model is a converted repo folder
    base = ["--prompt", "x", "--output", str(tmp_path / "x.mp4"), "--model", str(tmp_path), "--device", "cpu"]
    with pytest.raises(_Stop):
        generate.main(base + ["--dtype", "bfloat16"])
    kwargs = seen.pop()
    assert "torch_dtype" not in kwargs
    assert kwargs["dtype"] == {"default": torch.bfloat16, "vae": torch.float32, "audio_vae": torch.float32}
    with pytest.raises(_Stop):
        generate.main(base)
    assert seen.pop()["dtype"] == torch.float32


def test_generate_tiny_default_in_bf16_writes_a_clip(tmp_path):
    """End to end in bf16 (transformer fp32 islands kept): the clip is written with both streams."""
    generate = load_generate()
    out = tmp_path / "tiny_bf16.mp4"
    rc = generate.main(
        [
            "--prompt",
            "A red fox",
            "--output",
            str(out),
            "--dtype",
            "bfloat16",
            "--height",
            "32",
            "--width",
            "48",
            "--num_inference_steps",
            "1",
            "--seed",
            "3",
        ]
    )
    assert rc == 0
    info = probe_streams(out)
    assert info["video_frames"] == 25 and info["audio_channels"] == 2


def test_expert_parallel_loading_resolves_a_per_component_dtype(monkeypatch):
    """``from_pretrained(dtype={...}, expert_parallel=...)``: the transformer loader gets its own entry
    of the dict (``"transformer"``, else ``"default"``), the pipeline loader the whole dict."""
    import diffusers_magi2.pipelines.loading_magi2 as loading
    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.parallel.expert_parallel import Magi2ExpertParallelConfig
    from diffusers_magi2.pipelines.loading_magi2 import load_pipeline_with_expert_parallel

    calls = []

    def fake_transformer_loader(cls, path, **kw):
        calls.append(kw)
        return "T"

    monkeypatch.setattr(loading, "ep_device", lambda cfg: torch.device("cpu"))
    monkeypatch.setattr(Magi2Transformer3DModel, "from_pretrained", classmethod(fake_transformer_loader))

    class FakePipeline:
        @classmethod
        def from_pretrained(cls, path, **kw):
            return kw

    table = {"default": torch.bfloat16, "vae": torch.float32, "audio_vae": torch.float32}
    ep = Magi2ExpertParallelConfig(2)
    out = load_pipeline_with_expert_parallel(FakePipeline, "repo", expert_parallel=ep, dtype=table)
    assert calls.pop()["dtype"] == torch.bfloat16 and out["dtype"] == table and out["transformer"] == "T"
    load_pipeline_with_expert_parallel(
        FakePipeline, "repo", expert_parallel=ep, dtype={**table, "transformer": torch.float16}
    )
    assert calls.pop()["dtype"] == torch.float16
    load_pipeline_with_expert_parallel(FakePipeline, "repo", expert_parallel=ep, dtype=torch.bfloat16)
    assert calls.pop()["dtype"] == torch.bfloat16


@pytest.mark.parametrize("overrides", [None, TINY_TRAINED_CONFIG], ids=["default", "trained_shapes"])
def test_tiny_audio_vae_round_trips_through_the_transformers_channels(overrides):
    """The audio encoder's posterior has the decoder's and the transformer's latent width (its last conv emits
    mean and scale), so audio encoded for training decodes and enters the transformer."""
    pipe = build_tiny_random_pipeline(overrides)
    with torch.no_grad():
        latents = pipe.audio_vae.encode(torch.zeros(1, 2, 2 * 2048)).latent_dist.mean
        decoded = pipe.audio_vae.decode(latents).sample
    width = pipe.audio_vae.config.decoder_input_channels
    assert latents.shape == (1, width, 2) and width == pipe.transformer.config.audio_in_channels
    assert decoded.shape == (1, 2, 2 * 2048)
