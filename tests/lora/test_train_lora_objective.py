"""``examples/train_lora_objective.py`` (the LoRA script's flow-matching objective) on the tiny random transformer:
the sigma draws of each weighting scheme and flow shift, the loss weights, the audio loss, CFG dropout to the
negative prompt, and the flags' refusals."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers.train_workers import load_train_script

from diffusers_magi2 import build_tiny_random_pipeline


script = load_train_script()
objective_module = sys.modules["train_lora_objective"]
Objective = objective_module.Objective


def draw(seed: int, scheme: str = "none", **kw) -> float:
    return Objective(weighting_scheme=scheme, **kw).sample_sigma(torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shift", [1.0, 7.0])
def test_uniform_sigma_with_the_schedulers_flow_shift(shift):
    """``u ~ U(0, 1)`` from the generator, then ``s u / (1 + (s - 1) u)``: the sigmas of 7 lie above the uniform
    ones at the same draw, as the sampler's shifted steps lie above its linear ones."""
    for seed in range(5):
        u = float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))
        assert draw(seed, flow_shift=shift) == pytest.approx(shift * u / (1 + (shift - 1) * u), rel=1e-12)
    shifted = [draw(seed, flow_shift=7.0) for seed in range(200)]
    assert sum(shifted) / 200 > 0.75  # E[7u / (1 + 6u)] = 7/6 (1 - ln 7 / 6) = 0.788; uniform's 0.5


def test_logit_normal_sigma_is_the_sigmoid_of_a_normal_draw():
    for seed in range(5):
        z = float(torch.normal(0.5, 2.0, (1,), generator=torch.Generator().manual_seed(seed)))
        assert draw(seed, "logit_normal", logit_mean=0.5, logit_std=2.0) == pytest.approx(1 / (1 + math.exp(-z)))


@pytest.fixture(scope="module")
def transformer():
    return build_tiny_random_pipeline().transformer


def fixed_sample(transformer):
    g = torch.Generator().manual_seed(0)
    sample = {
        "latents": torch.randn(48, 2, 2, 2, generator=g),
        "text_states": torch.randn(5, 64, generator=g),
        "audio_latents": torch.randn(4, 64, generator=g),
    }
    fixed = {
        "sigma": 0.5,
        "eps": torch.randn(1, 48, 2, 2, 2, generator=g),
        "eps_a": torch.randn(1, 4, 64, generator=g),
    }
    return sample, fixed


def test_loss_weights_and_audio_loss_are_the_stated_mses(transformer):
    """At a fixed sigma 0.5 and noise: the default loss is the video MSE of one forward; ``--audio_loss_weight 0.5``
    adds half the audio MSE; ``cosmap`` multiplies by ``2 / (pi (1 - 2 sigma + 2 sigma^2)) = 4 / pi``."""
    sample, fixed = fixed_sample(transformer)
    with torch.no_grad():
        out = transformer(
            hidden_states=0.5 * sample["latents"][None] + 0.5 * fixed["eps"],
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=sample["text_states"][None],
            audio_hidden_states=0.5 * sample["audio_latents"][None] + 0.5 * fixed["eps_a"],
            return_dict=True,
        )
        video = (out.sample - (fixed["eps"] - sample["latents"][None])).pow(2).mean()
        audio = (out.audio_sample - (fixed["eps_a"] - sample["audio_latents"][None])).pow(2).mean()

        def loss(**kw):
            return float(script.training_loss(transformer, sample, None, torch.device("cpu"), fixed, Objective(**kw)))

        assert loss() == pytest.approx(float(video), rel=1e-5)
        assert loss(audio_loss_weight=0.5) == pytest.approx(float(video + 0.5 * audio), rel=1e-5)
        assert loss(weighting_scheme="cosmap") == pytest.approx(4 / math.pi * float(video), rel=1e-5)
    assert audio > 0.01 * video  # the audio term is not negligible, so the second check can fail


def test_cfg_dropout_feeds_the_negative_prompt_at_its_rate(transformer):
    """With ``cfg_dropout`` p the text a forward gets is the negative prompt's states on a share p of the draws
    (binomial: 400 draws at p = 0.3, within 5 standard deviations), the sample's on the others."""
    sample, _ = fixed_sample(transformer)
    negative = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    objective = Objective(cfg_dropout=0.3, negative_text_states=negative)
    g = torch.Generator().manual_seed(0)
    texts = [
        objective_module.flow_matching_inputs(sample, g, "cpu", None, objective)["text_states"] for _ in range(400)
    ]
    dropped = sum(torch.equal(t[0], negative) for t in texts)
    assert sum(torch.equal(t[0], sample["text_states"]) for t in texts) == 400 - dropped
    assert abs(dropped - 120) <= 5 * math.sqrt(400 * 0.3 * 0.7)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cfg_dropout", "1"], "--cfg_dropout must be in [0, 1)"),
        (["--flow_shift", "0"], "--flow_shift must be > 0"),
        (["--audio_loss_weight", "-1"], "--audio_loss_weight must be >= 0"),
        (["--weighting_scheme", "karras"], "invalid choice"),
    ],
)
def test_bad_objective_flags_are_refused_before_any_work(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        script.parse_args(["--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "out"), *flags])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
