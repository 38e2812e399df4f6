"""Packing of both models' inputs into one token sequence, and back.

Preview (SandAI preview data proxy ``process_input``): each batch row is one attention segment::

    [ video T*H*W (raster) | audio La | text Lt (valid) | I2V: special token, image h*w at time T+2 ]

with 9-column rope coordinates, modality ids and a time embedding (``timestep / 1000`` on video and audio,
0 elsewhere). Refiner (SandAI ``refiner_data_proxy.py``): one sample at a time, video in window-block order,
then audio, then text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from .embeddings_magi2 import audio_coords, image_coords, magi2_timestep_embedding, text_coords, video_coords
from .modality import Modality


__all__ = [
    "Magi2PackedInputs",
    "Magi2PackedLayout",
    "Magi2RefinerPackedSample",
    "check_transformer_inputs",
    "pack_magi2_inputs",
    "pack_refiner_sample",
    "unpack_magi2_outputs",
    "unpack_refiner_sample",
]


@dataclass(frozen=True)
class Magi2PackedLayout:
    """What the packer checked about a packed sequence, as Python ints, so that the forward after packing reads
    nothing back to the host (``Magi2Transformer3DModel.forward_packed``'s ``layout``).

    Attributes:
        segment_lengths: tokens of each attention segment (batch row), in order.
        modality_runs: ``(modality id, tokens)`` of each run of one modality, in packed order (``TIME`` counted as
            ``TEXT``); they sum to the token count.
    """

    segment_lengths: tuple[int, ...]
    modality_runs: tuple[tuple[int, int], ...]

    def group_sizes(self, start: int = 0, stop: Optional[int] = None) -> tuple[int, int, int]:
        """Tokens of each modality (video, audio, text) among packed rows ``[start, stop)`` (all by default)."""
        counts, position = [0, 0, 0], 0
        stop = sum(self.segment_lengths) if stop is None else stop
        for modality, length in self.modality_runs:
            lo, hi = max(position, start), min(position + length, stop)
            counts[modality] += max(hi - lo, 0)
            position += length
        return tuple(counts)


@dataclass
class Magi2PackedInputs:
    """Packed model inputs (SandAI ``process_input``'s result).

    Attributes:
        hidden_states: ``[N, max(Cv, Ca, Ct)]`` fp32 tokens, zero-padded on channels.
        coords: ``[N, 9]`` fp32 rope coordinates.
        modality_mapping: ``[N]`` int32 :class:`Modality` ids.
        cu_seqlens: ``[B+1]`` int32 segment boundaries (one segment per batch row).
        time_embedding: ``[N, 64]`` fp32 per-token sinusoidal time embedding.
        video_shape: ``(T, H, W)``; audio_length: ``La``; token_offsets: start of each row.
        layout: the segment lengths and modality runs (:class:`Magi2PackedLayout`).
    """

    hidden_states: torch.Tensor
    coords: torch.Tensor
    modality_mapping: torch.Tensor
    cu_seqlens: torch.Tensor
    time_embedding: torch.Tensor
    video_shape: tuple
    audio_length: int
    token_offsets: List[int]
    layout: Magi2PackedLayout


def check_transformer_inputs(
    config: Any, hidden_states, encoder_hidden_states, audio_hidden_states, encoder_attention_mask
) -> None:
    """Check the batch inputs both models' ``forward`` take against ``config``'s widths: ``hidden_states``
    ``[B, Cv, T, H, W]`` (``T, H, W >= 1``), ``encoder_hidden_states`` ``[B, Lt, Ct]``, ``audio_hidden_states``
    ``[B, La, Ca]`` or ``None``, and ``encoder_attention_mask`` ``[B, Lt]`` or ``None``.

    Raises:
        ValueError: naming the first input of the wrong rank, channel count or batch size, a zero ``T``, ``H`` or
            ``W``, or a mask that is not ``[B, Lt]``.
    """
    cv, ca, ct = config.in_channels, config.audio_in_channels, config.text_in_channels
    if hidden_states.dim() != 5 or hidden_states.shape[1] != cv:
        raise ValueError(f"hidden_states must be [B, {cv}, T, H, W], got {tuple(hidden_states.shape)}")
    b, _, t, h, w = hidden_states.shape
    if min(t, h, w) < 1:
        raise ValueError(f"hidden_states needs T, H, W >= 1 (patch size 1), got {(t, h, w)}")
    text = encoder_hidden_states
    if text.dim() != 3 or text.shape[0] != b or text.shape[2] != ct:
        raise ValueError(f"encoder_hidden_states must be [B={b}, L_text, {ct}], got {tuple(text.shape)}")
    audio = audio_hidden_states
    if audio is not None and (audio.dim() != 3 or audio.shape[0] != b or audio.shape[2] != ca):
        raise ValueError(f"audio_hidden_states must be [B={b}, L_audio, {ca}], got {tuple(audio.shape)}")
    mask = encoder_attention_mask
    if mask is not None and tuple(mask.shape) != (b, text.shape[1]):
        raise ValueError(f"encoder_attention_mask must be [B={b}, L_text={text.shape[1]}], got {tuple(mask.shape)}")


def pack_magi2_inputs(
    config: Any,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    audio_hidden_states: torch.Tensor,
    encoder_attention_mask: Optional[torch.Tensor] = None,
    image_latents: Optional[torch.Tensor] = None,
    image_embeds: Optional[torch.Tensor] = None,
) -> Magi2PackedInputs:
    """Pack a preview batch (module docstring).

    Args:
        config: the model config (channel widths, ``time_embed_dim``).
        hidden_states, timestep, encoder_hidden_states, audio_hidden_states, encoder_attention_mask,
        image_latents, image_embeds: as in :meth:`Magi2Transformer3DModel.forward`.

    Returns:
        :class:`Magi2PackedInputs`.

    Raises:
        ValueError: no ``audio_hidden_states``; the checks of :func:`check_transformer_inputs`; a bad
            ``timestep``; a mask that is not a prefix of ones.
    """
    if audio_hidden_states is None:
        raise ValueError("audio_hidden_states is required by the Preview: [B, L_audio, Ca] (L_audio may be 0)")
    check_transformer_inputs(config, hidden_states, encoder_hidden_states, audio_hidden_states, encoder_attention_mask)
    cv, ca, ct = config.in_channels, config.audio_in_channels, config.text_in_channels
    b, _, t, h, w = hidden_states.shape
    timestep = torch.as_tensor(timestep, device=hidden_states.device)
    if timestep.dim() == 0:
        timestep = timestep.expand(b)
    if timestep.shape != (b,):
        raise ValueError(f"timestep must be a scalar or [B={b}], got {tuple(timestep.shape)}")
    lt_max = encoder_hidden_states.shape[1]
    if encoder_attention_mask is not None:
        mask = encoder_attention_mask.bool()
        lengths = mask.sum(dim=1)
        prefix = torch.arange(lt_max, device=mask.device)[None, :] < lengths[:, None]
        if not torch.equal(mask, prefix):
            raise ValueError(
                "encoder_attention_mask must mark a prefix of each row (valid tokens first, padding after)"
            )
        text_lengths = [int(v) for v in lengths.tolist()]
    else:
        text_lengths = [lt_max] * b
    if (image_latents is None) != (image_embeds is None):
        raise ValueError("image_latents and image_embeds must be given together (I2V) or both be None")
    if image_latents is not None:
        if (
            image_latents.dim() != 5
            or image_latents.shape[0] != b
            or image_latents.shape[1] != cv
            or image_latents.shape[2] != 1
        ):
            raise ValueError(f"image_latents must be [B={b}, {cv}, 1, h, w], got {tuple(image_latents.shape)}")
        if image_embeds.shape != (b, ct):
            raise ValueError(f"image_embeds must be [B={b}, {ct}], got {tuple(image_embeds.shape)}")
        hi, wi = image_latents.shape[3], image_latents.shape[4]
    la = audio_hidden_states.shape[1]
    dev = hidden_states.device
    width = max(cv, ca, ct)
    f32 = torch.float32

    def pad(x: torch.Tensor) -> torch.Tensor:
        x = x.to(f32)
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    feats, coords, mods, times, offsets, runs = [], [], [], [], [], []
    vc = video_coords(t, h, w, device=dev)
    ac = audio_coords(la, device=dev) if la > 0 else torch.zeros(0, 9, device=dev)
    t_norm = timestep.to(f32) / 1000.0
    total = 0
    for i in range(b):
        offsets.append(total)
        lt = text_lengths[i]
        parts = [
            (pad(hidden_states[i].permute(1, 2, 3, 0).reshape(t * h * w, cv)), vc, Modality.VIDEO, True),
            (pad(audio_hidden_states[i]), ac, Modality.AUDIO, True),
            (pad(encoder_hidden_states[i, :lt]), text_coords(lt, device=dev), Modality.TEXT, False),
        ]
        if image_latents is not None:
            ic = image_coords(t + 2, hi, wi, device=dev)
            parts.append((pad(image_embeds[i : i + 1]), ic[:1], Modality.TEXT, False))
            patches = image_latents[i, :, 0].permute(1, 2, 0).reshape(hi * wi, cv)
            parts.append((pad(patches), ic[1:], Modality.VIDEO, False))
        for feat, crd, mod, noisy in parts:
            n = feat.shape[0]
            feats.append(feat)
            coords.append(crd)
            mods.append(torch.full((n,), int(mod), dtype=torch.int32, device=dev))
            times.append(t_norm[i].expand(n) if noisy else torch.zeros(n, dtype=f32, device=dev))
            runs.append((int(mod), n))
            total += n
    cu = torch.tensor(offsets + [total], dtype=torch.int32, device=dev)
    time_t = torch.cat(times)
    return Magi2PackedInputs(
        hidden_states=torch.cat(feats),
        coords=torch.cat(coords),
        modality_mapping=torch.cat(mods),
        cu_seqlens=cu,
        time_embedding=magi2_timestep_embedding(time_t, config.time_embed_dim),
        video_shape=(t, h, w),
        audio_length=la,
        token_offsets=offsets,
        layout=Magi2PackedLayout(tuple(b - a for a, b in zip(offsets, offsets[1:] + [total])), tuple(runs)),
    )


def unpack_magi2_outputs(config: Any, packed_out: torch.Tensor, packed: Magi2PackedInputs):
    """``[N, max(Cv, Ca)]`` output of ``packed`` -> video ``[B, Cv, T, H, W]`` and audio ``[B, La, Ca]``."""
    t, h, w = packed.video_shape
    cv, ca = config.in_channels, config.audio_in_channels
    n_vid, la = t * h * w, packed.audio_length
    videos, audios = [], []
    for off in packed.token_offsets:
        videos.append(packed_out[off : off + n_vid, :cv].reshape(t, h, w, cv).permute(3, 0, 1, 2))
        audios.append(packed_out[off + n_vid : off + n_vid + la, :ca])
    return torch.stack(videos).contiguous(), torch.stack(audios).contiguous()


@dataclass
class Magi2RefinerPackedSample:
    """One refiner sample, packed.

    Attributes:
        tokens: ``(video [T*H*W, Cv], audio [La, Ca], text [Lt, Ct])`` fp32, packed (= modality-sorted) order.
        coords: ``[N, 9]`` fp32 rope coordinates, packed order.
        group_sizes: ``(T*H*W, La, Lt)``.
        restore: ``[T*H*W]`` packed position of each raster video token.
        video_shape: ``(T, H, W)``.
    """

    tokens: tuple
    coords: torch.Tensor
    group_sizes: tuple
    restore: torch.Tensor
    video_shape: tuple


def pack_refiner_sample(
    geometry: Any, video: torch.Tensor, audio: Optional[torch.Tensor], text: torch.Tensor
) -> Magi2RefinerPackedSample:
    """Pack one refiner sample.

    Args:
        geometry: the sample's :class:`~diffusers_magi2.models.window_attention.Magi2WindowGeometry`.
        video: ``[Cv, T, H, W]``; audio: ``[La, Ca]`` or ``None``; text: ``[Lt, Ct]`` (padding removed).
    """
    cv, t, h, w = video.shape
    dev = video.device
    order = geometry.video_token_order(dev)
    tokens = [video.reshape(cv, t * h * w).T.float().index_select(0, order)]
    coords = [video_coords(t, h, w, device=dev).index_select(0, order)]
    la = 0 if audio is None else audio.shape[0]
    tokens.append(audio.float() if audio is not None else video.new_zeros(0, 0, dtype=torch.float32))
    if la:
        coords.append(audio_coords(la, device=dev))
    lt = text.shape[0]
    tokens.append(text.float())
    if lt:
        coords.append(text_coords(lt, device=dev))
    return Magi2RefinerPackedSample(
        tuple(tokens), torch.cat(coords), (t * h * w, la, lt), geometry.video_restore_order(dev), (t, h, w)
    )


def unpack_refiner_sample(packed_out: torch.Tensor, sample: Magi2RefinerPackedSample, cv: int, ca: int):
    """``[N, max(Cv, Ca)]`` output of one packed sample -> (video ``[Cv, T, H, W]``, audio ``[La, Ca]``)."""
    nv, la, _ = sample.group_sizes
    video = packed_out[:nv, :cv].index_select(0, sample.restore).T.reshape(cv, *sample.video_shape)
    return video, packed_out[nv : nv + la, :ca]
