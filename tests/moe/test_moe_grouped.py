"""The ``torch_grouped`` expert backend: the torch path's math with no host synchronisation.

It is the backend context parallelism picks on CPU (``"auto"`` with ``sync_free``); here it is checked against
the default torch path and for the absence of host reads (``.item()``, ``.tolist()``, ``.cpu()``,
``bool()``/``int()``/``float()`` of a tensor). Against SandAI's fixtures: ``test_moe_fixtures.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.moe_cases import count_host_reads, random_case

from diffusers_magi2.moe.experts import mh_moe_experts
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.moe.quantize import quantize_fp8
from diffusers_magi2.moe.routing import global_sort_routes


def _experts(backend, x, routes, weights, scales=()):
    with torch.no_grad():
        return mh_moe_experts(x, routes, weights, scales, backend, False, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_backend_matches_torch_backend(dtype: torch.dtype) -> None:
    """Same rounding points as the torch path; only fp32 elementwise/GEMM blocking may differ (≤ a few ulp)."""
    for shape in [(9, 3, 5, 3, 16, 24), (33, 3, 16, 6, 16, 32), (1, 2, 6, 1, 16, 16)]:
        x, probs, idx, *weights = random_case(*shape, dtype)
        routes = global_sort_routes(probs, idx, shape[2])
        got, want = (_experts(b, x, routes, weights) for b in ("torch_grouped", "torch"))
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(got, want)


def test_grouped_backend_fp8_and_mixed_dtypes_match_torch_backend() -> None:
    x, probs, idx, wg, wu, wd = random_case(20, 3, 5, 2, 16, 32, torch.bfloat16)
    routes = global_sort_routes(probs, idx, 5)
    quantized = [quantize_fp8(w) for w in (wg, wu, wd)]
    weights, scales = [q for q, _ in quantized], [s for _, s in quantized]
    got, want = (_experts(b, x, routes, weights, scales) for b in ("torch_grouped", "torch"))
    torch.testing.assert_close(got, want)
    got, want = (_experts(b, x.float(), routes, (wg, wu, wd)) for b in ("torch_grouped", "torch"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_grouped_backend_reads_nothing_on_the_host() -> None:
    """The whole MoE module forward (routing, CSR layout, experts, reduce) under ``torch_grouped``."""
    module = Magi2MultiHeadMoE(Magi2MultiHeadMoEConfig(64, 4, 8, 2, 32, torch.float32)).eval()
    module.set_backend("torch_grouped")
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), count_host_reads() as counts:
        out = module(x)
    assert counts == {}
    module.set_backend("torch")
    with torch.no_grad():
        torch.testing.assert_close(out, module(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad(), count_host_reads() as counts:
        module(x)
    assert counts.get("tolist", 0) >= 1  # the probe sees the default path's host read of the expert offsets


def test_grouped_backend_empty_and_bad_input() -> None:
    x, probs, idx, *weights = random_case(6, 2, 4, 2, 16, 16, torch.float32)
    gather_ids, probs_sorted, offsets = global_sort_routes(probs, idx, 4)
    empty = _experts("torch_grouped", x[:0], (gather_ids[:0], probs_sorted[:0], torch.zeros_like(offsets)), weights)
    assert empty.shape == (0, 2, 16) and empty.dtype == torch.float32
    with pytest.raises(ValueError, match="needs top-k routes"):  # 23 routes over 6 tokens x 2 heads
        _experts("torch_grouped", x, (gather_ids[:23], probs_sorted[:23], offsets.clamp(max=23)), weights)


def test_grouped_backend_upcasts_one_heads_experts_at_a_time(monkeypatch) -> None:
    """Never the whole bank in fp32: each upcast holds the ``E`` experts of one head (FP8 dequantized likewise)."""
    from diffusers_magi2.moe.expert_storage_fp8 import Fp8ExpertStorage

    num_heads, num_experts = 3, 5
    x, probs, idx, *weights = random_case(12, num_heads, num_experts, 2, 16, 24, torch.bfloat16)
    routes = global_sort_routes(probs, idx, num_experts)
    quantized = [quantize_fp8(w) for w in weights]
    upcast_rows = []
    original = Fp8ExpertStorage.dequantize

    def recording(self, weight, scale, out=None):
        upcast_rows.append(weight.shape[0])
        return original(self, weight, scale, out=out)

    monkeypatch.setattr(Fp8ExpertStorage, "dequantize", recording)
    got = _experts("torch_grouped", x, routes, [q for q, _ in quantized], [s for _, s in quantized])
    assert upcast_rows == [num_experts] * (3 * num_heads)
    monkeypatch.setattr(Fp8ExpertStorage, "dequantize", original)
    torch.testing.assert_close(got, _experts("torch", x, routes, [q for q, _ in quantized], [s for _, s in quantized]))


def test_torch_grouped_refuses_routes_not_declared_top_k():
    """``torch_grouped`` slices each head's routes at ``h·S·k``, which only top-k routes guarantee: a CSR of any
    other form is refused, pointing to ``"torch"``, which reads the head bounds."""
    x, probs, idx, *weights = random_case(9, 3, 5, 3, 16, 24, torch.float32)
    routes = list(global_sort_routes(probs, idx, 5))
    with pytest.raises(ValueError, match=r"torch_grouped expert backend takes top-k routes only.*use 'torch'"):
        mh_moe_experts(x, routes, weights, [], "torch_grouped", False, False)
