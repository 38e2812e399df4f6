"""Stable Audio Open VAE -> diffusers ``AutoencoderOobleck`` and the 441/512 resample.

Golden data: ``magi2_tiny_components/stable_audio_vae/`` (SandAI ``AudioAutoencoder.decode`` and
``decode_audio``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusers_magi2.conversion.components import convert_stable_audio_vae, oobleck_config_from_sao
from diffusers_magi2.pipelines.decoding_magi2 import resample_audio


RATIO = 441 / 512  # MAGI-2's audio resample (SandAI ``decode_audio``), exact in binary

ATOL = 1e-4


@pytest.fixture(scope="module")
def sao_root(fixtures_dir):
    return fixtures_dir / "magi2_tiny_components" / "stable_audio_vae"


@pytest.fixture(scope="module")
def cases(sao_root):
    return load_file(sao_root / "cases.safetensors")


@pytest.fixture(scope="module")
def audio_vae(sao_root, tmp_path_factory):
    from diffusers import AutoencoderOobleck

    out = tmp_path_factory.mktemp("sao") / "audio_vae"
    convert_stable_audio_vae(sao_root / "stable-audio-open-tiny", out, audio_encoder="zeros")
    return AutoencoderOobleck.from_pretrained(out).eval()


def test_tiny_encoder_not_representable_is_a_clear_error(sao_root, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match="latent_dim == channels"):
        convert_stable_audio_vae(sao_root / "stable-audio-open-tiny", out)
    assert not out.exists()


def test_decoder_weights_exact_and_decoys_skipped(sao_root, audio_vae):
    src = load_file(sao_root / "stable-audio-open-tiny" / "model.safetensors")
    decoys = [k for k in src if not k.startswith("pretransform.model.")]
    assert len(decoys) == 2
    state = audio_vae.state_dict()
    assert torch.equal(state["decoder.conv1.weight_v"], src["pretransform.model.decoder.layers.0.weight_v"])
    assert torch.equal(
        state["decoder.block.0.conv_t1.weight_g"], src["pretransform.model.decoder.layers.1.layers.1.weight_g"]
    )
    assert torch.equal(
        state["decoder.block.4.res_unit3.snake2.beta"].flatten(),
        src["pretransform.model.decoder.layers.5.layers.4.layers.2.beta"],
    )
    assert audio_vae.config.sampling_rate == 44100 and audio_vae.config.decoder_input_channels == 64
    # every parameter was written (nothing left on meta); the unrepresentable encoder is zeroed
    assert all(p.device.type == "cpu" for p in audio_vae.parameters())
    assert not state["encoder.conv2.weight_g"].any() and not state["encoder.block.0.conv1.bias"].any()


@torch.no_grad()
def test_decode_and_resample_match_reference(audio_vae, cases):
    # the engine passes latent.squeeze(0).T ([64, L]); the identity rescale broadcasts it to [1, 64, L]
    assert torch.equal(cases["decode.latent"][0].T, cases["decode.vae_input"])
    waveform = audio_vae.decode(cases["decode.latent"].transpose(1, 2)).sample
    assert waveform.shape == (1, 2, 5 * 2048)
    assert (waveform - cases["decode.waveform"]).abs().max() <= ATOL
    out = resample_audio(waveform[0].T, RATIO)  # SandAI decode_audio: waveform.squeeze(0).T, then the resample
    assert out.dtype == np.float32 and out.shape == (8820, 2)
    assert np.abs(out - cases["decode.resampled"].numpy()).max() <= 1e-5


@pytest.mark.parametrize("n, want", [(1000, 861), (1024, 882)])
def test_resample_cases(cases, n, want):
    out = resample_audio(cases[f"resample.n{n}.input"], RATIO)
    assert out.shape == (want, 2) and out.dtype == np.float32
    assert np.abs(out - cases[f"resample.n{n}.output"].numpy()).max() <= 1e-6
    with pytest.raises(ValueError, match="empty"):
        resample_audio(np.zeros((0, 2), np.float32), RATIO)


# --- a representable (Stable Audio Open 1.0-shaped) synthetic checkpoint: exact round trip ----------


def _sao_name(diffusers_key: str, n_blocks: int) -> str:
    """Independent inverse of the converter's map (diffusers key -> Stable Audio key)."""
    parts = diffusers_key.split(".")
    side, rest = parts[0], parts[1:]
    unit = {"snake1": 0, "conv1": 1, "snake2": 2, "conv2": 3}
    if rest[0] == "conv1":
        return f"{side}.layers.0.{rest[1]}"
    if rest[0] == "snake1":
        return f"{side}.layers.{n_blocks + 1}.{rest[1]}"
    if rest[0] == "conv2":
        return f"{side}.layers.{n_blocks + 2}.{rest[1]}"
    assert rest[0] == "block"
    b = int(rest[1]) + 1
    if rest[2].startswith("res_unit"):
        r = int(rest[2][-1]) - 1 + (0 if side == "encoder" else 2)
        return f"{side}.layers.{b}.layers.{r}.layers.{unit[rest[3]]}.{rest[4]}"
    inner = {"encoder": {"snake1": 3, "conv1": 4}, "decoder": {"snake1": 0, "conv_t1": 1}}[side][rest[2]]
    return f"{side}.layers.{b}.layers.{inner}.{rest[3]}"


