"""Fused Triton kernel for MAGI-2's multi-head routed experts (same signature as ``experts.torch_mh_moe_forward``).

One program per (flat expert ``g``, tile of ``BLOCK_T`` routes): the tile's token rows of its head are gathered
once (``x_t [BLOCK_T, Dh]``), then one loop over ``De`` in chunks ``c`` of ``BLOCK_DE``::

    h_c  = round_w(swiglu7(x_t @ W_gate[g][:, c], x_t @ W_up[g][:, c]))     (fp32 accumulation, fp32 swiglu7)
    acc += h_c @ W_down[g][c, :]                                            (fp32 [BLOCK_T, Dh])

and ``round_act(p * acc)`` is scatter-added into ``[S, H, Dh]``. The three weight tiles of a chunk are the loop's
only loads, so Triton's software pipeliner prefetches all of them ``num_stages`` deep (cp.async); the GPU builds are
checked on CPU by ``tests/helpers/kernel_build.py``. The rounding points follow SandAI's ``_mh_moe_fwd_kernel``; the
math is ours.

Modes:

* atomic (default): contributions are ``atomic_add``-ed into the output, in the activation dtype on sm_90 and
  newer (bf16 atomic adds, as the reference); below sm_90, where bf16 atomic adds are compare-and-swap loops, bf16
  contributions are rounded to bf16, summed in an fp32 buffer and cast once;
* ``deterministic=True``: each route writes its own row (no atomics); rows are reduced per (token, head) in
  ascending global expert id order, in the activation dtype: bit-identical across runs.

CPU interpreter (``TRITON_INTERPRET=1``, read once at import as Triton does): the interpreter computes bf16
``tl.dot`` on raw bit patterns, truncates fp32->bf16 casts and has no bf16 atomics, so when bf16 is involved every
loaded tile is upcast to fp32, roundings are emulated bit-exactly (round to nearest even), and atomic mode
accumulates bf16-rounded contributions in fp32 and casts once. fp16 runs natively in the interpreter (the same code
path as on the GPU). Mixed activation/weight dtypes are upcast to fp32 tiles on every device.

int4 experts: one launch per head on that head's banks, dequantized just before into three reused buffers of the
activation dtype by :mod:`.dequantize_triton` (whose docstring gives the measurements behind this choice); the
expert counts are runtime arguments, so those launches are the very build bf16 experts get.

Tile configs come from ``launch_configs/mh_moe_fwd.json`` per device and problem shape (:func:`tile_candidates`;
int4 experts take their dequantized banks' rows).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from .activation import SWIGLU7_ALPHA, SWIGLU7_LIMIT
from .expert_checks import check_expert_inputs, top_k_layout_poison
from .expert_formats import storage_of
from .expert_storage import check_kernel_device as check_storage_device
from .expert_storage_fp8 import check_fp8_capability, check_fp8_device
from .expert_storage_int4 import check_int4_capability, check_int4_device
from .triton_rounding import INTERPRET, round_to, rounding_mode


__all__ = [
    "LaunchSpec",
    "TileConfig",
    "check_fp8_capability",
    "check_fp8_device",
    "check_int4_capability",
    "check_int4_device",
    "check_storage_device",
    "check_triton_dims",
    "device_key",
    "launch_result",
    "launch_specs",
    "resolve_device_entry",
    "shape_key",
    "tile_candidates",
    "triton_mh_moe_forward",
]

_CONFIG_FILE = Path(__file__).with_name("launch_configs") / "mh_moe_fwd.json"


@dataclass(frozen=True)
class TileConfig:
    """One launch candidate: routes per tile, De chunk per pipelined step, warps, software-pipeline stages."""

    block_t: int
    block_de: int
    num_warps: int
    num_stages: int


def check_triton_dims(head_dim: int, expert_dim: int) -> None:
    """Raise ``ValueError`` unless ``Dh`` and ``De`` are positive multiples of 16 (``tl.dot`` minimum tile)."""
    for name, value in (("Dh (MoE head width)", head_dim), ("De (expert width)", expert_dim)):
        if value < 16 or value % 16 != 0:
            raise ValueError(f"the Triton MoE kernel needs {name} to be a positive multiple of 16; got {value}")


@triton.jit
def _swiglu7(gate, up, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """:func:`diffusers_magi2.moe.activation.swiglu7` on fp32 tiles, its constants passed as ``constexpr``."""
    g = tl.minimum(gate, LIMIT)
    u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return g * tl.sigmoid(ALPHA * g) * (u + 1.0)


@triton.jit
def tile_expert(tile_offsets_ptr, pid, NUM_FLAT, LOG2_FLAT):
    """The flat expert ``g`` (int64) with ``tile_offsets[g] <= pid < tile_offsets[g + 1]``: a binary search over the
    cumulative tile counts, empty experts skipped."""
    lo = pid * 0
    hi = lo + NUM_FLAT
    for _ in range(LOG2_FLAT):
        mid = (lo + hi) // 2
        go_right = tl.load(tile_offsets_ptr + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo.to(tl.int64)


@triton.jit
def _mh_moe_fwd_kernel(
    # pointers
    x_ptr,  # [S, H, Dh] activations
    w_gate_ptr,  # [F, Dh, De]: F = H*E flat experts (a per-head launch: F = E, one head's dequantized int4 bank)
    w_up_ptr,  # [F, Dh, De]
    w_down_ptr,  # [F, De, Dh]
    gather_ids_ptr,  # [T] int32/int64 token per route (CSR order)
    probs_ptr,  # [T] fp32 route weight
    offsets_ptr,  # [F+1] int64 CSR offsets (a per-head launch: that head's slice)
    tile_offsets_ptr,  # [F+1] int32 cumulative tile counts
    dest_ptr,  # [T] int64 destination row per route (deterministic mode only)
    out_ptr,  # atomic: [S, H, Dh]; deterministic: [T, Dh]
    sg_ptr,  # FP8 only: [H*E, De] fp32 W_gate scales (contiguous)
    su_ptr,  # FP8 only: [H*E, De] fp32 W_up scales
    sd_ptr,  # FP8 only: [H*E, Dh] fp32 W_down scales
    # strides (elements)
    stride_xs,
    stride_xh,
    stride_wg_e,
    stride_wg_k,
    stride_wg_n,
    stride_wu_e,
    stride_wu_k,
    stride_wu_n,
    stride_wd_e,
    stride_wd_n,
    stride_wd_k,
    stride_os,
    stride_oh,
    # matrix dimensions (the expert counts are not constexpr: whole-bank and per-head launches share one build)
    NUM_EXPERTS,
    NUM_FLAT,
    LOG2_FLAT,
    HEAD_DIM: tl.constexpr,
    EXPERT_DIM: tl.constexpr,
    # meta-parameters
    BLOCK_T: tl.constexpr,
    BLOCK_DE: tl.constexpr,
    DH_PAD: tl.constexpr,
    EVEN: tl.constexpr,
    UPCAST: tl.constexpr,
    W_SCALED: tl.constexpr,
    HID_ROUND: tl.constexpr,
    OUT_ROUND: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr,
    SWIGLU_ALPHA: tl.constexpr,
):
    pid = tl.program_id(0)
    total_tiles = tl.load(tile_offsets_ptr + NUM_FLAT)
    if pid >= total_tiles:
        return
    g = tile_expert(tile_offsets_ptr, pid, NUM_FLAT, LOG2_FLAT)
    head = g // NUM_EXPERTS
    tile = (pid - tl.load(tile_offsets_ptr + g)).to(tl.int64)
    row_start = tl.load(offsets_ptr + g).to(tl.int64) + tile * BLOCK_T
    row_end = tl.load(offsets_ptr + g + 1).to(tl.int64)

    rows = row_start + tl.arange(0, BLOCK_T).to(tl.int64)
    rmask = rows < row_end
    tok = tl.load(gather_ids_ptr + rows, mask=rmask, other=0).to(tl.int64)

    # The tile's token rows of its head, gathered once: [BLOCK_T, DH_PAD].
    cols_k = tl.arange(0, DH_PAD)
    kmask = cols_k < HEAD_DIM
    x_ptrs = x_ptr + tok[:, None] * stride_xs + head * stride_xh + cols_k[None, :]
    if EVEN:
        xt = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
    else:
        xt = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
    if UPCAST:
        xt = xt.to(tl.float32)

    # One loop over De chunks; its three weight tiles are the loop's only loads, so the software pipeliner
    # prefetches all of them (num_stages deep).
    cols_c = tl.arange(0, BLOCK_DE)
    wg_ptrs = w_gate_ptr + g * stride_wg_e + cols_k[:, None] * stride_wg_k + cols_c[None, :] * stride_wg_n
    wu_ptrs = w_up_ptr + g * stride_wu_e + cols_k[:, None] * stride_wu_k + cols_c[None, :] * stride_wu_n
    wd_ptrs = w_down_ptr + g * stride_wd_e + cols_c[:, None] * stride_wd_n + cols_k[None, :] * stride_wd_k
    acc = tl.zeros((BLOCK_T, DH_PAD), dtype=tl.float32)
    for n0 in range(0, EXPERT_DIM, BLOCK_DE):
        cols_n = n0 + cols_c
        nmask = cols_n < EXPERT_DIM
        if EVEN:
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
            wd = tl.load(wd_ptrs)
        else:
            wg = tl.load(wg_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            wd = tl.load(wd_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        wg_ptrs += BLOCK_DE * stride_wg_n
        wu_ptrs += BLOCK_DE * stride_wu_n
        wd_ptrs += BLOCK_DE * stride_wd_n
        if UPCAST:
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
            wd = wd.to(tl.float32)
        if W_SCALED:  # e4m3 -> fp32 -> activation dtype is exact; the scale is applied to the accumulator below
            # (through fp32: Triton 3.6 lowers e4m3 -> bf16 via a bf16.f16 cvt that ptxas refuses below sm_90)
            wg = wg.to(tl.float32).to(xt.dtype)
            wu = wu.to(tl.float32).to(xt.dtype)
        gate = tl.dot(xt, wg, input_precision="ieee")
        up = tl.dot(xt, wu, input_precision="ieee")
        if W_SCALED:  # per output channel: x @ (q * s) == (x @ q) * s
            gate = gate * tl.load(sg_ptr + g * EXPERT_DIM + cols_n, mask=nmask, other=0.0)[None, :]
            up = up * tl.load(su_ptr + g * EXPERT_DIM + cols_n, mask=nmask, other=0.0)[None, :]
            hid = round_to(_swiglu7(gate, up, SWIGLU_LIMIT, SWIGLU_ALPHA), x_ptr, HID_ROUND)
            wd = wd.to(tl.float32).to(hid.dtype)
        else:
            hid = round_to(_swiglu7(gate, up, SWIGLU_LIMIT, SWIGLU_ALPHA), w_down_ptr, HID_ROUND)
        acc = tl.dot(hid, wd, acc, input_precision="ieee")
    if W_SCALED:
        acc = acc * tl.load(sd_ptr + g * HEAD_DIM + cols_k, mask=kmask, other=0.0)[None, :]

    # Route weights and destinations are (re)loaded here, not kept live across the loop (register pressure).
    rows = row_start + tl.arange(0, BLOCK_T).to(tl.int64)
    rmask = rows < row_end
    prob = tl.load(probs_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    contrib = round_to(acc * prob[:, None], out_ptr, OUT_ROUND)
    store_mask = rmask[:, None] & kmask[None, :]
    if DETERMINISTIC:
        dest = tl.load(dest_ptr + rows, mask=rmask, other=0).to(tl.int64)
        tl.store(out_ptr + dest[:, None] * HEAD_DIM + cols_k[None, :], contrib, mask=store_mask)
    else:
        tok = tl.load(gather_ids_ptr + rows, mask=rmask, other=0).to(tl.int64)
        dst = out_ptr + tok[:, None] * stride_os + head * stride_oh + cols_k[None, :]
        tl.atomic_add(dst, contrib, mask=store_mask, sem="relaxed")


# ------------------------------------------------------------------------------------- tile-config selection

_CHOSEN: dict[tuple, TileConfig] = {}


def device_key(device: torch.device) -> tuple[str, ...]:
    """Lookup keys of ``device`` in the launch table: ``("interpreter",)`` in Triton's CPU interpreter, else the
    CUDA device name and its architecture, e.g. ``("NVIDIA H200", "sm_90")``."""
    device = torch.device(device)
    if INTERPRET or device.type != "cuda":
        return ("interpreter",)
    major, minor = torch.cuda.get_device_capability(device)
    return (torch.cuda.get_device_name(device), f"sm_{major}{minor}")


def shape_key(head_dim: int, expert_dim: int, act_dtype: torch.dtype, weight_dtype: torch.dtype) -> str:
    """The launch table's key of one problem shape, e.g. ``"256x1280 bfloat16/float8_e4m3fn"`` (``Dh x De act/weight``)."""
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    return f"{head_dim}x{expert_dim} {name(act_dtype)}/{name(weight_dtype)}"


