"""Feed-forward layers of MAGI-2 (SandAI ``MLP`` and ``MultiHeadMoELayer``), under ``transformer_blocks.{i}.mlp.``::

    dense:  y = down_proj(swiglu7(up_gate_proj(pre_norm(x))))
    MoE:    u = pre_norm(x);  y = merge_linear(moe(split_linear(u))) + shared_fc2(swiglu7(shared_fc1(u)))
                                  + modality_shared_fc2(swiglu7(modality_shared_fc1(u)))

with the three MoE terms each rounded to the residual dtype before the sum, as SandAI does.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

from ..moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from .modality import (
    Magi2ModalityDispatch,
    Magi2MultiModalityRMSNorm,
    chunk_group_sizes,
    modality_linear,
    swiglu7_interleaved,
)


__all__ = ["Magi2FeedForward", "Magi2MoEFeedForward", "check_chunk_size", "run_token_chunks"]


class Magi2FeedForward(nn.Module):
    """Dense swiglu7 MLP of both models (SandAI ``MLP``); ``up_gate_proj`` ``[M*2I, C]`` has gate/linear rows
    interleaved, ``down_proj`` is ``[M*C, I]``.

    Args:
        hidden_size: ``C``; intermediate_size: ``I``; num_modality: ``M`` (1 or 3).
        params_dtype: dtype of the two linears.
        eps: RMSNorm epsilon.
        output_dtype: dtype of the result; ``None`` = the input dtype (the refiner's is fp32).
        chunk_size: tokens per chunk (``None`` = unchunked; the same math up to GEMM rounding).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_modality: int = 1,
        params_dtype=None,
        eps: float = 1e-6,
        output_dtype: Optional[torch.dtype] = None,
        chunk_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.num_modality = num_modality
        self.output_dtype = output_dtype
        self.chunk_size = chunk_size
        self.pre_norm = Magi2MultiModalityRMSNorm(hidden_size, num_modality, eps=eps)
        self.up_gate_proj = modality_linear(hidden_size, 2 * intermediate_size, num_modality, dtype=params_dtype)
        self.down_proj = modality_linear(intermediate_size, hidden_size, num_modality, dtype=params_dtype)

    def _forward_tokens(self, hidden_states: torch.Tensor, group_sizes) -> torch.Tensor:
        x = self.pre_norm(hidden_states, group_sizes)
        x = self.up_gate_proj(x, group_sizes)
        x = swiglu7_interleaved(x)
        return self.down_proj(x, group_sizes).to(self.output_dtype or hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor, dispatch: Magi2ModalityDispatch, shard_plan=None) -> torch.Tensor:
        """Dense MLP on modality-sorted tokens.

        Args:
            hidden_states: ``[T, C]`` tokens, sorted by modality as ``dispatch`` describes.
            dispatch: the batch's modality order.
            shard_plan: not read (per-token work); taken so every block MLP has one signature.

        Returns:
            ``[T, C]`` in :attr:`output_dtype` (default ``hidden_states.dtype``).

        Raises:
            ValueError: last dim is not ``C``, or the group sizes do not sum to ``T``.
        """
        gs = dispatch.group_sizes if self.num_modality > 1 else None
        return run_token_chunks(self._forward_tokens, hidden_states, gs, self.chunk_size, self.output_dtype)


def check_chunk_size(chunk_size) -> Optional[int]:
    """``chunk_size`` if it is ``None`` or a positive int.

    Raises:
        ValueError: any other value (a chunk size <= 0 included).
    """
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk) or None; got {chunk_size!r}")
    return chunk_size


def run_token_chunks(fn, hidden_states: torch.Tensor, group_sizes, chunk: Optional[int], out_dtype=None):
    """``fn(tokens, group_sizes)`` over token chunks of ``hidden_states`` ``[T, C]`` (modality-sorted), written into
    one preallocated output; each chunk gets the modality counts of its rows."""
    n = hidden_states.shape[0]
    if chunk is None or n <= chunk:
        return fn(hidden_states, group_sizes)
    out = None
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        y = fn(hidden_states[a:b], None if group_sizes is None else chunk_group_sizes(group_sizes, a, b))
        if out is None:
            out = y.new_empty((n,) + tuple(y.shape[1:]), dtype=out_dtype or y.dtype)
        out[a:b] = y
    return out


