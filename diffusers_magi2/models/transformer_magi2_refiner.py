"""MAGI-2 1080p refiner (SandAI ``magi2_refiner.py``): a dense DiT over the upsampled, re-noised preview latent.

Per layer ``h = h + attention(h); h = h + mlp(h)``: one residual stream, no MoE, no sinks, no timestep, GQA,
a swiglu7 MLP of width ``int(4C * 2/3) // 4 * 4``, block-window attention in the window layers. Parameter names
are SandAI's with ``block.layers.{i}.`` -> ``transformer_blocks.{i}.``. Adapters, norms and rope are fp32
islands; attention runs in the compute dtype with an fp32 gate; the MLP returns fp32, so the residual is fp32
from layer 0's MLP on.

Token-chunked layers (:meth:`Magi2RefinerTransformer3DModel.enable_forward_chunking`). Only attention mixes tokens,
and only through its keys and values, so a layer can run its query rows ``Q_c`` a chunk at a time::

    q, k, v, g = project(h)                     # every row, computed chunk by chunk
    for each chunk c:  a_c = h_c + proj(attend(q_c, k, v) * sigmoid(g_c));  out_c = a_c + mlp(a_c)

Sequence-wide stay the layer's input ``h`` and output (the residual, ``[N, C]``, fp32 after layer 0), ``q``
(``[N, Hq*D]``), ``k`` and ``v`` (``[N, Hkv*D]``, compute dtype) and the gate logits ``[N, Hq]``; every other
activation (the attention output, the MLP's ``[Q_c, 2I]`` intermediate, norms, rope) has the chunk's rows. Chunks
of the window layers start and end on window-block borders. The same rows meet the same math, so chunked equals
whole up to how a GEMM rounds a row for a given number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (diffusers' pipeline loader looks it up here)
from diffusers.utils import BaseOutput

from .adapters_magi2 import Magi2PostAdapter, Magi2PreAdapter
from .attention_magi2 import (
    Magi2Attention,
    Magi2AttentionGeometry,
    Magi2AttentionMask,
    Magi2AttnProcessor,
    Magi2ForwardContext,
    Magi2WindowAttnProcessor,
)
from .cache_magi2 import register_block_for_caching_hooks
from .embeddings_magi2 import check_rope_coords
from .feedforward_magi2 import Magi2FeedForward, check_chunk_size
from .fp8_storage_magi2 import check_dense_storage_dtype
from .lora_magi2 import lora_scale_from_attention_kwargs
from .modality import Magi2ModalityDispatch, Modality, chunk_group_sizes
from .modeling_magi2 import Magi2TransformerBase
from .packing_magi2 import check_transformer_inputs, pack_refiner_sample, unpack_refiner_sample
from .window_attention import DEFAULT_MAX_DENSE_MASK_ELEMENTS, Magi2WindowGeometry, ranges_to_dense_mask


__all__ = [
    "Magi2RefinerTransformer3DModel",
    "Magi2RefinerTransformerOutput",
    "Magi2RefinerTransformerBlock",
    "refiner_mlp_intermediate_size",
]

#: Tokens per MLP chunk by default (bounds the fp32 ``[N, 2I]`` intermediate, 45 GB at 1080p unchunked).
DEFAULT_MLP_CHUNK_SIZE = 65536


def refiner_mlp_intermediate_size(hidden_size: int) -> int:
    """swiglu7 width of the refiner MLP, ``int(C * 4 * 2 / 3) // 4 * 4`` (SandAI ``TransformerLayer``)."""
    return int(hidden_size * 4 * 2 / 3) // 4 * 4


@dataclass
class Magi2RefinerTransformerOutput(BaseOutput):
    """Output of :class:`Magi2RefinerTransformer3DModel`: ``sample`` ``[B, Cv, T, H, W]`` and ``audio_sample``
    ``[B, La, Ca]`` (or ``None`` without audio tokens), fp32."""

    sample: torch.Tensor
    audio_sample: Optional[torch.Tensor] = None