@functools.lru_cache(maxsize=None)
def _launch_table() -> dict:
    return json.loads(_CONFIG_FILE.read_text())


def resolve_device_entry(keys: tuple[str, ...]) -> str:
    """The launch-table entry for a device's ``keys`` (see :func:`device_key`): the longest table key that is a
    substring of the device name, else its ``sm_XY`` key, else ``"default"``; string entries are aliases."""
    table = _launch_table()
    names = [k for k in table if not k.startswith(("_", "sm_")) and k not in ("default", "interpreter")]
    matches = [k for k in names if k in keys[0]]
    if matches:
        entry = max(matches, key=len)
    else:
        entry = next((key for key in keys if key in table), "default")
    seen = {entry}
    while isinstance(table[entry], str):
        entry = table[entry]
        if entry in seen:
            raise ValueError(f"alias loop at {entry!r} in {_CONFIG_FILE}")
        seen.add(entry)
    return entry


@functools.lru_cache(maxsize=None)
def tile_candidates(
    keys: tuple[str, ...], head_dim: int, expert_dim: int, act_dtype: torch.dtype, weight_dtype: torch.dtype
) -> tuple[TileConfig, ...]:
    """Tile candidates, in launch order, for a device (:func:`device_key`) and problem shape (:func:`shape_key`;
    the entry's ``"*"`` list for shapes it does not name), from ``launch_configs/mh_moe_fwd.json``."""
    shapes = _launch_table()[resolve_device_entry(keys)]
    rows = shapes.get(shape_key(head_dim, expert_dim, act_dtype, weight_dtype), shapes["*"])
    return tuple(TileConfig(*row) for row in rows)


