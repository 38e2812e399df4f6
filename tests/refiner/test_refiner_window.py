"""Block-window attention geometry and masks of the refiner (SandAI ``refiner_data_proxy.py``) against SandAI's fixture."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

from diffusers_magi2.models.window_attention import (
    Magi2WindowGeometry,
    block_window_attention,
    ranges_to_dense_mask,
)


CASES = [("", 16), ("noaudio.", 6)]  # (prefix, audio + text tokens)


@pytest.fixture(scope="module")
def case(fixtures_dir):
    return load_file(str(fixtures_dir / "magi2_tiny/refiner/fp32/transformer_case.safetensors"))


def _naive_mask(grid, block, radius, n_ctx):
    """Independent brute force: raster tokens -> block order by sorting, then pairwise rule."""
    T, H, W = grid
    toks = list(itertools.product(range(T), range(H), range(W)))
    key = lambda p: (p[0] // block[0], p[1] // block[1], p[2] // block[2], p)  # noqa: E731
    ordered = sorted(toks, key=key)
    nv = len(ordered)
    n = nv + n_ctx
    m = torch.ones(n, n, dtype=torch.bool)
    for i, a in enumerate(ordered):
        for j, b in enumerate(ordered):
            m[i, j] = all(abs(a[x] // block[x] - b[x] // block[x]) <= radius[x] for x in range(3))
    return ordered, m


@pytest.mark.parametrize("prefix,n_ctx", CASES)
def test_ranges_from_config_equal_fixture_pairs(case, prefix, n_ctx):
    geom = Magi2WindowGeometry((5, 4, 8), (2, 2, 2), (1, 1, 1), n_ctx)
    assert geom.num_tokens == case[prefix + "model.x"].shape[0]
    q, k = geom.ranges()
    ours = ranges_to_dense_mask(q, k, geom.num_tokens)
    ref = ranges_to_dense_mask(
        case[prefix + "model.local_attn.q_ranges"], case[prefix + "model.local_attn.k_ranges"], geom.num_tokens
    )
    assert torch.equal(ours, ref)
    assert torch.equal(geom.dense_mask(), ref)
    # the window really restricts something (not a full mask)
    assert 0.3 < ref.float().mean().item() < 0.9


@pytest.mark.parametrize("prefix,n_ctx", CASES)
def test_block_order_matches_fixture(case, prefix, n_ctx):
    geom = Magi2WindowGeometry((5, 4, 8), (2, 2, 2), (1, 1, 1), n_ctx)
    restore = case[prefix + "proxy.token_restore_order"].long()
    nv = geom.num_video_tokens
    assert torch.equal(geom.video_restore_order(), restore[:nv])
    assert torch.equal(restore[nv:], torch.arange(nv, geom.num_tokens))
    T, H, W = geom.grid
    raster = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij"), -1).reshape(
        -1, 3
    )
    coords = case[prefix + "model.coords_mapping"][:nv, :3].long()
    assert torch.equal(raster[geom.video_token_order()], coords)
    # order and restore are inverse permutations
    assert torch.equal(geom.video_token_order()[geom.video_restore_order()], torch.arange(nv))


@pytest.mark.parametrize(
    "grid,block,radius,n_ctx",
    [((5, 3, 7), (2, 2, 3), (1, 0, 1), 3), ((3, 5, 4), (2, 2, 2), (0, 1, 2), 0), ((4, 4, 4), (3, 3, 3), (1, 1, 1), 2)],
)
def test_mask_and_order_vs_brute_force(grid, block, radius, n_ctx):
    geom = Magi2WindowGeometry(grid, block, radius, n_ctx)
    ordered, m = _naive_mask(grid, block, radius, n_ctx)
    T, H, W = grid
    raster_index = {p: (p[0] * H + p[1]) * W + p[2] for p in ordered}
    assert geom.video_token_order().tolist() == [raster_index[p] for p in ordered]
    assert torch.equal(geom.dense_mask(), m)
    q, k = geom.ranges()
    assert torch.equal(ranges_to_dense_mask(q, k, geom.num_tokens), m)


@pytest.mark.parametrize("backend", ["gather", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree_with_dense_sdpa(backend, dtype):
    torch.manual_seed(0)
    geom = Magi2WindowGeometry((5, 6, 7), (2, 4, 3), (1, 1, 1), 5)  # partial blocks on every axis
    n = geom.num_tokens
    q = torch.randn(n, 6, 16, dtype=dtype)
    k = torch.randn(n, 2, 16, dtype=dtype)
    v = torch.randn(n, 2, 16, dtype=dtype)
    ref = block_window_attention(q.float(), k.float(), v.float(), geom, backend="sdpa")
    out = block_window_attention(q, k, v, geom, backend=backend, blocks_per_chunk=7)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() < tol
    # GQA grouping: query head h reads kv head h // 3 -- an independent dense computation
    mask = geom.dense_mask()
    kk = k.float().repeat_interleave(3, dim=1)
    vv = v.float().repeat_interleave(3, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) / 4.0
    s = s.masked_fill(~mask, float("-inf"))
    manual = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    assert (manual - ref).abs().max().item() < 1e-5


def test_released_geometry_without_dense_mask():
    """1080p: 63 x 68 x 120 latent, 8x4x4 blocks, radius 2 -- ranges are cheap, a dense mask is refused."""
    geom = Magi2WindowGeometry((63, 68, 120), (8, 4, 4), (2, 2, 2), 600)
    assert geom.num_video_tokens == 514_080
    assert geom.block_grid == (8, 17, 30)
    br = geom.block_ranges()
    counts = br[:, 1] - br[:, 0]
    assert counts[: 7 * 17 * 30].eq(128).all() and counts[7 * 17 * 30 :].eq(112).all()  # last t-block: 7 frames
    with pytest.raises(ValueError, match="dense"):
        geom.dense_mask()
    q, k = geom.ranges()
    # keys seen by an interior block: 5x5x5 blocks of 128 tokens (+ all context tokens)
    b = (2 * 17 + 8) * 30 + 15
    sel = (q[:, 0] == br[b, 0]) & (k[:, 1] <= geom.num_video_tokens)
    assert int((k[sel, 1] - k[sel, 0]).sum()) == 125 * 128
    sel_ctx = (q[:, 0] == br[b, 0]) & (k[:, 0] >= geom.num_video_tokens)
    assert int((k[sel_ctx, 1] - k[sel_ctx, 0]).sum()) == 600


def test_bad_geometry_raises():
    with pytest.raises(ValueError, match="block_size"):
        Magi2WindowGeometry((4, 4, 4), (0, 2, 2), (1, 1, 1))
    with pytest.raises(ValueError, match="radius"):
        Magi2WindowGeometry((4, 4, 4), (2, 2, 2), (1, -1, 1))
    with pytest.raises(ValueError, match="backend"):
        geom = Magi2WindowGeometry((2, 2, 2), (1, 1, 1), (1, 1, 1))
        x = torch.randn(8, 2, 8)
        block_window_attention(x, x, x, geom, backend="dense")


@pytest.mark.parametrize("backend", ["sdpa", "gather", "flex"])
def test_a_chunk_of_query_rows_attends_as_those_rows_of_the_whole(backend):
    """``query_start``: the query rows ``[a, b)`` over every key give rows ``[a, b)`` of the whole attention (the
    refiner's token-chunked layers), on block borders, across the video/context border and in the context."""
    torch.manual_seed(0)
    geom = Magi2WindowGeometry((5, 6, 7), (2, 4, 3), (1, 1, 1), 5)  # partial blocks on every axis
    n, nv = geom.num_tokens, geom.num_video_tokens
    q, k, v = torch.randn(n, 6, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    whole = block_window_attention(q, k, v, geom, backend=backend)
    starts = geom.block_ranges()[:, 0].tolist()
    cuts = [0, starts[3], starts[11], nv + 2, n]
    for a, b in zip(cuts, cuts[1:]):
        part = block_window_attention(q[a:b], k, v, geom, backend=backend, query_start=a, blocks_per_chunk=5)
        torch.testing.assert_close(part, whole[a:b], rtol=0, atol=1e-6)
    if backend == "gather":
        with pytest.raises(ValueError, match="window-block borders"):
            block_window_attention(q[1 : starts[3]], k, v, geom, backend=backend, query_start=1)
    with pytest.raises(ValueError, match="query rows inside"):
        block_window_attention(q[:8], k, v, geom, backend=backend, query_start=n - 4)
