"""Per-head top-k routing and the CSR route layout of MAGI-2's multi-head MoE (pure torch).

Per head, in the logits' dtype::

    scores    = sigmoid(logits)            (or softmax over the head's experts)
    selection = scores + expert_bias.view(H, 1, -1)       (the bias steers the choice only; [H] broadcasts)
    indices   = topk(selection, k, sorted=True).indices
    probs     = scores[indices] / max(sum |scores[indices]|, eps)     (with route_norm)

Routes are then sorted expert-major (CSR) over global ids ``g = h*E + e``. SandAI ``flash_mh_moe``
(``compute_topk_probs_and_indices``, ``flash_mh_moe_global_sort``) and vLLM-Omni's ``mh_moe``; the routing has no
host sync, so it runs in a CUDA graph or ``torch.compile``.

Non-finite logits are routed as the seed routes them: a NaN ranks first (as in ``torch.topk``) and makes its row's
weights NaN, which poison every expert output they reach; nothing here raises or reads the host. The MoE layer ORs
"some logit was not finite" into a device flag (:class:`NonFiniteLogitsFlag`), and the model's caller reads the
flags once per step, on every rank together
(:func:`diffusers_magi2.models.finite_checks_magi2.check_router_inputs_finite`), so a pipeline still refuses the
step. :func:`check_finite_router_logits` refuses non-finite logits with one host read for a caller that wants it. No
device-side assert is issued: on CUDA one would leave the context unusable for the next request.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

from ..utils.elementwise import sigmoid


__all__ = [
    "ExpertRoutes",
    "NonFiniteLogitsFlag",
    "RoutingScore",
    "check_finite_router_logits",
    "compute_topk_probs_and_indices",
    "global_sort_routes",
    "topk_probs_and_indices",
]

#: The router's score functions (``score_func``): per-expert sigmoid, or softmax over a head's experts.
RoutingScore = Literal["softmax", "sigmoid"]
_SCORE_FUNCS = get_args(RoutingScore)
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_NON_FINITE = "MoE router logits are not finite (NaN/inf in the MoE layer's input or gate weights); refusing to route"


class ExpertRoutes(NamedTuple):
    """The routes of one MoE call in CSR (expert-major) order over global expert ids ``g = h*E + e``, as
    :func:`global_sort_routes` returns them; the expert paths take it (or any three such tensors) as ``routes``.

    Attributes:
        gather_ids: ``[T]`` int32/int64, the token of each route.
        probs: ``[T]`` float, the weight of each route.
        expert_offsets: ``[H*E + 1]`` int32/int64; the routes of expert ``g`` are
            ``expert_offsets[g]:expert_offsets[g+1]``.
    """

    gather_ids: torch.Tensor
    probs: torch.Tensor
    expert_offsets: torch.Tensor


def check_finite_router_logits(router_logits: torch.Tensor) -> None:
    """Refuse non-finite router logits ``[H, S, E]`` (one host read; skipped while a CUDA graph is captured or
    ``torch.compile`` traces, where no value can be read).

    Raises:
        ValueError: naming the first (head, token) whose logits are not finite.
    """
    if torch.compiler.is_compiling() or (router_logits.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = ~torch.isfinite(router_logits)
    if not bool(bad.any()):
        return
    head, token, _ = (int(i) for i in bad.nonzero()[0])
    row = router_logits[head, token]
    raise ValueError(
        f"{_NON_FINITE}: head {head}, token {token} has logits {row[:4].tolist()}"
        f"{' ...' if row.numel() > 4 else ''}; check the input hidden states (and the gate) for NaN/inf"
    )


class NonFiniteLogitsFlag:
    """Whether some router logit was NaN/inf since the flag was last cleared: ``value`` is a 0-d bool device tensor
    (``None`` before the first :meth:`record`) that :meth:`record` ORs into with no host read. Each MoE layer holds
    one beside, not among, its parameters and buffers (as diffusers' hooks hold their state), so offloading hooks
    and dtype moves never touch it."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def record(self, router_logits: torch.Tensor) -> None:
        """``value |= any(~isfinite(router_logits))`` on the logits' device (a new tensor if it was elsewhere)."""
        seen = torch.isfinite(router_logits).logical_not().any()
        if self.value is None or self.value.device != seen.device:
            self.value = seen
        else:
            self.value.logical_or_(seen)

    def clear(self) -> None:
        if self.value is not None:
            self.value.zero_()


def compute_topk_probs_and_indices(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    score_func: RoutingScore = "sigmoid",
    expert_bias: torch.Tensor | None = None,
    route_norm: bool = True,
    norm_eps: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of every (head, token) and their weights (module docstring; ``route_scale`` not applied).

    Args:
        router_logits: ``[H, S, E]``, float32, bfloat16, float16 or float64; the routing runs in this dtype.
        top_k: experts per (head, token), ``1 <= top_k <= E``.
        score_func: ``"sigmoid"`` or ``"softmax"``.
        expert_bias: optional selection bias, ``[H, E]`` or ``[H*E]`` per expert, or ``[H]``, ``[H, 1]`` or
            ``[H, 1, 1]`` per head (broadcast over the experts); added as ``scores + expert_bias.view(H, 1, -1)``
            (type promotion included).
        route_norm: L1-normalise the chosen weights, ``p / max(sum |p|, norm_eps)``.
        norm_eps: lower clamp of the L1 norm.

    Returns:
        ``(probs [H, S, top_k]`` in the logits' dtype, ``indices [H, S, top_k] int64)``, in descending biased
        score; a row with a NaN logit has NaN weights (the NaN ranks first, as in ``torch.topk``).

    Raises:
        ValueError: ``router_logits`` is not a 3-D floating-point tensor, ``top_k`` is outside ``[1, E]``,
            ``score_func`` is unknown, or ``expert_bias`` is not a floating-point tensor of one of the shapes above.
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 3:
        raise ValueError(
            "router_logits must be a 3-D tensor [H, S, E]; got "
            f"{tuple(router_logits.shape) if isinstance(router_logits, torch.Tensor) else type(router_logits)}"
        )
    if not router_logits.is_floating_point() or router_logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"router_logits must be one of {_LOGIT_DTYPES}; got {router_logits.dtype}")
    num_heads, _, num_experts = router_logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}] (E = router_logits.shape[-1]); got {top_k!r}")
    if score_func not in _SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {_SCORE_FUNCS}; got {score_func!r}")
    if expert_bias is not None:
        shapes = _bias_shapes(num_heads, num_experts)
        if (
            not isinstance(expert_bias, torch.Tensor)
            or not expert_bias.is_floating_point()
            or tuple(expert_bias.shape) not in shapes
        ):
            got = tuple(expert_bias.shape) if isinstance(expert_bias, torch.Tensor) else type(expert_bias).__name__
            raise ValueError(
                f"expert_bias must be a floating-point tensor of shape {' or '.join(str(list(s)) for s in shapes)} "
                f"(H, E from router_logits); got {got}"
            )
    return topk_probs_and_indices(router_logits, top_k, score_func, expert_bias, route_norm, norm_eps)


