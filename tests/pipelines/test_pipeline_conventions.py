"""diffusers conventions of ``Magi2Pipeline``: videos per prompt, the four-tensor ``encode_prompt``,
step callbacks and interrupt in both stages, progress of every stage, the public tiny default, the
component fit check at construction and the prompt-truncation warning."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers.pipeline_stubs import (
    StandInRefiner,
    StandInTransformer,
    preview_scheduler,
    stub_embeds,
    tiny_oobleck,
    tiny_text_encoder,
)

import diffusers_magi2  # noqa: E402
from diffusers_magi2 import Magi2Pipeline  # noqa: E402
from diffusers_magi2.pipelines.text_encoding import add_figure_reference  # noqa: E402
from diffusers_magi2.pipelines.tiny_default import TINY_TRAINED_CONFIG  # noqa: E402


def stub_pipe(refiner=False):
    return Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=StandInTransformer(),
        audio_vae=tiny_oobleck(),
        scheduler=preview_scheduler(),
        refiner=StandInRefiner() if refiner else None,
    )


embeds = stub_embeds


@pytest.fixture(scope="module")
def tiny():
    pipe = diffusers_magi2.build_tiny_random_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture()
def warnings_logged(caplog):
    from diffusers.utils import logging as dlogging

    dlogging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        yield caplog
    dlogging.disable_propagation()


# ------------------------------------------------------------------------------ videos per prompt


def test_num_videos_per_prompt_draws_distinct_noise_per_video():
    """Two prompts x two videos: the model sees each prompt's text twice (adjacent rows) and four
    different noise rows; video 3 equals a one-video call started from the 4th row of the same draw."""
    pipe = stub_pipe()
    common = {"height": 32, "width": 48, "num_inference_steps": 2, "output_type": "latent"}
    out = pipe(**embeds(2), **common, num_videos_per_prompt=2, generator=torch.Generator().manual_seed(0))
    assert out.frames.shape == (4, 48, 32, 2, 3) and out.audio.shape == (4, 250, 64)
    first = pipe.transformer.calls[0]
    text = embeds(2)["prompt_embeds"]
    assert torch.equal(first["encoder_hidden_states"][:4, :5], text.repeat_interleave(2, 0))
    noise = first["hidden_states"][:4]
    assert all(not torch.equal(noise[a], noise[b]) for a in range(4) for b in range(a + 1, 4))

    g = torch.Generator().manual_seed(0)
    video_noise = torch.randn(4, 48, 32, 2, 3, generator=g)
    audio_noise = torch.randn(4, 250, 64, generator=g)
    assert torch.equal(noise, video_noise)
    e = embeds(2)
    one = pipe(**{k: v[1:] for k, v in e.items()}, **common, latents=video_noise[3:], audio_latents=audio_noise[3:])
    assert torch.equal(one.frames, out.frames[3:]) and torch.equal(one.audio, out.audio[3:])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_videos_per_prompt": 0}, "num_videos_per_prompt must be an integer >= 1"),
        ({"num_videos_per_prompt": 2, "latents": torch.randn(1, 48, 32, 2, 3)}, "one row per video"),
    ],
)
def test_bad_num_videos_per_prompt_raises_before_work(kwargs, message):
    pipe = stub_pipe()
    with pytest.raises(ValueError, match=message):
        pipe(**embeds(), height=32, width=48, num_inference_steps=1, output_type="latent", **kwargs)
    assert pipe.transformer.calls == []


# ------------------------------------------------------------------------------ encode_prompt


def test_encode_prompt_returns_both_pairs_per_video(tiny):
    prompts = ["A red fox trots through fresh snow", "A chef slices vegetables"]
    embeds_, mask, negative, negative_mask = tiny.encode_prompt(prompts, num_videos_per_prompt=2, device="cpu")
    alone, alone_mask, _ = tiny.encode_text(prompts, "cpu")
    neg_alone, neg_alone_mask, _ = tiny.encode_text([tiny.config.negative_prompt] * 2, "cpu")
    assert torch.equal(embeds_, alone.repeat_interleave(2, 0)) and torch.equal(
        mask, alone_mask.repeat_interleave(2, 0)
    )
    assert torch.equal(negative, neg_alone.repeat_interleave(2, 0))
    assert torch.equal(negative_mask, neg_alone_mask.repeat_interleave(2, 0))
    without = tiny.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu")
    assert without[2] is None and without[3] is None and torch.equal(without[0], alone)


def test_encode_prompt_works_in_isolation(tiny):
    """As diffusers' ``PipelineTesterMixin.test_encode_prompt_works_in_isolation``: the names of ``encode_prompt``'s
    return, read from its source with diffusers' ``ReturnNameVisitor``, are ``__call__`` arguments, and a pipeline
    without tokenizer and text encoder given the outputs under those names generates what the full one does."""
    import ast
    import inspect
    import textwrap

    from diffusers.utils.source_code_parsing_utils import ReturnNameVisitor

    visitor = ReturnNameVisitor()
    visitor.visit(ast.parse(textwrap.dedent(inspect.getsource(Magi2Pipeline.encode_prompt))))
    names = visitor.return_names
    assert names == [
        "prompt_embeds",
        "prompt_attention_mask",
        "negative_prompt_embeds",
        "negative_prompt_attention_mask",
    ]
    assert set(names) <= set(inspect.signature(Magi2Pipeline.__call__).parameters)

    kwargs = dict(zip(names, tiny.encode_prompt("A red fox trots through fresh snow", device="cpu")))
    common = {"height": 32, "width": 48, "num_inference_steps": 2, "output_type": "latent"}
    full = tiny("A red fox trots through fresh snow", **common, generator=torch.Generator().manual_seed(0))
    components = {**tiny.components, "tokenizer": None, "text_encoder": None}
    settings = {k: v for k, v in tiny.config.items() if not k.startswith("_") and k not in components}
    without_text = Magi2Pipeline(**components, **settings)
    without_text.set_progress_bar_config(disable=True)
    alone = without_text(**kwargs, **common, generator=torch.Generator().manual_seed(0))
    assert torch.equal(alone.frames, full.frames) and torch.equal(alone.audio, full.audio)


def test_text_only_construction_with_duration_s_none_encodes_and_a_call_names_duration_s(tiny):
    """diffusers' text-only construction passes ``None`` for every other argument, ``duration_s`` included: the
    pipeline builds (its spatial scale needs no clip), encodes as the full one does, and a call that needs the clip
    refuses ``None`` naming ``duration_s`` before any work."""
    components = {name: None for name in tiny.components if name not in ("tokenizer", "text_encoder")}
    text_only = Magi2Pipeline(tokenizer=tiny.tokenizer, text_encoder=tiny.text_encoder, **components, duration_s=None)
    text_only.set_progress_bar_config(disable=True)
    assert text_only.vae_scale_factor_spatial == 16
    for got, want in zip(text_only.encode_prompt("a cat", device="cpu"), tiny.encode_prompt("a cat", device="cpu")):
        assert torch.equal(got, want)

    no_clip = Magi2Pipeline(**tiny.components, duration_s=None)
    text_encoder_calls = []
    hook = tiny.text_encoder.register_forward_pre_hook(lambda *_: text_encoder_calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"duration_s must be a number > 0 .* got None"):
            no_clip("a cat", height=32, width=32, num_inference_steps=1)
    finally:
        hook.remove()
    assert text_encoder_calls == []


def test_i2v_image_embeds_are_the_documented_figure_token(tiny):
    """``__call__`` passes the transformer the ``<Figure 1>`` token that ``encode_prompt``'s docstring
    describes: ``encode_text(add_figure_reference(prompt), figure_target="<Figure 1>")``."""
    import PIL.Image

    prompt = "A red fox trots through fresh snow"
    seen = []
    handle = tiny.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["encoder_hidden_states"].clone(), kw["image_embeds"].clone())),
        with_kwargs=True,
    )
    try:
        tiny(
            prompt,
            image=PIL.Image.new("RGB", (48, 32), (90, 120, 30)),
            height=32,
            width=48,
            num_inference_steps=1,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        handle.remove()
    text, mask, figure = tiny.encode_text([add_figure_reference(prompt)], "cpu", figure_target="<Figure 1>")
    assert torch.count_nonzero(figure) > 0
    assert torch.equal(seen[0][1][:1], figure) and torch.equal(seen[0][0][:1, : text.shape[1]], text)


# ------------------------------------------------------------------------------ callbacks, interrupt


SMALL = {
    "height": 64,
    "width": 96,
    "preview_height": 32,
    "preview_width": 48,
    "num_inference_steps": 2,
    "output_type": "latent",
}


def test_refiner_stage_runs_the_step_callback_like_the_preview():
    """The callback sees every step of both stages with the stage's latents, and what it returns in
    the refiner stage replaces the refined latent and the audio latents."""
    pipe = stub_pipe(refiner=True)
    seen = []

    def callback(p, i, t, tensors):
        seen.append((p.num_timesteps, i, int(t), tuple(tensors["latents"].shape)))
        if p.num_timesteps == 5 and i == 4:
            return {
                "latents": torch.zeros_like(tensors["latents"]),
                "audio_latents": torch.ones_like(tensors["audio_latents"]),
            }
        return {}

    out = pipe(**embeds(), **SMALL, generator=torch.Generator().manual_seed(0), callback_on_step_end=callback)
    preview = [(2, i, int(t), (1, 48, 32, 2, 3)) for i, t in enumerate(pipe.prepare_timesteps(2)[2])]
    refiner = [(5, i, t, (1, 48, 63, 4, 6)) for i, t in enumerate([999, 952, 882, 768, 555])]
    assert seen == preview + refiner
    assert torch.count_nonzero(out.frames) == 0 and bool((out.audio == 1).all())


def test_interrupt_stops_the_refiner_stage_and_the_preview():
    pipe = stub_pipe(refiner=True)
    kept = {}

    def stop_in_refiner(p, i, t, tensors):
        if p.num_timesteps == 5 and i == 1:
            p._interrupt = True
            kept["latents"] = tensors["latents"].clone()
        return {}

    out = pipe(**embeds(), **SMALL, generator=torch.Generator().manual_seed(0), callback_on_step_end=stop_in_refiner)
    assert len(pipe.refiner.calls) == 2 * 2  # two refiner steps, cond + uncond each
    assert torch.equal(out.frames, kept["latents"])

    pipe.refiner.calls.clear()

    def stop_in_preview(p, i, t, tensors):
        p._interrupt = True
        return {}

    out = pipe(**embeds(), **SMALL, generator=torch.Generator().manual_seed(0), callback_on_step_end=stop_in_preview)
    assert pipe.refiner.calls == [] and out.frames.shape == (1, 48, 32, 2, 3)


# ------------------------------------------------------------------------------ progress


def test_every_stage_shows_progress(capsys):
    pipe = diffusers_magi2.build_tiny_random_pipeline()
    pipe.register_modules(refiner=StandInRefiner())
    pipe.refiner.register_to_config(text_in_channels=64)
    capsys.readouterr()
    pipe(
        "A red fox",
        height=32,
        width=32,
        preview_height=16,
        preview_width=16,
        num_inference_steps=1,
        refiner_num_inference_steps=1,
        generator=torch.Generator().manual_seed(0),
    )
    err = capsys.readouterr().err
    stages = ["Encoding text", "Denoising", "Refining", "Decoding video and audio"]
    positions = [err.find(stage) for stage in stages]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), err[-2000:]

    pipe.set_progress_bar_config(disable=True)
    pipe("A red fox", height=32, width=48, num_inference_steps=1, output_type="latent")
    assert "Encoding text" not in capsys.readouterr().err


# ------------------------------------------------------------------------------ tiny default


def test_tiny_default_is_public_with_dtype_and_call_defaults():
    assert "build_tiny_default_pipeline" in diffusers_magi2.__all__
    pipe = diffusers_magi2.build_tiny_default_pipeline(dtype=torch.bfloat16)
    assert (
        pipe.tiny_call_defaults
        == TINY_TRAINED_CONFIG["call"]
        == {"height": 32, "width": 32, "num_inference_steps": 16}
    )
    assert pipe.text_encoder.dtype == torch.bfloat16
    assert pipe.transformer.transformer_blocks[0].attention.linear_qkv.weight.dtype == torch.bfloat16
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "A red fox",
        **dict(pipe.tiny_call_defaults, num_inference_steps=1),
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    assert out.frames.shape == (1, 48, 7, 32 // 16, 32 // 16) and torch.isfinite(out.frames).all()


# ------------------------------------------------------------------------------ component fit


def mismatched(name, tiny):
    from diffusers import AutoencoderKLWan, AutoencoderOobleck

    if name == "vae":
        return AutoencoderKLWan(base_dim=4, z_dim=16, num_res_blocks=1)
    if name == "audio_vae":
        return AutoencoderOobleck(
            encoder_hidden_size=2,
            channel_multiples=[1, 2],
            downsampling_ratios=[2, 2],
            decoder_channels=2,
            decoder_input_channels=32,
        )
    torch.manual_seed(0)
    return tiny_text_encoder(tiny.tokenizer, hidden_size=48)


FITS = {
    "vae": (r"vae\.config\.z_dim is 16 but transformer\.config\.in_channels is 48"),
    "audio_vae": (r"audio_vae\.config\.decoder_input_channels is 32 but transformer\.config\.audio_in_channels is 64"),
    "text_encoder": (r"text_encoder\.config\.hidden_size is 48 but transformer\.config\.text_in_channels is 64"),
}


@pytest.mark.parametrize("name", sorted(FITS))
def test_components_that_do_not_fit_raise_at_construction(tiny, name):
    components = dict(tiny.components, **{name: mismatched(name, tiny)})
    with pytest.raises(ValueError, match=FITS[name]):
        Magi2Pipeline(**components)


def test_components_that_do_not_fit_raise_in_from_pretrained(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "tiny")
    with pytest.raises(ValueError, match=FITS["audio_vae"]):
        Magi2Pipeline.from_pretrained(tmp_path / "tiny", audio_vae=mismatched("audio_vae", tiny))
    assert isinstance(Magi2Pipeline.from_pretrained(tmp_path / "tiny"), Magi2Pipeline)


# ------------------------------------------------------------------------------ truncation


def test_prompt_over_the_token_limit_warns_how_much_is_dropped(tiny, warnings_logged):
    tiny.register_to_config(max_sequence_length=16)
    try:
        prompt = "A red fox trots through fresh snow at dawn while the wind howls over the frozen hills " * 3
        total = len(tiny.tokenizer(prompt)["input_ids"])
        embeds_, _, _ = tiny.encode_text([prompt], "cpu")
        assert embeds_.shape[1] == 16 and total > 16
        assert f"has {total} tokens" in warnings_logged.text
        assert f"the last {total - 16} tokens" in warnings_logged.text
        warnings_logged.clear()
        tiny.encode_text(["A red fox"], "cpu")
        assert "tokens" not in warnings_logged.text
    finally:
        tiny.register_to_config(max_sequence_length=7000)


def test_one_sampler_serves_both_stages():
    """Both stages run ``Magi2Pipeline._denoise`` (the transformer, then the refiner), and during each
    step ``current_timestep`` is the step's timestep."""
    pipe = stub_pipe(refiner=True)
    stages, timesteps = [], []
    denoise = pipe._denoise

    def recording_denoise(model, steps, *args, **kwargs):
        stages.append((model, [int(t) for t in steps]))
        return denoise(model, steps, *args, **kwargs)

    pipe._denoise = recording_denoise

    def callback(p, i, t, tensors):
        timesteps.append(int(p.current_timestep) == int(t))
        return {}

    pipe(**embeds(), **SMALL, generator=torch.Generator().manual_seed(0), callback_on_step_end=callback)
    assert [model for model, _ in stages] == [pipe.transformer, pipe.refiner]
    assert stages[1][1] == [999, 952, 882, 768, 555]
    assert len(timesteps) == 7 and all(timesteps) and pipe.current_timestep is None


