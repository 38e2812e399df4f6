"""MAGI-2 attention of both models (SandAI ``Attention`` in ``magi2_preview.py`` and ``magi2_refiner.py``):
gated, qk-normed, 3-axis-rope GQA self-attention over packed, modality-sorted tokens::

    u = pre_norm(x);  q, k, v = split(linear_qkv(u));  q, k = rope(q_norm(q)), rope(k_norm(k))
    y = linear_proj(attention(q, k, v; mask) * sigmoid(linear_g(u)))

:class:`Magi2Attention` owns the weights; a processor does the math (``set_attn_processor``):
:class:`Magi2AttnProcessor` (varlen with sinks, through the backend ``set_attention_backend`` picks) and
:class:`Magi2WindowAttnProcessor` (the refiner's block window).

The Preview's attention has sinks: :mod:`.attention_sinks_magi2` holds their two exact paths (by log-sum-exp, or
padded) and the table of which backend takes which; its names are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..parallel.exchanges import Magi2AttentionShard, Magi2LocalAttentionExchange
from ..utils.backends import check_backend, resolve_backend
from ..utils.elementwise import sigmoid
from .attention_sinks_magi2 import SINK_ATTENTION_PATHS, magi2_attention_with_sinks, sink_attention_path
from .embeddings_magi2 import apply_magi2_rotary_emb
from .modality import (
    Magi2ModalityDispatch,
    Magi2MultiModalityRMSNorm,
    chunk_group_sizes,
    linear_compute_dtype,
    modality_linear,
)
from .window_attention import (
    DEFAULT_MAX_DENSE_MASK_ELEMENTS,
    Magi2WindowGeometry,
    block_window_attention,
    cached_flex_block_mask,
)


__all__ = [
    "Magi2Attention",
    "Magi2AttentionGeometry",
    "Magi2AttentionMask",
    "Magi2ForwardContext",
    "Magi2AttnProcessor",
    "Magi2WindowAttnProcessor",
    "check_attention_kwargs",
    "check_transformer_geometry",
    "SINK_ATTENTION_PATHS",
    "magi2_attention_with_sinks",
    "sink_attention_path",
]


@dataclass
class Magi2AttentionMask:
    """Which tokens attend to which in one forward; built once by the model, read by every layer.

    Attributes:
        segment_lengths: tokens per packed sample; samples never attend to each other.
        window: block-window geometry of a single-sample sequence (window processors).
        dense_mask: explicit ``[N, N]`` bool mask (True = attend), evaluated with SDPA.

    The mask always describes the whole packed sequence, also where a context-parallel rank holds a shard of it.
    """

    segment_lengths: tuple
    window: Optional[Magi2WindowGeometry] = None
    dense_mask: Optional[torch.Tensor] = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def wrap(cls, mask: Union["Magi2AttentionMask", Sequence[int]]) -> "Magi2AttentionMask":
        """A mask as is, or the varlen mask of a sequence of segment lengths."""
        if isinstance(mask, cls):
            return mask
        return cls(tuple(int(n) for n in mask))

    def cached(self, key, build):
        """``build()`` once per mask."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


@dataclass
class Magi2ForwardContext:
    """What every block of one forward reads beside its hidden states; built once by the model.

    Attributes:
        rotary_emb: ``[N, 6D/8]`` fp32 rope bands, packed order (this rank's tokens under context parallelism).
        dispatch: the modality sort of those tokens.
        attention_mask: a :class:`Magi2AttentionMask` (segment lengths are wrapped into one) of the whole sequence.
        shard_plan: the forward's ``Magi2SequenceShardPlan`` under context parallelism, else ``None``; read only by
            the exchanges ``enable_parallelism`` installs on the attention and MoE layers.
    """

    rotary_emb: torch.Tensor
    dispatch: Magi2ModalityDispatch
    attention_mask: Union[Magi2AttentionMask, Sequence[int]]
    shard_plan: Optional[Any] = None

    def __post_init__(self) -> None:
        self.attention_mask = Magi2AttentionMask.wrap(self.attention_mask)


