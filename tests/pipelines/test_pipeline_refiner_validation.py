"""Bad inputs of the two-stage (refiner) path raise ``ValueError`` before any model runs."""

from __future__ import annotations

import pytest
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config  # noqa: E402
from diffusers.models.modeling_utils import ModelMixin  # noqa: E402
from helpers.pipeline_stubs import (
    RefinerStubOutput,
    StandInTransformer,
    preview_scheduler,
    short_clip_noise,
    tiny_oobleck,
    tiny_wan22_vae,
)

from diffusers_magi2 import Magi2Pipeline  # noqa: E402


class NeverRunRefiner(ModelMixin, ConfigMixin):
    """Stands in for the refiner component; validation must fail before it is called."""

    @register_to_config
    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, *args, **kwargs):  # pragma: no cover - must not run
        raise AssertionError("refiner ran before validation")


def make_pipe(refiner=True):
    return Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=StandInTransformer(),
        audio_vae=tiny_oobleck(),
        scheduler=preview_scheduler(),
        vae=tiny_wan22_vae(),
        refiner=NeverRunRefiner() if refiner else None,
    )


def embeds(negative=True):
    e = {"prompt_embeds": torch.randn(1, 4, 8), "prompt_attention_mask": torch.ones(1, 4, dtype=torch.bool)}
    if negative:
        e.update(
            negative_prompt_embeds=torch.randn(1, 2, 8),
            negative_prompt_attention_mask=torch.ones(1, 2, dtype=torch.bool),
        )
    return e


SMALL = {"height": 64, "width": 96, "preview_height": 32, "preview_width": 48}

MISSING_REFINER = {
    "1088x1920": {"prompt": "x", "height": 1088, "width": 1920},
    "resolution 1080p": {"prompt": "x", "resolution": "1080p"},
    "explicit preview size": dict(prompt="x", **SMALL),
}

BAD = {
    "output_height zero": (
        dict(**embeds(), **SMALL, output_height=0, output_width=96),
        "output_height must be a positive int",
    ),
    "output_width negative": (
        dict(**embeds(), **SMALL, output_height=64, output_width=-2),
        "output_width must be a positive int",
    ),
    "output_height float": (
        dict(**embeds(), **SMALL, output_height=60.0, output_width=96),
        "output_height must be a positive int",
    ),
    "output_width bool": (
        dict(**embeds(), **SMALL, output_height=60, output_width=True),
        "output_width must be a positive int",
    ),
    "output_height alone": (dict(**embeds(), **SMALL, output_height=60), "output_height and output_width go together"),
    "output size with latent output": (
        dict(**embeds(), **SMALL, output_height=60, output_width=90, output_type="latent"),
        "not allowed with output_type='latent'",
    ),
    "preview_height alone": (dict(**embeds(), height=64, width=96, preview_height=32), "go together"),
    "preview size not multiple of 16": (
        dict(**embeds(), height=64, width=96, preview_height=40, preview_width=48),
        "preview_height must be a positive multiple of 16",
    ),
    "preview size zero": (
        dict(**embeds(), height=64, width=96, preview_height=32, preview_width=0),
        "preview_width must be a positive multiple of 16",
    ),
    "unknown resolution": (dict(**embeds(), resolution="4k"), "resolution must be one of"),
    "resolution conflicts with size": (dict(**embeds(), resolution="1080p", height=256, width=448), "conflicts"),
    "refiner steps zero": (dict(**embeds(), **SMALL, refiner_num_inference_steps=0), "refiner_num_inference_steps"),
    "refiner guidance negative": (dict(**embeds(), **SMALL, refiner_guidance_scale=-1.0), "refiner_guidance_scale"),
    "refiner guidance nan": (dict(**embeds(), **SMALL, refiner_guidance_scale=float("nan")), "refiner_guidance_scale"),
    "refiner settings without the refiner path": (
        dict(**embeds(), height=32, width=48, refiner_num_inference_steps=3),
        "only apply to the two-stage",
    ),
    "refiner CFG without a negative prompt": (
        dict(**embeds(negative=False), **SMALL, guidance_scale=1.0, audio_guidance_scale=1.0),
        "negative prompt",
    ),
    "latents at the refined size": (
        dict(**embeds(), **SMALL, latents=torch.randn(1, 48, 2, 4, 6)),
        r"latents must be \[batch, 48, T, 2, 3\]",
    ),
}


@pytest.mark.parametrize("name", sorted(MISSING_REFINER))
def test_refiner_path_without_refiner_raises(name):
    pipe = make_pipe(refiner=False)
    with pytest.raises(ValueError, match="needs the `refiner` component"):
        pipe(**MISSING_REFINER[name])
    assert pipe.transformer.calls == []


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_refiner_input_raises_before_any_work(name):
    pipe = make_pipe()
    kwargs, message = BAD[name]
    with pytest.raises(ValueError, match=message):
        pipe(**kwargs)
    assert pipe.transformer.calls == []


def test_refiner_guidance_one_needs_no_negative_prompt():
    """With refiner CFG off and preview CFG off, no negative prompt is needed (and none is encoded)."""

    class HalfVelocity(NeverRunRefiner):
        def forward(self, hidden_states, encoder_hidden_states, return_dict=True, **kwargs):
            return RefinerStubOutput(sample=hidden_states * 0.5) if return_dict else (hidden_states * 0.5, None)

    pipe = make_pipe()
    pipe.register_modules(refiner=HalfVelocity())
    out = pipe(
        **embeds(negative=False),
        **SMALL,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        refiner_guidance_scale=1.0,
        num_inference_steps=1,
        output_type="latent",
        **short_clip_noise(pipe),
        generator=torch.Generator().manual_seed(0),
    )
    assert out.frames.shape == (1, 48, 3, 4, 6)