class Magi2MoEFeedForward(nn.Module):
    """Multi-head MoE MLP with shared experts (SandAI ``MultiHeadMoELayer``; module docstring); ``moe_mlp`` is
    :class:`diffusers_magi2.moe.layer.Magi2MultiHeadMoE`, its banks stored in ``moe.expert_dtype``.

    Args:
        hidden_size: model width ``C``.
        moe: the routed core's settings; ``moe.hidden_size`` is the width between ``split_linear`` and
            ``merge_linear``, ``moe.params_dtype`` the dtype of every projection here (the config's default: bf16).
        shared_intermediate_size: width of the shared expert.
        modality_specific_intermediate_size: width of the per-modality shared expert.
    """

    def __init__(
        self,
        hidden_size: int,
        moe: Magi2MultiHeadMoEConfig,
        shared_intermediate_size: int,
        modality_specific_intermediate_size: int,
    ) -> None:
        super().__init__()
        num_modality = 3
        dtype = moe.params_dtype
        self.shared_intermediate_size = shared_intermediate_size
        self.modality_specific_intermediate_size = modality_specific_intermediate_size
        self.pre_norm = Magi2MultiModalityRMSNorm(hidden_size, num_modality)
        self.split_linear = modality_linear(hidden_size, moe.hidden_size, 1, dtype=dtype)
        self.merge_linear = modality_linear(moe.hidden_size, hidden_size, 1, dtype=dtype)
        self.moe_mlp = Magi2MultiHeadMoE(moe)
        self.chunk_size: Optional[int] = None  # tokens per chunk (enable_forward_chunking); None = all at once
        self.shared_expert_fc1 = modality_linear(hidden_size, 2 * shared_intermediate_size, 1, dtype=dtype)
        self.shared_expert_fc2 = modality_linear(shared_intermediate_size, hidden_size, 1, dtype=dtype)
        self.modality_specific_shared_expert_fc1 = modality_linear(
            hidden_size, 2 * modality_specific_intermediate_size, num_modality, dtype=dtype
        )
        self.modality_specific_shared_expert_fc2 = modality_linear(
            modality_specific_intermediate_size, hidden_size, num_modality, dtype=dtype
        )

    def shared_forward(self, norm_output: torch.Tensor, dispatch) -> torch.Tensor:
        """Shared + modality-specific shared experts on the normed input ``[T, C]`` (``dispatch``: anything with
        ``group_sizes``, or the group sizes themselves)."""
        gs = getattr(dispatch, "group_sizes", dispatch)
        x1 = self.shared_expert_fc1(norm_output)
        x2 = self.modality_specific_shared_expert_fc1(norm_output, gs)
        a = swiglu7_interleaved(x1)
        b = swiglu7_interleaved(x2)
        return self.shared_expert_fc2(a) + self.modality_specific_shared_expert_fc2(b, gs)

    def forward(self, hidden_states: torch.Tensor, dispatch: Magi2ModalityDispatch, shard_plan=None) -> torch.Tensor:
        """Routed + shared experts on modality-sorted tokens.

        Args:
            hidden_states: ``[T, C]`` tokens in the residual dtype, sorted as ``dispatch`` describes.
            dispatch: the batch's modality order.
            shard_plan: the forward's ``Magi2SequenceShardPlan`` under context parallelism (tokens are this rank's
                shard), else ``None``; handed to the routed experts' exchange.

        Returns:
            ``[T, C]`` in ``hidden_states.dtype``.

        Raises:
            ValueError: last dim is not ``C``, the group sizes do not sum to ``T``, or the expert backend fails.
        """
        # the routed experts' exchange says whether the layer may run in token chunks (not when it exchanges tokens)
        chunk = _moe_core(self.moe_mlp).exchange.token_chunk(self.chunk_size)
        tokens = functools.partial(self._forward_tokens, shard_plan=shard_plan)
        return run_token_chunks(tokens, hidden_states, dispatch.group_sizes, chunk)

    def _forward_tokens(self, hidden_states: torch.Tensor, group_sizes, shard_plan=None) -> torch.Tensor:
        dtype = hidden_states.dtype
        norm_output = self.pre_norm(hidden_states, group_sizes)
        routed = self.moe_mlp(self.split_linear(norm_output), shard_plan=shard_plan)
        routed = self.merge_linear(routed)
        shared = self.shared_forward(norm_output, group_sizes)
        return (routed.to(dtype) + shared.to(dtype)).to(dtype)


def _moe_core(moe: nn.Module) -> nn.Module:
    """The ``Magi2MultiHeadMoE`` itself, also where a router LoRA wraps it."""
    return moe.get_base_layer() if hasattr(moe, "get_base_layer") else moe
