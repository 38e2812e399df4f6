"""Position and time embeddings of MAGI-2 (Preview and Refiner).

* :class:`Magi2RotaryPosEmbed` — element-wise 3-axis Fourier/RoPE table from 9-column token
  coordinates (SandAI ``ElementWiseFourierEmbed``, reference spec §1.3). Its ``bands`` buffer is the
  checkpoint key ``pre_adapter.rope.bands``.
* :func:`apply_magi2_rotary_emb` — GPT-NeoX rotate-half on the first ``6*B`` (= 3/4) head dims
  (SandAI ``apply_rotary_emb_torch``, non-interleaved).
* :func:`magi2_timestep_embedding` — the cos-first sinusoidal time embedding (SandAI
  ``sinusoidal_embedding_1d``), which overwrites channels ``0:64`` of the embedded stream.
* ``*_coords`` helpers — the coordinate rows the preview data proxy builds (spec §1.3 table,
  SandAI ``get_coords`` + ``SingleData.coords_to_cat``).

All math is fp32. Independent implementation of the reference behaviour.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

__all__ = [
    "Magi2RotaryPosEmbed",
    "apply_magi2_rotary_emb",
    "magi2_timestep_embedding",
    "magi2_default_rope_bands",
    "grid_coords",
    "video_coords",
    "audio_coords",
    "text_coords",
    "image_coords",
]


def magi2_default_rope_bands(head_dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Default rope bands ``temperature ** (-k / B)``, ``k = 0..B-1``, ``B = head_dim // 8`` (fp32 ``[B]``).

    Matches SandAI ``freq_bands(dim // 8, step=1)``.
    """
    num_bands = head_dim // 8
    exponent = torch.arange(0, num_bands, dtype=torch.int64).to(torch.float32) / num_bands
    return 1.0 / (temperature**exponent)


