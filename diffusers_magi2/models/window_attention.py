"""Block-window attention of the MAGI-2 refiner (SandAI ``refiner_data_proxy.py``: ``_build_block_order``,
``BlockGridLocalAttn``, ``_build_window_local_attn_handler``).

Video tokens form 3-D blocks of ``(bt, bh, bw)`` latent positions (released 8 x 4 x 4; edge blocks partial).
Video token ``q`` may attend video token ``k`` iff ``|block(q) - block(k)| <= (rt, rh, rw)`` on every axis
(released radius 2); context tokens (audio, text) attend and are attended by every token. One sample packs as::

    [ video tokens in block order | context tokens (audio, then text) ]

with blocks row-major over (t, h, w) blocks and tokens row-major inside a block. The mask exists as MagiAttention
``(q, k)`` ranges, a flex ``BlockMask``, a dense ``[N, N]`` bool (small inputs only), and the ``"gather"``
kernel, which gathers each query block's key window (exact, ``O(chunk x window)`` memory).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..utils.backends import check_backend, resolve_backend


__all__ = [
    "Magi2WindowGeometry",
    "ranges_to_dense_mask",
    "block_window_attention",
    "cached_flex_block_mask",
    "DEFAULT_MAX_DENSE_MASK_ELEMENTS",
]

#: Largest ``N_q * N_k`` for which a dense boolean mask may be built (8192^2).
DEFAULT_MAX_DENSE_MASK_ELEMENTS = 1 << 26


def _triple(value: Sequence[int], name: str, minimum: int) -> tuple[int, int, int]:
    try:
        vals = tuple(int(v) for v in value)
    except TypeError as exc:  # not iterable
        raise ValueError(f"{name} must be a sequence of 3 ints (t, h, w), got {value!r}") from exc
    if len(vals) != 3 or any(v < minimum for v in vals):
        raise ValueError(f"{name} must be 3 ints (t, h, w) each >= {minimum}, got {value!r}")
    return vals  # type: ignore[return-value]


def _axis_block_sizes(n: int, b: int) -> torch.Tensor:
    """Sizes of the blocks along one axis: ``ceil(n / b)`` blocks of ``b``, the last one partial."""
    nb = -(-n // b)
    sizes = torch.full((nb,), b, dtype=torch.int64)
    sizes[-1] = n - b * (nb - 1)
    return sizes


@dataclass(frozen=True)
class Magi2WindowGeometry:
    """Geometry of one refiner sample's block-window attention.

    Args:
        grid: ``(T, H, W)`` latent video size (tokens; patch size 1).
        block_size: ``(bt, bh, bw)`` block size in latent positions (released ``(8, 4, 4)``).
        radius: ``(rt, rh, rw)`` block radius per axis (released ``(2, 2, 2)``); ``0`` = own block only.
        num_context_tokens: audio + text tokens packed after the video tokens (they attend to and
            are attended by everything).

    Raises:
        ValueError: non-positive grid/block sizes, negative radii or negative context length.
    """

    grid: tuple[int, int, int]
    block_size: tuple[int, int, int]
    radius: tuple[int, int, int]
    num_context_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", _triple(self.grid, "grid", 1))
        object.__setattr__(self, "block_size", _triple(self.block_size, "block_size", 1))
        object.__setattr__(self, "radius", _triple(self.radius, "radius", 0))
        if int(self.num_context_tokens) < 0:
            raise ValueError(f"num_context_tokens must be >= 0, got {self.num_context_tokens}")
        object.__setattr__(self, "num_context_tokens", int(self.num_context_tokens))

    @property
    def num_video_tokens(self) -> int:
        """``T * H * W``."""
        return math.prod(self.grid)

    @property
    def num_tokens(self) -> int:
        """Video plus context tokens."""
        return self.num_video_tokens + self.num_context_tokens

    @property
    def block_grid(self) -> tuple[int, int, int]:
        """Number of blocks per axis, ``ceil(grid / block_size)``."""
        return tuple(-(-n // b) for n, b in zip(self.grid, self.block_size))  # type: ignore[return-value]

    @property
    def num_blocks(self) -> int:
        return math.prod(self.block_grid)

    def _block_token_counts(self) -> torch.Tensor:
        st, sh, sw = (_axis_block_sizes(n, b) for n, b in zip(self.grid, self.block_size))
        return (st[:, None, None] * sh[None, :, None] * sw[None, None, :]).reshape(-1)

    def block_ranges(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[num_blocks, 2]`` int64 ``[start, end)`` of each block in packed (block) order."""
        counts = self._block_token_counts()
        ends = torch.cumsum(counts, 0)
        return torch.stack([ends - counts, ends], dim=1).to(device)

    def video_restore_order(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[T*H*W]`` int64 with ``packed[order]`` = raster order (the reference's ``token_restore_order``)."""
        T, H, W = self.grid
        bt, bh, bw = self.block_size
        _, nh, nw = self.block_grid
        t = torch.arange(T).view(T, 1, 1)
        h = torch.arange(H).view(1, H, 1)
        w = torch.arange(W).view(1, 1, W)
        sh = _axis_block_sizes(H, bh)[h // bh]
        sw = _axis_block_sizes(W, bw)[w // bw]
        block_id = ((t // bt) * nh + (h // bh)) * nw + (w // bw)
        rank = ((t % bt) * sh + (h % bh)) * sw + (w % bw)
        starts = self.block_ranges()[:, 0]
        return (starts[block_id] + rank).reshape(-1).to(device)

    def video_token_order(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[T*H*W]`` int64 with ``raster[order]`` = block order (the reference's ``token_order``)."""
        restore = self.video_restore_order()
        order = torch.empty_like(restore)
        order[restore] = torch.arange(restore.numel())
        return order.to(device)

    def token_block_coords(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[T*H*W, 3]`` int64 block index ``(t//bt, h//bh, w//bw)`` of each token in packed order."""
        T, H, W = self.grid
        bt, bh, bw = self.block_size
        t = torch.arange(T).view(T, 1, 1).expand(T, H, W)
        h = torch.arange(H).view(1, H, 1).expand(T, H, W)
        w = torch.arange(W).view(1, 1, W).expand(T, H, W)
        raster = torch.stack([t // bt, h // bh, w // bw], dim=-1).reshape(-1, 3)
        return raster[self.video_token_order()].to(device)

    def ranges(self, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask as ``(q_ranges, k_ranges)``, each ``[P, 2]`` int32 ``[start, end)`` in packed order; it allows
        the same ``(q, k)`` pairs as the reference's ranges, with one key range per neighbour ``(dt, dh)`` row."""
        nt, nh, nw = self.block_grid
        rt, rh, rw = self.radius
        br = self.block_ranges()
        b = torch.arange(self.num_blocks)
        qt, qh, qw = b // (nh * nw), (b // nw) % nh, b % nw
        w_lo = (qw - rw).clamp(min=0)
        w_hi = (qw + rw).clamp(max=nw - 1)
        q_parts, k_parts = [], []
        for dt in range(-rt, rt + 1):
            kt = qt + dt
            for dh in range(-rh, rh + 1):
                kh = qh + dh
                ok = (kt >= 0) & (kt < nt) & (kh >= 0) & (kh < nh)
                if not bool(ok.any()):
                    continue
                row = (kt * nh + kh) * nw
                k_start = br[(row + w_lo)[ok], 0]
                k_end = br[(row + w_hi)[ok], 1]
                q_parts.append(br[ok])
                k_parts.append(torch.stack([k_start, k_end], dim=1))
        nv, n = self.num_video_tokens, self.num_tokens
        if self.num_context_tokens > 0:
            q_parts.append(br)
            k_parts.append(torch.tensor([[nv, n]]).expand(br.shape[0], 2))
            q_parts.append(torch.tensor([[nv, n]]))
            k_parts.append(torch.tensor([[0, n]]))
        q = torch.cat(q_parts).to(torch.int32)
        k = torch.cat(k_parts).to(torch.int32)
        return q.to(device), k.to(device)

    def dense_mask(
        self,
        device: Optional[torch.device] = None,
        max_elements: int = DEFAULT_MAX_DENSE_MASK_ELEMENTS,
    ) -> torch.Tensor:
        """Boolean ``[N, N]`` mask (True = may attend), for SDPA on small sequences.

        Raises:
            ValueError: ``N * N > max_elements``.
        """
        n = self.num_tokens
        if n * n > max_elements:
            raise ValueError(
                f"refusing to build a dense {n}x{n} attention mask ({n * n} elements > "
                f"max_elements={max_elements}); use the 'flex' or 'gather' window-attention backend"
            )
        nv = self.num_video_tokens
        bc = self.token_block_coords(device)
        r = torch.tensor(self.radius, device=bc.device)
        mask = torch.ones(n, n, dtype=torch.bool, device=bc.device)
        mask[:nv, :nv] = ((bc[:, None, :] - bc[None, :, :]).abs() <= r).all(-1)
        return mask

    def flex_mask_mod(self, device: Optional[torch.device] = None, query_start: int = 0):
        """``mask_mod(b, h, q_idx, kv_idx)`` for ``flex_attention`` (per-axis block-index lookups, ``[N]`` each);
        ``q_idx`` counts from packed row ``query_start`` (a chunk of the queries)."""
        nv, n = self.num_video_tokens, self.num_tokens
        coords = torch.zeros(n, 3, dtype=torch.int32, device=device)
        coords[:nv] = self.token_block_coords(device).to(torch.int32)
        bt, bh, bw = coords[:, 0].contiguous(), coords[:, 1].contiguous(), coords[:, 2].contiguous()
        is_ctx = torch.zeros(n, dtype=torch.bool, device=device)
        is_ctx[nv:] = True
        rt, rh, rw = self.radius

        def mask_mod(b, h, q_idx, kv_idx):
            q_idx = q_idx + query_start
            local = (
                ((bt[q_idx] - bt[kv_idx]).abs() <= rt)
                & ((bh[q_idx] - bh[kv_idx]).abs() <= rh)
                & ((bw[q_idx] - bw[kv_idx]).abs() <= rw)
            )
            return local | is_ctx[q_idx] | is_ctx[kv_idx]

        return mask_mod

    def flex_block_mask(
        self,
        device: Optional[torch.device] = None,
        compile_mask: Optional[bool] = None,
        query_rows: Optional[tuple[int, int]] = None,
    ):
        """``BlockMask`` for ``torch.nn.attention.flex_attention`` over the packed sequence.

        Args:
            device: device of the attention inputs.
            compile_mask: ``create_block_mask(_compile=True)`` (never materialises the dense mask); default on CUDA.
            query_rows: ``(start, stop)``: the mask of those packed query rows over every key (``None``: all rows).
        """
        from torch.nn.attention.flex_attention import create_block_mask

        device = torch.device(device) if device is not None else torch.device("cpu")
        if compile_mask is None:
            compile_mask = device.type == "cuda"
        n = self.num_tokens
        start, stop = (0, n) if query_rows is None else query_rows
        return create_block_mask(
            self.flex_mask_mod(device, start), B=None, H=None, Q_LEN=stop - start, KV_LEN=n, device=device,
            _compile=compile_mask,
        )  # fmt: skip


def ranges_to_dense_mask(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    num_tokens: int,
    max_elements: int = DEFAULT_MAX_DENSE_MASK_ELEMENTS,
) -> torch.Tensor:
    """Union of ``(q_range, k_range)`` rectangles as a boolean ``[num_tokens, num_tokens]`` mask.

    Args:
        q_ranges, k_ranges: ``[P, 2]`` integer ``[start, end)`` pairs (MagiAttention layout, full attention).
        num_tokens: sequence length N.

    Raises:
        ValueError: shape mismatch, ranges outside ``[0, N]``, or ``N * N > max_elements``.
    """
    if q_ranges.shape != k_ranges.shape or q_ranges.dim() != 2 or q_ranges.shape[-1] != 2:
        raise ValueError(
            f"q_ranges and k_ranges must both be [P, 2], got {tuple(q_ranges.shape)} and {tuple(k_ranges.shape)}"
        )
    if num_tokens * num_tokens > max_elements:
        raise ValueError(f"refusing to build a dense {num_tokens}x{num_tokens} mask (> {max_elements} elements)")
    for name, r in (("q_ranges", q_ranges), ("k_ranges", k_ranges)):
        if r.numel() and (int(r.min()) < 0 or int(r.max()) > num_tokens or bool((r[:, 1] < r[:, 0]).any())):
            raise ValueError(f"{name} must hold [start, end) pairs inside [0, {num_tokens}]")
    idx = torch.arange(num_tokens, device=q_ranges.device)
    qm = (idx[None, :] >= q_ranges[:, :1]) & (idx[None, :] < q_ranges[:, 1:])  # [P, N]
    km = (idx[None, :] >= k_ranges[:, :1]) & (idx[None, :] < k_ranges[:, 1:])
    return (qm.T.float() @ km.float()) > 0


def _heads_first(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``kernel`` (a ``[B, H, N, D]`` attention with GQA) on ``[B, N, H, D]`` tensors."""
    qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return kernel(*qkv, enable_gqa=q.shape[2] != k.shape[2], **kwargs).transpose(1, 2)


def _sdpa_bnhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float):
    """SDPA on ``[B, N, H, D]`` tensors; returns ``[B, Nq, Hq, D]``."""
    return _heads_first(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, scale=scale)


def _gather_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    geometry: Magi2WindowGeometry,
    scale: float,
    blocks_per_chunk: int,
    query_start: int = 0,
) -> torch.Tensor:
    """Exact block-window attention by gathering each query block's key window; ``query`` holds the packed rows
    from ``query_start`` on, which start and end on block borders within the video tokens."""
    nv, n = geometry.num_video_tokens, geometry.num_tokens
    device = query.device
    q0, q1 = query_start, query_start + query.shape[0]
    out = torch.empty_like(query)
    if q1 > nv:
        c0 = max(q0, nv)
        out[c0 - q0 :] = _sdpa_bnhd(query[None, c0 - q0 :], key[None], value[None], None, scale)[0]
    if nv == 0 or q0 >= nv:
        return out
    nt, nh, nw = geometry.block_grid
    rt, rh, rw = geometry.radius
    br = geometry.block_ranges(device)
    counts = br[:, 1] - br[:, 0]
    qmax = int(counts.max())  # padded shapes from every block: a chunk's blocks are padded as the whole's
    starts = br[:, 0].tolist()
    first, last = _block_span(starts, nv, q0, min(q1, nv))
    kslot = qmax  # every neighbour block gets a slot of the largest block size
    offsets = torch.arange(-rt, rt + 1, device=device)
    dts, dhs, dws = torch.meshgrid(
        offsets, torch.arange(-rh, rh + 1, device=device), torch.arange(-rw, rw + 1, device=device), indexing="ij"
    )
    dts, dhs, dws = dts.reshape(-1), dhs.reshape(-1), dws.reshape(-1)  # [Nb_nei]
    ctx_idx = torch.arange(nv, n, device=device)
    ar_q = torch.arange(qmax, device=device)
    ar_k = torch.arange(kslot, device=device)
    rep = query.shape[1] // key.shape[1]
    for b0 in range(first, last, blocks_per_chunk):
        b = torch.arange(b0, min(b0 + blocks_per_chunk, last), device=device)
        bt, bh, bw = b // (nh * nw), (b // nw) % nh, b % nw
        q_idx = br[b, :1] + ar_q[None, :]  # [nb, qmax]
        q_valid = ar_q[None, :] < counts[b, None]
        q_idx = torch.where(q_valid, q_idx, torch.full_like(q_idx, q0))
        kt, kh, kw = bt[:, None] + dts, bh[:, None] + dhs, bw[:, None] + dws  # [nb, Nnei]
        nb_ok = (kt >= 0) & (kt < nt) & (kh >= 0) & (kh < nh) & (kw >= 0) & (kw < nw)
        kb = torch.where(nb_ok, (kt * nh + kh) * nw + kw, torch.zeros_like(kt))
        k_idx = br[kb, 0][..., None] + ar_k  # [nb, Nnei, kslot]
        k_valid = nb_ok[..., None] & (ar_k < counts[kb][..., None])
        k_idx = torch.where(k_valid, k_idx, torch.zeros_like(k_idx)).flatten(1)
        k_valid = k_valid.flatten(1)
        if n > nv:
            k_idx = torch.cat([k_idx, ctx_idx.expand(b.numel(), -1)], dim=1)
            k_valid = torch.cat([k_valid, torch.ones(b.numel(), n - nv, dtype=torch.bool, device=device)], dim=1)
        qb = query[q_idx - q0]  # [nb, qmax, Hq, D]
        kb_ = key[k_idx]
        vb = value[k_idx]
        if rep > 1:  # explicit GQA expansion: masked SDPA kernels need equal head counts
            kb_ = kb_.repeat_interleave(rep, dim=2)
            vb = vb.repeat_interleave(rep, dim=2)
        ob = _sdpa_bnhd(qb, kb_, vb, k_valid[:, None, None, :], scale)  # [nb, qmax, Hq, D]
        out[q_idx[q_valid] - q0] = ob[q_valid]
    return out


def _block_span(starts: list, num_video_tokens: int, lo: int, hi: int) -> tuple[int, int]:
    """The blocks ``[first, last)`` covering packed video rows ``[lo, hi)`` exactly (``starts``: each block's first
    row).

    Raises:
        ValueError: ``lo`` or ``hi`` inside a block.
    """
    bounds = starts + [num_video_tokens]
    first, last = bisect.bisect_left(bounds, lo), bisect.bisect_left(bounds, hi)
    if bounds[first] != lo or bounds[last] != hi:
        raise ValueError(f"query rows [{lo}, {hi}) must start and end on window-block borders for the gather kernel")
    return first, last


_compiled_flex = None
_FLEX_MASK_CACHE: dict = {}
_FLEX_MASK_CACHE_SIZE = 4


def cached_flex_block_mask(geometry: Magi2WindowGeometry, device) -> object:
    """``geometry.flex_block_mask(device)``, cached for the last few geometries (cond and uncond per step)."""
    key = (geometry, str(torch.device(device)))
    if key not in _FLEX_MASK_CACHE:
        if len(_FLEX_MASK_CACHE) >= _FLEX_MASK_CACHE_SIZE:
            _FLEX_MASK_CACHE.pop(next(iter(_FLEX_MASK_CACHE)))
        _FLEX_MASK_CACHE[key] = geometry.flex_block_mask(device)
    return _FLEX_MASK_CACHE[key]


def _flex(q, k, v, block_mask, scale):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return _heads_first(fn, q, k, v, block_mask=block_mask, scale=scale)


def block_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    geometry: Optional[Magi2WindowGeometry] = None,
    *,
    dense_mask: Optional[torch.Tensor] = None,
    backend: str = "auto",
    scale: Optional[float] = None,
    block_mask=None,
    max_dense_elements: int = DEFAULT_MAX_DENSE_MASK_ELEMENTS,
    blocks_per_chunk: int = 64,
    query_start: int = 0,
) -> torch.Tensor:
    """Bidirectional attention of one packed refiner sample under its block-window mask.

    Args:
        query: ``[Nq, Hq, D]``, the packed rows ``[query_start, query_start + Nq)`` (``Nq = N``: every row); key,
            value: ``[N, Hkv, D]``, ``Hq % Hkv == 0``, one dtype, packed order.
        geometry: the sample's :class:`Magi2WindowGeometry`; ``None`` (without ``dense_mask``) = full attention.
        dense_mask: explicit bool ``[N, N]`` mask (True = attend), for ``"sdpa"``/``"auto"`` only.
        backend: ``"sdpa"``, ``"flex"`` (compiled on CUDA), ``"gather"`` (``blocks_per_chunk`` query blocks at
            a time) or ``"auto"`` (the ``window_attn`` row of :mod:`~diffusers_magi2.utils.backends`).
        scale: softmax scale, default ``D ** -0.5``.
        block_mask: a prebuilt ``BlockMask`` of the query rows for ``"flex"`` (built from ``geometry`` if omitted).
        query_start: the packed row of ``query[0]``: a chunk of the queries attends over every key (for
            ``"gather"`` the chunk starts and ends on window-block borders of the video tokens).

    Returns:
        ``[Nq, Hq, D]`` in the query dtype.

    Raises:
        ValueError: unknown backend, shape mismatch, query rows outside ``[0, N]`` (or off the block borders for
            ``"gather"``), or a dense mask that would be too large.
    """
    check_backend("window_attn", backend)
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"expected query [N, Hq, D] and key/value [N, Hkv, D], got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    nq, hq, d = query.shape
    n = key.shape[0]
    q0, q1 = int(query_start), int(query_start) + nq
    if key.shape[2] != d or hq % key.shape[1] or not 0 <= q0 <= q1 <= n:
        raise ValueError(
            f"key/value {tuple(key.shape)} incompatible with query {tuple(query.shape)} from row {query_start} (query "
            "rows inside the keys' N, the same D, Hq % Hkv == 0)"
        )
    if geometry is not None and geometry.num_tokens != n:
        raise ValueError(f"geometry describes {geometry.num_tokens} tokens but query has {n}")
    scale = d**-0.5 if scale is None else float(scale)

    if dense_mask is not None:
        if backend not in ("auto", "sdpa"):
            raise ValueError(f"an explicit dense_mask can only be used with backend 'sdpa', got {backend!r}")
        if dense_mask.shape != (n, n) or dense_mask.dtype != torch.bool:
            raise ValueError(f"dense_mask must be bool [{n}, {n}], got {dense_mask.dtype} {tuple(dense_mask.shape)}")
        return _sdpa_bnhd(query[None], key[None], value[None], dense_mask[q0:q1].to(query.device), scale)[0]
    if geometry is None:
        return _sdpa_bnhd(query[None], key[None], value[None], None, scale)[0]

    backend = resolve_backend(
        "window_attn", backend, query.device, num_tokens=n, max_dense_elements=max_dense_elements
    )
    if backend == "sdpa":
        mask = geometry.dense_mask(query.device, max_elements=max_dense_elements)
        return _sdpa_bnhd(query[None], key[None], value[None], mask[q0:q1], scale)[0]
    if backend == "gather":
        return _gather_window_attention(query, key, value, geometry, scale, blocks_per_chunk, q0)
    # flex
    if block_mask is None:
        block_mask = geometry.flex_block_mask(query.device, query_rows=None if nq == n else (q0, q1))
    return _flex(query[None], key[None], value[None], block_mask, scale)[0]
