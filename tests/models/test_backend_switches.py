"""The mHC and window-attention switches go through the one backend policy (``diffusers_magi2.utils.backends``)."""

from __future__ import annotations

import pytest
import torch

from diffusers_magi2.models.attention_magi2 import Magi2WindowAttnProcessor
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.window_attention import Magi2WindowGeometry, block_window_attention
from diffusers_magi2.utils.backends import BACKEND_CHOICES


TINY = {
    "num_layers": 1,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "num_key_value_heads": 2,
    "in_channels": 4,
    "audio_in_channels": 4,
    "text_in_channels": 4,
    "multimodal_layers": (),
    "moe_layers": (),
    "num_streams": 2,
}


def test_mhc_switch_resolves_through_the_policy_table():
    model = Magi2Transformer3DModel(**TINY)
    block = model.transformer_blocks[0]
    streams = torch.zeros(3, 2, model.hidden_size)
    assert not block._mhc_fused(streams)  # "auto" off CUDA: the torch einsums, as SandAI's code
    model.set_mhc_backend("fused")
    assert block._mhc_fused(streams)  # a concrete name is never replaced
    model.set_mhc_backend("torch")
    assert not block._mhc_fused(streams)
    with pytest.raises(ValueError, match=r"mhc backend must be one of \('auto', 'fused', 'torch'\)"):
        model.set_mhc_backend("triton")


def test_window_switch_names_come_from_the_policy_table():
    allowed = ("auto", *BACKEND_CHOICES["window_attn"])
    for name in allowed:
        assert Magi2WindowAttnProcessor(backend=name).backend == name
    with pytest.raises(ValueError, match=r"window_attn backend must be one of \('auto', 'sdpa', 'flex', 'gather'\)"):
        Magi2WindowAttnProcessor(backend="fa3")
    geometry = Magi2WindowGeometry((2, 2, 2), (1, 1, 1), (1, 1, 1))
    q = torch.randn(8, 2, 8)
    with pytest.raises(ValueError, match="window_attn backend must be one of"):
        block_window_attention(q, q, q, geometry, backend="dense")
    # "auto" on CPU with a small mask is sdpa, a concrete "gather" runs the gather kernel: both the same attention
    torch.testing.assert_close(
        block_window_attention(q, q, q, geometry, backend="auto"),
        block_window_attention(q, q, q, geometry, backend="gather"),
    )