def test_the_latents_leave_the_pipeline_module_only_to_start_the_refiner_and_to_be_decoded():
    """Following the video latents from noise to frames in a two-stage call (the tiny default with a stand-in
    refiner), the only package functions outside ``pipeline_magi2.py`` they are handed to are the two stages'
    forwards (``preview_forward``, ``refiner_forward``: public, the modular denoisers call them too), the refiner
    stage's ``prepare_refiner_latents`` and the decoder's ``decode_video_latents``, and no code outside
    ``pipeline_magi2.py`` calls back into it (the loop, the guidance, callbacks and cache contexts are inline)."""
    import diffusers_magi2.pipelines as pipelines
    from diffusers_magi2 import build_tiny_random_pipeline

    folder = str(Path(pipelines.__file__).parent)
    pipeline_file = str(Path(folder) / "pipeline_magi2.py")
    handed, called_back = set(), set()
    pipe = build_tiny_random_pipeline()
    pipe.register_modules(refiner=StandInRefiner())
    channels = pipe.num_channels_latents

    def is_video_latent(value) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() == 5 and value.shape[1] == channels

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        # the pipeline's own methods count as the pipeline (its mixins live in other files: validation_magi2.py,
        # autoencoding_magi2.py), as callee and as caller
        callee_is_pipeline = callee == pipeline_file or frame.f_locals.get("self") is pipe
        caller_is_pipeline = caller == pipeline_file or frame.f_back.f_locals.get("self") is pipe
        if callee.startswith(folder) and not callee_is_pipeline and caller_is_pipeline:
            if any(is_video_latent(v) for v in frame.f_locals.values()):
                handed.add(f"{Path(callee).stem}.{frame.f_code.co_name}")
        if callee == pipeline_file and caller.startswith(folder) and not caller_is_pipeline:
            called_back.add(frame.f_code.co_name)

    call = dict(SMALL, output_type="np")
    sys.setprofile(profile)
    try:
        out = pipe("a fox", **call, generator=torch.Generator().manual_seed(0), callback_on_step_end=lambda *a: {})
    finally:
        sys.setprofile(None)
    assert out.frames.shape[2:4] == (SMALL["height"], SMALL["width"])
    assert handed == {
        "sampling_magi2.preview_forward",
        "sampling_magi2.refiner_forward",
        "refiner_stage.prepare_refiner_latents",
        "decoding_magi2.decode_video_latents",
    }
    assert called_back == set()


def test_check_inputs_takes_the_call_arguments_by_keyword():
    pipe = stub_pipe()
    pipe.check_inputs(prompt="a fox", output_type="latent")  # the call's defaults fill in the rest
    with pytest.raises(ValueError, match="multiple of 16"):
        pipe.check_inputs(prompt="a fox", height=500)
    with pytest.raises(TypeError):
        pipe.check_inputs("a fox")
