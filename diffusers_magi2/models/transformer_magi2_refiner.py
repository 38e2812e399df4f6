"""MAGI-2 1080p refiner: ``Magi2RefinerTransformer3DModel``.

SandAI's 1080p tier runs a second, dense 6.7B DiT (``inference/model/magi2_refiner.py``) over the
upsampled, re-noised preview latent (reference spec §1.12, §2.3, §5.7). Differences from the
preview transformer: one residual stream (no hyper-connections), no MoE, no attention sinks, no
timestep input, GQA (32 query / 8 kv heads), swiglu7 MLP of width ``int(4C*2/3)//4*4`` (10920), and
block-window attention in every layer (:mod:`diffusers_magi2.models.window_attention`).

Parameter names are SandAI's with the single rename ``block.layers.{i}.`` ->
``transformer_blocks.{i}.`` (281 tensors at full size: 280 parameters + the rope ``bands`` buffer).

Dtype policy (follows the reference's cast points; "compute dtype" = the dtype of the block
linears: bf16 in the released model, fp32 when the model is loaded fully in fp32):

* adapters, post-adapter, every RMSNorm weight and the rope table are fp32 (``_keep_in_fp32_modules``);
* the embedded tokens are cast to the compute dtype before layer 0;
* attention: ``pre_norm`` -> compute dtype -> ``linear_qkv`` / ``linear_g`` -> fp32; fp32 qk-norm and
  rope; q/k/v -> compute dtype for attention; ``out * sigmoid(g)`` (fp32) -> compute dtype ->
  ``linear_proj`` (compute-dtype output);
* MLP: ``pre_norm`` -> compute dtype -> ``up_gate_proj`` -> fp32 swiglu7 -> compute dtype ->
  ``down_proj`` -> **fp32** output, so the residual becomes fp32 from layer 0's MLP onwards.

Independent implementation; no reference code is copied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (diffusers' pipeline loader looks it up here)
from diffusers.utils import BaseOutput

from ..conversion.sandai_config_refiner import refiner_config_from_sandai  # noqa: F401  (re-exported for the converter)
from .embeddings_magi2 import Magi2RotaryPosEmbed, apply_magi2_rotary_emb
from .modeling_magi2 import Magi2ModelMixin
from .modality import (
    Magi2ModalityDispatch,
    Magi2ModalityGroupedLinear,
    Magi2MultiModalityRMSNorm,
    Modality,
    swiglu7_interleaved,
)
from .window_attention import (
    DEFAULT_MAX_DENSE_MASK_ELEMENTS,
    WINDOW_ATTENTION_BACKENDS,
    Magi2WindowGeometry,
    block_window_attention,
    ranges_to_dense_mask,
    resolve_window_backend,
)

__all__ = [
    "Magi2RefinerTransformer3DModel",
    "Magi2RefinerTransformerOutput",
    "Magi2RefinerTransformerBlock",
    "refiner_config_from_sandai",
    "refiner_mlp_intermediate_size",
    "refiner_state_dict_key_from_sandai",
    "sandai_state_dict_key_from_refiner",
]

#: Tokens per MLP chunk (same math as unchunked, up to GEMM row-blocking rounding; bounds the fp32
#: ``[N, 2I]`` intermediate).
DEFAULT_MLP_CHUNK_SIZE = 65536

_SANDAI_LAYER_PREFIX = "block.layers."
_DIFFUSERS_LAYER_PREFIX = "transformer_blocks."


def refiner_state_dict_key_from_sandai(key: str) -> str:
    """SandAI refiner key -> diffusers key: only ``block.layers.{i}.`` -> ``transformer_blocks.{i}.``."""
    if key.startswith(_SANDAI_LAYER_PREFIX):
        return _DIFFUSERS_LAYER_PREFIX + key[len(_SANDAI_LAYER_PREFIX):]
    return key


def sandai_state_dict_key_from_refiner(key: str) -> str:
    """Inverse of :func:`refiner_state_dict_key_from_sandai`."""
    if key.startswith(_DIFFUSERS_LAYER_PREFIX):
        return _SANDAI_LAYER_PREFIX + key[len(_DIFFUSERS_LAYER_PREFIX):]
    return key


def refiner_mlp_intermediate_size(hidden_size: int) -> int:
    """swiglu7 width of the refiner MLP: ``int(C * 4 * 2 / 3) // 4 * 4`` (4096 -> 10920).

    Matches the reference ``TransformerLayer`` rule (a multiple of 4, not 128 as in the preview).
    """
    return int(hidden_size * 4 * 2 / 3) // 4 * 4


@dataclass
class Magi2RefinerTransformerOutput(BaseOutput):
    """Output of :class:`Magi2RefinerTransformer3DModel`.

    Args:
        sample: ``[B, Cv, T, H, W]`` fp32 video velocity prediction.
        audio_sample: ``[B, La, Ca]`` fp32 audio prediction, or ``None`` when no audio tokens were given
            (the released pipeline runs the refiner without audio).
    """

    sample: torch.Tensor
    audio_sample: Optional[torch.Tensor] = None


# ----------------------------------------------------------------------------- modules


class Magi2RefinerPreAdapter(nn.Module):
    """Per-modality fp32 input embedders (Linear with bias) and the rope table.

    Keys: ``video_embedder``, ``audio_embedder``, ``text_embedder`` (``[C, C_in]`` + bias) and
    ``rope.bands`` (SandAI ``Adapter``).
    """

    def __init__(self, hidden_size: int, head_dim: int, video_in: int, audio_in: int, text_in: int) -> None:
        super().__init__()
        self.video_embedder = nn.Linear(video_in, hidden_size, bias=True)
        self.text_embedder = nn.Linear(text_in, hidden_size, bias=True)
        self.audio_embedder = nn.Linear(audio_in, hidden_size, bias=True)
        self.rope = Magi2RotaryPosEmbed(head_dim)


class Magi2RefinerAttention(nn.Module):
    """Gated GQA self-attention of one refiner layer (SandAI refiner ``Attention``), no sinks.

    Keys: ``pre_norm`` ``[M*C]``, ``linear_qkv`` ``[M*(Hq+2Hkv)*D, C]`` (rows q | k | v, head-major),
    ``linear_g`` ``[M*Hq, C]`` (if gating), ``linear_proj`` ``[M*C, Hq*D]``, ``q_norm``/``k_norm``
    ``[M*D]``; M = 3 in multimodal layers else 1.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, num_modality: int,
        gating: bool, eps: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.pre_norm = Magi2MultiModalityRMSNorm(hidden_size, num_modality=num_modality, eps=eps)
        self.linear_qkv = Magi2ModalityGroupedLinear(
            hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, num_modality=num_modality
        )
        if gating:
            self.linear_g = Magi2ModalityGroupedLinear(hidden_size, num_heads, num_modality=num_modality)
        else:
            self.linear_g = None
        self.linear_proj = Magi2ModalityGroupedLinear(num_heads * head_dim, hidden_size, num_modality=num_modality)
        self.q_norm = Magi2MultiModalityRMSNorm(head_dim, num_modality=num_modality, eps=eps, out_dtype=torch.float32)
        self.k_norm = Magi2MultiModalityRMSNorm(head_dim, num_modality=num_modality, eps=eps, out_dtype=torch.float32)

    def forward(self, hidden_states: torch.Tensor, ctx: "_PackedContext", window: bool) -> torch.Tensor:
        """``hidden_states`` ``[N, C]`` (modality-sorted) -> ``[N, C]`` in the compute dtype."""
        gs = ctx.group_sizes
        cdt = self.linear_qkv.weight.dtype
        n = hidden_states.shape[0]
        x = self.pre_norm(hidden_states, gs).to(cdt)
        qkv = self.linear_qkv(x, gs, out_dtype=torch.float32)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim), gs)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim), gs)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k, v = ctx.unsort(q), ctx.unsort(k), ctx.unsort(v)
        q = apply_magi2_rotary_emb(q, ctx.rope).to(cdt)
        k = apply_magi2_rotary_emb(k, ctx.rope).to(cdt)
        v = v.to(cdt)
        if window and ctx.dense_mask is not None:
            out = block_window_attention(q, k, v, None, dense_mask=ctx.dense_mask, backend="sdpa")
        elif window:
            out = block_window_attention(
                q, k, v, ctx.geometry, backend=ctx.backend, block_mask=ctx.block_mask,
                max_dense_elements=ctx.max_dense_elements,
            )
        else:
            out = block_window_attention(q, k, v, None)
        out = ctx.sort(out)
        if self.linear_g is not None:
            g = self.linear_g(x, gs, out_dtype=torch.float32)
            out = out * torch.sigmoid(g).unsqueeze(-1)
        out = out.reshape(n, q_size).to(cdt)
        return self.linear_proj(out, gs, out_dtype=cdt)