class Magi2RotaryPosEmbed(nn.Module):
    """Element-wise 3-axis rope table (SandAI ``ElementWiseFourierEmbed``, spec §1.3).

    For each token with coordinates ``(t, h, w, T, H, W, refT, refH, refW)``:
    ``scale_a = (ref_a - 1) / (size_a - 1)`` (1 where ``ref_a == size_a == 1``), ``h``/``w`` are
    centred by ``(size - 1) / 2`` (``t`` is not), ``theta[a, k] = coord_a * scale_a * bands[k]``.
    Output ``[N, 6B]`` fp32 = ``[sin theta_t, sin theta_h, sin theta_w, cos theta_t, cos theta_h, cos theta_w]``.

    Args:
        head_dim: attention head dim; ``B = head_dim // 8`` bands per axis, ``6B = 3/4 * head_dim``
            dims are rotated.

    Buffers: ``bands`` ``[B]`` fp32, persistent (checkpoint key ``pre_adapter.rope.bands``).
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 for the MAGI-2 rope, got {head_dim}")
        self.head_dim = head_dim
        self.register_buffer("bands", magi2_default_rope_bands(head_dim), persistent=True)

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        """``coords`` ``[N, 9]`` (any float dtype, computed in fp32) -> rope ``[N, 6B]`` fp32.

        Raises:
            ValueError: if ``coords`` is not ``[N, 9]`` or a scale is 0/0 or infinite (a size of 1
                with a reference other than 1), which the reference asserts against.
        """
        if coords.dim() != 2 or coords.shape[1] != 9:
            raise ValueError(f"coords must be [N, 9], got {tuple(coords.shape)}")
        coords = coords.float()
        pos, sizes, refs = coords[:, 0:3], coords[:, 3:6], coords[:, 6:9]
        unit = (refs == 1) & (sizes == 1)
        denom = torch.where(unit, torch.ones_like(sizes), sizes - 1)
        scales = torch.where(unit, torch.ones_like(sizes), (refs - 1) / denom)
        if not torch.compiler.is_compiling() and not coords.is_meta:
            bad = (sizes == 1) & ~unit
            if bool(bad.any()):
                raise ValueError("coords: a size of 1 needs a reference of 1 on that axis (scale would be inf)")
        centers = (sizes - 1) / 2
        centers = torch.cat([torch.zeros_like(centers[:, :1]), centers[:, 1:]], dim=1)
        pos = pos - centers
        proj = pos.unsqueeze(-1) * scales.unsqueeze(-1) * self.bands.float()  # [N, 3, B]
        return torch.cat((proj.sin(), proj.cos()), dim=1).flatten(1)


def apply_magi2_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on the first ``rope.shape[-1]`` dims of each head, in fp32.

    Args:
        x: ``[N, heads, head_dim]`` (any float dtype; the result is fp32).
        rope: ``[N, 2R]`` fp32 from :class:`Magi2RotaryPosEmbed`; first half sin, second half cos;
            ``2R <= head_dim`` dims are rotated, the rest pass through.

    With ``x1 = x[..., :R]``, ``x2 = x[..., R:2R]``: ``out1 = x1*cos - x2*sin``,
    ``out2 = x2*cos + x1*sin`` (SandAI ``apply_rotary_emb_torch``, non-interleaved).
    """
    x = x.float()
    rot = rope.shape[-1]
    half = rot // 2
    if rot > x.shape[-1]:
        raise ValueError(f"rope width {rot} exceeds head_dim {x.shape[-1]}")
    sin = rope[:, None, :half].float()
    cos = rope[:, None, half:].float()
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def magi2_timestep_embedding(t_normalized: torch.Tensor, dim: int = 64) -> torch.Tensor:
    """Cos-first sinusoidal time embedding (SandAI ``sinusoidal_embedding_1d``).

    Args:
        t_normalized: ``[N]`` diffusion time on the **0-1** scale (the reference passes
            timestep/1000); cast to fp32, then ``p = t * 1000``.
        dim: embedding width (64 in MAGI-2).

    Returns:
        ``[N, dim]`` fp32: ``[cos(p f_k) for k < dim/2, sin(p f_k) ...]`` with
        ``f_k = exp(-ln(10000) k / (dim/2))``; an odd ``dim`` gets a trailing zero column.
        ``t = 0`` gives ``dim/2`` ones then zeros.
    """
    position = t_normalized.to(torch.float32).reshape(-1) * 1000.0
    half = dim // 2
    # The fp32 exponent is the reference's; the exp itself is taken in float64 and rounded once so the
    # frequencies are correctly rounded on every CPU/GPU (vectorised fp32 exp differs by 1 ulp across
    # SIMD widths; the golden fixtures hold the correctly rounded values).
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32) / half
    freqs = torch.exp(exponent.double()).to(device=position.device, dtype=torch.float32)
    args = position[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def grid_coords(
    shape: tuple[int, int, int],
    ref_shape: tuple[int, int, int],
    offset: tuple[float, float, float] = (0, 0, 0),
    device: Optional[torch.device] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Coordinates ``[T*H*W, 9]`` of a (T, H, W) grid, row-major t, h, w (SandAI ``get_coords``).

    Columns: ``(t + off_t, h + off_h, w + off_w, T, H, W, refT, refH, refW)``.
    """
    T, H, W = shape
    t = torch.arange(T, device=device, dtype=dtype) + offset[0]
    h = torch.arange(H, device=device, dtype=dtype) + offset[1]
    w = torch.arange(W, device=device, dtype=dtype) + offset[2]
    gt, gh, gw = torch.meshgrid(t, h, w, indexing="ij")
    xyz = torch.stack([gt, gh, gw], dim=-1).reshape(-1, 3)
    meta = torch.tensor([T, H, W, *ref_shape], device=device, dtype=dtype).expand(xyz.shape[0], -1)
    return torch.cat([xyz, meta], dim=-1)


def video_coords(T: int, H: int, W: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Video latent tokens (``spatial_rope_interpolation="extra"``): refs equal sizes. ``[T*H*W, 9]``."""
    return grid_coords((T, H, W), (T, H, W), device=device, dtype=dtype)


def audio_coords(length: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Audio tokens ``(a, 0, 0)`` with size ``(L,1,1)`` and reference ``((L-1)//8+1, 1, 1)``. ``[L, 9]``."""
    return grid_coords((length, 1, 1), ((length - 1) // 8 + 1, 1, 1), device=device, dtype=dtype)


def text_coords(length: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Text tokens at ``t = -L..-1`` with reference (1,1,1) (position-free when ``L > 1``). ``[L, 9]``."""
    return grid_coords((length, 1, 1), (1, 1, 1), offset=(-length, 0, 0), device=device, dtype=dtype)


def image_coords(
    t_offset: int, height: int, width: int, device=None, dtype=torch.float32
) -> torch.Tensor:
    """Reference image ``k``: one special-token row then ``height*width`` patch rows. ``[1 + h*w, 9]``.

    ``t_offset`` is ``T + 2 + k`` (``T`` = video latent frames). Special token: ``(t_off, -1, -1,
    1, h, w, 1, h, w)``; patches: a ``(1, h, w)`` grid at time ``t_off``.
    """
    special = torch.tensor(
        [[t_offset, -1, -1, 1, height, width, 1, height, width]], device=device, dtype=dtype
    )
    patches = grid_coords((1, height, width), (1, height, width), offset=(t_offset, 0, 0), device=device, dtype=dtype)
    return torch.cat([special, patches], dim=0)