def _tile_configs_to_try(candidates: tuple[TileConfig, ...], cache_key: tuple) -> tuple[TileConfig, ...]:
    """``candidates`` in order, starting at the one that last launched for ``cache_key``."""
    chosen = _CHOSEN.get(cache_key)
    return candidates[candidates.index(chosen) :] if chosen in candidates else candidates


# -------------------------------------------------------------------------------------------------- launch


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_meta(config: TileConfig, constants: dict) -> dict:
    """The keyword arguments of one launch with ``config``: the constexprs (tile sizes clamped to the problem)
    and ``num_warps``/``num_stages``."""
    block_de = min(config.block_de, _next_pow2(constants["EXPERT_DIM"]))
    even = constants["HEAD_DIM"] == constants["DH_PAD"] and constants["EXPERT_DIM"] % block_de == 0
    return {
        "BLOCK_T": config.block_t,
        "BLOCK_DE": block_de,
        "EVEN": even,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        **constants,
    }


def _launch(config: TileConfig, grid: int, args: tuple, constants: dict) -> None:
    """Launch one kernel with ``config`` (separate so tests can observe or fail launches)."""
    _mh_moe_fwd_kernel[(grid,)](*args, **kernel_meta(config, constants))


def tile_offsets_for(offsets: Tensor, block_t: int) -> Tensor:
    """``[H*E+1]`` int32 cumulative per-expert tile counts for tiles of ``block_t`` routes."""
    counts = offsets[1:] - offsets[:-1]
    tiles = torch.div(counts + (block_t - 1), block_t, rounding_mode="floor")
    return torch.cat([tiles.new_zeros(1), torch.cumsum(tiles, 0)]).to(torch.int32)


