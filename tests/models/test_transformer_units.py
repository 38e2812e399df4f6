"""Unit checks of the shared MAGI-2 building blocks against independent computations/invariants."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffusers_magi2.loaders.sandai_config import load_sandai_config, preview_config_from_sandai
from diffusers_magi2.models.embeddings_magi2 import (
    Magi2RotaryPosEmbed,
    apply_magi2_rotary_emb,
    audio_coords,
    check_rope_coords,
    magi2_timestep_embedding,
    text_coords,
)
from diffusers_magi2.models.mhc import mhc_coefficients, mhc_hyper_connect, mhc_reduce_streams, sinkhorn_knopp
from diffusers_magi2.models.modality import (
    Magi2ModalityDispatch,
    Magi2ModalityGroupedLinear,
    Magi2MultiModalityRMSNorm,
    Modality,
    swiglu7_interleaved,
)


def test_timestep_embedding_cos_first_and_unrounded():
    emb = magi2_timestep_embedding(torch.tensor([0.0, 0.73325]), 64)
    assert torch.equal(emb[0], torch.cat([torch.ones(32), torch.zeros(32)]))
    p = torch.tensor(0.73325, dtype=torch.float32).double() * 1000  # fp32(t) * 1000, not rounded to 733
    freqs = torch.exp(-math.log(10000) * torch.arange(32, dtype=torch.float64) / 32)
    ref = torch.cat([torch.cos(p * freqs), torch.sin(p * freqs)])
    assert (emb[1].double() - ref).abs().max() < 5e-4  # fp32 argument rounding at p ~ 733
    assert (emb[1] - magi2_timestep_embedding(torch.tensor([0.733]), 64)[0]).abs().max() > 1e-3


def test_rope_layout_and_identity_for_text():
    rope = Magi2RotaryPosEmbed(32)
    assert torch.allclose(rope.bands, 10000 ** (-torch.arange(4) / 4.0))
    text = rope(text_coords(5))
    assert torch.equal(text, torch.cat([torch.zeros(5, 12), torch.ones(5, 12)], dim=1))
    audio = rope(audio_coords(11))  # t scaled by (ref-1)/(size-1) = 1/10
    assert torch.allclose(audio[3, 0], torch.sin(torch.tensor(3 * 0.1)))
    x = torch.randn(5, 2, 32)
    y = apply_magi2_rotary_emb(x, text)
    assert torch.equal(y, x)  # identity rotation
    coords = torch.tensor([[1.0, 2.0, 3.0, 4, 5, 6, 4, 5, 6]])
    r = rope(coords)
    y = apply_magi2_rotary_emb(x[:1], r)
    assert torch.allclose(y.norm(dim=-1), x[:1].norm(dim=-1), atol=1e-5)  # rotation keeps norms
    assert torch.equal(y[..., 24:], x[:1, :, 24:])  # last quarter not rotated
    with pytest.raises(ValueError, match="a size of 1 needs a reference of 1"):
        check_rope_coords(torch.tensor([[0.0, 0, 0, 1, 1, 1, 2, 1, 1]]))  # size 1 with ref 2: infinite scale
    check_rope_coords(coords)


def test_multi_modality_norm_and_grouped_linear_blocks():
    dispatch = Magi2ModalityDispatch.from_modality_mapping(torch.tensor([2, 0, 1, 3, 0], dtype=torch.int32))
    assert dispatch.group_sizes == (2, 1, 2)  # TIME counts as TEXT
    x = torch.randn(5, 8)
    xs = dispatch.sort(x)
    assert torch.equal(dispatch.unsort(xs), x)
    norm = Magi2MultiModalityRMSNorm(8, 3)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    y = norm(xs, dispatch.group_sizes)
    gains = norm.weight.view(3, 8) + 1
    ref = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * gains[dispatch.sorted_modality_ids]
    assert torch.allclose(y, ref, atol=1e-6)
    lin = Magi2ModalityGroupedLinear(8, 4, 3)
    out = lin(xs, dispatch.group_sizes)
    w = lin.weight.view(3, 4, 8)[dispatch.sorted_modality_ids]
    assert torch.allclose(out, torch.einsum("toi,ti->to", w, xs), atol=1e-6)
    with pytest.raises(ValueError):
        lin(xs, (1, 1, 1))
    with pytest.raises(ValueError):
        Magi2ModalityDispatch.from_modality_mapping(torch.tensor([0, 5]))
    for m in range(3):  # each modality's packed positions, without a host read
        assert torch.equal(dispatch.token_indices(m), (dispatch.modality_ids == m).nonzero().flatten())
    known = Magi2ModalityDispatch.from_modality_mapping(torch.tensor([2, 0, 1, 3, 0]), group_sizes=(2, 1, 2))
    assert torch.equal(known.permutation, dispatch.permutation) and known.group_sizes == dispatch.group_sizes
    assert int(Modality.TIME) == 3


def test_swiglu7_interleaved_constants():
    z = torch.tensor([[9.0, 9.0, -1.0, -9.0]])  # (gate 9 -> 7, lin 9 -> 7), (gate -1, lin -9 -> -7)
    out = swiglu7_interleaved(z)
    g = torch.tensor([7.0, -1.0])
    ref = g * torch.sigmoid(1.702 * g) * (torch.tensor([7.0, -7.0]) + 1)
    assert torch.allclose(out[0], ref)


def test_mhc_sinkhorn_and_mixing():
    torch.manual_seed(0)
    z = torch.randn(6, 4, 4)
    m = sinkhorn_knopp(z)
    assert torch.allclose(m.sum(-1), torch.ones(6, 4), atol=1e-6)  # rows last: exact
    assert torch.allclose(m.sum(-2), torch.ones(6, 4), atol=2e-2)  # columns: approximately
    h = torch.randn(6, 24)
    ones = torch.ones(1)
    pre, post, res = mhc_coefficients(
        h, ones, ones, ones, torch.zeros(4), torch.zeros(4), torch.zeros(4, 4), 4, 1.0, torch.float32
    )
    assert torch.allclose(pre, torch.sigmoid(h[:, :4])) and torch.allclose(post, 2 * torch.sigmoid(h[:, 4:8]))
    s = torch.randn(6, 4, 8)
    o = torch.randn(6, 8)
    assert torch.allclose(mhc_reduce_streams(pre, s), (pre[:, :, None] * s).sum(1), atol=1e-6)
    ref = torch.einsum("tij,tjc->tic", res, s) + post[:, :, None] * o[:, None]
    assert torch.allclose(mhc_hyper_connect(s, o, post, res), ref, atol=1e-6)
    # bf16: fused rounds once; both modes stay within bf16 resolution of the fp32 result
    for fused in (True, False):
        got = mhc_hyper_connect(s.bfloat16(), o.bfloat16(), post.bfloat16(), res.bfloat16(), fused)
        assert got.dtype == torch.bfloat16 and (got.float() - ref).abs().max() < 0.1


def test_sandai_config_extends_and_validation(tmp_path):
    base = {
        "arch_config": {
            "hidden_size": 8,
            "num_layers": 1,
            "head_dim": 8,
            "video_in_channels": 1,
            "audio_in_channels": 1,
            "text_in_channels": 1,
            "mhc_config": {"enable": True, "num_stream": 2},
            "attn_gating": {"enable": True},
            "attn_sinks": {"enable": True},
        },
        "x": {"a": 1, "b": 2},
    }
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "child.json").write_text(json.dumps({"extends": "base.json", "x": {"b": 3}}))
    cfg = load_sandai_config(tmp_path / "child.json")
    assert cfg["x"] == {"a": 1, "b": 3} and "extends" not in cfg
    assert preview_config_from_sandai(cfg)["num_streams"] == 2
    (tmp_path / "loop.json").write_text(json.dumps({"extends": "loop.json"}))
    with pytest.raises(ValueError, match="cyclic"):
        load_sandai_config(tmp_path / "loop.json")
    bad = json.loads(json.dumps(base))
    bad["arch_config"]["attn_sinks"]["enable"] = False
    with pytest.raises(ValueError, match="attn_sinks"):
        preview_config_from_sandai(bad)


def test_fused_mhc_chunking_is_exact(monkeypatch):
    import diffusers_magi2.models.mhc as mhc

    g = torch.Generator().manual_seed(5)
    s = torch.randn(37, 4, 16, generator=g).bfloat16()
    o = torch.randn(37, 16, generator=g).bfloat16()
    hp = torch.rand(37, 4, generator=g).bfloat16()
    hr = sinkhorn_knopp(torch.randn(37, 4, 4, generator=g)).bfloat16()
    whole = (mhc.mhc_reduce_streams(hp, s), mhc.mhc_hyper_connect(s, o, hp, hr))
    monkeypatch.setattr(mhc, "MHC_FUSED_CHUNK", 5)
    chunked = (mhc.mhc_reduce_streams(hp, s), mhc.mhc_hyper_connect(s, o, hp, hr))
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    # fused = one rounding of the fp32 result
    ref = (torch.einsum("tij,tjc->tic", hr.float(), s.float()) + hp.float()[..., None] * o.float()[:, None]).bfloat16()
    assert torch.equal(whole[1], ref)
