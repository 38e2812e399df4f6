"""MAGI-2's TurboVAE video decoder (SandAI ``turbo_vaed.py`` ``TurboVAED``; same ``decoder.*`` keys).

``conv_in`` (3x3x3, time edge-replicated) -> mid residual blocks -> up blocks (optional width-change block,
optional 2x upsampler: ``upsample3d`` doubles the frames with a (3, 1, 1) time conv, both modes upsample space
nearest-exact + 3x3 conv) -> head (unpatchify, or per-frame conv + ``pixel_shuffle(2)``). ``decode``
de-normalises with the config's Wan2.2 tables and decodes in temporal windows that overlap by one latent
frame: ``T`` latent frames give ``1 + 4 (T - 1)`` frames at 16x the latent size.

Spatial tiling (``enable_tiling``, not in the reference): every op of the decoder is spatially local (convolutions,
per-position RMS norms, nearest-exact upsampling), so a decoded pixel depends only on latents within the decoder's
receptive radius ``r`` (in latent pixels; :meth:`Magi2TurboVAEDecoder.spatial_receptive_radius`). A tile of latents
``[a, b)`` decoded with ``ceil(r)`` extra latents on each side (cut at the frame's edge) therefore gives the pixels
of ``[16 a, 16 b)`` that a whole-frame decode gives, up to floating-point summation order (the convolutions see
other input shapes: not bit for bit); the tiles are joined without blending. Peak activation
memory scales with the tile's area plus its halo instead of the frame's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import AutoencoderMixin, DecoderOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils.accelerate_utils import apply_forward_hook


__all__ = ["Magi2TurboVAEDecoder", "WAN22_LATENTS_MEAN", "WAN22_LATENTS_STD"]

# Wan2.2 VAE latent statistics (48 channels): the defaults of the config's latents_mean / latents_std
WAN22_LATENTS_MEAN: Tuple[float, ...] = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD: Tuple[float, ...] = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip


def _channel_rms_norm(hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free RMS norm over dim 1, mean square in fp32, result in the input dtype."""
    input_dtype = hidden_states.dtype
    variance = hidden_states.to(torch.float32).pow(2).mean(1, keepdim=True)
    return (hidden_states * torch.rsqrt(variance + eps)).to(input_dtype)


