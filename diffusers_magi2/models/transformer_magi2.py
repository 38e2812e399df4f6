"""``Magi2Transformer3DModel``: SandAI's MAGI-2 Preview DiT (``magi2_preview.py`` ``Transformer``) as a diffusers model.

Per layer, with the residual as ``n`` mHC streams (:mod:`.mhc`)::

    s = mhc(s, attention);  s = mhc(s, mlp)          mlp: dense swiglu7, or the multi-head MoE in MoE layers

between the pre adapter (per-modality embedders, time embedding over channels ``[0:64]``) and the post adapter.
Parameter names are SandAI's with ``block.layers.{i}.`` -> ``transformer_blocks.{i}.`` and each layer's flat mHC
tensors ``mhc_{param}_{site}`` held by its two :class:`~.mhc.Magi2HyperConnection` sites as ``mhc_{site}.{param}``
(:mod:`~diffusers_magi2.loaders.key_plan`). fp32 islands (``_keep_in_fp32_modules``, by module name): embedders,
post adapter, norms, sinks, ``mhc_attn`` / ``mhc_mlp`` / ``mhc_norm``, router, rope bands, FP8 scales; the routed
experts are stored in ``expert_dtype`` (int4 experts with their bf16 group scales, which are no islands); the residual runs in the attention weights' dtype, coefficients, norms and
routing in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

import torch
import torch.nn as nn
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (diffusers' pipeline loader looks it up here)
from diffusers.utils import BaseOutput

from ..loaders.expert_parallel_loading import ExpertParallelLoaderMixin
from ..loaders.key_plan import check_no_flat_mhc_keys
from ..moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from ..moe.quantize import EXPERT_DTYPES, INT4, parse_expert_dtype
from ..moe.quantize import FP8_SCALE_NAMES as _FP8_SCALE_NAMES
from ..moe.quantize_int4 import INT4_GROUP_SIZE, INT4_PACKING, check_int4_banks
from ..utils.backends import check_backend, resolve_backend
from ..utils.dtype_utils import parse_dtype
from ..utils.safetensors_io import read_index, read_safetensors_header
from .adapters_magi2 import Magi2PostAdapter, Magi2PreAdapter
from .attention_magi2 import (
    Magi2Attention,
    Magi2AttentionGeometry,
    Magi2AttentionMask,
    Magi2ForwardContext,
)
from .cache_magi2 import register_block_for_caching_hooks
from .embeddings_magi2 import check_rope_coords
from .feedforward_magi2 import Magi2FeedForward, Magi2MoEFeedForward, check_chunk_size
from .fp8_storage_magi2 import check_dense_storage_dtype
from .lora_magi2 import lora_scale_for_call, lora_scale_from_attention_kwargs
from .mhc import Magi2HyperConnection, mhc_hyper_connect, mhc_reduce_streams
from .modality import Magi2ModalityDispatch, Magi2MultiModalityRMSNorm, Modality
from .modeling_magi2 import Magi2TransformerBase
from .packing_magi2 import Magi2PackedInputs, Magi2PackedLayout, pack_magi2_inputs, unpack_magi2_outputs


__all__ = [
    "Magi2Transformer3DModel",
    "Magi2TransformerOutput",
    "Magi2TransformerBlock",
    "Magi2FeedForward",
    "Magi2MoEFeedForward",
    "Magi2PreAdapter",
    "Magi2PostAdapter",
    "Magi2PackedInputs",
]


@dataclass
class Magi2TransformerOutput(BaseOutput):
    """Output of :meth:`Magi2Transformer3DModel.forward`: fp32 velocities ``sample`` ``[B, Cv, T, H, W]`` and
    ``audio_sample`` ``[B, La, Ca]``."""

    sample: torch.Tensor
    audio_sample: torch.Tensor


class Magi2TransformerBlock(nn.Module):
    """One Preview layer with two mHC sites, attention and MLP (SandAI ``TransformerLayer``).

    Args:
        geometry: the model's attention heads and sinks (width ``C``).
        num_streams: mHC streams ``n``.
        num_modality: 3 for a multimodal layer, else 1.
        mlp: the layer's feed-forward (dense or MoE).
        params_dtype: dtype of the attention's projections (``None`` = torch default).
    """

    def __init__(
        self,
        geometry: Magi2AttentionGeometry,
        num_streams: int,
        num_modality: int,
        mlp: nn.Module,
        params_dtype=None,
    ) -> None:
        super().__init__()
        n, c = num_streams, geometry.hidden_size
        self.num_streams = n
        self.hidden_size = c
        self.num_modality = num_modality
        # the sites first: the parameter order (which seeded inits walk) stays that of the former flat mhc_* tensors
        self.mhc_attn = Magi2HyperConnection(n, c)
        self.mhc_mlp = Magi2HyperConnection(n, c)
        self.attention = Magi2Attention.from_geometry(geometry, num_modality, params_dtype=params_dtype)
        self.mlp = mlp
        self.mhc_norm = Magi2MultiModalityRMSNorm(n * c, num_modality, out_dtype=torch.float32)
        self.mhc_backend = "auto"
        self.chunk_size: Optional[int] = None  # tokens per chunk of the per-token work (enable_forward_chunking)

    def _mhc_fused(self, streams: torch.Tensor) -> bool:
        """Whether this call mixes the streams fused (the ``mhc`` row of :mod:`~diffusers_magi2.utils.backends`)."""
        backend = resolve_backend("mhc", self.mhc_backend, streams.device, grad_enabled=torch.is_grad_enabled())
        return backend == "fused"

    def _site_coefficients(self, streams: torch.Tensor, site: Magi2HyperConnection, dispatch: Magi2ModalityDispatch):
        """``site``'s ``(h_pre, h_post, H_res)`` through the shared ``mhc_norm``, in token chunks."""
        gs = dispatch.group_sizes if self.num_modality > 1 else None
        return site(streams, self.mhc_norm, gs, self.chunk_size)

    def forward(self, hidden_states: torch.Tensor, context: Magi2ForwardContext) -> torch.Tensor:
        """``hidden_states`` ``[T, n*C]`` modality-sorted, in the residual dtype -> the same shape; ``context`` is
        the forward's :class:`~.attention_magi2.Magi2ForwardContext`."""
        s = hidden_states.reshape(hidden_states.shape[0], self.num_streams, self.hidden_size)
        fused = self._mhc_fused(s)
        h_pre, h_post, h_res = self._site_coefficients(s, self.mhc_attn, context.dispatch)
        attn_out = self.attention(mhc_reduce_streams(h_pre, s, fused), context)
        s = mhc_hyper_connect(s, attn_out, h_post, h_res, fused)
        h_pre, h_post, h_res = self._site_coefficients(s, self.mhc_mlp, context.dispatch)
        mlp_out = self.mlp(mhc_reduce_streams(h_pre, s, fused), context.dispatch, context.shard_plan)
        s = mhc_hyper_connect(s, mlp_out, h_post, h_res, fused)
        return s.reshape(s.shape[0], self.num_streams * self.hidden_size)