class Magi2RefinerTransformerBlock(nn.Module):
    """One refiner layer; window layers get a :class:`Magi2WindowAttnProcessor`, the others dense attention.

    Args:
        geometry: the model's attention heads (width ``C``; no sinks).
        intermediate_size: swiglu7 width of the MLP.
        num_modality: 3 for a multimodal layer, else 1.
        attention_gating: per-head sigmoid output gate, applied in fp32.
        window: block-window attention (else dense within the sample).
        eps: RMSNorm epsilon.
    """

    def __init__(
        self,
        geometry: Magi2AttentionGeometry,
        intermediate_size: int,
        num_modality: int,
        attention_gating: bool,
        window: bool,
        eps: float,
    ) -> None:
        super().__init__()
        processor = Magi2WindowAttnProcessor() if window else Magi2AttnProcessor(upcast_off_cuda=False)
        self.attention = Magi2Attention.from_geometry(
            geometry, num_modality, gated=attention_gating, gate_in_fp32=True, eps=eps, processor=processor
        )
        self.mlp = Magi2FeedForward(
            geometry.hidden_size,
            intermediate_size,
            num_modality,
            eps=eps,
            output_dtype=torch.float32,
            chunk_size=DEFAULT_MLP_CHUNK_SIZE,
        )

        #: query tokens per chunk of the whole layer (module docstring; ``enable_forward_chunking``), ``None``: the
        #: attention over every token at once
        self.chunk_size: Optional[int] = None

    def forward(self, hidden_states: torch.Tensor, context: Magi2ForwardContext) -> torch.Tensor:
        """``hidden_states`` ``[N, C]`` modality-sorted -> ``[N, C]`` (fp32 after layer 0's MLP); ``context`` is the
        forward's :class:`~.attention_magi2.Magi2ForwardContext`. In token chunks where :attr:`chunk_size` is set
        and the attention's exchange allows it (one process; under context parallelism the MLP alone chunks)."""
        chunk = self.attention.exchange.token_chunk(self.chunk_size)
        if chunk is None or hidden_states.shape[0] <= chunk:
            hidden_states = hidden_states + self.attention(hidden_states, context)
            return hidden_states + self.mlp(hidden_states, context.dispatch, context.shard_plan)
        return self._forward_chunked(hidden_states, context, chunk)

    def _forward_chunked(self, hidden_states: torch.Tensor, context: Magi2ForwardContext, chunk: int):
        attn = self.attention
        registry = getattr(attn, "_diffusers_hook", None)
        if registry is not None and registry.hooks:
            raise RuntimeError(
                f"token-chunked layers run the attention's processor directly, past the hooks on it "
                f"({list(registry.hooks)}); call disable_forward_chunking() to use them"
            )
        n, processor = hidden_states.shape[0], attn.processor
        chunks = processor.query_chunks(context.attention_mask, n, chunk)
        projected = processor.project(attn, hidden_states, context, chunks)
        out = None
        for a, b in chunks:
            x = hidden_states[a:b] + processor.attend_rows(attn, projected, context, a, b)
            rows = Magi2ModalityDispatch.from_sorted_group_sizes(
                chunk_group_sizes(context.dispatch.group_sizes, a, b), x.device
            )
            x = x + self.mlp(x, rows)
            if out is None:
                out = x.new_empty((n,) + tuple(x.shape[1:]))
            out[a:b] = x
        return out