class _ChannelRMSNorm(nn.Module):
    """Module wrapper of :func:`_channel_rms_norm`."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _channel_rms_norm(hidden_states, self.eps)


def _pad_time_replicate(hidden_states: torch.Tensor, kernel_t: int) -> torch.Tensor:
    """Pad ``[B, C, T, H, W]`` symmetrically in time by repeating the first and last frame."""
    pad = (kernel_t - 1) // 2
    if pad == 0:
        return hidden_states
    first = hidden_states[:, :, :1].expand(-1, -1, pad, -1, -1)
    last = hidden_states[:, :, -1:].expand(-1, -1, pad, -1, -1)
    return torch.cat([first, hidden_states, last], dim=2)


def _triple(value: Union[int, Sequence[int]]) -> Tuple[int, int, int]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value, value)  # type: ignore[return-value]


class _TimeReplicateConv3d(nn.Module):
    """3-D conv, time edge-replicated, space zero-padded (SandAI ``TurboVAEDCausalConv3d``, non-causal)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Union[int, Sequence[int]] = 3) -> None:
        super().__init__()
        self.kernel_size = _triple(kernel_size)
        kt, kh, kw = self.kernel_size
        self.conv = nn.Conv3d(in_channels, out_channels, self.kernel_size, padding=(0, kh // 2, kw // 2))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.conv(_pad_time_replicate(hidden_states, self.kernel_size[0]))


class _TimeReplicateSeparableConv3d(nn.Module):
    """Depthwise ``k^3`` conv then pointwise conv (SandAI ``TurboVAEDCausalDepthwiseSeparableConv3d``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Union[int, Sequence[int]] = 3) -> None:
        super().__init__()
        self.kernel_size = _triple(kernel_size)
        kt, kh, kw = self.kernel_size
        self.depthwise_conv = nn.Conv3d(
            in_channels, in_channels, self.kernel_size, groups=in_channels, padding=(0, kh // 2, kw // 2)
        )
        self.pointwise_conv = nn.Conv3d(in_channels, out_channels, kernel_size=1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.depthwise_conv(_pad_time_replicate(hidden_states, self.kernel_size[0]))
        return self.pointwise_conv(hidden_states)


def _make_conv(in_channels: int, out_channels: int, kernel_size: int, separable: bool) -> nn.Module:
    if separable:
        return _TimeReplicateSeparableConv3d(in_channels, out_channels, kernel_size)
    return _TimeReplicateConv3d(in_channels, out_channels, kernel_size)


class _ResidualBlock3d(nn.Module):
    """``x + conv2(silu(norm2(conv1(act(norm1(x))))))`` with a shortcut on width change (SandAI ``TurboVAEDResNetBlock3d``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        resnet_eps: float,
        separable: bool,
        dw_kernel_size: int,
        relu_first: bool = False,
    ) -> None:
        super().__init__()
        kernel = dw_kernel_size if separable else 3
        self.relu_first = relu_first
        self.norm1 = _ChannelRMSNorm(1e-8)
        self.conv1 = _make_conv(in_channels, out_channels, kernel, separable)
        self.norm2 = _ChannelRMSNorm(1e-8)
        self.conv2 = _make_conv(out_channels, out_channels, kernel, separable)
        self.norm3 = None
        self.conv_shortcut = None
        if in_channels != out_channels:
            self.norm3 = _ChannelRMSNorm(resnet_eps)
            self.conv_shortcut = _make_conv(in_channels, out_channels, 1, separable)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden_states = self.norm1(inputs)
        hidden_states = F.relu(hidden_states) if self.relu_first else F.silu(hidden_states)
        hidden_states = self.conv1(hidden_states)
        hidden_states = F.silu(self.norm2(hidden_states))
        hidden_states = self.conv2(hidden_states)
        if self.conv_shortcut is not None:
            inputs = self.conv_shortcut(self.norm3(inputs))
        return hidden_states + inputs


class _NearestExactUpsample2x(nn.Module):
    """2x nearest-exact upsampling of ``[N, C, H, W]`` in fp32."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        upsampled = F.interpolate(hidden_states.float(), scale_factor=(2.0, 2.0), mode="nearest-exact")
        return upsampled.to(hidden_states.dtype)


class _Upsampler(nn.Module):
    """2x upsampler (SandAI ``WanResample``); ``upsample3d`` interleaves ``time_conv``'s channel halves in time,
    dropping the first frame of a decode's first window."""

    def __init__(self, channels: int, temporal: bool) -> None:
        super().__init__()
        self.temporal = temporal
        self.resample = nn.Sequential(_NearestExactUpsample2x(), nn.Conv2d(channels, channels, 3, padding=1))
        if temporal:
            self.time_conv = _TimeReplicateConv3d(channels, channels * 2, (3, 1, 1))

    def forward(self, hidden_states: torch.Tensor, is_first_chunk: bool) -> torch.Tensor:
        batch, channels, frames, height, width = hidden_states.shape
        if self.temporal:
            hidden_states = self.time_conv(hidden_states)
            # [B, (2, C), T, H, W] -> [B, C, (T, 2), H, W]
            hidden_states = hidden_states.view(batch, 2, channels, frames, height, width)
            hidden_states = hidden_states.permute(0, 2, 3, 1, 4, 5).reshape(batch, channels, frames * 2, height, width)
            if is_first_chunk:
                hidden_states = hidden_states[:, :, 1:]
        frames = hidden_states.shape[2]
        hidden_states = hidden_states.permute(0, 2, 1, 3, 4).reshape(batch * frames, channels, height, width)
        hidden_states = self.resample(hidden_states)
        out_channels, out_h, out_w = hidden_states.shape[1:]
        return hidden_states.view(batch, frames, out_channels, out_h, out_w).permute(0, 2, 1, 3, 4)


class _MidBlock(nn.Module):
    def __init__(self, channels: int, num_layers: int, resnet_eps: float, separable: bool, dw_kernel_size: int):
        super().__init__()
        self.resnets = nn.ModuleList(
            [_ResidualBlock3d(channels, channels, resnet_eps, separable, dw_kernel_size) for _ in range(num_layers)]
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            hidden_states = resnet(hidden_states)
        return hidden_states


class _UpBlock(nn.Module):
    """``conv_in`` (width change) -> optional upsampler -> ``num_layers`` res-blocks (SandAI ``TurboVAEDUpBlock3d``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        num_layers: int,
        resnet_eps: float,
        upsample: bool,
        spatial_only: bool,
        separable: bool,
        dw_kernel_size: int,
    ) -> None:
        super().__init__()
        self.conv_in = None
        if in_channels != out_channels:
            self.conv_in = _ResidualBlock3d(in_channels, out_channels, resnet_eps, separable, dw_kernel_size)
        self.upsamplers = None
        if upsample:
            self.upsamplers = nn.ModuleList([_Upsampler(out_channels, temporal=not spatial_only)])
        self.resnets = nn.ModuleList(
            [
                _ResidualBlock3d(
                    out_channels, out_channels, resnet_eps, separable, dw_kernel_size, relu_first=upsample
                )
                for _ in range(num_layers)
            ]
        )

    def forward(self, hidden_states: torch.Tensor, is_first_chunk: bool) -> torch.Tensor:
        if self.conv_in is not None:
            hidden_states = self.conv_in(hidden_states)
        if self.upsamplers is not None:
            for upsampler in self.upsamplers:
                hidden_states = upsampler(hidden_states, is_first_chunk)
        for resnet in self.resnets:
            hidden_states = resnet(hidden_states)
        return hidden_states


class _PixelShuffleUpsampler(nn.Module):
    """Per-frame 3x3 conv then ``pixel_shuffle(2)``: ``[N, C, H, W] -> [N, C/4, 2H, 2W]`` (key ``conv.*``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.pixel_shuffle(self.conv(hidden_states), 2)


def _unpatchify(hidden_states: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[B, C*p*p, T, H, W] -> [B, C, T, H*p, W*p]``, channel ``c*p*p + pw*p + ph`` (SandAI ``_turbo_unpatchify``)."""
    if patch_size == 1:
        return hidden_states
    batch, channels_p, frames, height, width = hidden_states.shape
    channels = channels_p // (patch_size * patch_size)
    hidden_states = hidden_states.view(batch, channels, patch_size, patch_size, frames, height, width)
    hidden_states = hidden_states.permute(0, 1, 4, 5, 3, 6, 2)
    return hidden_states.reshape(batch, channels, frames, height * patch_size, width * patch_size)


class _TurboDecoder3d(nn.Module):
    """The decoder network: latents ``[B, z, T, h, w]`` -> pixels ``[B, 3, T', 16h, 16w]`` for one window."""

    def __init__(
        self,
        latent_channels: int,
        out_channels: int,
        block_out_channels: Sequence[int],
        layers_per_block: Sequence[int],
        spatio_temporal_scaling: Sequence[bool],
        spatio_only: Sequence[bool],
        is_dw_conv: Sequence[bool],
        dw_kernel_size: int,
        resnet_eps: float,
        patch_size: int,
        use_unpatchify: bool,
    ) -> None:
        super().__init__()
        # The config lists are in encoder order; the decoder walks them in reverse.
        channels = list(reversed(block_out_channels))
        layers = list(reversed(layers_per_block))
        scaling = list(reversed(spatio_temporal_scaling))
        spatial_only = list(reversed(spatio_only))
        separable = list(reversed(is_dw_conv))
        self.patch_size = patch_size
        self.use_unpatchify = use_unpatchify

        self.conv_in = _TimeReplicateConv3d(latent_channels, channels[0], 3)
        self.mid_block = _MidBlock(channels[0], layers[0], resnet_eps, separable[0], dw_kernel_size)
        self.up_blocks = nn.ModuleList()
        width = channels[0]
        for i, block_width in enumerate(channels):
            self.up_blocks.append(
                _UpBlock(
                    width,
                    block_width,
                    layers[i + 1],
                    resnet_eps,
                    upsample=scaling[i],
                    spatial_only=spatial_only[i],
                    separable=separable[i + 1],
                    dw_kernel_size=dw_kernel_size,
                )
            )
            width = block_width

        if use_unpatchify:
            conv_out_channels = out_channels * patch_size * patch_size
        else:
            self.norm_up_1 = _ChannelRMSNorm(1e-8)
            self.upsampler2d_1 = _PixelShuffleUpsampler(width)
            width = width // 4
            conv_out_channels = out_channels
        self.conv_out = _TimeReplicateConv3d(width, conv_out_channels, 3)

    def forward(self, hidden_states: torch.Tensor, is_first_chunk: bool) -> torch.Tensor:
        hidden_states = self.conv_in(hidden_states)
        hidden_states = self.mid_block(hidden_states)
        for up_block in self.up_blocks:
            hidden_states = up_block(hidden_states, is_first_chunk)
        if not self.use_unpatchify:
            hidden_states = F.silu(self.norm_up_1(hidden_states))
            frames = [self.upsampler2d_1(hidden_states[:, :, t]) for t in range(hidden_states.shape[2])]
            hidden_states = torch.stack(frames, dim=2)
        hidden_states = F.silu(_channel_rms_norm(hidden_states, 1e-8))
        hidden_states = self.conv_out(hidden_states)
        if self.use_unpatchify:
            hidden_states = _unpatchify(hidden_states, self.patch_size)
        return hidden_states


@dataclass
class _WindowPlan:
    """One decoder call: latent frames ``[start, stop)``, first-window flag, pixel frames to trim."""

    start: int
    stop: int
    is_first_chunk: bool
    trim_left: int
    trim_right: int


def _spatial_receptive_radius(decoder: nn.Module) -> float:
    """Receptive radius of ``decoder``'s spatial ops in latent pixels, walking its modules in execution order."""
    radius, scale, counted = 0.0, 1.0, set()
    for module in decoder.modules():
        if isinstance(module, _NearestExactUpsample2x):
            scale *= 2.0
        elif isinstance(module, _PixelShuffleUpsampler):  # its conv at this scale, then pixel_shuffle doubles it
            radius += (max(module.conv.kernel_size) // 2) / scale
            counted.add(module.conv)
            scale *= 2.0
        elif isinstance(module, (nn.Conv2d, nn.Conv3d)) and module not in counted:
            radius += (max(module.kernel_size[-2:]) // 2) / scale
    return radius


class Magi2TurboVAEDecoder(AutoencoderMixin, ModelMixin, ConfigMixin):
    r"""TurboVAE decoder of MAGI-2 (the pipeline's default ``video_decoder``); decode-only.

    Config arguments (the SandAI JSON's names):
        latent_channels (`int`, 48): latent channels ``z``.
        out_channels (`int`, 3): pixel channels.
        decoder_block_out_channels (`Tuple[int]`): widths in *encoder* order (decoder reverses them).
        decoder_layers_per_block (`Tuple[int]`): ``len(block_out_channels) + 1`` res-block counts,
            encoder order; the last entry (after reversing: the first) is the mid block.
        decoder_spatio_temporal_scaling (`Tuple[bool]`): which up-blocks upsample (encoder order).
        decoder_spatio_only (`Tuple[bool]`): which of those upsample in space only.
        decoder_is_dw_conv (`Tuple[bool]`): depthwise-separable convs per block (mid block + up-blocks).
        decoder_dw_kernel_size (`int`, 3): kernel of the depthwise convs.
        patch_size (`int`, 2): must be 2 (the reference asserts it).
        use_unpatchify (`bool`): head type, see the module docstring.
        resnet_norm_eps (`float`): eps of the shortcut norm (``norm3``).
        first_chunk_size (`int`), step_size (`int`): sliding-window schedule in latent frames.
        spatial_compression_ratio (`int`, 16), temporal_compression_ratio (`int`, 4): strides.
        latents_mean, latents_std (`Tuple[float]`, ``latent_channels`` values each): the Wan2.2 latent
            statistics used to de-normalise (defaults: the 48 released values).
        decoder_causal (`bool`, False): must be False (the reference asserts a non-causal decoder).

    Raises:
        ValueError: inconsistent config (list lengths, ``patch_size != 2``, table lengths, causal decoder,
            non-positive window sizes).
    """

    config_name = "config.json"
    _supports_gradient_checkpointing = False
    _no_split_modules = ["_UpBlock", "_MidBlock"]

    @register_to_config
    def __init__(
        self,
        latent_channels: int = 48,
        out_channels: int = 3,
        decoder_block_out_channels: Tuple[int, ...] = (64, 128, 256, 512),
        decoder_layers_per_block: Tuple[int, ...] = (2, 2, 2, 3, 3),
        decoder_spatio_temporal_scaling: Tuple[bool, ...] = (False, True, True, True),
        decoder_spatio_only: Tuple[bool, ...] = (False, True, False, False),
        decoder_is_dw_conv: Tuple[bool, ...] = (False, False, False, False, False),
        decoder_dw_kernel_size: int = 3,
        patch_size: int = 2,
        use_unpatchify: bool = True,
        resnet_norm_eps: float = 1e-6,
        first_chunk_size: int = 7,
        step_size: int = 7,
        spatial_compression_ratio: int = 16,
        temporal_compression_ratio: int = 4,
        latents_mean: Tuple[float, ...] = WAN22_LATENTS_MEAN,
        latents_std: Tuple[float, ...] = WAN22_LATENTS_STD,
        decoder_causal: bool = False,
    ) -> None:
        super().__init__()
        n_blocks = len(decoder_block_out_channels)
        problems = []
        if len(decoder_layers_per_block) != n_blocks + 1:
            problems.append(
                f"decoder_layers_per_block needs {n_blocks + 1} entries, got {len(decoder_layers_per_block)}"
            )
        for name, values, want in (
            ("decoder_spatio_temporal_scaling", decoder_spatio_temporal_scaling, n_blocks),
            ("decoder_spatio_only", decoder_spatio_only, n_blocks),
            ("decoder_is_dw_conv", decoder_is_dw_conv, n_blocks + 1),
        ):
            if len(values) != want:
                problems.append(f"{name} needs {want} entries, got {len(values)}")
        if patch_size != 2:
            problems.append(f"patch_size must be 2 (as in the reference), got {patch_size}")
        if decoder_causal:
            problems.append("decoder_causal=True is not supported (the reference asserts is_causal == False)")
        if len(latents_mean) != latent_channels or len(latents_std) != latent_channels:
            problems.append(
                f"latents_mean/latents_std need {latent_channels} values each, got {len(latents_mean)}/{len(latents_std)}"
            )
        if first_chunk_size < 1 or step_size < 1:
            problems.append(f"first_chunk_size and step_size must be >= 1, got {first_chunk_size}/{step_size}")
        if problems:
            raise ValueError("Invalid Magi2TurboVAEDecoder config: " + "; ".join(problems))

        self.decoder = _TurboDecoder3d(
            latent_channels=latent_channels,
            out_channels=out_channels,
            block_out_channels=decoder_block_out_channels,
            layers_per_block=decoder_layers_per_block,
            spatio_temporal_scaling=decoder_spatio_temporal_scaling,
            spatio_only=decoder_spatio_only,
            is_dw_conv=decoder_is_dw_conv,
            dw_kernel_size=decoder_dw_kernel_size,
            resnet_eps=resnet_norm_eps,
            patch_size=patch_size,
            use_unpatchify=use_unpatchify,
        )
        self.use_tiling = False
        self.tile_sample_min_height = 512
        self.tile_sample_min_width = 512

    def spatial_receptive_radius(self) -> float:
        """Latent pixels on each side that one decoded pixel depends on (the tiling halo, rounded up)."""
        return _spatial_receptive_radius(self.decoder)

    def enable_tiling(self, tile_sample_min_height: Optional[int] = None, tile_sample_min_width: Optional[int] = None):
        r"""Decode each temporal window in spatial tiles (diffusers' ``enable_tiling``); the result equals the
        untiled decode up to floating-point summation order (see the module docstring).

        Args:
            tile_sample_min_height (`int`, *optional*, 512), tile_sample_min_width (`int`, *optional*, 512): pixel
                size of the part each tile keeps; a multiple of ``spatial_compression_ratio``. Each tile is decoded
                with ``ceil(spatial_receptive_radius())`` extra latent pixels on every side inside the frame.

        Raises:
            ValueError: a tile size that is not a positive multiple of ``spatial_compression_ratio``.
        """
        ratio = self.config.spatial_compression_ratio
        height = self.tile_sample_min_height if tile_sample_min_height is None else tile_sample_min_height
        width = self.tile_sample_min_width if tile_sample_min_width is None else tile_sample_min_width
        for name, value in (("tile_sample_min_height", height), ("tile_sample_min_width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < ratio or value % ratio:
                raise ValueError(f"{name} must be a positive multiple of {ratio} pixels, got {value!r}")
        self.use_tiling = True
        self.tile_sample_min_height, self.tile_sample_min_width = height, width

    def _decode_tiled(self, latents: torch.Tensor, is_first_chunk: bool) -> torch.Tensor:
        """One temporal window decoded tile by tile with a halo, each tile's core written into the output."""
        ratio = self.config.spatial_compression_ratio
        tile_h, tile_w = self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio
        height, width = latents.shape[-2:]
        if height <= tile_h and width <= tile_w:
            return self.decoder(latents, is_first_chunk=is_first_chunk)
        halo = math.ceil(self.spatial_receptive_radius())
        video = None
        for top in range(0, height, tile_h):
            for left in range(0, width, tile_w):
                bottom, right = min(top + tile_h, height), min(left + tile_w, width)
                y0, x0 = max(top - halo, 0), max(left - halo, 0)
                tile = self.decoder(
                    latents[..., y0 : min(bottom + halo, height), x0 : min(right + halo, width)],
                    is_first_chunk=is_first_chunk,
                )
                if video is None:
                    video = tile.new_empty(*tile.shape[:3], height * ratio, width * ratio)
                core = tile[
                    ..., (top - y0) * ratio : (bottom - y0) * ratio, (left - x0) * ratio : (right - x0) * ratio
                ]
                video[..., top * ratio : bottom * ratio, left * ratio : right * ratio] = core
        return video

    def denormalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents / (1 / std) + mean`` with fp32 tables, in ``latents.dtype`` (SandAI ``_sliding_window_decode``)."""
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=latents.device)
        inv_std = 1.0 / torch.tensor(self.config.latents_std, dtype=torch.float32, device=latents.device)
        shape = (1, -1, 1, 1, 1)
        return (latents / inv_std.view(shape) + mean.view(shape)).to(latents.dtype)

    def plan_windows(self, num_latent_frames: int) -> Tuple[int, list]:
        """``(num_padding_frames, windows)``: latents padded to ``first_chunk_size + n * step_size`` frames, windows
        ``[0, first+1)``, ``[i-1, i+step+1)``, ..., ``[i-1, T)``, each trimmed by one latent frame of overlap.

        Raises:
            ValueError: ``num_latent_frames < 1``.
        """
        if num_latent_frames < 1:
            raise ValueError(f"need at least one latent frame, got {num_latent_frames}")
        first, step = self.config.first_chunk_size, self.config.step_size
        overlap = self.config.temporal_compression_ratio
        if num_latent_frames < first:
            padding = first - num_latent_frames
        else:
            padding = (-(num_latent_frames - first)) % step
        total = num_latent_frames + padding
        if total == first:
            return padding, [_WindowPlan(0, total, True, 0, 0)]
        windows = [_WindowPlan(0, first + 1, True, 0, overlap)]
        for i in range(first, total, step):
            last = i + step == total
            windows.append(
                _WindowPlan(i - 1, i + step if last else i + step + 1, False, overlap, 0 if last else overlap)
            )
        return padding, windows

    def _decode(self, latents: torch.Tensor, output_device: Optional[torch.device] = None) -> torch.Tensor:
        z = self.denormalize_latents(latents)
        padding, windows = self.plan_windows(z.shape[2])
        if padding:
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, padding, -1, -1)], dim=2)
        chunks = []
        for window in windows:
            window_latents = z[:, :, window.start : window.stop]
            if self.use_tiling:
                out = self._decode_tiled(window_latents, window.is_first_chunk)
            else:
                out = self.decoder(window_latents, is_first_chunk=window.is_first_chunk)
            out = out[:, :, window.trim_left : out.shape[2] - window.trim_right]
            chunks.append(out if output_device is None else out.to(output_device))
        video = torch.cat(chunks, dim=2)
        if padding:
            video = video[:, :, : video.shape[2] - padding * self.config.temporal_compression_ratio]
        return video

    @apply_forward_hook
    @torch.no_grad()
    def decode(
        self,
        latents: torch.Tensor,
        return_dict: bool = True,
        output_device: Optional[Union[str, torch.device]] = None,
    ) -> Union[DecoderOutput, Tuple[torch.Tensor]]:
        r"""Decode normalised video latents to pixels.

        Args:
            latents (`torch.Tensor`): ``[B, latent_channels, T_lat, h, w]`` normalised latents (cast to the model dtype).
            return_dict (`bool`): return a :class:`~diffusers.models.autoencoders.vae.DecoderOutput`.
            output_device: move each decoded window there (the reference's ``output_offload``).

        Returns:
            ``DecoderOutput(sample=video)`` (or ``(video,)``), ``[B, 3, 1 + 4 (T_lat - 1), 16 h, 16 w]`` in the
            model dtype, nominally in [-1, 1].

        Raises:
            ValueError: wrong rank or channel count.
        """
        if latents.ndim != 5 or latents.shape[1] != self.config.latent_channels:
            raise ValueError(
                f"latents must be [B, {self.config.latent_channels}, T, h, w], got {tuple(latents.shape)}"
            )
        latents = latents.to(device=self.device, dtype=self.dtype)
        video = self._decode(latents, torch.device(output_device) if output_device is not None else None)
        if not return_dict:
            return (video,)
        return DecoderOutput(sample=video)

    def forward(self, latents: torch.Tensor, return_dict: bool = True):
        """Same as :meth:`decode`."""
        return self.decode(latents, return_dict=return_dict)