def _launch_tiles(
    configs: tuple[TileConfig, ...], offsets: torch.Tensor, num_routes: int, make_args, constants: dict
) -> TileConfig:
    """Launch with the first config that fits the device and return it.

    ``make_args(tile_offsets)`` builds the kernel's positional arguments (:func:`tile_offsets_for`). The grid is the
    host-known upper bound ``⌊T/B⌋ + min(H·E, T)`` of ``Σ_g ⌈n_g/B⌉`` (programs past ``tile_offsets[-1]`` exit at
    once), so no count is read back: no host synchronisation, on the GPU and in the interpreter alike. A config
    that raises ``OutOfResources`` (at compile/launch time, before anything is enqueued) is skipped; any other
    error propagates.

    Raises:
        ValueError: ``configs`` is empty.
        triton.runtime.errors.OutOfResources: no config fits.
    """
    num_flat = offsets.numel() - 1
    last_error: OutOfResources | None = None
    for config in configs:
        grid = num_routes // config.block_t + min(num_flat, num_routes)
        try:
            _launch(config, max(grid, 1), make_args(tile_offsets_for(offsets, config.block_t)), constants)
        except OutOfResources as err:
            last_error = err
            continue
        return config
    if last_error is None:
        raise ValueError(f"no tile candidates in {_CONFIG_FILE}")
    raise last_error