@torch.no_grad()
def test_representable_checkpoint_round_trips_exactly(tmp_path):
    from diffusers import AutoencoderOobleck

    torch.manual_seed(0)
    cfg = {
        "encoder_hidden_size": 4,
        "downsampling_ratios": [2, 2],
        "channel_multiples": [1, 2],
        "decoder_channels": 3,
        "decoder_input_channels": 2,
        "audio_channels": 2,
        "sampling_rate": 44100,
    }
    ref = AutoencoderOobleck(**cfg).eval()
    for p in ref.parameters():
        p.copy_(torch.randn_like(p) * 0.3)
    src = tmp_path / "sao"
    src.mkdir()
    tensors = {
        "pretransform.model." + _sao_name(k, 2): (v.flatten() if k.endswith((".alpha", ".beta")) else v).contiguous()
        for k, v in ref.state_dict().items()
    }
    tensors["conditioner.decoy.weight"] = torch.zeros(3)
    save_file(tensors, str(src / "model.safetensors"))
    oobleck = {
        "in_channels": 2,
        "channels": 4,
        "c_mults": [1, 2],
        "strides": [2, 2],
        "latent_dim": 4,
        "use_snake": True,
    }
    dec = {
        "out_channels": 2,
        "channels": 3,
        "c_mults": [1, 2],
        "strides": [2, 2],
        "latent_dim": 2,
        "use_snake": True,
        "final_tanh": False,
    }
    model_config = {
        "sample_rate": 44100,
        "model": {
            "pretransform": {
                "type": "autoencoder",
                "config": {
                    "encoder": {"type": "oobleck", "config": oobleck},
                    "decoder": {"type": "oobleck", "config": dec},
                    "bottleneck": {"type": "vae"},
                    "latent_dim": 2,
                    "io_channels": 2,
                },
            }
        },
    }
    (src / "model_config.json").write_text(json.dumps(model_config))
    config, representable = oobleck_config_from_sao(model_config)
    assert representable and config == cfg

    with pytest.raises(ValueError, match="only for unrepresentable"):
        convert_stable_audio_vae(src, tmp_path / "z", audio_encoder="zeros")
    convert_stable_audio_vae(src, tmp_path / "out")
    got = AutoencoderOobleck.from_pretrained(tmp_path / "out").eval()
    want_state, got_state = ref.state_dict(), got.state_dict()
    assert set(got_state) == set(want_state)
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    audio = torch.randn(1, 2, 64)
    assert torch.equal(got.encode(audio).latent_dist.mean, ref.encode(audio).latent_dist.mean)

    # final_tanh is not representable -> clear error
    dec["final_tanh"] = True
    (src / "model_config.json").write_text(json.dumps(model_config))
    with pytest.raises(ValueError, match="final_tanh"):
        convert_stable_audio_vae(src, tmp_path / "t")
    assert not (tmp_path / "t").exists()