class _Magi2AttnProcessorBase:
    """The steps both processors share; subclasses give :meth:`attend` (packed order).

    Besides the whole-sequence ``__call__``, a processor attends a sequence in chunks of query rows (the refiner's
    token-chunked block, one process): :meth:`project` gives the roped q, k, v and the gate logits of every row,
    written chunk by chunk into whole ``[N, ...]`` tensors; :meth:`attend_rows` then attends one chunk of query rows
    over every key and projects its output. Only the inputs, k, v, q and the gate logits are sequence-wide (in the
    compute dtype; the gate in ``linear_g``'s); every other activation has the chunk's rows. The rows and the math
    are those of ``__call__``, so chunked and whole differ only where a GEMM or kernel rounds a row differently by
    the number of rows it is given.
    """

    _attention_backend = None

    def attend(
        self, attn, query, key, value, attention_mask: Magi2AttentionMask, heads=None, query_start: int = 0
    ) -> torch.Tensor:
        """``[Nq, Hq, D]``, ``[N, Hkv, D]`` x2 -> ``[Nq, Hq, D]``; ``heads``: the query heads this rank computes
        under context parallelism (``None``: all); ``query_start``: the packed row of ``query[0]`` (``Nq < N``: a
        chunk of the queries, one segment; its rows from :meth:`query_chunks`)."""
        raise NotImplementedError

    def query_chunks(self, attention_mask: Magi2AttentionMask, num_tokens: int, chunk_size: int) -> list:
        """``[(start, stop), ...]`` query rows of at most ``chunk_size`` (one process, one segment)."""
        return [(a, min(a + chunk_size, num_tokens)) for a in range(0, num_tokens, chunk_size)]

    def _project_rows(self, attn, hidden_states, group_sizes, dispatch, rotary_emb):
        """``(u, q, k, v)`` of modality-sorted rows: ``u`` the normed input, q/k normed and roped, all three in the
        compute dtype and packed order."""
        n = hidden_states.shape[0]
        dtype = attn.compute_dtype
        u = attn.pre_norm(hidden_states, group_sizes)
        q, k, v = torch.split(attn.linear_qkv(u, group_sizes), [attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = attn.q_norm(q.reshape(n, attn.heads, attn.head_dim), group_sizes)
        k = attn.k_norm(k.reshape(n, attn.kv_heads, attn.head_dim), group_sizes)
        v = v.reshape(n, attn.kv_heads, attn.head_dim)
        q = dispatch.unsort(q)  # one at a time: each sorted copy (and then qkv) is freed at once
        k = dispatch.unsort(k)
        v = dispatch.unsort(v)
        q = apply_magi2_rotary_emb(q, rotary_emb).to(dtype)
        k = apply_magi2_rotary_emb(k, rotary_emb).to(dtype)
        return u, q, k, v.to(dtype)

    def _output_rows(self, attn, out, gate_logits, group_sizes):
        """Gate and ``linear_proj`` of modality-sorted attention output rows ``[n, Hq, D]``."""
        n, dtype = out.shape[0], attn.compute_dtype
        if gate_logits is not None:
            g = gate_logits.float() if attn.gate_in_fp32 else gate_logits.to(out.dtype)
            out = out * sigmoid(g).unsqueeze(-1)
        return attn.linear_proj(out.reshape(n, attn.q_size).to(dtype), group_sizes)

    def project(self, attn, hidden_states: torch.Tensor, context: Magi2ForwardContext, chunks) -> tuple:
        """``(q, k, v, gate_logits)`` of every row, computed ``chunks`` (``[(start, stop), ...]``) at a time:
        ``[N, Hq, D]``, ``[N, Hkv, D]`` x2 in the compute dtype and ``[N, Hq]`` (``None`` ungated). Needs the identity
        modality dispatch (sorted = packed order)."""
        n, dtype = hidden_states.shape[0], attn.compute_dtype
        query = hidden_states.new_empty((n, attn.heads, attn.head_dim), dtype=dtype)
        key = hidden_states.new_empty((n, attn.kv_heads, attn.head_dim), dtype=dtype)
        value = torch.empty_like(key)
        gate = None
        for a, b in chunks:
            gs = chunk_group_sizes(context.dispatch.group_sizes, a, b) if attn.num_modality > 1 else None
            u, query[a:b], key[a:b], value[a:b] = self._project_rows(
                attn, hidden_states[a:b], gs, context.dispatch, context.rotary_emb[a:b]
            )
            if attn.linear_g is not None:
                g = attn.linear_g(u, gs)
                if gate is None:
                    gate = g.new_empty((n,) + tuple(g.shape[1:]))
                gate[a:b] = g
        return query, key, value, gate

    def attend_rows(self, attn, projected: tuple, context: Magi2ForwardContext, start: int, stop: int):
        """The attention output ``[stop - start, C]`` (compute dtype) of query rows ``[start, stop)`` (one of
        :meth:`query_chunks`) over every key; ``projected`` is :meth:`project`'s."""
        query, key, value, gate = projected
        gs = chunk_group_sizes(context.dispatch.group_sizes, start, stop) if attn.num_modality > 1 else None
        out = self.attend(attn, query[start:stop], key, value, context.attention_mask, query_start=start)
        return self._output_rows(attn, out.to(attn.compute_dtype), None if gate is None else gate[start:stop], gs)

    def _attend_shard(self, attn, shard: Magi2AttentionShard, attention_mask: Magi2AttentionMask) -> torch.Tensor:
        """:meth:`attend` over the shard's heads; a shard of no query head attends to nothing (``[N, 0, D]``)."""
        if shard.query.shape[1] == 0:
            return shard.query
        return self.attend(attn, shard.query, shard.key, shard.value, attention_mask, shard.heads)

    def __call__(self, attn: "Magi2Attention", hidden_states: torch.Tensor, context: Magi2ForwardContext):
        dispatch, mask = context.dispatch, context.attention_mask
        gs = dispatch.group_sizes if attn.num_modality > 1 else None
        u, q, k, v = self._project_rows(attn, hidden_states, gs, dispatch, context.rotary_emb)
        # the installed exchange brings the tokens and heads this rank attends over (one process: all, here)
        shard, handle = attn.exchange.dispatch(q, k, v, context.shard_plan)
        out = attn.exchange.combine(self._attend_shard(attn, shard, mask), handle)
        out = dispatch.sort(out.to(attn.compute_dtype))
        return self._output_rows(attn, out, None if attn.linear_g is None else attn.linear_g(u, gs), gs)


def _attend_rows_densely(query, key, value, scale, backend) -> torch.Tensor:
    """A chunk of one segment's query rows ``[Nq, Hq, D]`` over all its keys, through the kernel the whole segment
    takes (``dispatch_attention_fn``, k/v at ``Hq`` heads)."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = dispatch_attention_fn(query[None], key[None], value[None], scale=scale, backend=backend)
    return out[0].to(query.dtype)


class Magi2AttnProcessor(_Magi2AttnProcessorBase):
    """Varlen attention with sinks, one segment per packed sample (SandAI preview ``Attention.forward``).

    Args:
        upcast_off_cuda: attend the (rounded) q/k/v in fp32 off CUDA, as FA3 keeps softmax and ``P @ V`` in fp32.
    """

    def __init__(self, upcast_off_cuda: bool = True) -> None:
        self.upcast_off_cuda = upcast_off_cuda

    def attend(self, attn, query, key, value, attention_mask: Magi2AttentionMask, heads=None, query_start=0):
        sinks = attn.sinks
        if heads is not None and sinks is not None:
            sinks = sinks[:, heads.start : heads.stop]
        if self.upcast_off_cuda and not query.is_cuda and query.dtype != torch.float32:
            query, key, value = query.float(), key.float(), value.float()
        if query.shape[0] != key.shape[0]:  # a chunk of one segment's queries (the refiner's dense layers: no sinks)
            return _attend_rows_densely(query, key, value, attn.scale, self._attention_backend)
        return magi2_attention_with_sinks(
            query,
            key,
            value,
            sinks,
            attention_mask.segment_lengths,
            attn.scale,
            backend=self._attention_backend,
        )


class Magi2WindowAttnProcessor(_Magi2AttnProcessorBase):
    """Block-window attention of one packed Refiner sample (SandAI refiner ``Attention.forward``).

    Reads ``attention_mask.window`` or ``.dense_mask``; with neither it attends densely per segment.

    Args:
        backend: ``"auto"``, ``"sdpa"``, ``"flex"`` or ``"gather"`` (ValueError otherwise).
        max_dense_mask_elements: largest ``N * N`` dense mask the ``"sdpa"`` kernel may build.
    """

    def __init__(self, backend: str = "auto", max_dense_mask_elements: int = DEFAULT_MAX_DENSE_MASK_ELEMENTS) -> None:
        self.backend = check_backend("window_attn", backend)
        self.max_dense_mask_elements = int(max_dense_mask_elements)

    def query_chunks(self, attention_mask, num_tokens, chunk_size):
        """Query rows of at most ``chunk_size`` that start and end on window-block borders (a block larger than
        ``chunk_size`` is a chunk of its own), then the context rows."""
        geometry = attention_mask.window
        if geometry is None or attention_mask.dense_mask is not None:
            return super().query_chunks(attention_mask, num_tokens, chunk_size)
        return attention_mask.cached(("query_chunks", chunk_size), lambda: _block_chunks(geometry, chunk_size))

    def attend(self, attn, query, key, value, attention_mask: Magi2AttentionMask, heads=None, query_start=0):
        mask = attention_mask
        backend, max_dense, geometry = self.backend, self.max_dense_mask_elements, mask.window
        if mask.dense_mask is not None:
            return block_window_attention(
                query, key, value, None, dense_mask=mask.dense_mask, backend=backend, scale=attn.scale,
                query_start=query_start,
            )  # fmt: skip
        if geometry is None and query.shape[0] != key.shape[0]:
            return _attend_rows_densely(query, key, value, attn.scale, self._attention_backend)
        if geometry is None:
            return magi2_attention_with_sinks(
                query,
                key,
                value,
                None,
                mask.segment_lengths,
                attn.scale,
                self._attention_backend,
            )
        device = query.device
        backend = resolve_backend(
            "window_attn", backend, device, num_tokens=geometry.num_tokens, max_dense_elements=max_dense
        )
        dense = block = None
        if backend == "sdpa":
            dense = mask.cached(
                ("dense", geometry, str(device), max_dense),
                lambda: geometry.dense_mask(device, max_elements=max_dense),
            )
        elif backend == "flex" and query.shape[0] == key.shape[0]:
            block = mask.cached(("flex", geometry, str(device)), lambda: cached_flex_block_mask(geometry, device))
        elif backend == "flex":  # a chunk of the queries: its own block mask, once per forward
            rows = (query_start, query_start + query.shape[0])
            block = mask.cached(
                ("flex", geometry, str(device), rows), lambda: geometry.flex_block_mask(device, None, rows)
            )
        return block_window_attention(
            query,
            key,
            value,
            None if dense is not None else geometry,
            dense_mask=dense,
            backend=backend,
            scale=attn.scale,
            block_mask=block,
            max_dense_elements=max_dense,
            query_start=query_start,
        )


def _block_chunks(geometry: Magi2WindowGeometry, chunk_size: int) -> list:
    """``[(start, stop), ...]``: the video rows cut on window-block borders, at most ``chunk_size`` rows a chunk
    unless one block is larger; then the context rows in chunks of ``chunk_size``."""
    chunks, start = [], 0
    ends = geometry.block_ranges()[:, 1].tolist()
    for previous, end in zip([0] + ends[:-1], ends):
        if end - start > chunk_size and previous > start:
            chunks.append((start, previous))
            start = previous
    nv, n = geometry.num_video_tokens, geometry.num_tokens
    if nv > start:
        chunks.append((start, nv))
    chunks += [(a, min(a + chunk_size, n)) for a in range(nv, n, chunk_size)]
    return chunks


@dataclass(frozen=True)
class Magi2AttentionGeometry:
    """Head layout of a model's attention layers, the same in every layer: ``num_attention_heads`` query heads
    ``Hq`` and ``num_key_value_heads`` kv heads of ``attention_head_dim`` ``D`` (width ``C = Hq * D``), and
    ``num_sink_tokens`` sinks per head (0: none)."""

    num_attention_heads: int
    num_key_value_heads: int
    attention_head_dim: int
    num_sink_tokens: int = 0

    @property
    def hidden_size(self) -> int:
        """Model width ``C = Hq * D``."""
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_config(cls, config) -> "Magi2AttentionGeometry":
        """The geometry a model config names (``num_sink_tokens`` 0 where it names none)."""
        heads = (config.num_attention_heads, config.num_key_value_heads, config.attention_head_dim)
        return cls(*heads, config.get("num_sink_tokens", 0))


class Magi2Attention(nn.Module, AttentionModuleMixin):
    """Weights of one MAGI-2 attention (checkpoint prefix ``transformer_blocks.{i}.attention.``).

    Args:
        query_dim: model width ``C``.
        heads: query heads ``Hq``; ``Hq * dim_head`` is the attention width.
        kv_heads: key/value heads ``Hkv`` (``Hq % Hkv == 0``).
        dim_head: head dim ``D`` (``6 * D / 8`` dims carry rope).
        num_modality: 3 for multimodal layers (grouped weights), else 1.
        num_sink_tokens: sinks per head (0: none, no ``sinks`` parameter; the Preview uses 1).
        gated: per-head sigmoid output gate ``linear_g``.
        gate_in_fp32: apply the gate in fp32 (the Refiner) instead of the compute dtype (the Preview).
        eps: RMSNorm epsilon.
        params_dtype: dtype of ``linear_g``, ``linear_qkv``, ``linear_proj`` (``None`` = torch default).
        processor: a processor instance (default :class:`Magi2AttnProcessor`).

    Parameters (fp32 but the three linears): ``pre_norm [M*C]``, ``linear_g [M*Hq, C]``, ``linear_qkv
    [M*(Hq+2Hkv)*D, C]`` (rows q | k | v), ``linear_proj [M*C, Hq*D]``, ``sinks [S, Hq]``, ``q_norm``/``k_norm [M*D]``.
    """

    _default_processor_cls = Magi2AttnProcessor
    _available_processors = [Magi2AttnProcessor, Magi2WindowAttnProcessor]
    _supports_qkv_fusion = False

    def __init__(
        self,
        query_dim: int,
        heads: int,
        kv_heads: int,
        dim_head: int,
        num_modality: int = 1,
        num_sink_tokens: int = 0,
        gated: bool = True,
        gate_in_fp32: bool = False,
        eps: float = 1e-6,
        params_dtype: Optional[torch.dtype] = None,
        processor=None,
    ) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim_head
        self.num_modality = num_modality
        self.q_size = heads * dim_head
        self.kv_size = kv_heads * dim_head
        self.scale = dim_head**-0.5
        self.gate_in_fp32 = gate_in_fp32
        grouped = {"num_modality": num_modality, "dtype": params_dtype}
        self.pre_norm = Magi2MultiModalityRMSNorm(query_dim, num_modality, eps=eps)
        self.linear_g = modality_linear(query_dim, heads, **grouped) if gated else None
        self.linear_qkv = modality_linear(query_dim, self.q_size + 2 * self.kv_size, **grouped)
        self.linear_proj = modality_linear(self.q_size, query_dim, **grouped)
        if num_sink_tokens > 0:
            self.sinks = nn.Parameter(torch.zeros(num_sink_tokens, heads, dtype=torch.float32))
        else:
            self.sinks = None
        self.q_norm = Magi2MultiModalityRMSNorm(dim_head, num_modality, eps=eps, out_dtype=torch.float32)
        self.k_norm = Magi2MultiModalityRMSNorm(dim_head, num_modality, eps=eps, out_dtype=torch.float32)
        self.set_processor(processor if processor is not None else self._default_processor_cls())
        #: how the attention meets its tokens (:mod:`diffusers_magi2.parallel.exchanges`): all here (one process),
        #: or the Ulysses exchange that ``enable_parallelism`` installs
        self.exchange = Magi2LocalAttentionExchange()

    @classmethod
    def from_geometry(cls, geometry: Magi2AttentionGeometry, num_modality: int = 1, **kwargs) -> "Magi2Attention":
        """The attention of a layer with ``num_modality`` weight blocks in a model of ``geometry``; ``kwargs`` are
        the remaining constructor arguments (``gated``, ``eps``, ``processor``, ...)."""
        g = geometry
        heads = (g.num_attention_heads, g.num_key_value_heads, g.attention_head_dim)
        return cls(g.hidden_size, *heads, num_modality, g.num_sink_tokens, **kwargs)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype the attention runs in (``linear_qkv``'s compute dtype)."""
        return linear_compute_dtype(self.linear_qkv)

    def forward(self, hidden_states: torch.Tensor, context: Magi2ForwardContext) -> torch.Tensor:
        """``hidden_states`` ``[N, C]`` modality-sorted, ``context`` the forward's :class:`Magi2ForwardContext` ->
        ``[N, C]`` compute dtype."""
        return self.processor(self, hidden_states, context)


def check_transformer_geometry(
    num_layers: int, num_attention_heads: int, num_key_value_heads: int, attention_head_dim: int, **layer_lists
) -> None:
    """Check a MAGI-2 config's attention geometry and its per-layer index lists (``name=[indices]``).

    Raises:
        ValueError: a count below 1, ``Hq % Hkv != 0``, a head dim that is not a multiple of 8 (rope), or
            a layer index outside ``[0, num_layers)``.
    """
    if num_layers < 1 or num_attention_heads < 1 or num_key_value_heads < 1:
        raise ValueError("num_layers, num_attention_heads and num_key_value_heads must be >= 1")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({num_key_value_heads})"
        )
    if attention_head_dim % 8:
        raise ValueError(f"attention_head_dim must be a multiple of 8, got {attention_head_dim}")
    for name, layers in layer_lists.items():
        if layers is not None and any(not 0 <= int(i) < num_layers for i in layers):
            raise ValueError(f"{name} must hold layer indices in [0, {num_layers}), got {list(layers)}")


def check_attention_kwargs(owner: str, attention_kwargs, supported: Sequence[str]) -> dict:
    """``attention_kwargs`` as a dict after checking that ``owner`` (a model or pipeline name) uses every key.

    Raises:
        ValueError: not a dict/``None``, or a key outside ``supported`` (never silently dropped).
    """
    if attention_kwargs is None:
        return {}
    if not isinstance(attention_kwargs, dict):
        raise ValueError(f"attention_kwargs must be a dict or None, got {type(attention_kwargs).__name__}")
    unknown = sorted(k for k in attention_kwargs if k not in supported)
    if unknown:
        raise ValueError(
            f"{owner} does not support attention_kwargs {unknown}; allowed keys: {list(supported)} (choose attention "
            "kernels with set_attention_backend / set_attn_processor)"
        )
    return dict(attention_kwargs)