# ------------------------------------------------------------------------------------ deterministic reduce


def _route_destinations(offsets: torch.Tensor, gather_ids: torch.Tensor, num_experts: int, num_tokens: int):
    """Row of each route in the per-route output: grouped by (head, token), in CSR (= ascending expert) order."""
    num_routes = gather_ids.numel()
    route = torch.arange(num_routes, device=gather_ids.device, dtype=torch.int64)
    flat = torch.searchsorted(offsets, route, right=True) - 1
    key = torch.div(flat, num_experts, rounding_mode="floor") * num_tokens + gather_ids.to(torch.int64)
    order = torch.sort(key, stable=True).indices
    dest = torch.empty_like(order)
    dest[order] = route
    return dest


def _deterministic_reduce(rows: torch.Tensor, num_heads: int, num_tokens: int, act_dtype: torch.dtype):
    """``[T, Dh]`` per-route rows (laid out by :func:`_route_destinations`) -> ``[S, H, Dh]``: the ``k`` rows of
    each (token, head) summed in ascending expert id, rounded to the activation dtype after every add."""
    top_k = rows.shape[0] // (num_tokens * num_heads)
    rows = rows.to(act_dtype).view(num_heads, num_tokens, top_k, rows.shape[1])
    total = rows[:, :, 0]
    for j in range(1, top_k):
        total = total + rows[:, :, j]
    return total.permute(1, 0, 2).contiguous()


# ------------------------------------------------------------------------------------------------- forward


@dataclass
class LaunchSpec:
    """Everything one kernel launch needs but the tile config (built without reading tensor values, so meta
    tensors work: the GPU-target compile check builds from it). ``num_routes`` bounds the launch's routes (its
    grid); ``prepare``, if set, runs before the launch (int4: dequantize the head's banks); ``out`` is the call's
    output, which every launch of a call shares; ``per_head``: the call launches once per head."""

    make_args: Callable[[Tensor], tuple]
    constants: dict
    out: Tensor
    offsets: Tensor
    num_routes: int
    prepare: Optional[Callable[[], None]] = None
    per_head: bool = False