class Magi2RefinerMLP(nn.Module):
    """Dense swiglu7 MLP (SandAI refiner ``MLP``); keys ``pre_norm``, ``up_gate_proj`` ``[M*2I, C]``
    (interleaved gate/linear rows), ``down_proj`` ``[M*C, I]``. Output fp32."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_modality: int, eps: float) -> None:
        super().__init__()
        self.pre_norm = Magi2MultiModalityRMSNorm(hidden_size, num_modality=num_modality, eps=eps)
        self.up_gate_proj = Magi2ModalityGroupedLinear(hidden_size, 2 * intermediate_size, num_modality=num_modality)
        self.down_proj = Magi2ModalityGroupedLinear(intermediate_size, hidden_size, num_modality=num_modality)

    def _forward_tokens(self, hidden_states: torch.Tensor, group_sizes: Sequence[int]) -> torch.Tensor:
        cdt = self.up_gate_proj.weight.dtype
        x = self.pre_norm(hidden_states, group_sizes).to(cdt)
        x = self.up_gate_proj(x, group_sizes, out_dtype=torch.float32)
        x = swiglu7_interleaved(x, out_dtype=cdt)
        return self.down_proj(x, group_sizes, out_dtype=torch.float32)

    def forward(
        self, hidden_states: torch.Tensor, group_sizes: Sequence[int], chunk_size: Optional[int] = None
    ) -> torch.Tensor:
        """``[N, C]`` modality-sorted -> ``[N, C]`` fp32.

        Every op is per token, so with ``chunk_size`` the tokens are processed ``chunk_size`` at a
        time (same math, up to GEMM rounding; bounds the ``[N, 2I]`` fp32 intermediate, 45 GB at 1080p
        unchunked).
        """
        n = hidden_states.shape[0]
        if chunk_size is None or n <= chunk_size:
            return self._forward_tokens(hidden_states, group_sizes)
        starts = [0]
        for g in group_sizes:
            starts.append(starts[-1] + int(g))
        out = []
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            gs = tuple(max(0, min(b, starts[m + 1]) - max(a, starts[m])) for m in range(len(group_sizes)))
            out.append(self._forward_tokens(hidden_states[a:b], gs))
        return torch.cat(out, dim=0)


class Magi2RefinerTransformerBlock(nn.Module):
    """One refiner layer: ``h = h + attention(h); h = h + mlp(h)`` (no post-norms, no mHC)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
        num_modality: int, gating: bool, window: bool, eps: float,
    ) -> None:
        super().__init__()
        self.window = window
        self.attention = Magi2RefinerAttention(
            hidden_size, num_heads, num_kv_heads, head_dim, num_modality, gating, eps
        )
        self.mlp = Magi2RefinerMLP(hidden_size, intermediate_size, num_modality, eps)

    def forward(self, hidden_states: torch.Tensor, ctx: "_PackedContext") -> torch.Tensor:
        """``hidden_states`` ``[N, C]`` modality-sorted; returns ``[N, C]`` (fp32 after layer 0's MLP)."""
        hidden_states = hidden_states + self.attention(hidden_states, ctx, self.window)
        hidden_states = hidden_states + self.mlp(hidden_states, ctx.group_sizes, ctx.mlp_chunk_size)
        return hidden_states


