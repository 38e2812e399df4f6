"""``Magi2MultiHeadMoE``: the routed-expert core of a MAGI-2 MoE layer, ready for expert parallelism (EP).

SandAI ``CoreMultiHeadMoE``: ``x [S, C]`` is viewed as ``[S, H, Dh]``; head ``h`` routes to the top-k of its own
``E`` experts (:mod:`.routing`) and sums their outputs weighted by ``route_scale * p``::

    y[s, h] = route_scale * sum_k p[s, h, k] * W_down[g] swiglu7(x[s, h] W_gate[g], x[s, h] W_up[g]),  g = h E + e_k

``forward`` = split heads -> ``exchange.dispatch`` -> :meth:`~Magi2MultiHeadMoE.forward_local_heads` (the local
experts) -> ``exchange.combine`` -> merge heads; the exchange (:mod:`diffusers_magi2.parallel.exchanges`) moves
nothing in one process. Tensors (``L`` local heads):
``gate [L E, Dh]`` fp32, ``W_gate``/``W_up [L E, Dh, De]``, ``W_down [L E, De, Dh]`` (``params_dtype``; or FP8 with
fp32 ``W_*_scale``; or int4 codes with bf16 ``W_*_group_scale``: the layer's :attr:`expert_storage`,
:mod:`.expert_storage`), ``router.expert_bias(_ema) [L E]`` fp32 frozen parameters (routing reads the EMA one).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import KW_ONLY, dataclass
from typing import Optional, Union, get_args

import torch
from torch import nn

from ..parallel.exchanges import expert_exchange
from ..parallel.expert_parallel import ep_head_layout
from ..utils.backends import check_backend, resolve_backend
from ..utils.dtype_utils import parse_dtype
from ..utils.safetensors_io import take_rows
from .expert_formats import expert_storage
from .expert_storage import BANKS as _BANKS
from .experts import mh_moe_experts
from .quantize import FP8_DTYPE, INT4, parse_expert_dtype
from .quantize_int4 import INT4_GROUP_SIZE
from .routing import NonFiniteLogitsFlag, RoutingScore, global_sort_routes, topk_probs_and_indices


__all__ = ["Magi2MultiHeadMoEConfig", "Magi2MultiHeadMoE", "moe_tensors_on_meta"]

# set by moe_tensors_on_meta: Magi2MultiHeadMoE builds its tensors on the meta device
_TENSORS_ON_META: contextvars.ContextVar[bool] = contextvars.ContextVar("magi2_moe_tensors_on_meta", default=False)


@contextlib.contextmanager
def moe_tensors_on_meta():
    """Every ``Magi2MultiHeadMoE`` built inside this context holds its tensors (router, expert banks, FP8 scales)
    on the meta device, so none is ever allocated at full size; a loader then places each one (e.g. only this
    expert-parallel rank's rows). accelerate's ``init_empty_weights`` would still allocate each parameter before
    moving it to meta, and keeps buffers real."""
    token = _TENSORS_ON_META.set(True)
    try:
        yield
    finally:
        _TENSORS_ON_META.reset(token)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


@dataclass(frozen=True)
class Magi2MultiHeadMoEConfig:
    """Shape and routing settings of one multi-head MoE core (SandAI ``moe_config``; the fields, their order and
    defaults of vLLM-Omni's ``mh_moe.Magi2MultiHeadMoEConfig``, plus keyword-only storage options).

    Attributes:
        hidden_size: width ``C``, split into ``num_heads`` heads of ``Dh = C / H``.
        num_heads: MoE heads ``H``.
        num_experts: experts per head ``E``.
        top_k: experts per (token, head), ``1 <= k <= E``.
        expert_intermediate_size: expert width ``De``.
        params_dtype: dtype of the expert banks (a name is accepted; stored as the ``torch.dtype``); the router is
            fp32.
        score_func: ``"sigmoid"`` or ``"softmax"`` (:data:`~diffusers_magi2.moe.routing.RoutingScore`).
        route_norm: L1-normalise the chosen weights.
        route_scale: factor applied once to the normalised weights.
        expert_dtype: keyword-only: ``None`` (``params_dtype``), ``"float8_e4m3fn"``
            (:mod:`diffusers_magi2.moe.quantize`) or ``"int4"`` (:mod:`diffusers_magi2.moe.quantize_int4`).
        int4_group_size: keyword-only: rows of the contraction dim per int4 scale (int4 experts only).

    Raises:
        ValueError: a non-positive size, ``C % H != 0``, ``top_k`` out of range, an unknown ``score_func`` or dtype,
            a non-finite ``route_scale``; with int4 experts, a group size that does not divide ``Dh`` (``W_gate``,
            ``W_up``) or ``De`` (``W_down``), or an odd ``Dh``/``De``, naming the tensor.
    """

    hidden_size: int
    num_heads: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    params_dtype: torch.dtype
    score_func: RoutingScore = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    _: KW_ONLY
    expert_dtype: Optional[Union[str, torch.dtype]] = None
    int4_group_size: int = INT4_GROUP_SIZE

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_experts", "top_k", "expert_intermediate_size"):
            _positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}): each MoE head "
                "owns hidden_size // num_heads channels"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}]; got {self.top_k}")
        if self.score_func not in get_args(RoutingScore):
            raise ValueError(f"score_func must be one of {get_args(RoutingScore)}; got {self.score_func!r}")
        if not isinstance(self.route_norm, bool):
            raise ValueError(f"route_norm must be a bool; got {self.route_norm!r}")
        if isinstance(self.route_scale, bool) or not isinstance(self.route_scale, (int, float)):
            raise ValueError(f"route_scale must be a finite float; got {self.route_scale!r}")
        if not math.isfinite(self.route_scale):
            raise ValueError(f"route_scale must be a finite float; got {self.route_scale!r}")
        # frozen: the normalised values are set once, here
        object.__setattr__(self, "params_dtype", parse_dtype(self.params_dtype, "params_dtype"))
        object.__setattr__(self, "route_scale", float(self.route_scale))
        object.__setattr__(self, "expert_dtype", parse_expert_dtype(self.expert_dtype))
        _positive_int("int4_group_size", self.int4_group_size)
        self.storage().check_banks(self.head_dim, self.expert_intermediate_size, "int4_group_size")

    @property
    def head_dim(self) -> int:
        """MoE head width ``Dh = hidden_size // num_heads`` (not the attention head dim)."""
        return self.hidden_size // self.num_heads

    def storage(self):
        """The :class:`~diffusers_magi2.moe.expert_storage.ExpertStorage` of ``expert_dtype``
        (:func:`~diffusers_magi2.moe.expert_formats.expert_storage`)."""
        return expert_storage(self.expert_dtype, self.params_dtype, self.int4_group_size)


class _Magi2RouterBuffers(nn.Module):
    """Holds the router biases, frozen fp32 parameters (``requires_grad=False``, as the seed's), so their keys read
    ``router.expert_bias(_ema)`` as in SandAI's files: ``expert_bias_ema`` steers the routing (SandAI's EMA bias,
    the pair of the EMA weights), ``expert_bias`` is kept beside it (a converter or loader writes it from the EMA
    one; whatever updates the bias updates ``expert_bias_ema``)."""

    def __init__(self, num_rows: int, device: Optional[str] = None) -> None:
        super().__init__()
        for name in ("expert_bias", "expert_bias_ema"):
            bias = torch.zeros(num_rows, dtype=torch.float32, device=device)
            self.register_parameter(name, nn.Parameter(bias, requires_grad=False))


class Magi2MultiHeadMoE(nn.Module):
    """Multi-head routed MoE core ``[S, C] -> [S, C]`` (module docstring); routing reads
    ``router.expert_bias_ema``. The EP head layout is ``ep_layout``
    (:func:`diffusers_magi2.parallel.expert_parallel.ep_head_layout`); row ``h_local E + e`` is global head
    ``local_head_start + h_local``.

    Args:
        config: :class:`Magi2MultiHeadMoEConfig`.
        ep_group: optional process group for expert parallelism (rank and size read from it).
        ep_rank: this rank's index in the EP group.
        ep_size: EP group size ``N``.

    Raises:
        ValueError: a bad ``config``, ``ep_size < 1``, ``ep_rank`` out of range, or rank/size disagreeing with the group.
    """

    def __init__(
        self,
        config: Magi2MultiHeadMoEConfig,
        ep_group: object | None = None,
        *,
        ep_rank: int | None = None,
        ep_size: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, Magi2MultiHeadMoEConfig):
            raise ValueError(f"config must be a Magi2MultiHeadMoEConfig; got {type(config).__name__}")
        if ep_group is not None:
            import torch.distributed as dist

            group_rank, group_size = dist.get_rank(ep_group), dist.get_world_size(ep_group)
            if ep_rank is not None and ep_rank != group_rank:
                raise ValueError(f"ep_rank={ep_rank} disagrees with the rank {group_rank} of ep_group")
            if ep_size is not None and ep_size != group_size:
                raise ValueError(f"ep_size={ep_size} disagrees with the size {group_size} of ep_group")
            ep_rank, ep_size = group_rank, group_size
        ep_size = 1 if ep_size is None else ep_size
        ep_rank = 0 if ep_rank is None else ep_rank
        _positive_int("ep_size", ep_size)
        if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank must be an int in [0, ep_size={ep_size}); got {ep_rank!r}")

        self.config = config
        self.ep_group = ep_group
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_heads
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        #: MoE head width ``Dh`` and expert width ``De`` (vLLM-Omni's names; ``head_dim`` and
        #: ``expert_intermediate_size`` are the same numbers under the config's names)
        self.d_head = self.head_dim = config.head_dim
        self.d_expert = self.expert_intermediate_size = config.expert_intermediate_size

        # 1. Expert-parallel bookkeeping (the head layout shared with the EP collectives).
        layout = self.ep_layout = ep_head_layout(self.num_heads, ep_size, ep_rank)
        self.padded_num_heads = layout.padded_num_heads
        self.local_num_heads = layout.local_num_heads
        self.local_head_start = layout.local_head_start
        self.ep_pad_heads = layout.padded_num_heads - self.num_heads
        self.local_real_num_heads = layout.num_real_local_heads
        self.has_real_moe_heads = layout.has_real_heads
        self.local_flatten_num_experts = self.local_num_heads * self.num_experts
        #: how the heads meet their tokens (:mod:`diffusers_magi2.parallel.exchanges`): dispatch before the local
        #: experts, combine after; ``enable_parallelism`` installs the context-parallel one
        self.exchange = expert_exchange(layout, ep_group)

        # 2. Tensors, under the checkpoint names and layouts.
        rows, dh, de = self.local_flatten_num_experts, self.head_dim, self.expert_intermediate_size
        device = "meta" if _TENSORS_ON_META.get() else None
        self.gate = nn.Parameter(torch.empty(rows, dh, dtype=torch.float32, device=device))
        #: how the expert banks are stored (:mod:`diffusers_magi2.moe.expert_storage`), chosen once: it creates the
        #: banks and their scales here, quantizes, dequantizes for the backends and keeps the dtypes on moves
        self.expert_storage = config.storage()
        #: kept for callers: whether the experts are FP8 or int4, and the int4 group size (the storage holds the rest)
        self.fp8_experts = config.expert_dtype == FP8_DTYPE
        self.int4_experts = config.expert_dtype == INT4
        self.int4_group_size = config.int4_group_size
        #: the scale buffers beside ``W_gate``/``W_up``/``W_down`` (FP8: fp32 ``*_scale``; int4: bf16
        #: ``*_group_scale``; none for unquantized experts)
        self.expert_scale_names = self.expert_storage.scale_names
        self.expert_storage.create_banks(self, rows, dh, de, device)
        self.router = _Magi2RouterBuffers(rows, device)
        self.reset_parameters()

        # 3. Backend, chosen once (see set_backend).
        self._backend = "auto"
        self._deterministic = False
        #: whether a router logit was NaN/inf since the last check (``route`` records it with no host read;
        #: ``models.finite_checks_magi2.check_router_inputs_finite`` reads and clears it)
        self.non_finite_router_logits = NonFiniteLogitsFlag()

    # ------------------------------------------------------------------ set-up

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init (normal, std 0.02 router / 1/sqrt(fan_in) experts); rows of padded heads are zero."""
        self.gate.normal_(0.0, 0.02)
        self.router.expert_bias.zero_()
        self.router.expert_bias_ema.zero_()
        real_rows = self.local_real_num_heads * self.num_experts
        self.gate[real_rows:].zero_()
        stds = (self.head_dim**-0.5, self.head_dim**-0.5, self.expert_intermediate_size**-0.5)
        self.expert_storage.init_banks(self, real_rows, stds)

    def set_backend(self, backend: str = "auto", *, deterministic: bool = False) -> None:
        """Choose the expert backend once for this module.

        Args:
            backend: ``"torch"`` (loop over experts), ``"torch_grouped"`` (grouped GEMMs, no host sync), ``"triton"``
                (fused kernel; CPU only under ``TRITON_INTERPRET=1``) or ``"auto"`` (the ``moe_experts`` row of
                :mod:`diffusers_magi2.utils.backends`, per call).
            deterministic: Triton only: atomic-free, reduced in ascending expert id (bit-identical across runs).

        Raises:
            ValueError: unknown backend, or ``"triton"`` with ``Dh``/``De`` not multiples of 16, FP8 experts on a GPU
                below compute capability 8.9 or int4 experts below 8.0 (checked per call too; no silent fallback).
            ImportError: ``"triton"`` requested but Triton cannot be imported.
        """
        check_backend("moe_experts", backend)
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be a bool; got {deterministic!r}")
        if backend == "triton":
            from .experts_triton import check_storage_device, check_triton_dims  # ImportError if Triton is missing

            check_triton_dims(self.head_dim, self.expert_intermediate_size)
            check_storage_device(self.expert_storage, self.W_gate.device)
        self._backend = backend
        self._deterministic = deterministic

    @property
    def backend(self) -> str:
        """The backend chosen with :meth:`set_backend` (``"auto"`` by default)."""
        return self._backend

    @property
    def deterministic(self) -> bool:
        """Whether the Triton backend runs in deterministic (atomic-free) mode."""
        return self._deterministic

    def ep_slice(self, checkpoint_tensor: torch.Tensor) -> torch.Tensor:
        """Slice flattened ``(head, expert)`` checkpoint rows for this rank.

        Rows ``[local_head_start E, (local_head_start + L) E)`` of a full (all-heads) ``[H E, ...]`` tensor, zeros
        for padded heads; a tensor that already holds this rank's ``L E`` rows is returned as it is.

        Raises:
            ValueError: ``checkpoint_tensor`` is not a tensor whose first dimension is ``H*E`` or ``L*E``.
        """
        full_rows, local_rows = self.num_heads * self.num_experts, self.local_flatten_num_experts
        rows = (
            checkpoint_tensor.shape[0]
            if isinstance(checkpoint_tensor, torch.Tensor) and checkpoint_tensor.dim()
            else None
        )
        if rows == local_rows:
            return checkpoint_tensor
        if rows != full_rows:
            raise ValueError(
                f"ep_slice expects a full tensor with first dimension H*E = {full_rows} (or this rank's L*E = "
                f"{local_rows}); got {tuple(getattr(checkpoint_tensor, 'shape', ()))}"
            )
        return take_rows(checkpoint_tensor, self.local_head_start * self.num_experts, local_rows)

    _EP_SHARDED_KEYS = ("gate", "W_gate", "W_up", "W_down", "router.expert_bias", "router.expert_bias_ema")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Full (all-heads) EP tensors are cut with :meth:`ep_slice`; other sizes raise ``ValueError``."""
        if self.ep_size > 1:
            full_rows = self.num_heads * self.num_experts
            for name in self._EP_SHARDED_KEYS + self.expert_scale_names:  # the scales are EP-sharded too
                key = prefix + name
                value = state_dict.get(key)
                if not isinstance(value, torch.Tensor) or value.dim() < 1:
                    continue
                if value.shape[0] == full_rows and full_rows != self.local_flatten_num_experts:
                    state_dict[key] = self.ep_slice(value)
                elif value.shape[0] != self.local_flatten_num_experts:
                    raise ValueError(
                        f"{key}: expert-parallel rank {self.ep_rank}/{self.ep_size} expects {self.local_flatten_num_experts}"
                        f" local rows or the full {full_rows} (num_heads*num_experts); got shape {tuple(value.shape)}"
                    )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ----------------------------------------------------------------- forward

    def forward(
        self,
        x: torch.Tensor,
        *,
        ep_token_counts: list[int] | None = None,
        shard_plan: object | None = None,
    ) -> torch.Tensor:
        """Routed MoE on ``x [S, hidden]`` (the ``split_linear`` output); returns ``[S, hidden]``.

        ``exchange.dispatch`` -> :meth:`forward_local_heads` -> ``exchange.combine`` (one process: nothing moves;
        expert parallel: the EP collectives; context parallel: the exchange ``enable_parallelism`` installed).

        Args:
            ep_token_counts: with EP, ``None`` (tokens replicated) or the per-rank token counts (tokens sharded;
                :mod:`diffusers_magi2.parallel.expert_parallel` layouts a and b).
            shard_plan: the forward's ``Magi2SequenceShardPlan`` under context parallelism (tokens are this rank's
                shard), else ``None``.

        Raises:
            ValueError: ``x`` is not ``[S, hidden_size]`` floating point; ``ep_token_counts`` is not ``ep_size``
                non-negative ints with this rank's entry equal to ``S``; ``ep_size > 1`` without a group.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(
                f"x must be a 2-D tensor [S, hidden_size={self.hidden_size}]; got {tuple(getattr(x, 'shape', ()))}"
            )
        if x.shape[1] != self.hidden_size:
            raise ValueError(f"x must have last dimension hidden_size={self.hidden_size}; got {x.shape[1]}")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"x must be float32/bfloat16/float16; got {x.dtype}")
        num_tokens = x.shape[0]
        heads = x.reshape(num_tokens, self.num_heads, self.head_dim)
        local, handle = self.exchange.dispatch(heads, ep_token_counts=ep_token_counts, shard_plan=shard_plan)
        local_out = self.forward_local_heads(local, sync_free=self.exchange.sync_free)
        return self.exchange.combine(local_out, handle).reshape(num_tokens, self.hidden_size)

    def compute_router_logits(self, x_local: torch.Tensor) -> torch.Tensor:
        """Router logits of the real local heads: ``[S', Hr, Dh] -> [Hr, S', E]`` in fp32 (x upcast).

        SandAI ``CoreMultiHeadMoE._route``; autocast is disabled here, so routing is fp32 under autocast too.
        """
        num_real = x_local.shape[1]
        gate = self.gate[: num_real * self.num_experts].to(torch.float32)
        gate = gate.view(num_real, self.num_experts, self.head_dim)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return torch.einsum("shd,hed->hse", x_local.to(torch.float32), gate)

    def route(self, x_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of the real local heads.

        Args:
            x_local: ``[S', Hr, Dh]``, ``Hr <= local_real_num_heads``.

        Returns:
            ``(probs [Hr, S', k] fp32`` already multiplied by ``route_scale``, ``indices [Hr, S', k] int64)``. NaN/inf
            logits are not refused here (no host read): they give NaN weights and are recorded in
            :attr:`non_finite_router_logits`.
        """
        num_real = x_local.shape[1]
        logits = self.compute_router_logits(x_local)
        self.non_finite_router_logits.record(logits)
        probs, indices = topk_probs_and_indices(
            logits,
            self.top_k,
            self.config.score_func,
            self.router.expert_bias_ema[: num_real * self.num_experts],
            self.config.route_norm,
        )
        return probs * self.config.route_scale, indices

    def forward_local_heads(self, x_local: torch.Tensor, *, sync_free: bool = False) -> torch.Tensor:
        """Route and run the experts of this rank's heads: ``[S', L, Dh] -> [S', L, Dh]``.

        ``x_local`` holds every token this rank serves, as :meth:`forward`'s exchange hands them over (checked
        there, not again); padded heads give zeros. ``sync_free=True`` (context parallelism) makes ``"auto"`` pick
        a backend without host synchronisation.

        Raises:
            RuntimeError: the chosen backend fails (no silent fallback).
        """
        num_real = self.local_real_num_heads
        if num_real == 0 or x_local.shape[0] == 0:
            return torch.zeros_like(x_local, memory_format=torch.contiguous_format)
        x_real = x_local[:, :num_real]
        probs, indices = self.route(x_real)
        routes = global_sort_routes(probs, indices, self.num_experts)
        rows = num_real * self.num_experts
        weights = [getattr(self, name)[:rows] for name in _BANKS]
        scales = [getattr(self, name)[:rows] for name in self.expert_scale_names] or None
        y = self.run_experts(x_real, routes, weights, scales=scales, sync_free=sync_free)
        if num_real == self.local_num_heads:
            return y
        out = torch.zeros_like(x_local, memory_format=torch.contiguous_format)
        out[:, :num_real] = y
        return out

    def run_experts(self, x, routes, weights, *, scales=None, sync_free: bool = False) -> torch.Tensor:
        """Expert compute with the backend chosen by :meth:`set_backend` (arguments as ``torch_mh_moe_forward``;
        ``sync_free`` as :meth:`forward_local_heads`)."""
        backend = resolve_backend("moe_experts", self._backend, x.device, sync_free=sync_free)
        return mh_moe_experts(  # global_sort_routes of this layer's top-k routes
            x, routes, weights, () if scales is None else scales, backend, self._deterministic, True
        )

    def _apply(self, fn, recurse=True):
        # banks and scales of a storage that keeps its dtypes (quantized) follow device moves only. fn is first
        # applied to an empty tensor of the same dtype and device, so a kept tensor is never converted (a
        # transient copy of the whole bank) only to be discarded
        if not self.expert_storage.keeps_dtype:
            return super()._apply(fn, recurse)
        kept = {id(getattr(self, name)) for name in self.expert_storage.layer_tensors()}

        def keep_storage_dtype(tensor):
            if id(tensor) in kept:
                probe = fn(tensor.new_empty(0))
                if probe.dtype != tensor.dtype:
                    return tensor.to(device=probe.device)
            return fn(tensor)

        return super()._apply(keep_storage_dtype, recurse)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, experts={self.num_experts}, top_k={self.top_k}, head_dim={self.head_dim}, "
            f"expert_dim={self.expert_intermediate_size}, ep_rank={self.ep_rank}, ep_size={self.ep_size}, "
            f"local_heads={self.local_num_heads}" + self.expert_storage.describe()
        )