def launch_specs(
    x: Tensor,
    routes: Sequence[Tensor],
    weights: Sequence[Tensor],
    *,
    scales: Optional[Sequence[Tensor]],
    deterministic: bool,
    capability: Optional[tuple[int, int]],
    top_k_routes: bool = False,
) -> list[LaunchSpec]:
    """Arguments and constexprs of the kernel launches for validated ``x, routes, weights, scales`` (as
    :func:`triton_mh_moe_forward` takes them), built for ``capability`` (the CUDA compute capability; ``None`` for
    the interpreter); the launches share one ``out``.

    bf16/fp16/fp32 and FP8 experts: one launch over all ``H*E`` experts. int4 experts: one launch per head, on
    three ``[E, K, N]`` buffers of the activation dtype that its ``prepare`` fills with the head's dequantized banks
    (:mod:`.dequantize_triton`); its grid is sized by the head's ``S*k`` routes for ``top_k_routes`` (the call's
    result is then NaN if the offsets do not have that layout), else by all ``T`` (any CSR, no host read).

    Raises:
        ValueError: FP8 experts for a capability below 8.9, int4 experts below 8.0.
    """
    (gather_ids, probs, expert_offsets), w_gate = routes, weights[0]
    storage = storage_of(weights, scales)
    storage.check_capability(capability)
    per_head, scaled = storage.per_head_kernel, storage.scaled_kernel
    interpret = capability is None
    num_tokens, num_heads, head_dim = x.shape
    num_flat = w_gate.shape[0]
    num_experts = num_flat // num_heads
    num_routes = gather_ids.numel()
    device, act_dtype = x.device, x.dtype
    tile_dtype = storage.kernel_dtype(act_dtype)
    if per_head:  # one head's banks at a time, in the activation dtype (the kernel then runs as for those experts)
        banks = [
            torch.empty(num_experts, *storage.logical_shape(w.shape)[1:], device=device, dtype=tile_dtype)
            for w in weights
        ]
    else:
        banks = list(weights)
    expert_dim = banks[0].shape[2]
    # The interpreter mishandles bf16 (dot on raw bits, truncating casts, no atomics): upcast its tiles and emulate
    # the roundings. Mixed activation/weight dtypes are upcast too (tl.dot needs equal operand dtypes).
    interp_bf16 = interpret and torch.bfloat16 in (act_dtype, tile_dtype)
    upcast = interp_bf16 or (act_dtype != tile_dtype and not scaled)  # scaled tiles convert to the activation dtype
    native = not (interpret and act_dtype == torch.bfloat16)  # native casts round to nearest even
    # bf16 atomic adds: none in the interpreter, compare-and-swap loops below sm_90. There contributions are
    # rounded to bf16, then summed in an fp32 buffer (native fp32 atomics) and cast once.
    fp32_sum = not deterministic and act_dtype == torch.bfloat16 and (interpret or tuple(capability) < (9, 0))
    store_native = native and not fp32_sum
    offsets = expert_offsets.to(torch.int64)
    # Rows are rounded in-kernel; where stored in fp32 the later cast is exact.
    out_dtype = act_dtype if store_native else torch.float32
    if deterministic:
        dest = _route_destinations(offsets, gather_ids, num_experts, num_tokens)
        out = torch.empty(num_routes, head_dim, device=device, dtype=out_dtype)
        stride_os, stride_oh = 0, 0
    else:
        dest = gather_ids  # unused
        out = torch.zeros(num_tokens, num_heads, head_dim, device=device, dtype=out_dtype)
        stride_os, stride_oh = out.stride(0), out.stride(1)
    launch_flat = num_experts if per_head else num_flat
    constants = {
        "NUM_EXPERTS": num_experts,
        "NUM_FLAT": launch_flat,
        "LOG2_FLAT": max(1, (launch_flat - 1).bit_length()),
        "HEAD_DIM": head_dim,
        "EXPERT_DIM": expert_dim,
        "DH_PAD": _next_pow2(head_dim),
        "UPCAST": upcast,
        "W_SCALED": scaled,
        "HID_ROUND": rounding_mode(storage.hidden_dtype(act_dtype), native_ok=not upcast),
        "OUT_ROUND": rounding_mode(act_dtype, native_ok=store_native),
        "DETERMINISTIC": deterministic,
        "SWIGLU_LIMIT": SWIGLU7_LIMIT,
        "SWIGLU_ALPHA": SWIGLU7_ALPHA,
    }
    probs32 = probs.to(torch.float32)
    w_strides = (*banks[0].stride(), *banks[1].stride(), *banks[2].stride())
    strides = (x.stride(0), x.stride(1), *w_strides, stride_os, stride_oh)
    scale_args = tuple(s.contiguous() for s in scales) if scaled else (probs32,) * 3  # unused unless scaled

    def spec(x_launch, offsets_launch, out_launch, bound, prepare=None) -> LaunchSpec:
        def make_args(tile_offsets: torch.Tensor) -> tuple:
            pointers = (x_launch, *banks, gather_ids, probs32, offsets_launch, tile_offsets, dest, out_launch)
            return (*pointers, *scale_args, *strides)

        return LaunchSpec(make_args, constants, out, offsets_launch, bound, prepare, per_head)

    if not per_head:
        return [spec(x, offsets, out, num_routes)]
    top_k_routes = bool(top_k_routes and num_tokens * num_heads and num_routes % (num_tokens * num_heads) == 0)
    per_head = num_routes // num_heads if top_k_routes else num_routes
    specs = []
    for head in range(num_heads):
        rows = slice(head * num_experts, (head + 1) * num_experts)

        def prepare(rows: slice = rows) -> None:
            storage.head_banks(weights, scales, rows, tile_dtype, banks, storage.device_dequantizer())

        # the head's x and output columns as [S, 1, Dh] views: inside the launch it is head 0 of E experts
        out_launch = out if deterministic else out[:, head : head + 1]
        offsets_launch = offsets[rows.start : rows.stop + 1]
        specs.append(spec(x[:, head : head + 1], offsets_launch, out_launch, per_head, prepare))
    return specs


