"""``model.out`` of the tiny fixtures' transformer cases (``<case>/fp32/transformer_case.safetensors``), for the
quantization tests and benchmarks: the preview with its own or teacher-forced routes, the refiner with its windows."""

from __future__ import annotations

import torch

from diffusers_magi2.moe.layer import Magi2MultiHeadMoE


def preview_out(model, d: dict, prefix: str, forced=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``model.out`` of the case and the top-k expert indices of every MoE layer (``[H, S, k]``, sorted along k).

    ``forced``: those indices per MoE layer instead of the model's own choice (teacher-forced routing), weighted as
    the router weights them (sigmoid scores at the chosen experts, L1-normalised, times ``route_scale``)."""
    chosen: list[torch.Tensor] = []
    moes = [m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]

    def recording(moe):
        route = moe.route

        def wrapped(x):
            probs, indices = route(x)
            if forced is not None:
                indices = forced[len(chosen)]
                probs = torch.sigmoid(moe.compute_router_logits(x)).gather(-1, indices)
                probs = probs / probs.sum(-1, keepdim=True) * moe.config.route_scale
            chosen.append(indices.sort(dim=-1).values)
            return probs, indices

        return wrapped

    for moe in moes:
        moe.route = recording(moe)
    try:
        g = lambda k: d[prefix + "model." + k]  # noqa: E731
        with torch.no_grad():
            out = model.forward_packed(
                g("x"), g("coords_mapping"), g("modality_mapping"), g("cu_seqlens_q"), g("time_token_sequence")
            )
    finally:
        for moe in moes:
            del moe.route
    return out[:, : g("out").shape[1]].float(), chosen


def refiner_out(model, d: dict) -> torch.Tensor:
    """``model.out`` of the refiner case (its local-attention windows)."""
    g = lambda k: d["noaudio.model." + k]  # noqa: E731
    with torch.no_grad():
        out = model.forward_packed(
            g("x"),
            g("coords_mapping"),
            g("modality_mapping"),
            q_ranges=g("local_attn.q_ranges"),
            k_ranges=g("local_attn.k_ranges"),
        )
    return out.float()
