"""The one backend-selection policy (``diffusers_magi2.utils.backends``) and its ``moe_experts`` row."""

from __future__ import annotations

import re

import pytest
import torch

from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.utils import backends
from diffusers_magi2.utils.backends import BACKEND_CHOICES, check_backend, resolve_backend


def test_documented_table_lists_every_switch_and_backend() -> None:
    doc = backends.__doc__
    for switch, names in BACKEND_CHOICES.items():
        row = re.search(rf"^``{switch}``.*$", doc, flags=re.M)
        assert row, switch
        block = doc[row.start() : doc.find("\n``", row.end())]
        for name in names:
            assert f"``{name}``" in block, (switch, name)


@pytest.mark.parametrize(
    ("switch", "device", "conditions", "expected"),
    [
        ("moe_experts", "cpu", {}, "torch"),
        ("moe_experts", "cpu", {"sync_free": True}, "torch_grouped"),
        ("moe_experts", "cuda", {}, "triton"),
        ("moe_experts", "cuda", {"sync_free": True}, "triton"),
        ("moe_experts", "meta", {}, "torch"),
        ("mhc", "cuda", {"grad_enabled": False}, "fused"),
        ("mhc", "cuda", {"grad_enabled": True}, "torch"),
        ("mhc", "cpu", {"grad_enabled": False}, "torch"),
        ("window_attn", "cuda", {"num_tokens": 10**6, "max_dense_elements": 1}, "flex"),
        ("window_attn", "cpu", {"num_tokens": 100, "max_dense_elements": 10_000}, "sdpa"),
        ("window_attn", "cpu", {"num_tokens": 101, "max_dense_elements": 10_000}, "gather"),
    ],
)
def test_auto_resolves_per_table(switch, device, conditions, expected) -> None:
    assert resolve_backend(switch, "auto", torch.device(device), **conditions) == expected


@pytest.mark.parametrize("switch", sorted(BACKEND_CHOICES))
def test_concrete_backend_is_never_replaced(switch) -> None:
    for name in BACKEND_CHOICES[switch]:
        for device in ("cpu", "cuda"):
            assert resolve_backend(switch, name, device, grad_enabled=True, num_tokens=1, max_dense_elements=1) == name


def test_bad_names_raise_listing_allowed_values() -> None:
    with pytest.raises(
        ValueError, match=r"moe_experts backend must be one of \('auto', 'torch', 'torch_grouped', 'triton'\)"
    ):
        check_backend("moe_experts", "cuda")
    with pytest.raises(ValueError, match="unknown backend switch"):
        check_backend("attention", "auto")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("mhc", None, "cpu")
    module = Magi2MultiHeadMoE(Magi2MultiHeadMoEConfig(32, 2, 2, 1, 16, torch.float32))
    with pytest.raises(ValueError, match=r"\('auto', 'torch', 'torch_grouped', 'triton'\)"):
        module.set_backend("fused")
    assert module.backend == "auto"
