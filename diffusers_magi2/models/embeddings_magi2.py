"""Position and time embeddings of MAGI-2, all fp32.

Rope (SandAI ``ElementWiseFourierEmbed``): a token at ``(t, h, w)`` of a grid ``(T, H, W)`` with reference size
``(refT, refH, refW)`` gets, per axis ``a`` and band ``k < B = head_dim / 8``::

    theta[a, k] = (pos_a - c_a) * (ref_a - 1) / (size_a - 1) * bands[k],   c = (0, (H-1)/2, (W-1)/2)

and the table ``[sin theta, cos theta]`` (``6B`` = 3/4 of the head dims) rotates q and k rotate-half
(SandAI ``apply_rotary_emb_torch``). The time embedding is SandAI's cos-first ``sinusoidal_embedding_1d``; the
``*_coords`` helpers build the coordinate rows of SandAI ``get_coords``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn


__all__ = [
    "Magi2RotaryPosEmbed",
    "check_rope_coords",
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
    """Rope bands ``temperature ** (-k / B)``, ``B = head_dim // 8`` (SandAI ``freq_bands``)."""
    num_bands = head_dim // 8
    exponent = torch.arange(0, num_bands, dtype=torch.int64).to(torch.float32) / num_bands
    return 1.0 / (temperature**exponent)


class Magi2RotaryPosEmbed(nn.Module):
    """Element-wise 3-axis rope table (module docstring); ``bands`` is a persistent ``[B]`` fp32 buffer.

    Args:
        head_dim: attention head dim, a multiple of 8.
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 for the MAGI-2 rope, got {head_dim}")
        self.head_dim = head_dim
        self.register_buffer("bands", magi2_default_rope_bands(head_dim), persistent=True)

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        """``coords`` ``[N, 9]`` (any float dtype, computed in fp32) -> rope ``[N, 6B]`` fp32.

        The coordinates are trusted (the packers build them; :func:`check_rope_coords` checks others at the edge).
        """
        coords = coords.float()
        pos, sizes, refs = coords[:, 0:3], coords[:, 3:6], coords[:, 6:9]
        unit = (refs == 1) & (sizes == 1)
        denom = torch.where(unit, torch.ones_like(sizes), sizes - 1)
        scales = torch.where(unit, torch.ones_like(sizes), (refs - 1) / denom)
        centers = (sizes - 1) / 2
        centers = torch.cat([torch.zeros_like(centers[:, :1]), centers[:, 1:]], dim=1)
        pos = pos - centers
        proj = pos.unsqueeze(-1) * scales.unsqueeze(-1) * self.bands.float()  # [N, 3, B]
        return torch.cat((proj.sin(), proj.cos()), dim=1).flatten(1)


def check_rope_coords(coords: torch.Tensor) -> None:
    """Check rope coordinates from a caller (one host read): ``[N, 9]`` rows of position, size and reference per
    axis, where an axis of size 1 has reference 1.

    Raises:
        ValueError: ``coords`` is not ``[N, 9]``, or a size of 1 has a reference other than 1 (its scale would be
            infinite).
    """
    if coords.dim() != 2 or coords.shape[1] != 9:
        raise ValueError(f"coords must be [N, 9] (position, size, reference per axis), got {tuple(coords.shape)}")
    sizes, refs = coords[:, 3:6], coords[:, 6:9]
    if not coords.is_meta and bool(((sizes == 1) & (refs != 1)).any()):
        raise ValueError("coords: a size of 1 needs a reference of 1 on that axis (its rope scale would be inf)")


def apply_magi2_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on the first ``2R`` dims of each head, fp32: ``(x1 cos - x2 sin, x2 cos + x1 sin, rest)``.

    Args:
        x: ``[N, heads, head_dim]``, any float dtype.
        rope: ``[N, 2R]`` fp32 ``[sin | cos]`` from :class:`Magi2RotaryPosEmbed`, ``2R <= head_dim``.
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
        t_normalized: ``[N]`` diffusion time on the 0-1 scale; ``p = 1000 t``.
        dim: embedding width (64).

    Returns:
        ``[N, dim]`` fp32 ``[cos(p f_k), sin(p f_k)]``, ``f_k = exp(-ln(10000) k / (dim/2))`` (odd ``dim``: a zero column).
    """
    position = t_normalized.to(torch.float32).reshape(-1) * 1000.0
    half = dim // 2
    # exp in float64, rounded once: fp32 exp differs by 1 ulp across SIMD widths; the fixtures are correctly rounded
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
    """Coordinates ``[T*H*W, 9]`` ``(t, h, w) + offset, T, H, W, ref`` of a grid, row-major (SandAI ``get_coords``)."""
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


def image_coords(t_offset: int, height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Reference image ``k`` at ``t_offset = T + 2 + k``: the special-token row ``(t, -1, -1, 1, h, w, 1, h, w)``
    then its ``(1, h, w)`` patch grid, ``[1 + h*w, 9]``."""
    special = torch.tensor([[t_offset, -1, -1, 1, height, width, 1, height, width]], device=device, dtype=dtype)
    patches = grid_coords((1, height, width), (1, height, width), offset=(t_offset, 0, 0), device=device, dtype=dtype)
    return torch.cat([special, patches], dim=0)