#: Tokens per chunk of :meth:`Magi2Transformer3DModel.enable_forward_chunking`, on by default; chosen from the
#: memory plan (``tests/benchmarks/bench_memory.py``): at 540p with CFG (116 k tokens) it keeps the step's
#: activations within what one 141 GB H200 leaves beside the FP8 model; below it the chunking is a no-op.
DEFAULT_FORWARD_CHUNK_SIZE = 16384


def _check_local_mhc_names(pretrained_model_name_or_path, kwargs: dict) -> bool:
    """Refuse flat mHC names in a local folder's safetensors weights (read from the index or the file header, before
    anything is loaded); whether the names were checked so (else they are checked from the loading info)."""
    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, _add_variant

    folder = Path(pretrained_model_name_or_path) / (kwargs.get("subfolder") or "")
    index, single = (
        folder / _add_variant(n, kwargs.get("variant")) for n in (SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME)
    )
    if index.is_file():
        check_no_flat_mhc_keys(read_index(folder, index.name, single.name), str(folder))
    elif single.is_file():
        check_no_flat_mhc_keys(read_safetensors_header(single).tensors, str(folder))
    return index.is_file() or single.is_file()


#: The routed core's settings (:class:`~diffusers_magi2.moe.layer.Magi2MultiHeadMoEConfig` fields) that the model
#: config holds as ``moe_<field>``.
_MOE_CORE_FIELDS = (
    "num_heads",
    "num_experts",
    "top_k",
    "expert_intermediate_size",
    "score_func",
    "route_norm",
    "route_scale",
)


