"""Every bad input of ``Magi2Pipeline.__call__`` raises ``ValueError`` before any work (no model call)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.pipeline_stubs import StandInTransformer, preview_scheduler, tiny_oobleck, tiny_wan22_vae

from diffusers_magi2 import Magi2Pipeline  # noqa: E402


class NoTextEncoder(torch.nn.Module):
    """Fails loudly if the pipeline tries to encode text (validation must come first)."""

    def forward(self, *args, **kwargs):  # pragma: no cover - must not run
        raise AssertionError("text encoder ran before validation")


@pytest.fixture()
def pipe():
    transformer = StandInTransformer()
    transformer.register_to_config(text_in_channels=8)  # the width of embeds() below
    transformer.supported_attention_kwargs = ()  # takes none
    vae = tiny_wan22_vae()
    vae.encode_calls = []

    def no_encode(*args, **kwargs):  # the I2V image must not be encoded before validation
        vae.encode_calls.append(args)
        raise AssertionError("vae.encode ran before validation")

    vae.encode = no_encode
    return Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=transformer,
        audio_vae=tiny_oobleck(),
        scheduler=preview_scheduler(),
        vae=vae,
    )


def embeds(n=1):
    return {"prompt_embeds": torch.randn(n, 4, 8), "prompt_attention_mask": torch.ones(n, 4, dtype=torch.bool)}


IMAGE = PIL.Image.new("RGB", (40, 30), (10, 20, 30))

BAD = {
    "height not multiple of 16": ({"prompt": "x", "height": 500}, "multiple of 16"),
    "width not multiple of 16": ({"prompt": "x", "width": 900}, "multiple of 16"),
    "height not int": ({"prompt": "x", "height": 512.0}, "multiple of 16"),
    "1080p needs the refiner": ({"prompt": "x", "height": 1088, "width": 1920}, "refiner"),
    "empty prompt": ({"prompt": ""}, "empty"),
    "whitespace prompt": ({"prompt": "   "}, "empty"),
    "empty prompt in list": ({"prompt": ["ok", ""]}, "empty"),
    "no prompt at all": ({}, "prompt is required"),
    "prompt wrong type": ({"prompt": 3}, "string"),
    "prompt and embeds": (dict(prompt="x", **embeds()), "either prompt or prompt_embeds"),
    "image wrong type (int)": ({"prompt": "x", "image": 5}, "image must be"),
    "image wrong type (tensor)": ({"prompt": "x", "image": torch.zeros(3, 8, 8)}, "image must be"),
    "image float array": ({"prompt": "x", "image": np.zeros((8, 8, 3), dtype=np.float32)}, "uint8"),
    "image missing file": ({"prompt": "x", "image": "/no/such/file.png"}, "existing file"),
    "steps 0": ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    "steps negative": ({"prompt": "x", "num_inference_steps": -3}, "num_inference_steps"),
    "steps float": ({"prompt": "x", "num_inference_steps": 2.5}, "num_inference_steps"),
    "negative guidance": ({"prompt": "x", "guidance_scale": -1.0}, "guidance_scale"),
    "negative audio guidance": ({"prompt": "x", "audio_guidance_scale": -0.5}, "audio_guidance_scale"),
    "nan guidance": ({"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale"),
    "prompt_embeds without mask": ({"prompt_embeds": torch.randn(1, 4, 8)}, "prompt_attention_mask"),
    "mask shape mismatch": (
        {"prompt_embeds": torch.randn(1, 4, 8), "prompt_attention_mask": torch.ones(1, 3, dtype=torch.bool)},
        "prompt_attention_mask",
    ),
    "negative embeds without mask": (
        dict(**embeds(), negative_prompt_embeds=torch.randn(1, 4, 8)),
        "negative_prompt_attention_mask",
    ),
    "image + prompt_embeds without image_embeds": (dict(**embeds(), image=IMAGE), "image_embeds"),
    "image_embeds without image": ({"prompt": "x", "image_embeds": torch.zeros(1, 8)}, "only used with image"),
    "bad output_type": ({"prompt": "x", "output_type": "mp4"}, "output_type"),
    "bad callback input": (
        {"prompt": "x", "callback_on_step_end_tensor_inputs": ["noise"]},
        "callback_on_step_end_tensor_inputs",
    ),
    "latents wrong shape": (
        {"prompt": "x", "height": 32, "width": 48, "latents": torch.randn(1, 48, 3, 2, 2)},
        "latents must be",
    ),
    "audio latents wrong channels": (
        {"prompt": "x", "audio_latents": torch.randn(1, 10, 32)},
        "audio_latents must be",
    ),
    # the given noise must describe the config's clip (10 s: 32 video and 250 audio latent frames)
    "latents shorter than the clip": (
        {"prompt": "x", "height": 32, "width": 48, "latents": torch.randn(1, 48, 3, 2, 3)},
        r"latents have 3 latent frames; a config.duration_s=10.0 s clip has 32",
    ),
    "audio_latents shorter than the clip": (
        {"prompt": "x", "audio_latents": torch.randn(1, 10, 64)},
        r"audio_latents have 10 latent frames; a config.duration_s=10.0 s clip has 250",
    ),
    # a list of generators needs one per video
    "fewer generators than videos": (
        {"prompt": ["a", "b"], "generator": [torch.Generator()]},
        r"generator is a list of 1 generators for 2 videos",
    ),
    "more generators than videos": (
        {"prompt": "x", "num_videos_per_prompt": 2, "generator": [torch.Generator()] * 3},
        r"generator is a list of 3 generators for 2 videos",
    ),
    # batch mismatches, caught before the image or the text is encoded
    "negative_prompt list length": (
        {"prompt": ["a", "b"], "negative_prompt": ["n"]},
        r"negative_prompt has 1 entries for a batch of 2",
    ),
    "negative_prompt list length with image": (
        {"prompt": "x", "image": IMAGE, "negative_prompt": ["n", "m"]},
        r"negative_prompt has 2 entries for a batch of 1",
    ),
    "negative_prompt_embeds batch vs prompt": (
        {
            "prompt": ["a", "b"],
            "negative_prompt_embeds": torch.randn(1, 4, 8),
            "negative_prompt_attention_mask": torch.ones(1, 4, dtype=torch.bool),
        },
        r"negative_prompt_embeds has batch 1.*batch 2",
    ),
    "latents batch": (
        {"prompt": "x", "height": 32, "width": 48, "latents": torch.randn(2, 48, 3, 2, 3)},
        r"latents has batch 2.*batch 1",
    ),
    "latents batch with image": (
        {"prompt": ["a", "b"], "image": IMAGE, "height": 32, "width": 48, "latents": torch.randn(1, 48, 3, 2, 3)},
        r"latents has batch 1.*batch 2",
    ),
    "audio_latents batch": (
        {"prompt": ["a", "b"], "audio_latents": torch.randn(1, 10, 64)},
        r"audio_latents has batch 1.*batch 2",
    ),
    "image_embeds batch": (
        dict(**embeds(), image=IMAGE, image_embeds=torch.zeros(2, 8)),
        r"image_embeds has batch 2.*batch 1",
    ),
    # attention_kwargs: every key must reach a model that uses it
    "unknown attention_kwargs": (
        {"prompt": "x", "attention_kwargs": {"lora_rank": 1}},
        r"does not support attention_kwargs \['lora_rank'\]",
    ),
    "attention_kwargs not a dict": ({"prompt": "x", "attention_kwargs": ["scale"]}, "attention_kwargs must be a dict"),
    # text width vs transformer.config.text_in_channels (8 here)
    "prompt_embeds width": (
        {"prompt_embeds": torch.randn(1, 4, 6), "prompt_attention_mask": torch.ones(1, 4, dtype=torch.bool)},
        r"prompt_embeds has 6 channels; transformer.config.text_in_channels allows only 8",
    ),
    "negative_prompt_embeds width": (
        dict(
            **embeds(),
            negative_prompt_embeds=torch.randn(1, 4, 5),
            negative_prompt_attention_mask=torch.ones(1, 4, dtype=torch.bool),
        ),
        r"negative_prompt_embeds has 5 channels; transformer.config.text_in_channels allows only 8",
    ),
    "image_embeds width": (
        dict(**embeds(), image=IMAGE, image_embeds=torch.zeros(1, 7)),
        r"image_embeds has 7 channels; transformer.config.text_in_channels allows only 8",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_before_any_work(pipe, name):
    kwargs, message = BAD[name]
    with pytest.raises(ValueError, match=message):
        pipe(**kwargs)
    assert pipe.transformer.calls == [] and pipe.vae.encode_calls == []


def test_image_needs_the_vae(pipe):
    pipe.register_modules(vae=None)
    with pytest.raises(ValueError, match="vae"):
        pipe(prompt="x", image=IMAGE)


def test_decoding_needs_a_decoder(pipe):
    pipe.register_modules(vae=None)
    with pytest.raises(ValueError, match="video_decoder"):
        pipe(**embeds(), output_type="np")
    assert pipe.transformer.calls == []


def _warnings_of_a_32x48_call(pipe, caplog):
    """``(the warnings logged, the output)`` of a one-step 32x48 call on given latents."""
    import logging

    from diffusers.utils import logging as dlogging

    dlogging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            out = pipe(
                **embeds(),
                negative_prompt_embeds=torch.randn(1, 2, 8),
                negative_prompt_attention_mask=torch.ones(1, 2, dtype=torch.bool),
                height=32,
                width=48,
                num_inference_steps=1,
                output_type="latent",
                latents=torch.randn(1, 48, 32, 2, 3),
                audio_latents=torch.randn(1, 250, 64),
            )
    finally:
        dlogging.disable_propagation()
    return caplog.text, out


def test_untrained_resolution_warns_but_runs(pipe, caplog):
    text, out = _warnings_of_a_32x48_call(pipe, caplog)
    assert "outside the trained resolutions" in text
    assert out.frames.shape == (1, 48, 32, 2, 3)


def test_a_pipeline_trained_at_its_size_does_not_warn(pipe, caplog):
    """``trained_resolutions`` is the pipeline's config value: a model trained at 32x48 saves it and stays silent
    there, the released model's list (the default) warns."""
    assert pipe.config.trained_resolutions == [[256, 448], [512, 896]]
    assert "outside the trained resolutions ((256, 448), (512, 896))" in _warnings_of_a_32x48_call(pipe, caplog)[0]
    pipe.register_to_config(trained_resolutions=[[32, 48]])
    assert "outside the trained resolutions" not in _warnings_of_a_32x48_call(pipe, caplog)[0]
    pipe.register_to_config(trained_resolutions=[[32, 32]])
    assert "32x48 is outside the trained resolutions ((32, 32),)" in _warnings_of_a_32x48_call(pipe, caplog)[0]


@pytest.mark.parametrize("value", [[], [[32]], [[32, 0]], "32x32", [["a", 32]], 32])
def test_bad_trained_resolutions_refused_at_construction(pipe, value):
    with pytest.raises(ValueError, match=r"trained_resolutions must be a non-empty sequence of \(height, width\)"):
        Magi2Pipeline(**pipe.components, trained_resolutions=value)


def test_trained_resolutions_round_trip_through_model_index(pipe, tmp_path):
    from diffusers import DiffusionPipeline

    saved = Magi2Pipeline(**pipe.components, trained_resolutions=((32, 32), (64, 96)))
    saved.save_config(tmp_path)
    loaded = DiffusionPipeline.load_config(tmp_path)["trained_resolutions"]
    assert loaded == [[32, 32], [64, 96]]
    assert Magi2Pipeline(**pipe.components, trained_resolutions=loaded).config.trained_resolutions == loaded