def triton_mh_moe_forward(
    x: Tensor,
    gather_ids: Tensor,
    probs: Tensor,
    expert_offsets: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    *,
    deterministic: bool = False,
    scales: Optional[Sequence[Tensor]] = None,
    tile_config: Optional[TileConfig] = None,
    top_k_routes: bool = False,
) -> Tensor:
    """Fused gather/expert/scatter kernel; same contract as
    :func:`diffusers_magi2.moe.experts.torch_mh_moe_forward` (vLLM-Omni's ``mh_moe`` signature).

    FP8 experts (``float8_e4m3fn`` weights with ``scales``) are loaded as FP8 tiles and converted in registers to
    the activation dtype (exact); each GEMM's fp32 accumulator is multiplied by its per-output-channel scale. int4
    experts (``uint8`` codes with their group ``scales``) run one head at a time: the head's banks are dequantized
    into reused buffers of the activation dtype (rounded once from ``NF4[c] * s``), then the kernel runs as for
    experts stored in that dtype (:mod:`.dequantize_triton` says why).

    Args:
        x, gather_ids, probs, expert_offsets, w_gate, w_up, w_down, scales: as for the torch path (``x``'s last dim
            contiguous, weights of any strides).
        deterministic: per-route rows without atomics, summed per (token, head) in ascending expert id (top-k
            routes): bit-identical across runs.
        tile_config: launch with this tile only instead of the launch table's candidates (benchmarks).
        top_k_routes: the routes are ``global_sort_routes`` of top-k routes (head ``h``'s start at row ``h·S·k``),
            as ``Magi2MultiHeadMoE`` passes them: int4 experts then launch each head's grid for its ``S·k`` routes
            (the result is NaN if the offsets disagree); ``False`` (any CSR) sizes it by all ``T``.

    Raises:
        ValueError: an argument that is not a tensor, ``scales`` not three tensors, bad shapes/dtypes/devices,
            ``Dh``/``De`` not multiples of 16, CPU tensors without ``TRITON_INTERPRET=1``, FP8 experts on a GPU
            without FP8 support (compute capability < 8.9), int4 experts below compute capability 8.0, or
            (deterministic) ``T`` not a multiple of ``S*H``.
        triton.runtime.errors.OutOfResources: no tile candidate fits the device.
        RuntimeError: any launch failure other than ``OutOfResources`` (never swallowed).
    """
    routes, weights = (gather_ids, probs, expert_offsets), (w_gate, w_up, w_down)
    num_tokens, num_heads, head_dim, num_experts, expert_dim = check_expert_inputs(x, routes, weights, scales)
    check_triton_dims(head_dim, expert_dim)
    storage = storage_of(weights, scales)
    check_storage_device(storage, x.device)
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool; got {deterministic!r}")
    if tile_config is not None and not isinstance(tile_config, TileConfig):
        raise ValueError(f"tile_config must be a TileConfig or None; got {tile_config!r}")
    if not x.is_cuda and not INTERPRET:
        raise ValueError(
            f"triton_mh_moe_forward needs CUDA tensors (got {x.device}); CPU tensors run only in Triton's "
            "interpreter, enabled by TRITON_INTERPRET=1 before diffusers_magi2.moe.experts_triton is imported"
        )
    if x.stride(2) != 1:
        raise ValueError("x must have a contiguous last dimension (stride 1)")
    num_routes = gather_ids.numel()
    if deterministic and num_tokens * num_heads > 0 and num_routes % (num_tokens * num_heads) != 0:
        raise ValueError(
            f"deterministic mode needs the same number of routes per (token, head): T={num_routes} is not a "
            f"multiple of S*H={num_tokens * num_heads}"
        )
    if num_routes == 0 or num_tokens == 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)

    keys = device_key(x.device)
    capability = None if keys == ("interpreter",) else torch.cuda.get_device_capability(x.device)
    specs = launch_specs(
        x,
        routes,
        weights,
        scales=scales,
        deterministic=deterministic,
        capability=capability,
        top_k_routes=top_k_routes,
    )
    cache_key = (keys, head_dim, expert_dim, x.dtype, storage.kernel_dtype(x.dtype), deterministic)
    if tile_config is not None:
        configs = (tile_config,)
    else:
        configs = _tile_configs_to_try(tile_candidates(*cache_key[:-1]), cache_key)
    for spec in specs:  # int4: one head at a time, each dequantized just before its launch
        if spec.prepare is not None:
            spec.prepare()
        chosen = _launch_tiles(configs, spec.offsets, spec.num_routes, spec.make_args, spec.constants)
        configs = configs[configs.index(chosen) :]
    if tile_config is None:
        _CHOSEN[cache_key] = chosen
    return launch_result(specs, x, routes, weights, deterministic, top_k_routes)


def launch_result(
    specs: Sequence[LaunchSpec],
    x: Tensor,
    routes: Sequence[Tensor],
    weights: Sequence[Tensor],
    deterministic: bool,
    top_k_routes: bool = False,
) -> Tensor:
    """The ``[S, H, Dh]`` result of :func:`triton_mh_moe_forward` from its launches' shared output (deterministic:
    the per-route rows reduced; int4 with ``top_k_routes``: NaN if the offsets are not in the layout its per-head
    grids assumed). Reads no tensor values (the memory plan runs it on fake tensors)."""
    (gather_ids, _, expert_offsets), w_gate = routes, weights[0]
    num_tokens, num_heads = x.shape[:2]
    out = specs[0].out
    out = _deterministic_reduce(out, num_heads, num_tokens, x.dtype) if deterministic else out.to(x.dtype)
    num_routes = gather_ids.numel()
    if specs[0].per_head and top_k_routes and num_routes % (num_tokens * num_heads) == 0:
        num_experts = w_gate.shape[0] // num_heads
        out += top_k_layout_poison(expert_offsets, num_experts, num_routes // num_heads).to(out.dtype)
    return out
