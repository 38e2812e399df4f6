"""Wan2.2 VAE: original ``WanVAE_`` ``.pth`` -> diffusers ``AutoencoderKLWan``, its patchify
round trip and tiling.

Golden data: ``magi2_tiny_components/wan22_vae/`` (SandAI reference encode, upstream Wan2.2 decode).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from diffusers_magi2.conversion.components import (
    convert_wan22_vae,
    wan22_config_from_state_dict,
    wan22_to_diffusers_key_map,
)
from diffusers_magi2.models.turbo_vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD


ATOL = 1e-4  # fp32 max abs


@pytest.fixture(scope="module")
def wan_dir(fixtures_dir):
    return fixtures_dir / "magi2_tiny_components" / "wan22_vae"


@pytest.fixture(scope="module")
def cases(wan_dir):
    return load_file(wan_dir / "cases.safetensors")


@pytest.fixture(scope="module")
def vae(wan_dir, tmp_path_factory):
    from diffusers import AutoencoderKLWan

    out = tmp_path_factory.mktemp("wan") / "vae"
    convert_wan22_vae(wan_dir / "Wan2.2_VAE.pth", out)
    return AutoencoderKLWan.from_pretrained(out).eval()


def _tables(vae):
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
    return mean, inv_std


def test_config_derived_from_shapes_matches_reference_kwargs(wan_dir, vae):
    kwargs = json.loads((wan_dir / "wan_vae_config.json").read_text())["constructor_kwargs"]
    cfg = vae.config
    assert (cfg.base_dim, cfg.decoder_base_dim, cfg.z_dim) == (kwargs["dim"], kwargs["dec_dim"], kwargs["z_dim"])
    assert list(cfg.dim_mult) == kwargs["dim_mult"]
    assert cfg.num_res_blocks == kwargs["num_res_blocks"]
    assert list(cfg.temperal_downsample) == kwargs["temporal_downsample"]
    assert cfg.is_residual and cfg.in_channels == 12 and cfg.out_channels == 12
    # Wan2.2 factors come from the patch size too (16, not 8).
    assert (cfg.patch_size, cfg.scale_factor_spatial, cfg.scale_factor_temporal) == (2, 16, 4)


def test_latent_tables_in_config_match_reference(vae, cases):
    mean, inv_std = _tables(vae)
    assert torch.equal(mean.flatten(), cases["scale.mean"])
    assert torch.equal(torch.tensor(vae.config.latents_std), cases["scale.std"])
    assert torch.equal(inv_std.flatten(), cases["scale.inv_std"])


def test_key_map_is_total_and_one_to_one(wan_dir):
    state = torch.load(wan_dir / "Wan2.2_VAE.pth", weights_only=True, mmap=True)
    mapping, unknown = wan22_to_diffusers_key_map(state)
    assert unknown == [] and len(mapping) == len(state) == 196
    assert len(set(mapping.values())) == 196
    assert (
        mapping["encoder.downsamples.1.downsamples.0.shortcut.weight"]
        == "encoder.down_blocks.1.resnets.0.conv_shortcut.weight"
    )
    assert (
        mapping["decoder.upsamples.0.upsamples.3.time_conv.weight"] == "decoder.up_blocks.0.upsampler.time_conv.weight"
    )
    assert mapping["encoder.middle.1.to_qkv.weight"] == "encoder.mid_block.attentions.0.to_qkv.weight"


@torch.no_grad()
def test_video_encode_raw_and_normalised(vae, cases):
    mu = vae.encode(cases["encode.video"]).latent_dist.mean
    assert mu.shape == cases["encode.video_latent_unnormalized"].shape
    assert (mu - cases["encode.video_latent_unnormalized"]).abs().max() <= ATOL
    mean, inv_std = _tables(vae)
    assert ((mu - mean) * inv_std - cases["encode.video_latent"]).abs().max() <= ATOL


@torch.no_grad()
def test_image_encode_and_engine_image_path_latent(vae, cases):
    mean, inv_std = _tables(vae)
    img = (vae.encode(cases["encode.image"]).latent_dist.mean - mean) * inv_std
    assert img.shape == (1, 48, 1, 2, 2)
    assert (img - cases["encode.image_latent"]).abs().max() <= ATOL
    # the engine's i2v VAE input (already resized/letterboxed) -> its normalised latent, 32x96 -> 2x6
    ref = (vae.encode(cases["image_path.vae_input"]).latent_dist.mean - mean) * inv_std
    assert ref.shape == cases["image_path.latent"].shape == (1, 48, 1, 2, 6)
    assert (ref - cases["image_path.latent"]).abs().max() <= ATOL


@torch.no_grad()
def test_decode_matches_upstream_wan22(vae, cases):
    mean, inv_std = _tables(vae)
    z = cases["decode.latent"] / inv_std + mean
    video = vae.decode(z).sample
    assert video.shape == (1, 3, 9, 32, 48)  # T = 1 + 4 (T_lat - 1), 16x spatial
    assert (video - cases["decode.video"]).abs().max() <= ATOL


@torch.no_grad()
def test_patchify_roundtrip_and_tiling_agree(vae):
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

    x = torch.randn(1, 3, 1, 64, 64, generator=torch.Generator().manual_seed(0))
    p = patchify(x, 2)
    assert p.shape == (1, 12, 1, 32, 32)
    assert torch.equal(unpatchify(p, 2), x)
    plain_latent = vae.encode(x).latent_dist.mean
    plain_video = vae.decode(plain_latent).sample
    vae.enable_tiling()
    try:
        tiled_latent = vae.encode(x).latent_dist.mean
        tiled_video = vae.decode(plain_latent).sample
        # force the tiled decode path itself (the latent is smaller than one tile)
        forced_video = vae.tiled_decode(plain_latent).sample
        # Library gap (diffusers 0.42.1): AutoencoderKLWan.tiled_encode never patchifies, so a forced
        # tiled encode of a Wan2.2 (patch_size=2) VAE fails. When diffusers fixes it this assertion
        # fails and the forced encode should join the comparisons below.
        with pytest.raises(RuntimeError, match="channels"):
            vae.tiled_encode(x)
    finally:
        vae.disable_tiling()
    assert plain_latent.shape == (1, 48, 1, 4, 4) and plain_video.shape == x.shape
    for got, want in ((tiled_latent, plain_latent), (tiled_video, plain_video), (forced_video, plain_video)):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-4


def test_bf16_output_and_tables(wan_dir, tmp_path):
    out = tmp_path / "vae_bf16"
    convert_wan22_vae(wan_dir / "Wan2.2_VAE.pth", out, dtype="bf16")
    tensors = load_file(out / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["latents_mean"] == list(WAN22_LATENTS_MEAN) and cfg["latents_std"] == list(WAN22_LATENTS_STD)


def test_pickle_refused_by_weights_only_is_an_error_and_leaves_nothing(tmp_path):
    class Evil:  # any non-allow-listed object makes weights_only refuse the file
        def __reduce__(self):
            return (print, ("unsafe",))

    bad = tmp_path / "Wan2.2_VAE.pth"
    torch.save({"encoder.conv1.weight": torch.zeros(1), "obj": Evil()}, bad)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="weights_only=True"):
        convert_wan22_vae(bad, out)
    assert not out.exists()


def test_wan21_layout_and_unknown_keys_rejected(wan_dir, tmp_path):
    state = torch.load(wan_dir / "Wan2.2_VAE.pth", weights_only=True)
    flat = {k.replace("encoder.downsamples.0.downsamples.", "encoder.downsamples."): v for k, v in state.items()}
    bad = tmp_path / "wan21.pth"
    torch.save(
        {k: v for k, v in flat.items() if not k.startswith("encoder.downsamples.0.")}
        | {"encoder.downsamples.0.residual.0.gamma": torch.ones(4, 1, 1, 1)},
        bad,
    )
    with pytest.raises(ValueError, match="Wan2.1"):
        convert_wan22_vae(bad, tmp_path / "o1")
    extra = tmp_path / "extra.pth"
    torch.save(dict(state) | {"encoder.bogus.weight": torch.zeros(2)}, extra)
    with pytest.raises(ValueError, match="encoder.bogus.weight"):
        convert_wan22_vae(extra, tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    cfg = wan22_config_from_state_dict(state)
    assert cfg["decoder_base_dim"] == 6


def test_non_empty_output_refused_and_untouched(wan_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        convert_wan22_vae(wan_dir / "Wan2.2_VAE.pth", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="dtype"):
        convert_wan22_vae(wan_dir / "Wan2.2_VAE.pth", tmp_path / "o", dtype="fp16")
