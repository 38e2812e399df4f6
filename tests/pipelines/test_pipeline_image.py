"""I2V image conditioning: the reference's resize/letterbox/preprocess chain, Wan2.2 encode, and the spatial factor
(patch size counted)."""

from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.pipeline_stubs import StandInTransformer, preview_scheduler, tiny_oobleck, tiny_wan22_vae
from safetensors.torch import load_file

from diffusers_magi2 import Magi2Pipeline  # noqa: E402
from diffusers_magi2.pipelines.pipeline_magi2 import letterbox_image  # noqa: E402


def make_pipe(vae):
    return Magi2Pipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=StandInTransformer(),
        audio_vae=tiny_oobleck(),
        scheduler=preview_scheduler(),
        vae=vae,
    )


@pytest.fixture(scope="module")
def wan_fixture(fixtures_dir, tmp_path_factory):
    """The fixture's Wan2.2 VAE converted by the package's converter, and its cases."""
    from diffusers import AutoencoderKLWan

    from diffusers_magi2.conversion.components import convert_wan22_vae

    folder = fixtures_dir / "magi2_tiny_components" / "wan22_vae"
    out = convert_wan22_vae(folder / "Wan2.2_VAE.pth", tmp_path_factory.mktemp("wan") / "vae")
    vae = AutoencoderKLWan.from_pretrained(out, torch_dtype=torch.float32).eval()
    cases = load_file(str(folder / "cases.safetensors"))
    meta = json.loads((folder / "cases.json").read_text())
    return vae, cases, meta


def test_image_path_matches_reference(wan_fixture):
    """25x40 image, 64x96 preview: long side 96 -> 96x60 -> letterbox -> floor to 32 -> 32x96 -> bf16
    pixels -> normalised mean latent [1, 48, 1, 2, 6] (fixture ``image_path.*``)."""
    vae, cases, _ = wan_fixture
    pipe = make_pipe(vae)
    image = PIL.Image.fromarray(cases["image_path.pil_rgb_uint8"].numpy())
    pixels = pipe.preprocess_reference_image(image, 64, 96)
    assert pixels.dtype == torch.float32
    torch.testing.assert_close(pixels, cases["image_path.vae_input"], atol=0, rtol=0)
    latent = pipe.encode_reference_image(pixels)
    torch.testing.assert_close(latent, cases["image_path.latent"], atol=1e-5, rtol=1e-5)
    # also from a uint8 array and from a file path
    pixels_np = pipe.preprocess_reference_image(cases["image_path.pil_rgb_uint8"].numpy(), 64, 96)
    assert torch.equal(pixels_np, pixels)


def test_wan_encode_cases_and_latent_tables_from_config(wan_fixture):
    vae, cases, _ = wan_fixture
    pipe = make_pipe(vae)
    torch.testing.assert_close(torch.tensor(vae.config.latents_mean), cases["scale.mean"], atol=0, rtol=0)
    torch.testing.assert_close(torch.tensor(vae.config.latents_std), cases["scale.std"], atol=0, rtol=0)
    latent = pipe.encode_reference_image(cases["encode.image"])
    torch.testing.assert_close(latent, cases["encode.image_latent"], atol=1e-5, rtol=1e-5)
    video = pipe.encode_video(cases["encode.video"])  # 9 frames: the public video encode
    torch.testing.assert_close(video, cases["encode.video_latent"], atol=1e-5, rtol=1e-5)


def test_fallback_decoder_is_the_wan_vae_with_config_tables(wan_fixture):
    """Without a video_decoder the pipeline de-normalises z / (1/std) + mean and decodes with the Wan
    VAE (clamped), reproducing the fixture's ``decode.video``."""
    vae, cases, _ = wan_fixture
    pipe = make_pipe(vae)
    video = pipe.decode_video(cases["decode.latent"])
    torch.testing.assert_close(video, cases["decode.video"], atol=1e-5, rtol=1e-5)