class Magi2RefinerTransformer3DModel(Magi2TransformerBase):
    r"""MAGI-2 1080p refiner DiT (SandAI ``magi2_refiner.Transformer``) as a diffusers model.

    Config defaults are the released refiner (SandAI ``configs/magi2_refiner.json``).

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
        dense_storage_dtype: storage of the dense projections: ``None`` (the load dtype) or ``"float8_e4m3fn"``
            (fp32 scales per output channel, :meth:`enable_fp8_storage`); anything else raises ``ValueError``.

    Runtime switches: ``set_attn_processor(Magi2WindowAttnProcessor(backend=...))`` (the window kernel),
    ``set_attention_backend`` (dense layers), :meth:`enable_forward_chunking` (token-chunked layers; by default only
    the MLP runs in chunks of 65,536 tokens).
    """

    _no_split_modules = ["Magi2RefinerTransformerBlock"]
    _repeated_blocks = ["Magi2RefinerTransformerBlock"]
    _keep_in_fp32_modules = ["pre_adapter", "post_adapter", "pre_norm", "q_norm", "k_norm", "weight_scale"]

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
        dense_storage_dtype: Optional[str] = None,
    ) -> None:
        super().__init__()
        check_dense_storage_dtype(dense_storage_dtype)
        self._check_geometry("multimodal_layers", "window_attention_layers")
        Magi2WindowGeometry((1, 1, 1), tuple(window_block_size), tuple(window_radius))

        geometry = Magi2AttentionGeometry.from_config(self.config)
        hidden = geometry.hidden_size
        inter = mlp_intermediate_size if mlp_intermediate_size is not None else refiner_mlp_intermediate_size(hidden)
        mm = {int(i) for i in multimodal_layers}
        win = set(range(num_layers)) if window_attention_layers is None else {int(i) for i in window_attention_layers}

        self.pre_adapter = Magi2PreAdapter(
            hidden, attention_head_dim, in_channels, audio_in_channels, text_in_channels
        )
        self.transformer_blocks = nn.ModuleList(
            [
                Magi2RefinerTransformerBlock(
                    geometry, inter, 3 if i in mm else 1, attention_gating, i in win, norm_eps
                )
                for i in range(num_layers)
            ]
        )
        self.post_adapter = Magi2PostAdapter(hidden, in_channels, audio_in_channels, eps=norm_eps)
        self.gradient_checkpointing = False
        if dense_storage_dtype is not None:
            self.enable_fp8_storage()

    def window_geometry(
        self, num_frames: int, height: int, width: int, num_context_tokens: int
    ) -> Magi2WindowGeometry:
        """Window geometry of one sample from this model's config (block sizes, radii)."""
        return Magi2WindowGeometry(
            (num_frames, height, width),
            tuple(self.config.window_block_size),
            tuple(self.config.window_radius),
            num_context_tokens,
        )

    def enable_forward_chunking(self, chunk_size: Optional[int] = None, dim: int = 0) -> None:
        """Run every layer ``chunk_size`` query tokens at a time (default 65,536): its attention over all keys and
        its MLP, chunk by chunk, so that the activations beside the residual, q, k and v scale with the chunk
        (module docstring; window layers cut their chunks on window-block borders); the output adapter's fp32 norm
        and the input adapter of ``forward_packed`` too. Under context parallelism the
        attention runs whole and the MLP in chunks. The same result up to GEMM rounding; inference and training.

        Args:
            chunk_size: query tokens per chunk, a positive int (``None``: 65,536).
            dim: the token dim, 0 (diffusers' signature).

        Raises:
            ValueError: ``dim`` other than 0 (tokens are dim 0) or a non-positive ``chunk_size``.
        """
        if dim != 0:
            raise ValueError(f"the refiner chunks its layers over tokens (dim 0), got dim={dim}")
        chunk_size = check_chunk_size(DEFAULT_MLP_CHUNK_SIZE if chunk_size is None else chunk_size)
        self.pre_adapter.chunk_size = self.post_adapter.chunk_size = chunk_size
        for block in self.transformer_blocks:
            block.chunk_size = block.mlp.chunk_size = chunk_size

    def disable_forward_chunking(self) -> None:
        """Run every layer and the adapters over all tokens at once (the MLP included)."""
        self.pre_adapter.chunk_size = self.post_adapter.chunk_size = None
        for block in self.transformer_blocks:
            block.chunk_size = block.mlp.chunk_size = None

    @lora_scale_from_attention_kwargs
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
        """SandAI ``Transformer.forward`` on one packed sample.

        Args:
            x: ``[N, C_max]`` packed tokens (video first, in block order); modality ``m`` uses ``C_m`` channels.
            coords_mapping: ``[N, 9]`` rope coordinates.
            modality_mapping: ``[N]`` :class:`Modality` ids (0 video, 1 audio, 2 text).
            window_geometry: the block-window geometry; or
            q_ranges, k_ranges: the reference's ``[P, 2]`` ranges, as a dense mask (small inputs only).
                With neither, attention is dense.
            attention_kwargs: ``{"scale": s}`` scales the loaded LoRA adapters by ``s`` for this call (or ``None``).

        Returns ``[N, max(Cv, Ca)]`` fp32; ValueError for inconsistent shapes, unknown modality ids, both a geometry
        and ranges, or an ``attention_kwargs`` key other than ``"scale"``.
        """
        self.check_attention_kwargs(attention_kwargs)
        if x.dim() != 2 or coords_mapping.shape != (x.shape[0], 9) or modality_mapping.shape != (x.shape[0],):
            raise ValueError(
                f"expected x [N, C], coords_mapping [N, 9], modality_mapping [N]; got {tuple(x.shape)}, "
                f"{tuple(coords_mapping.shape)}, {tuple(modality_mapping.shape)}"
            )
        check_rope_coords(coords_mapping)
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
        if any(b.chunk_size is not None for b in self.transformer_blocks) and bool((ids[1:] < ids[:-1]).any()):
            raise ValueError(
                "token-chunked layers (enable_forward_chunking) need modality_mapping in modality order (video, "
                "audio, text), as the refiner packs its samples; call disable_forward_chunking() for another order"
            )
        dense_mask = None
        if q_ranges is not None or k_ranges is not None:
            if q_ranges is None or k_ranges is None:
                raise ValueError("q_ranges and k_ranges must be given together")
            limit = DEFAULT_MAX_DENSE_MASK_ELEMENTS
            dense_mask = ranges_to_dense_mask(q_ranges.cpu(), k_ranges.cpu(), x.shape[0], limit).to(x.device)
        mask = Magi2AttentionMask((x.shape[0],), window_geometry, dense_mask)

        def embed_rows(lo: int, hi: int):
            rows = ids[lo:hi]
            if rows.numel() < 2 or bool((rows[1:] >= rows[:-1]).all()):
                local = tuple(int(c) for c in torch.bincount(rows, minlength=3).tolist())
                dispatch = Magi2ModalityDispatch.from_sorted_group_sizes(local, x.device)
            else:
                dispatch = Magi2ModalityDispatch.from_modality_mapping(rows)
            return (*self.pre_adapter(x[lo:hi], coords_mapping[lo:hi], dispatch), dispatch)

        return self._forward_sample(x.shape[0], mask, embed_rows)

    def _forward_sample(self, num_tokens: int, mask: Magi2AttentionMask, embed_rows) -> torch.Tensor:
        """The forward of one packed sample, shared by :meth:`forward` and :meth:`forward_packed`:
        ``embed_rows(lo, hi) -> (embedded, rope, dispatch)`` of packed rows ``[lo, hi)``. Under context parallelism
        this rank embeds and runs its rows only (attention sees every row through Ulysses); all rows are gathered
        at the end. Returns ``[N, max(Cv, Ca)]`` fp32."""
        plan = self._context_parallel_plan(num_tokens, mask.segment_lengths)
        lo, hi = (0, num_tokens) if plan is None else (plan.start, plan.start + plan.num_local_tokens)
        embedded, rope, dispatch = embed_rows(lo, hi)
        h = dispatch.sort(embedded).to(self.compute_dtype)
        del embedded  # the fp32 embedding ([N, C], 8.4 GB at 1080p) is freed before the blocks run
        context = Magi2ForwardContext(rope, dispatch, mask, plan)
        for block in self.transformer_blocks:
            h = self._run_block(block, h, context)
        out = self.post_adapter(dispatch.unsort(h).float(), dispatch)
        return out if plan is None else self._gather_sequence_shards(out, plan)

    @lora_scale_from_attention_kwargs
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_hidden_states: Optional[torch.Tensor] = None,
        encoder_attention_mask: Optional[torch.Tensor] = None,
        attention_kwargs: Optional[dict[str, Any]] = None,
        return_dict: bool = True,
    ) -> Union[Magi2RefinerTransformerOutput, tuple]:
        """Velocity prediction for a batch of video latents (no timestep), one packed sample at a time (under
        :meth:`enable_parallelism` each sample's tokens are split over the ranks, as in :meth:`forward_packed`).

        Args:
            hidden_states: ``[B, Cv, T, H, W]`` video latent.
            encoder_hidden_states: ``[B, Lt, Ct]`` text features.
            audio_hidden_states: ``[B, La, Ca]`` audio latent, or ``None``.
            encoder_attention_mask: ``[B, Lt]`` bool, True = real text token; ``None`` = all valid.
            attention_kwargs: ``{"scale": s}`` scales the loaded LoRA adapters by ``s`` for this call (or ``None``).
            return_dict: return :class:`Magi2RefinerTransformerOutput` (else a tuple).

        Returns:
            ``sample`` ``[B, Cv, T, H, W]`` fp32 and ``audio_sample`` ``[B, La, Ca]`` fp32 or ``None``.

        Raises:
            ValueError: the checks of :func:`~.packing_magi2.check_transformer_inputs` (ranks, channel counts, batch
                sizes, a zero ``T``/``H``/``W``, the mask shape); an ``attention_kwargs`` key other than ``"scale"``.
        """
        self.check_attention_kwargs(attention_kwargs)
        cfg = self.config
        check_transformer_inputs(
            cfg, hidden_states, encoder_hidden_states, audio_hidden_states, encoder_attention_mask
        )
        B, _, T, H, W = hidden_states.shape

        pa = self.pre_adapter
        La = 0 if audio_hidden_states is None else audio_hidden_states.shape[1]
        video_out, audio_out = [], []
        for b in range(B):
            text = encoder_hidden_states[b]
            if encoder_attention_mask is not None:
                text = text[encoder_attention_mask[b].to(torch.bool)]
            geom = self.window_geometry(T, H, W, La + text.shape[0])
            audio = None if audio_hidden_states is None else audio_hidden_states[b]
            sample = pack_refiner_sample(geom, hidden_states[b], audio, text)

            def embed_rows(lo: int, hi: int, sample=sample):
                parts, local, start = [], [], 0
                for m, tokens, n in zip(Modality, sample.tokens, sample.group_sizes):
                    a, z = max(lo, start) - start, min(hi, start + n) - start
                    local.append(max(0, z - a))
                    if z > a:
                        parts.append(pa.embed(m, tokens[a:z]))
                    start += n
                emb = torch.cat(parts) if parts else sample.coords.new_zeros(0, pa.width)
                dispatch = Magi2ModalityDispatch.from_sorted_group_sizes(tuple(local), hidden_states.device)
                return emb, pa.rope(sample.coords[lo:hi]), dispatch

            mask = Magi2AttentionMask((geom.num_tokens,), geom)
            out = self._forward_sample(geom.num_tokens, mask, embed_rows)
            video, audio = unpack_refiner_sample(out, sample, cfg.in_channels, cfg.audio_in_channels)
            video_out.append(video)
            audio_out.append(audio)
        sample = torch.stack(video_out)
        audio_sample = torch.stack(audio_out) if audio_hidden_states is not None else None
        if not return_dict:
            return (sample, audio_sample)
        return Magi2RefinerTransformerOutput(sample=sample, audio_sample=audio_sample)


register_block_for_caching_hooks(Magi2RefinerTransformerBlock)