class Magi2RefinerPostAdapter(nn.Module):
    """Per-modality final RMSNorm (1 + w, fp32) and fp32 Linear without bias to the latent channels."""

    def __init__(self, hidden_size: int, video_in: int, audio_in: int, eps: float) -> None:
        super().__init__()
        self.final_norm_video = Magi2MultiModalityRMSNorm(hidden_size, eps=eps)
        self.final_norm_audio = Magi2MultiModalityRMSNorm(hidden_size, eps=eps)
        self.final_linear_video = nn.Linear(hidden_size, video_in, bias=False)
        self.final_linear_audio = nn.Linear(hidden_size, audio_in, bias=False)


@dataclass
class _PackedContext:
    """Per-forward state shared by the layers (tokens are processed in modality-sorted order)."""

    group_sizes: tuple[int, ...]
    rope: torch.Tensor  # [N, 6B] fp32, packed order
    perm: Optional[torch.Tensor]  # packed -> sorted (None = identity)
    inv_perm: Optional[torch.Tensor]
    geometry: Optional[Magi2WindowGeometry]
    dense_mask: Optional[torch.Tensor]
    backend: str
    max_dense_elements: int
    mlp_chunk_size: Optional[int] = None
    block_mask: Any = None  # flex BlockMask, built once per forward

    def sort(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else x.index_select(0, self.perm)

    def unsort(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.inv_perm is None else x.index_select(0, self.inv_perm)


# ----------------------------------------------------------------------------- model


class Magi2RefinerTransformer3DModel(Magi2ModelMixin, ConfigMixin):
    r"""MAGI-2 1080p refiner DiT (SandAI ``magi2_refiner.Transformer``) as a diffusers model.

    Config defaults are the released refiner (``configs/magi2_refiner.json``): 30 layers, width 4096
    (32 x 128 query heads, 8 kv heads), in-channels 48 / 64 / 5120, multimodal layers 0, 1, 28, 29,
    gated attention, block-window attention in all layers with 8 x 4 x 4 blocks and radius 2.

    Args:
        num_layers: transformer layers.
        num_attention_heads: query heads ``Hq``; hidden size ``C = Hq * attention_head_dim``.
        attention_head_dim: head dim ``D`` (multiple of 8; ``6 * D/8`` dims carry rope).
        num_key_value_heads: kv heads (``Hq % Hkv == 0``).
        in_channels, audio_in_channels, text_in_channels: latent / audio-latent / text-feature widths.
        multimodal_layers: layers whose norms and linears have one block per modality (video, audio, text).
        window_attention_layers: layers using block-window attention; ``None`` = all (released);
            other layers attend densely within the sample.
        window_block_size: ``(bt, bh, bw)`` window block size in latent positions.
        window_radius: ``(rt, rh, rw)`` block radius per axis.
        attention_gating: per-head sigmoid output gate (``linear_g``).
        mlp_intermediate_size: swiglu7 width; ``None`` -> :func:`refiner_mlp_intermediate_size`.
        norm_eps: RMSNorm epsilon.
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["Magi2RefinerTransformerBlock"]
    _repeated_blocks = ["Magi2RefinerTransformerBlock"]
    _keep_in_fp32_modules = ["pre_adapter", "post_adapter", "pre_norm", "q_norm", "k_norm"]
    _skip_layerwise_casting_patterns = ["pre_adapter", "post_adapter", "norm"]
    #: ``attention_kwargs`` keys :meth:`forward` / :meth:`forward_packed` understand; any other key raises.
    supported_attention_kwargs: tuple = ("window_backend", "max_dense_mask_elements", "mlp_chunk_size")

    @register_to_config
    def __init__(
        self,
        num_layers: int = 30,
        num_attention_heads: int = 32,
        attention_head_dim: int = 128,
        num_key_value_heads: int = 8,
        in_channels: int = 48,
        audio_in_channels: int = 64,
        text_in_channels: int = 5120,
        multimodal_layers: Sequence[int] = (0, 1, 28, 29),
        window_attention_layers: Optional[Sequence[int]] = None,
        window_block_size: Sequence[int] = (8, 4, 4),
        window_radius: Sequence[int] = (2, 2, 2),
        attention_gating: bool = True,
        mlp_intermediate_size: Optional[int] = None,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_layers < 1 or num_attention_heads < 1 or num_key_value_heads < 1:
            raise ValueError("num_layers, num_attention_heads and num_key_value_heads must be >= 1")
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({num_key_value_heads})"
            )
        if attention_head_dim % 8:
            raise ValueError(f"attention_head_dim must be a multiple of 8, got {attention_head_dim}")
        for name, layers in (("multimodal_layers", multimodal_layers), ("window_attention_layers", window_attention_layers)):
            if layers is not None and any(not 0 <= int(i) < num_layers for i in layers):
                raise ValueError(f"{name} must hold layer indices in [0, {num_layers}), got {list(layers)}")
        # validate window geometry early (raises ValueError on bad values)
        Magi2WindowGeometry((1, 1, 1), tuple(window_block_size), tuple(window_radius))

        hidden = num_attention_heads * attention_head_dim
        inter = mlp_intermediate_size if mlp_intermediate_size is not None else refiner_mlp_intermediate_size(hidden)
        mm = {int(i) for i in multimodal_layers}
        win = set(range(num_layers)) if window_attention_layers is None else {int(i) for i in window_attention_layers}

        self.pre_adapter = Magi2RefinerPreAdapter(hidden, attention_head_dim, in_channels, audio_in_channels, text_in_channels)
        self.transformer_blocks = nn.ModuleList(
            [
                Magi2RefinerTransformerBlock(
                    hidden, num_attention_heads, num_key_value_heads, attention_head_dim, inter,
                    3 if i in mm else 1, attention_gating, i in win, norm_eps,
                )
                for i in range(num_layers)
            ]
        )
        self.post_adapter = Magi2RefinerPostAdapter(hidden, in_channels, audio_in_channels, norm_eps)
        self.gradient_checkpointing = False

    # ------------------------------------------------------------------ helpers
    @property
    def hidden_size(self) -> int:
        """``num_attention_heads * attention_head_dim``."""
        return self.config.num_attention_heads * self.config.attention_head_dim

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the block linears (the reference's ``params_dtype``: bf16 released, fp32 for checks)."""
        return self.transformer_blocks[0].attention.linear_qkv.weight.dtype

    def window_geometry(self, num_frames: int, height: int, width: int, num_context_tokens: int) -> Magi2WindowGeometry:
        """Window geometry of one sample from this model's config (block sizes, radii)."""
        return Magi2WindowGeometry(
            (num_frames, height, width), tuple(self.config.window_block_size), tuple(self.config.window_radius),
            num_context_tokens,
        )

    @staticmethod
    def _parse_attention_kwargs(attention_kwargs: Optional[dict]) -> tuple[str, int, Optional[int]]:
        """``(window_backend, max_dense_mask_elements, mlp_chunk_size)`` from ``attention_kwargs``.

        Raises:
            ValueError: not a dict/``None``, a key outside :attr:`supported_attention_kwargs`, an unknown
                window backend, or a bad ``mlp_chunk_size``.
        """
        if attention_kwargs is not None and not isinstance(attention_kwargs, dict):
            raise ValueError(f"attention_kwargs must be a dict or None, got {type(attention_kwargs).__name__}")
        kw = dict(attention_kwargs or {})
        backend = kw.pop("window_backend", "auto")
        max_dense = int(kw.pop("max_dense_mask_elements", DEFAULT_MAX_DENSE_MASK_ELEMENTS))
        chunk = kw.pop("mlp_chunk_size", DEFAULT_MLP_CHUNK_SIZE)
        if kw:
            raise ValueError(
                f"unsupported attention_kwargs {sorted(kw)}; allowed: 'window_backend' "
                f"{WINDOW_ATTENTION_BACKENDS}, 'max_dense_mask_elements', 'mlp_chunk_size'"
            )
        if backend not in WINDOW_ATTENTION_BACKENDS:
            raise ValueError(f"window_backend must be one of {WINDOW_ATTENTION_BACKENDS}, got {backend!r}")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"mlp_chunk_size must be a positive int or None, got {chunk!r}")
        return backend, max_dense, chunk

    def _run(
        self,
        embedded: torch.Tensor,
        rope: torch.Tensor,
        modality_ids: torch.Tensor,
        group_sizes_sorted: Optional[tuple[int, ...]],
        geometry: Optional[Magi2WindowGeometry],
        dense_mask: Optional[torch.Tensor],
        backend: str,
        max_dense: int,
        mlp_chunk_size: Optional[int] = DEFAULT_MLP_CHUNK_SIZE,
    ) -> torch.Tensor:
        """Blocks + post adapter on one packed sample. ``embedded`` ``[N, C]`` fp32 in packed order.

        Returns ``[N, max(Cv, Ca)]`` fp32 in packed order (video rows in ``[:Cv]``, audio rows in
        ``[:Ca]``, text rows zero).
        """
        if group_sizes_sorted is not None:
            perm = inv = None
            group_sizes = group_sizes_sorted
        else:
            dispatch = Magi2ModalityDispatch.from_modality_mapping(modality_ids)
            perm, inv, group_sizes = dispatch.permutation, dispatch.inverse_permutation, dispatch.group_sizes
        block_mask = None
        if geometry is not None and dense_mask is None:
            # resolve "auto" once and build the mask once per forward (not once per layer)
            backend = resolve_window_backend(backend, embedded.device, geometry.num_tokens, max_dense)
            if backend == "sdpa":
                dense_mask = geometry.dense_mask(embedded.device, max_elements=max_dense)
            elif backend == "flex":
                block_mask = self._cached_block_mask(geometry, embedded.device)
        ctx = _PackedContext(
            group_sizes, rope, perm, inv, geometry, dense_mask, backend, max_dense, mlp_chunk_size, block_mask
        )
        h = ctx.sort(embedded).to(self.compute_dtype)
        for block in self.transformer_blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                h = self._gradient_checkpointing_func(block, h, ctx)
            else:
                h = block(h, ctx)
        h = ctx.unsort(h).float()
        cv, ca = self.config.in_channels, self.config.audio_in_channels
        out = torch.zeros(h.shape[0], max(cv, ca), dtype=torch.float32, device=h.device)
        pa = self.post_adapter
        vmask = modality_ids == int(Modality.VIDEO)
        amask = modality_ids == int(Modality.AUDIO)
        out[vmask, :cv] = pa.final_linear_video(pa.final_norm_video(h[vmask]))
        if bool(amask.any()):
            out[amask, :ca] = pa.final_linear_audio(pa.final_norm_audio(h[amask]))
        return out

    def _cached_block_mask(self, geometry: Magi2WindowGeometry, device: torch.device):
        """flex ``BlockMask`` for ``geometry`` on ``device``, cached (cond and uncond geometries differ
        only in their text length; the 5-step refiner stage reuses both 5 times)."""
        cache = self.__dict__.setdefault("_block_mask_cache", {})
        key = (geometry, str(device))
        if key not in cache:
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[key] = geometry.flex_block_mask(device)
        return cache[key]

    # --------------------------------------------------------------- packed entry
    def forward_packed(
        self,
        x: torch.Tensor,
        coords_mapping: torch.Tensor,
        modality_mapping: torch.Tensor,
        *,
        window_geometry: Optional[Magi2WindowGeometry] = None,
        q_ranges: Optional[torch.Tensor] = None,
        k_ranges: Optional[torch.Tensor] = None,
        attention_kwargs: Optional[dict] = None,
    ) -> torch.Tensor:
        """Packed entry equal to the reference ``Transformer.forward`` for one sample (batch 1).

        Args:
            x: ``[N, C_max]`` packed tokens, each zero-padded on channels; a token of modality m uses
                its first ``C_m`` channels. Video tokens already in block order.
            coords_mapping: ``[N, 9]`` (t, h, w, T, H, W, refT, refH, refW).
            modality_mapping: ``[N]`` integer :class:`Modality` ids (0 video, 1 audio, 2 text).
            window_geometry: the block-window geometry (video tokens first, in block order, then
                ``num_context_tokens`` others); or
            q_ranges, k_ranges: the reference's ``local_attn_handler`` ranges (``[P, 2]``), turned into
                a dense mask (small inputs only). With neither, attention is dense over the sample.
            attention_kwargs: ``{"window_backend": ..., "max_dense_mask_elements": ..., "mlp_chunk_size": ...}``.

        Returns:
            ``[N, max(Cv, Ca)]`` fp32 (reference ``x_out``).

        Raises:
            ValueError: inconsistent shapes, unknown modality ids, both a geometry and ranges given.
        """
        backend, max_dense, chunk = self._parse_attention_kwargs(attention_kwargs)
        if x.dim() != 2 or coords_mapping.shape != (x.shape[0], 9) or modality_mapping.shape != (x.shape[0],):
            raise ValueError(
                f"expected x [N, C], coords_mapping [N, 9], modality_mapping [N]; got {tuple(x.shape)}, "
                f"{tuple(coords_mapping.shape)}, {tuple(modality_mapping.shape)}"
            )
        ids = modality_mapping.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > 2):
            raise ValueError("modality_mapping must hold 0 (video), 1 (audio) or 2 (text)")
        cfg = self.config
        counts = tuple(int(c) for c in torch.bincount(ids, minlength=3).tolist())  # tokens per modality
        need = max(
            cfg.in_channels if counts[0] else 0,
            cfg.audio_in_channels if counts[1] else 0,
            cfg.text_in_channels if counts[2] else 0,
        )
        if x.shape[1] < need:
            raise ValueError(f"x has {x.shape[1]} channels, the present modalities need {need}")
        if window_geometry is not None and (q_ranges is not None or k_ranges is not None):
            raise ValueError("pass either window_geometry or q_ranges/k_ranges, not both")
        dense_mask = None
        if q_ranges is not None or k_ranges is not None:
            if q_ranges is None or k_ranges is None:
                raise ValueError("q_ranges and k_ranges must be given together")
            dense_mask = ranges_to_dense_mask(q_ranges.cpu(), k_ranges.cpu(), x.shape[0], max_dense).to(x.device)
            if backend not in ("auto", "sdpa"):
                raise ValueError("explicit q/k ranges are evaluated with the 'sdpa' backend only")
        pa = self.pre_adapter
        x = x.float()
        emb = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        for mid, lin, c in ((2, pa.text_embedder, cfg.text_in_channels), (1, pa.audio_embedder, cfg.audio_in_channels),
                            (0, pa.video_embedder, cfg.in_channels)):
            if counts[mid]:
                m = ids == mid
                emb[m] = lin(x[m, :c])
        rope = pa.rope(coords_mapping)
        sorted_ok = ids.numel() < 2 or bool((ids[1:] >= ids[:-1]).all())
        gs = counts if sorted_ok else None
        return self._run(emb, rope, ids, gs, window_geometry, dense_mask, backend, max_dense, chunk)

    # ------------------------------------------------------------ diffusers entry
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_hidden_states: Optional[torch.Tensor] = None,
        encoder_attention_mask: Optional[torch.Tensor] = None,
        attention_kwargs: Optional[dict[str, Any]] = None,
        return_dict: bool = True,
    ) -> Union[Magi2RefinerTransformerOutput, tuple]:
        """Refine a batch of video latents (velocity prediction; the refiner takes no timestep).

        Each sample is packed as the reference refiner data proxy does (spec §5.7): video tokens in
        block order (``window_block_size`` blocks), then audio tokens, then the sample's valid text
        tokens; coordinates per spec §1.3; block-window attention from the config; outputs restored
        to raster order.

        Args:
            hidden_states: ``[B, Cv, T, H, W]`` video latent (any float dtype; fp32 math at the adapters).
            encoder_hidden_states: ``[B, Lt, Ct]`` text features.
            audio_hidden_states: ``[B, La, Ca]`` audio latent, or ``None`` (released pipeline: no
                audio tokens). ``La`` may be 0.
            encoder_attention_mask: ``[B, Lt]`` bool/0-1, True = real text token (padding is dropped,
                not attended); ``None`` = all tokens valid.
            attention_kwargs: optional ``{"window_backend": "auto"|"sdpa"|"flex"|"gather",
                "max_dense_mask_elements": int, "mlp_chunk_size": int | None}`` (see
                :func:`~diffusers_magi2.models.window_attention.block_window_attention`; MLP token chunk,
                default 65,536).
            return_dict: return :class:`Magi2RefinerTransformerOutput` (else a tuple).

        Returns:
            ``sample`` ``[B, Cv, T, H, W]`` fp32 and ``audio_sample`` ``[B, La, Ca]`` fp32 or ``None``.

        Raises:
            ValueError: wrong ranks, channel counts, batch sizes or mask shape; an ``attention_kwargs``
                key other than :attr:`supported_attention_kwargs` or a bad value for one.
        """
        backend, max_dense, chunk = self._parse_attention_kwargs(attention_kwargs)
        cfg = self.config
        if hidden_states.dim() != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {cfg.in_channels}, T, H, W], got {tuple(hidden_states.shape)}"
            )
        B, _, T, H, W = hidden_states.shape
        if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[0] != B or encoder_hidden_states.shape[2] != cfg.text_in_channels:
            raise ValueError(
                f"encoder_hidden_states must be [{B}, Lt, {cfg.text_in_channels}], got {tuple(encoder_hidden_states.shape)}"
            )
        if audio_hidden_states is not None and (
            audio_hidden_states.dim() != 3 or audio_hidden_states.shape[0] != B
            or audio_hidden_states.shape[2] != cfg.audio_in_channels
        ):
            raise ValueError(
                f"audio_hidden_states must be [{B}, La, {cfg.audio_in_channels}], got {tuple(audio_hidden_states.shape)}"
            )
        Lt = encoder_hidden_states.shape[1]
        if encoder_attention_mask is not None and tuple(encoder_attention_mask.shape) != (B, Lt):
            raise ValueError(f"encoder_attention_mask must be [{B}, {Lt}], got {tuple(encoder_attention_mask.shape)}")

        from .embeddings_magi2 import audio_coords, text_coords, video_coords

        device = hidden_states.device
        pa = self.pre_adapter
        La = 0 if audio_hidden_states is None else audio_hidden_states.shape[1]
        nv = T * H * W
        video_out, audio_out = [], []
        for b in range(B):
            text = encoder_hidden_states[b]
            if encoder_attention_mask is not None:
                text = text[encoder_attention_mask[b].to(torch.bool)]
            lt = text.shape[0]
            geom = self.window_geometry(T, H, W, La + lt)
            order = geom.video_token_order(device)
            vid = hidden_states[b].reshape(cfg.in_channels, nv).T.float().index_select(0, order)
            parts = [pa.video_embedder(vid)]
            coords = [video_coords(T, H, W, device=device).index_select(0, order)]
            if La:
                parts.append(pa.audio_embedder(audio_hidden_states[b].float()))
                coords.append(audio_coords(La, device=device))
            if lt:
                parts.append(pa.text_embedder(text.float()))
                coords.append(text_coords(lt, device=device))
            emb = torch.cat(parts, dim=0)
            rope = pa.rope(torch.cat(coords, dim=0))
            ids = torch.cat(
                [torch.full((nv,), 0), torch.full((La,), 1), torch.full((lt,), 2)]
            ).to(device)
            out = self._run(emb, rope, ids, (nv, La, lt), geom, None, backend, max_dense, chunk)
            restore = geom.video_restore_order(device)
            video_out.append(out[:nv, : cfg.in_channels].index_select(0, restore).T.reshape(cfg.in_channels, T, H, W))
            if audio_hidden_states is not None:
                audio_out.append(out[nv : nv + La, : cfg.audio_in_channels])
        sample = torch.stack(video_out)
        audio_sample = torch.stack(audio_out) if audio_hidden_states is not None else None
        if not return_dict:
            return (sample, audio_sample)
        return Magi2RefinerTransformerOutput(sample=sample, audio_sample=audio_sample)

    # ------------------------------------------------------------ original checkpoint
    @classmethod
    def from_original_checkpoint(
        cls,
        refiner_dir: Union[str, os.PathLike],
        config: Optional[Union[dict, str, os.PathLike]] = None,
        *,
        torch_dtype: Optional[torch.dtype] = None,
        device: Union[str, torch.device] = "cpu",
    ) -> "Magi2RefinerTransformer3DModel":
        """Build the refiner from a SandAI ``refiner/`` checkpoint folder (safetensors shards + index).

        Runs the converter's validated key plan in memory (the same checks and the same rename
        ``block.layers.{i}.`` -> ``transformer_blocks.{i}.`` as ``magi2-convert``), then a strict load.

        Args:
            refiner_dir: folder with ``model.safetensors.index.json`` and its shards.
            config: SandAI config dict or JSON path (``extends`` is resolved); default: the
                ``magi2_*.json`` beside the shards, else the bundled released ``magi2_refiner.json``
                (the released refiner folder ships no config).
            torch_dtype: dtype of the block linears; ``None`` = the config's ``params_dtype``
                (bf16, the released setting). ``torch.float32`` gives the all-fp32 model for exact
                checks. The fp32 islands (adapters, norms, rope) always load as fp32.
            device: where the weights are placed.

        Returns:
            the model in eval mode.

        Raises:
            ValueError: every missing/unexpected key, shape or dtype mismatch and index fault, listed
                together (``CheckpointValidationError``); a config without the refiner sections.
        """
        from ..conversion.convert_transformer import load_original_checkpoint
        from ..conversion.sandai_config import load_sandai_config, released_config_path

        refiner_dir = Path(refiner_dir)
        if config is None:
            try:
                cfg = load_sandai_config(refiner_dir)
            except ValueError:
                cfg = load_sandai_config(released_config_path("magi2_refiner.json"))
        elif isinstance(config, dict):
            cfg = config
        else:
            cfg = load_sandai_config(config)
        if torch_dtype is None:
            name = str(cfg.get("magi2_refiner_arch_config", {}).get("params_dtype", "bfloat16")).replace("torch.", "")
            if name not in ("bfloat16", "float16", "float32"):
                raise ValueError(f"unsupported params_dtype {name!r} in the SandAI refiner config")
            torch_dtype = getattr(torch, name)
        model = load_original_checkpoint(cls, refiner_dir, cfg, component="refiner", dtype=torch_dtype)
        return model.to(device).eval()