def _bias_shapes(num_heads: int, num_experts: int) -> tuple[tuple[int, ...], ...]:
    """The ``expert_bias`` shapes routing takes: per expert, or per head (broadcast over the experts)."""
    return (num_heads, num_experts), (num_heads * num_experts,), (num_heads,), (num_heads, 1), (num_heads, 1, 1)


def topk_probs_and_indices(router_logits, top_k, score_func, expert_bias, route_norm, norm_eps=1e-12):
    """:func:`compute_topk_probs_and_indices` (same arguments, all positional) without its checks, for callers that
    made them (the MoE layer): non-finite logits give NaN weights (never an out-of-range index), no host read."""
    num_heads = router_logits.shape[0]
    if score_func == "sigmoid":
        scores = sigmoid(router_logits)
    else:
        scores = torch.softmax(router_logits, dim=-1)

    if expert_bias is None:
        selection = scores
    else:
        selection = scores + expert_bias.to(device=scores.device).reshape(num_heads, 1, -1)
    _, indices = torch.topk(selection, top_k, dim=-1, largest=True, sorted=True)
    probs = torch.gather(scores, -1, indices)
    if route_norm:
        probs = probs / probs.abs().sum(dim=-1, keepdim=True).clamp_min(norm_eps)
    return probs, indices


def global_sort_routes(
    topk_probs: torch.Tensor,
    topk_indices: torch.Tensor,
    num_experts: int,
) -> ExpertRoutes:
    """Routes in (head, token, k) order, stably sorted by global expert id (offsets by ``searchsorted``).

    Args:
        topk_probs: ``[H, S, k]`` float routing weights.
        topk_indices: ``[H, S, k]`` integer local expert ids.
        num_experts: ``E``, experts per head.

    Returns:
        :class:`ExpertRoutes` ``(gather_ids [T]`` int32, ``probs [T]`` float32, ``expert_offsets [H*E + 1]`` int64),
        ``T = H * S * k``.

    Raises:
        ValueError: shapes differ or are not 3-D, ``topk_indices`` is not an integer tensor, or
            ``num_experts < 1``.
    """
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 3:
        raise ValueError("topk_indices must be a 3-D integer tensor [H, S, k]")
    if not isinstance(topk_probs, torch.Tensor) or topk_probs.shape != topk_indices.shape:
        raise ValueError(
            "topk_probs must be a tensor with the same shape as topk_indices [H, S, k]; got "
            f"{tuple(getattr(topk_probs, 'shape', ()))} vs {tuple(topk_indices.shape)}"
        )
    if topk_indices.dtype.is_floating_point or topk_indices.dtype == torch.bool:
        raise ValueError(f"topk_indices must be an integer tensor; got {topk_indices.dtype}")
    if not topk_probs.is_floating_point():
        raise ValueError(f"topk_probs must be a floating-point tensor; got {topk_probs.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int; got {num_experts!r}")

    num_heads, num_tokens, top_k = topk_indices.shape
    device = topk_indices.device
    head_base = torch.arange(num_heads, device=device, dtype=torch.int64).view(num_heads, 1, 1) * num_experts
    flat_ids = (topk_indices.to(torch.int64) + head_base).reshape(-1)
    if num_heads * num_experts < 2**31:  # int32 keys sort ~3x faster on CPU; same stable order
        flat_ids = flat_ids.to(torch.int32)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    probs_sorted = topk_probs.reshape(-1).to(torch.float32).index_select(0, order)
    # position p in (h, s, k) order holds token (p // k) % S (int32 when it fits)
    positions = order.to(torch.int32 if order.numel() < 2**31 else torch.int64, copy=True)
    gather_ids = positions.div_(top_k, rounding_mode="floor").remainder_(max(num_tokens, 1)).to(torch.int32)
    boundaries = torch.arange(num_heads * num_experts + 1, device=device, dtype=sorted_ids.dtype)
    expert_offsets = torch.searchsorted(sorted_ids, boundaries, right=False).to(torch.int64)
    return ExpertRoutes(gather_ids, probs_sorted, expert_offsets)