def _dense_intermediate_size(hidden_size: int, factor: float) -> int:
    return int(hidden_size * factor * 2 / 3) // 128 * 128


class Magi2Transformer3DModel(ExpertParallelLoaderMixin, Magi2TransformerBase):
    r"""MAGI-2 Preview diffusion transformer (114B-parameter MoE, joint audio + video).

    Defaults are the released Preview (SandAI ``configs/magi2_preview.json``).

    Args:
        num_layers: transformer layers.
        num_attention_heads: query heads ``Hq``; hidden size ``C = Hq * attention_head_dim``.
        attention_head_dim: head dim (multiple of 8; ``6 * D/8`` dims carry rope).
        num_key_value_heads: kv heads (``Hq % Hkv == 0``).
        in_channels, audio_in_channels, text_in_channels: video latent / audio latent / text widths.
        intermediate_factor: dense MLP width = ``int(C*f*2/3)//128*128`` (8192 released).
        multimodal_layers: layers with per-modality (3-block) attention/MLP weights.
        moe_layers: layers whose MLP is the multi-head MoE; others are dense.
        num_streams: mHC streams ``n`` (residual width ``n*C``).
        num_sink_tokens: attention sinks per head (>= 1; the reference requires sinks).
        moe_*: multi-head MoE settings (heads, experts per head, top-k, expert width, router).
        shared_expert_intermediate_size, modality_specific_expert_intermediate_size: shared-expert widths.
        split_merge_intermediate_size: MoE width between split/merge linears (``None`` = hidden).
        time_embed_dim: width of the time embedding written into channels ``[0:dim]`` (64).
        params_dtype: construction-time dtype of the non-fp32 weights (not stored in the config).
        expert_dtype: storage of the routed experts: ``None`` (the load dtype), ``"float8_e4m3fn"`` (weight-only,
            fp32 scales per expert and output channel; :mod:`diffusers_magi2.moe.quantize`) or ``"int4"`` (4-bit NF4
            codes, bf16 scales per group of ``expert_int4_group_size`` rows; :mod:`diffusers_magi2.moe.quantize_int4`).
        expert_int4_group_size: int4 experts: rows of each expert matrix's contraction dim per scale (128).
        expert_int4_packing: int4 experts: the code and packing of the stored banks; only ``"nf4_pairs_along_n"``.
        dense_storage_dtype: storage of the dense projections: ``None`` (the load dtype) or ``"float8_e4m3fn"``
            (fp32 scales per output channel, :meth:`enable_fp8_storage`).

    Raises:
        ValueError: inconsistent geometry, a ``dense_storage_dtype`` outside ``(None, "float8_e4m3fn")``,
            ``expert_dtype`` outside ``(None, "float8_e4m3fn", "int4")``, or with int4
            experts an ``expert_int4_packing`` other than ``"nf4_pairs_along_n"`` or an ``expert_int4_group_size``
            that does not divide the MoE head width and expert width (each error names the config key).

    Runtime switches: ``set_attention_backend``, :meth:`set_moe_backend`, :meth:`set_mhc_backend`,
    :meth:`enable_forward_chunking` (token chunks of the per-token work; on by default).
    """

    _no_split_modules = ["Magi2TransformerBlock"]
    _repeated_blocks = ["Magi2TransformerBlock"]
    _keep_in_fp32_modules = [
        "pre_adapter",
        "post_adapter",
        "pre_norm",
        "q_norm",
        "k_norm",
        "mhc_attn",
        "mhc_mlp",
        "mhc_norm",
        "sinks",
        "gate",
        "router",
        *_FP8_SCALE_NAMES,
        "weight_scale",  # FP8-stored dense projections' per-channel scales
    ]
    ignore_for_config = ["params_dtype"]

    @register_to_config
    def __init__(
        self,
        num_layers: int = 40,
        num_attention_heads: int = 24,
        attention_head_dim: int = 128,
        num_key_value_heads: int = 24,
        in_channels: int = 48,
        audio_in_channels: int = 64,
        text_in_channels: int = 5120,
        intermediate_factor: float = 4,
        multimodal_layers: Sequence[int] = (0, 1, 38, 39),
        moe_layers: Sequence[int] = tuple(range(2, 38)),
        num_streams: int = 4,
        num_sink_tokens: int = 1,
        moe_num_heads: int = 12,
        moe_num_experts: int = 256,
        moe_top_k: int = 6,
        moe_expert_intermediate_size: int = 1280,
        shared_expert_intermediate_size: int = 1280,
        modality_specific_expert_intermediate_size: int = 1280,
        moe_score_func: str = "sigmoid",
        moe_route_norm: bool = True,
        moe_route_scale: float = 4.9,
        split_merge_intermediate_size: Optional[int] = None,
        time_embed_dim: int = 64,
        params_dtype: Optional[torch.dtype] = None,
        expert_dtype: Optional[str] = None,
        expert_int4_group_size: int = INT4_GROUP_SIZE,
        expert_int4_packing: str = INT4_PACKING,
        dense_storage_dtype: Optional[str] = None,
    ) -> None:
        super().__init__()
        check_dense_storage_dtype(dense_storage_dtype)
        if parse_expert_dtype(expert_dtype) is not None and not isinstance(expert_dtype, str):
            self.register_to_config(expert_dtype=EXPERT_DTYPES[1])  # a torch dtype given: the config stores its name
        if expert_dtype == INT4:
            if expert_int4_packing != INT4_PACKING:
                raise ValueError(
                    f"expert_int4_packing must be {INT4_PACKING!r} (NF4 codes, two per byte along N); got "
                    f"{expert_int4_packing!r}"
                )
            moe_width = (split_merge_intermediate_size or num_attention_heads * attention_head_dim) // moe_num_heads
            check_int4_banks(moe_width, moe_expert_intermediate_size, expert_int4_group_size, "expert_int4_group_size")
        self._check_geometry("multimodal_layers", "moe_layers")
        if num_sink_tokens < 1:
            raise ValueError("num_sink_tokens must be >= 1 (MAGI-2 Preview requires attention sinks)")
        hidden_size = num_attention_heads * attention_head_dim
        if time_embed_dim > num_streams * hidden_size:
            raise ValueError("time_embed_dim exceeds the residual width")
        if params_dtype is not None:
            params_dtype = parse_dtype(params_dtype, "params_dtype")
        width = num_streams * hidden_size
        self.pre_adapter = Magi2PreAdapter(width, attention_head_dim, in_channels, audio_in_channels, text_in_channels)
        self.post_adapter = Magi2PostAdapter(width, in_channels, audio_in_channels)
        mm, moe = {int(i) for i in multimodal_layers}, {int(i) for i in moe_layers}
        if moe:  # the routed core of every MoE layer (read, never written, by each layer)
            moe_config = Magi2MultiHeadMoEConfig(
                hidden_size=split_merge_intermediate_size or hidden_size,
                params_dtype=params_dtype if params_dtype is not None else torch.get_default_dtype(),
                expert_dtype=expert_dtype,
                int4_group_size=expert_int4_group_size,
                **{field: self.config[f"moe_{field}"] for field in _MOE_CORE_FIELDS},
            )
        geometry = Magi2AttentionGeometry.from_config(self.config)
        blocks = []
        for i in range(num_layers):
            num_modality = 3 if i in mm else 1
            if i in moe:
                mlp = Magi2MoEFeedForward(
                    hidden_size,
                    moe_config,
                    shared_expert_intermediate_size,
                    modality_specific_expert_intermediate_size,
                )
            else:
                mlp = Magi2FeedForward(
                    hidden_size, _dense_intermediate_size(hidden_size, intermediate_factor), num_modality, params_dtype
                )
            blocks.append(Magi2TransformerBlock(geometry, num_streams, num_modality, mlp, params_dtype))
        self.transformer_blocks = nn.ModuleList(blocks)
        self.gradient_checkpointing = False
        self.enable_forward_chunking(DEFAULT_FORWARD_CHUNK_SIZE)
        if dense_storage_dtype is not None:
            self.enable_fp8_storage()

    def enable_forward_chunking(self, chunk_size: Optional[int] = None, dim: int = 0) -> None:
        """Run each block's per-token work ``chunk_size`` tokens at a time (default
        :data:`DEFAULT_FORWARD_CHUNK_SIZE`, on from construction): the mHC site projections (an fp32 norm of the
        ``n*C``-wide state), the dense MLPs, the MoE layers (router logits, the per-route rows, shared experts) and
        the pre/post adapters. Tokens are independent there, so the result is the same up to GEMM rounding. Under
        context or expert parallelism the routed experts still run once per layer (every rank must join each
        exchange; a rank's shard is already ``1/N`` of the tokens).

        Args:
            chunk_size: tokens per chunk (``None``: the default).
            dim: must be 0 (tokens).

        Raises:
            ValueError: ``dim`` other than 0, or ``chunk_size`` not a positive int.
        """
        if dim != 0:
            raise ValueError(f"the preview chunks its per-token work over tokens (dim 0), got dim={dim}")
        chunk_size = check_chunk_size(DEFAULT_FORWARD_CHUNK_SIZE if chunk_size is None else chunk_size)
        self.pre_adapter.chunk_size = self.post_adapter.chunk_size = chunk_size
        for block in self.transformer_blocks:
            block.chunk_size = chunk_size
            block.mlp.chunk_size = chunk_size

    def disable_forward_chunking(self) -> None:
        """Run each block's per-token work over all tokens at once."""
        self.pre_adapter.chunk_size = self.post_adapter.chunk_size = None
        for block in self.transformer_blocks:
            block.chunk_size = None
            block.mlp.chunk_size = None

    @property
    def residual_dtype(self) -> torch.dtype:
        """Dtype of the residual streams: the compute dtype (:attr:`compute_dtype`)."""
        return self.compute_dtype

    def set_mhc_backend(self, backend: str = "auto") -> None:
        """Choose how the mHC stream mixing rounds in low precision: ``"fused"``, ``"torch"`` or ``"auto"`` (the
        ``mhc`` row of :mod:`~diffusers_magi2.utils.backends`, the choice SandAI's code makes).

        Raises:
            ValueError: unknown backend name.
        """
        check_backend("mhc", backend)
        for block in self.transformer_blocks:
            block.mhc_backend = backend

    def set_moe_backend(self, backend: str = "auto", **kwargs) -> None:
        """Apply ``Magi2MultiHeadMoE.set_backend(backend, **kwargs)`` to every MoE layer."""
        for module in self.modules():  # a router LoRA wraps ``mlp.moe_mlp``; the MoE itself is inside
            if isinstance(module, Magi2MultiHeadMoE):
                module.set_backend(backend, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``ModelMixin.from_pretrained`` (``local_files_only`` defaults to ``HF_HUB_OFFLINE``).

        Args:
            expert_parallel: ``Magi2ExpertParallelConfig(ep_degree=N)``: load only this rank's routed experts.
            expert_dtype: ``"float8_e4m3fn"`` or ``"int4"`` quantizes a bf16 repo's routed experts while reading,
                shard by shard (an FP8 or int4 repo loads as stored without it: its config says so; another
                ``expert_dtype`` for it, ``None`` included, is refused).
            expert_int4_group_size: with ``expert_dtype="int4"`` on a bf16 repo: rows of the contraction dim per
                scale (default 128); an int4 repo keeps the size it was written with.

        Raises:
            ValueError: an FP8 or int4 repo asked for another ``expert_dtype`` (naming the config key, before
                anything loads); a missing, misshaped or truncated FP8 or int4 scale (naming it); an int4 repo read with
                another ``expert_int4_group_size`` or ``expert_int4_packing`` than it was written with (naming the
                config key); an ``expert_dtype`` outside ``(None, "float8_e4m3fn", "int4")``; an expert-parallel
                loading error; or a checkpoint that names
                the mHC tensors flat (written before the ``mhc_attn`` / ``mhc_mlp`` submodules; checked before
                loading for a local folder, from the unexpected keys otherwise).
        """
        if kwargs.get("local_files_only") is None:
            from huggingface_hub import constants as hf_constants

            offline = bool(getattr(hf_constants, "HF_HUB_OFFLINE", False)) or os.environ.get(
                "HF_HUB_OFFLINE", ""
            ).strip().upper() in ("1", "ON", "YES", "TRUE")
            kwargs["local_files_only"] = offline
        checked = _check_local_mhc_names(pretrained_model_name_or_path, kwargs)
        if checked or kwargs.get("use_flashpack"):  # (flashpack gives no loading info)
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        # a Hub id (or local weights other than safetensors): the names are known once it is loaded
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
        check_no_flat_mhc_keys(info.get("unexpected_keys", ()), str(pretrained_model_name_or_path))
        return (model, info) if want_info else model

    def forward_packed(
        self,
        hidden_states: torch.Tensor,
        coords: torch.Tensor,
        modality_mapping: torch.Tensor,
        cu_seqlens: torch.Tensor,
        time_embedding: Optional[torch.Tensor] = None,
        attention_kwargs: Optional[Dict[str, Any]] = None,
        return_layer_outputs: bool = False,
        *,
        layout: Optional[Magi2PackedLayout] = None,
    ):
        """SandAI ``Transformer.forward`` on packed tokens.

        Args:
            hidden_states: ``[N, C_max]`` tokens zero-padded on channels (video rows use ``[:Cv]``, ...).
            coords: ``[N, 9]`` rope coordinates.
            modality_mapping: ``[N]`` :class:`Modality` ids.
            cu_seqlens: ``[S+1]`` segment boundaries; segments attend separately.
            time_embedding: ``[N, time_embed_dim]``, written over channels ``[0:dim]`` after the adapters.
            attention_kwargs: ``{"scale": s}`` scales the loaded LoRA adapters by ``s`` for this call (or ``None``).
            return_layer_outputs: also return the residual after each layer, ``[N, n*C]`` fp32.
            layout: what the packer checked (:class:`~.packing_magi2.Magi2PackedLayout`, as :meth:`forward` passes
                it): the inputs are then trusted and nothing is read back to the host. ``None``: the inputs are
                checked here, and the segment lengths and modality counts read from ``cu_seqlens`` and
                ``modality_mapping``.

        Returns:
            ``[N, max(Cv, Ca)]`` fp32 (and the list of layer outputs if requested).

        Raises:
            ValueError: without ``layout``, on inconsistent shapes, unknown modality ids or bad rope coordinates;
                an ``attention_kwargs`` key other than ``"scale"``.
        """
        self.check_attention_kwargs(attention_kwargs)
        with lora_scale_for_call(self, attention_kwargs):  # not a decorator: its *args would keep the input alive
            if layout is None:
                layout = self._checked_layout(hidden_states, coords, modality_mapping, cu_seqlens, time_embedding)
            n_tok, dim = hidden_states.shape[0], self.config.time_embed_dim
            mask = Magi2AttentionMask(layout.segment_lengths)
            ids = modality_mapping.to(device=hidden_states.device, dtype=torch.int64)
            plan = self._context_parallel_plan(n_tok, mask.segment_lengths)
            lo, hi = (0, n_tok) if plan is None else (plan.start, plan.start + plan.num_local_tokens)
            if plan is not None:  # this rank keeps its slice of the packed sequence; attention sees all of it
                hidden_states, coords, ids, time_embedding = (
                    None if t is None else plan.shard(t) for t in (hidden_states, coords, ids, time_embedding)
                )
            dispatch = Magi2ModalityDispatch.from_modality_mapping(ids, group_sizes=layout.group_sizes(lo, hi))

            x, rope = self.pre_adapter(hidden_states, coords, dispatch)
            hidden_states = None  # the packed fp32 input is freed here when the caller handed it over (forward does)
            if time_embedding is not None:
                x[:, :dim] = time_embedding.to(x.dtype)  # x is this call's own buffer
            x = x.to(self.residual_dtype)  # the fp32 embedding is freed before the sort's copy
            x = dispatch.sort(x)
            context = Magi2ForwardContext(rope, dispatch, mask, plan)
            layer_outputs = []
            for block in self.transformer_blocks:
                x = self._run_block(block, x, context)
                if return_layer_outputs:
                    layer_outputs.append(dispatch.unsort(x).float())
            x = dispatch.unsort(x)
            out = self.post_adapter(x, dispatch)
            if plan is not None:
                out = self._gather_sequence_shards(out, plan)
                layer_outputs = [self._gather_sequence_shards(t, plan) for t in layer_outputs]
            if return_layer_outputs:
                return out, layer_outputs
            return out

    def _checked_layout(self, hidden_states, coords, modality_mapping, cu_seqlens, time_embedding):
        """:meth:`forward_packed`'s checks of packed inputs it was given without their layout, and the layout (the
        segment lengths and modality runs, read back to the host)."""
        n_tok = hidden_states.shape[0]
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be packed [N, C], got {tuple(hidden_states.shape)}")
        if coords.shape != (n_tok, 9):
            raise ValueError(f"coords must be [{n_tok}, 9], got {tuple(coords.shape)}")
        if modality_mapping.shape != (n_tok,):
            raise ValueError(f"modality_mapping must be [{n_tok}], got {tuple(modality_mapping.shape)}")
        cu = [int(v) for v in cu_seqlens.reshape(-1).tolist()]
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != n_tok or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to N={n_tok}, got {cu}")
        dim = self.config.time_embed_dim
        if time_embedding is not None and time_embedding.shape != (n_tok, dim):
            raise ValueError(f"time_embedding must be [{n_tok}, {dim}], got {tuple(time_embedding.shape)}")
        check_rope_coords(coords)
        ids = modality_mapping.to(torch.int64)
        ids = torch.where(ids == int(Modality.TIME), torch.full_like(ids, int(Modality.TEXT)), ids)
        modalities, lengths = torch.unique_consecutive(ids, return_counts=True)
        runs = tuple(zip(modalities.tolist(), lengths.tolist()))
        if any(not 0 <= m <= int(Modality.TEXT) for m, _ in runs):
            raise ValueError("modality_mapping must hold Modality ids 0 (video), 1 (audio), 2 (text) or 3 (time)")
        layout = Magi2PackedLayout(tuple(b - a for a, b in zip(cu, cu[1:])), runs)
        counts = layout.group_sizes()
        widest = max(
            self.config.in_channels if counts[Modality.VIDEO] else 0,
            self.config.audio_in_channels if counts[Modality.AUDIO] else 0,
            self.config.text_in_channels if counts[Modality.TEXT] else 0,
        )
        if hidden_states.shape[1] < widest:
            raise ValueError(
                f"hidden_states has {hidden_states.shape[1]} channels; the modalities present need {widest}"
            )
        return layout

    def pack_inputs(self, *args, **kwargs) -> Magi2PackedInputs:
        """:func:`pack_magi2_inputs` with this model's config, on :meth:`forward`'s inputs.

        Raises:
            ValueError: wrong ranks, channel counts, batch sizes, or a mask that is not a prefix of ones.
        """
        return pack_magi2_inputs(self.config, *args, **kwargs)

    def unpack_outputs(self, packed_out: torch.Tensor, packed: Magi2PackedInputs):
        """:func:`unpack_magi2_outputs` with this model's config."""
        return unpack_magi2_outputs(self.config, packed_out, packed)

    @lora_scale_from_attention_kwargs
    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_attention_mask: Optional[torch.Tensor] = None,
        image_latents: Optional[torch.Tensor] = None,
        image_embeds: Optional[torch.Tensor] = None,
        attention_kwargs: Optional[Dict[str, Any]] = None,
        return_dict: bool = True,
    ) -> Union[Magi2TransformerOutput, tuple]:
        """Diffusers-facing forward; each batch row is one attention segment.

        Args:
            hidden_states: ``[B, Cv, T, H, W]`` noisy video latent.
            timestep: ``[B]`` or scalar float time on the 0-1000 scale.
            encoder_hidden_states: ``[B, Lt, Ct]`` text features, zero-padded on the right.
            audio_hidden_states: ``[B, La, Ca]`` noisy audio latent.
            encoder_attention_mask: ``[B, Lt]`` bool prefix mask of real text tokens; ``None`` = all real.
            image_latents: ``[B, Cv, 1, h, w]`` I2V reference latent, with ``image_embeds`` ``[B, Ct]``.
            attention_kwargs: ``{"scale": s}`` scales the loaded LoRA adapters by ``s`` for this call (or ``None``).
            return_dict: return :class:`Magi2TransformerOutput` (else a tuple).

        Returns:
            ``Magi2TransformerOutput(sample [B, Cv, T, H, W] fp32, audio_sample [B, La, Ca] fp32)``. A NaN or inf
            that reaches a MoE router is recorded, not raised (no host read inside the blocks, and under context
            parallelism every rank finishes the forward): the output then holds NaNs, and the router check
            raises for it at the end of the forward on every rank, once installed
            (:func:`~diffusers_magi2.models.finite_checks_magi2.apply_router_input_check`; the pipelines do).

        Raises:
            ValueError: bad shapes (see :meth:`pack_inputs`), or an ``attention_kwargs`` key other than ``"scale"``.
        """
        self.check_attention_kwargs(attention_kwargs)
        packed = self.pack_inputs(
            hidden_states,
            timestep,
            encoder_hidden_states,
            audio_hidden_states,
            encoder_attention_mask,
            image_latents,
            image_embeds,
        )
        out = self.forward_packed(
            _hand_over(packed, "hidden_states"),  # no reference stays here: freed once embedded
            packed.coords,
            packed.modality_mapping,
            packed.cu_seqlens,
            packed.time_embedding,
            layout=packed.layout,  # checked by the packer: nothing is checked or read back again
        )
        video, audio = self.unpack_outputs(out, packed)
        if not return_dict:
            return (video, audio)
        return Magi2TransformerOutput(sample=video, audio_sample=audio)


def _hand_over(packed: Magi2PackedInputs, name: str) -> torch.Tensor:
    """``packed.<name>``, leaving ``None`` behind (the callee then holds the only reference)."""
    tensor = getattr(packed, name)
    setattr(packed, name, None)
    return tensor


register_block_for_caching_hooks(Magi2TransformerBlock)
