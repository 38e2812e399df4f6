"""The tiny model's training scripts (``examples/tiny``): bad flags are refused with one ``error:`` line before
any work, and ``--resume_from_checkpoint latest`` picks the newest complete checkpoint (none: a new run)."""

from __future__ import annotations

import pytest
from helpers.launch import load_tiny_training


def _refused(main, argv, capsys, match):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and match in err[0], err


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--component", "text_encoder"], "invalid choice"),
        (["--component", "video_decoder", "--max_train_steps", "0"], "must be an integer >= 1"),
        (["--component", "audio_vae", "--learning_rate", "nan"], "finite number > 0"),
        (["--component", "audio_vae", "--resume_from_checkpoint", "checkpoint-3"], "not a checkpoint-<step> folder"),
        (["--component", "audio_vae", "--lr_warmup_steps", "-1"], "--lr_warmup_steps must be >= 0"),
        (["--component", "audio_vae", "--lr_scheduler", "exponential"], "invalid choice"),
        (["--component", "audio_vae", "--new_concepts"], "apply to --component video_decoder"),
        (["--component", "video_decoder", "--init_from", "nowhere"], "--init_from nowhere: no config.json"),
    ],
)
def test_autoencoder_script_refuses_bad_flags(tmp_path, capsys, extra, match):
    script = load_tiny_training("train_tiny_autoencoders")
    argv = ["--output_dir", str(tmp_path), "--max_train_steps", "3", *extra]
    _refused(script.main, argv, capsys, match)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--autoencoders_dir", ".", "--num_seeds", "2"], "--num_seeds must be >= 4"),
        (["--autoencoders_dir", ".", "--cfg_dropout", "1.5"], "--cfg_dropout must be < 1"),
        (["--pipeline_output_dir", "out"], "the following arguments are required: --autoencoders_dir"),
        (["--autoencoders_dir", "."], "no video_decoder/config.json"),
    ],
)
def test_transformer_script_refuses_bad_flags(tmp_path, capsys, extra, match):
    script = load_tiny_training("train_tiny_transformer")
    _refused(script.main, ["--output_dir", str(tmp_path), "--max_train_steps", "3", *extra], capsys, match)


def test_resume_latest_is_the_newest_complete_checkpoint(tmp_path):
    training = load_tiny_training("tiny_training")
    for name in ("checkpoint-9", "checkpoint-10", ".checkpoint-11.partial", "checkpoint-notes"):
        (tmp_path / name).mkdir()
    args = training.common_parser("x").parse_args(
        ["--output_dir", str(tmp_path), "--max_train_steps", "3", "--resume_from_checkpoint", "latest"]
    )
    assert training.check_resume(training.common_parser("x"), args) == (tmp_path / "checkpoint-10", 10)


def test_resume_latest_without_a_checkpoint_starts_a_new_run(tmp_path, capsys):
    """As diffusers' training scripts do: ``latest`` in a folder with no complete checkpoint says so and resumes
    nothing."""
    training = load_tiny_training("tiny_training")
    (tmp_path / ".checkpoint-11.partial").mkdir()
    args = training.common_parser("x").parse_args(
        ["--output_dir", str(tmp_path), "--max_train_steps", "3", "--resume_from_checkpoint", "latest"]
    )
    assert training.check_resume(training.common_parser("x"), args) is None
    assert f"no checkpoint-<step> folder in {tmp_path}; starting a new run" in capsys.readouterr().out


def test_audio_autoencoder_loss_is_the_waveform_error_plus_the_unit_scale_term():
    """On a stand-in VAE (encoder: a fixed linear map to 3 latent channels per 4 samples; decoder: a fixed map back),
    against the docstring's formula computed independently."""
    import types

    import torch

    script = load_tiny_training("train_tiny_autoencoders")
    generator = torch.Generator().manual_seed(0)
    down, up = torch.randn(3, 8, generator=generator), torch.randn(8, 3, generator=generator)

    def encode(audio):  # [N, 2, S] -> [N, 3, S / 4]
        mu = torch.einsum("ck,nks->ncs", down, audio.unflatten(-1, (-1, 4)).permute(0, 1, 3, 2).flatten(1, 2))
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mean=mu))

    def decode(mu):
        frames = torch.einsum("kc,ncs->nks", up, mu).unflatten(1, (2, 4)).permute(0, 1, 3, 2).flatten(2)
        return types.SimpleNamespace(sample=frames)

    audio = torch.randn(5, 2, 24, generator=generator)
    vae = types.SimpleNamespace(encode=encode, decode=decode)
    mu = encode(audio).latent_dist.mean
    stds = [mu[:, c].flatten().std().item() for c in range(3)]
    expected = (decode(mu).sample - audio).abs().mean().item() + 0.01 * sum((s - 1) ** 2 for s in stds) / 3
    assert abs(script.audio_autoencoder_loss(vae, audio).item() - expected) < 1e-5
    assert abs(stds[0] - 1) > 0.1  # the scale term is not zero on this case


def test_new_concept_triples_are_every_triple_with_a_new_colour_or_motion_and_no_training_triple():
    from diffusers_magi2.pipelines.tiny_world import COLOURS, HELD_OUT, MOTIONS, SEEN, SHAPES

    triples = load_tiny_training("train_tiny_autoencoders").new_concept_triples()
    # purple x 2 shapes x (4 motions + stays still) + 4 colours x 2 shapes x stays still
    assert len(triples) == len(set(triples)) == 1 * 2 * 5 + 4 * 2 * 1
    assert not set(triples) & {*SEEN, *HELD_OUT}
    assert all(t[0] not in COLOURS or t[2] not in MOTIONS for t in triples) and {t[1] for t in triples} == set(SHAPES)