def test_spatial_factor_patchify_and_1080p_reference_latent(tmp_path):
    """Scale factor 16 (patch 2 counted), 1920x1080 -> [1, 48, 1, 30, 56], tiled == untiled on a
    small input, patchify/unpatchify round trip."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

    vae = tiny_wan22_vae()
    pipe = make_pipe(vae)
    assert pipe.vae_scale_factor_spatial == 16 and pipe.vae_scale_factor_temporal == 4
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (1080, 1920, 3), dtype=np.uint8))
    pixels = pipe.preprocess_reference_image(image, 512, 896)
    assert pixels.shape == (1, 3, 1, 480, 896)  # 896x504 -> floored to multiples of 32 -> 896x480
    latent = pipe.encode_reference_image(pixels)
    assert latent.shape == (1, 48, 1, 30, 56)

    x = torch.randn(1, 3, 1, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = vae.encode(x).latent_dist.mode()
        vae.enable_tiling()
        tiled = vae.encode(x).latent_dist.mode()
        vae.disable_tiling()
    assert plain.shape == (1, 48, 1, 4, 4)
    assert (plain - tiled).abs().max().item() <= 1e-4
    y = torch.randn(1, 3, 2, 8, 12)
    assert torch.equal(unpatchify(patchify(y, 2), 2), y)


def test_letterbox_keeps_aspect_on_white():
    img = PIL.Image.new("RGB", (40, 20), (0, 0, 0))
    out = np.asarray(letterbox_image(img, 40, 40))
    assert out.shape == (40, 40, 3)
    assert (out[:10] == 255).all() and (out[30:] == 255).all() and (out[12:28] == 0).all()
    with pytest.raises(ValueError):
        letterbox_image(PIL.Image.new("RGB", (0, 5)), 8, 8)


def test_i2v_call_keeps_image_in_uncond_and_special_token_in_both(wan_fixture):
    vae, _, _ = wan_fixture
    pipe = make_pipe(vae)
    token = torch.randn(1, 8)
    pipe(
        prompt_embeds=torch.randn(1, 4, 8),
        prompt_attention_mask=torch.ones(1, 4, dtype=torch.bool),
        negative_prompt_embeds=torch.randn(1, 2, 8),
        negative_prompt_attention_mask=torch.ones(1, 2, dtype=torch.bool),
        image=PIL.Image.new("RGB", (48, 32), (200, 10, 10)),
        image_embeds=token,
        height=32,
        width=48,
        num_inference_steps=1,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    call = pipe.transformer.calls[0]
    assert call["image_latents"].shape == (2, 48, 1, 2, 2)  # 48x32 floored to multiples of 32: 32x32
    assert torch.equal(call["image_latents"][0], call["image_latents"][1])
    assert torch.equal(call["image_embeds"], token.expand(2, -1))


@pytest.mark.parametrize(
    "pixels, match",
    [
        (torch.zeros(1, 3, 9, 32, 96, dtype=torch.uint8), r"pixels must be a floating-point tensor \[B, C, F, H, W\]"),
        (torch.zeros(3, 9, 32, 96), r"pixels must be a floating-point tensor .* shape \(3, 9, 32, 96\)"),
        (torch.zeros(1, 4, 9, 32, 96), r"its C must be 3 \(RGB\)"),
        (torch.zeros(1, 3, 8, 32, 96), r"its F must be 4k \+ 1 frames"),
        (torch.zeros(1, 3, 9, 40, 96), r"its H must be a positive multiple of 16"),
        (torch.zeros(1, 3, 9, 32, 0), r"its W must be a positive multiple of 16"),
    ],
)
def test_encode_video_refuses_pixels_of_another_layout_before_encoding(wan_fixture, pixels, match):
    vae, _, _ = wan_fixture
    pipe = make_pipe(vae)
    encoded = []
    handle = vae.encoder.register_forward_pre_hook(lambda *_: encoded.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            pipe.encode_video(pixels)
    finally:
        handle.remove()
    assert encoded == []


def test_encode_video_without_a_vae_says_so():
    with pytest.raises(ValueError, match="encode_video needs the pipeline's vae"):
        make_pipe(None).encode_video(torch.zeros(1, 3, 1, 16, 16))
