"""Reference-image (I2V) preprocessing (SandAI ``Magi2InferenceEngine._encode_image`` with
``ref_image_type="original"``, and ``resizepad``): long side scaled to ``max(height, width)``, letterboxed on
white, floored to multiples of 32 and mapped to [-1, 1], rounded to ``reference_image_dtype``; the Wan2.2 VAE
encodes it to the normalised mean latent ``(mu - mean) / std``.
"""

from __future__ import annotations

import os

import numpy as np
import PIL.Image
import torch
from diffusers.video_processor import VideoProcessor

from .autoencoding_magi2 import encode_video_pixels


__all__ = [
    "IMAGE_TYPES",
    "encode_reference_image",
    "letterbox_image",
    "load_reference_image",
    "preprocess_reference_image",
    "reference_image_processor",
]

#: What ``image=`` may be (used in error messages).
IMAGE_TYPES = "PIL.Image.Image, a local file path (str or os.PathLike), or an RGB uint8 numpy array [H, W, 3]"


def letterbox_image(image: PIL.Image.Image, height: int, width: int) -> PIL.Image.Image:
    """``image`` resized (LANCZOS, aspect kept) and centred on a white ``height x width`` canvas (SandAI ``resizepad``).

    Raises:
        ValueError: the image has a zero dimension.
    """
    w, h = image.size
    if w <= 0 or h <= 0:
        raise ValueError(f"image must have a positive size; got width {w}, height {h}")
    scale = min(width / w, height / h)
    new_w = max(1, int(round(w * scale)))
    new_h = max(1, int(round(h * scale)))
    resized = image.convert("RGB").resize((new_w, new_h), resample=PIL.Image.Resampling.LANCZOS)
    canvas = PIL.Image.new("RGB", (width, height), (255, 255, 255))
    canvas.paste(resized, ((width - new_w) // 2, (height - new_h) // 2))
    return canvas


def load_reference_image(image: PIL.Image.Image | str | os.PathLike | np.ndarray) -> PIL.Image.Image:
    """``image`` (PIL, uint8 ``[H, W, 3]`` array or local path) as a PIL image."""
    if isinstance(image, PIL.Image.Image):
        return image
    if isinstance(image, np.ndarray):
        return PIL.Image.fromarray(image)
    from diffusers.utils import load_image

    return load_image(os.fspath(image))


def preprocess_reference_image(
    image: PIL.Image.Image | str | os.PathLike | np.ndarray,
    height: int,
    width: int,
    processor: VideoProcessor,
    rounding_dtype: torch.dtype,
) -> torch.Tensor:
    """The I2V image as VAE input ``[1, 3, 1, H', W']`` (module docstring; ``processor`` is a
    ``VideoProcessor(vae_scale_factor=32)``), e.g. 1920x1080 for 512x896 -> 896x480."""
    pil = load_reference_image(image)
    longest = max(height, width)
    if pil.width > pil.height:
        target_w, target_h = longest, int(pil.height * longest / pil.width)
    else:
        target_h, target_w = longest, int(pil.width * longest / pil.height)
    canvas = letterbox_image(pil, target_h, target_w)
    pixels = processor.preprocess(canvas, height=target_h, width=target_w)
    return pixels.to(rounding_dtype).unsqueeze(2)[:, :3].float()


def reference_image_processor(vae_scale_factor_spatial: int = 16) -> VideoProcessor:
    """The ``VideoProcessor`` of :func:`preprocess_reference_image`: sizes floored to ``2 x`` the VAE's spatial factor."""
    return VideoProcessor(vae_scale_factor=2 * vae_scale_factor_spatial)


@torch.no_grad()
def encode_reference_image(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised fp32 mean latent ``[B, 48, 1, H/16, W/16]`` of ``pixels`` ``[B, 3, 1, H, W]`` in [-1, 1] (``vae``:
    the Wan2.2 ``AutoencoderKLWan``; :func:`~.autoencoding_magi2.encode_video_pixels` of one frame)."""
    return encode_video_pixels(vae, pixels)
