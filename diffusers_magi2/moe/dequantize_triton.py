"""int4 routed experts on the Triton backend: one head's bank dequantized just in time, then the bf16 kernel.

:func:`dequantize_int4_triton` is :func:`~diffusers_magi2.moe.quantize_int4.dequantize_int4` as a Triton kernel:
``W[r, k, n] = round_out(NF4[c[r, k, n]] * s[r, k // G, n])``, the product in fp32 (both factors exact) rounded once
to the output dtype (nearest even). :func:`~diffusers_magi2.moe.experts_triton.triton_mh_moe_forward` runs int4
experts one head at a time: the head's three banks into three reused buffers of the activation dtype (bf16: 0.50 GB
at the released size, 256 experts x 3 x 256 x 1280), then the fused kernel on that head's routes, the same build
bf16 experts get.

Why this path (a) and not decoding inside the fused kernel's ``De`` loop (b, W4A16, as vLLM's
``fused_moe_kernel_gptq_awq`` or Marlin), at the released shape (Dh 256, De 1280, 12 heads x top-6 of 256;
``python -m tests.benchmarks.bench_moe --expert_dtype int4`` prints this model, ``--w4a16_builds`` the builds):

* Bandwidth and FLOPs of one MoE call on an H200 (4.8 TB/s, 989 dense bf16 TFLOP/s, ~3.3e13 CUDA-core lane
  operations/s). (a) reads 1.56 GB of codes and scales and writes 6.04 GB of bf16 per call: 1.6 ms, whatever the
  tokens. (b) decodes each expert's 0.98 M weights once per tile of 64 routes (>= 5 operations a weight: unpack,
  look up, scale, cast, store to shared memory for the MMA) and reads 4.5 GB less than bf16 experts: at a 16,384-token
  call (the default forward chunk; 384 rows per expert) 2.0 ms more than bf16 experts against (a)'s 1.6 ms, on a
  4.3 ms GEMM; unchunked at 540p with CFG (116k tokens, 2.7k rows per expert) 19 ms against 1.6 ms, on 30 ms. (b)
  costs less only below ~320 rows per expert per call (~13.6k tokens): a chunking remainder, or the 8,192-token
  chunks of the 80 GB recipe (0.7 ms against 1.6 ms on 2.1 ms of GEMMs). With the default chunks (a) adds ~37 % to
  the routed experts at 540p, which are 14 % of a step's FLOPs: ~5 % of a step; with 8,192-token chunks ~75 %.
* GPU-target builds (``tests/moe/test_moe_kernel_build.py``'s reading of the cubin, Triton 3.9). (a) is the bf16
  kernel's build (sm_90 ``[64, 32, 8, 3]``: 190 registers, no spills, HGMMA; sm_89 168, sm_80 180) and this kernel's
  (64-70 registers, no spills, 37 KB of shared memory, the code tiles double-buffered by cp.async). (b), built at the
  bf16 kernel's tiles (``tests/benchmarks/w4a16_variant.py``), needs 255 registers and spills on every target (sm_90:
  42 spill instructions, 18 at half the ``De`` chunk; sm_89: 32; sm_80: 6), its code tiles single-buffered and each
  decoded tile stored back to shared memory before its MMA. At 16-route tiles it builds without spills on sm_89 and
  sm_80 (128 and 152 registers); on sm_90 it spills at every tile tried (down to ``[32, 16, 4, 3]``).

So int4 takes (a) for every call; its buffers hold 0.5 GB while a layer runs. Where calls are small (the 80 GB
recipe's 8,192-token chunks) a W4A16 kernel that builds clean on sm_90 would win by the model; the GPU check
(``tests/benchmarks/gpu_check.sh``, step ``bench_moe_int4``) times (a) per call size, the number it would have to beat.

Tiles: one program per (row ``r``, ``BLOCK_N`` output columns) loops over ``K`` in ``BLOCK_K`` rows (one scale row
a step: ``BLOCK_K`` divides ``G``); the loop's code tiles are software-pipelined (``tl.range(num_stages)``:
cp.async). Each code byte is looked up in a 256-entry table of its two levels (the even column's first, so the
``[BLOCK_K, BLOCK_N / 2, 2]`` pairs are the ``[BLOCK_K, BLOCK_N]`` tile). In Triton's CPU interpreter
(``TRITON_INTERPRET=1``), whose fp32->bf16 casts truncate, the bf16 rounding is emulated (round to nearest even).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .quantize_int4 import NF4_LEVELS
from .triton_rounding import INTERPRET, round_to, rounding_mode


__all__ = [
    "DEQUANT_BLOCK_N",
    "DEQUANT_NUM_STAGES",
    "DEQUANT_NUM_WARPS",
    "dequant_launch",
    "dequantize_int4_into",
    "dequantize_int4_triton",
]

#: output columns per program, warps and software-pipeline stages of the dequantization kernel
DEQUANT_BLOCK_N, DEQUANT_NUM_WARPS, DEQUANT_NUM_STAGES = 128, 4, 3
_MAX_BLOCK_K = 32


@triton.jit
def _dequantize_int4_kernel(
    # pointers
    codes_ptr,  # [R, K, N/2] uint8: byte (k, j) = c[k, 2j] | c[k, 2j+1] << 4
    scale_ptr,  # [R, K/G, N] bf16/fp16 group scales
    byte_levels_ptr,  # [256, 2] fp32: the two NF4 levels of every byte (low nibble first)
    out_ptr,  # [R, K, N] bf16/fp16/fp32
    # matrix dimensions
    K,
    N,
    GROUP,
    # strides (elements; every last dim is contiguous)
    stride_cr,
    stride_ck,
    stride_sr,
    stride_sg,
    stride_or,
    stride_ok,
    # meta-parameters
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
    OUT_ROUND: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK_N
    ks = tl.arange(0, BLOCK_K)
    cols = col0 + tl.arange(0, BLOCK_N)
    bytes_ = col0 // 2 + tl.arange(0, BLOCK_N // 2)
    pair = tl.arange(0, 2)
    code_ptrs = codes_ptr + row * stride_cr + ks[:, None] * stride_ck + bytes_[None, :]
    scale_ptrs = scale_ptr + row * stride_sr + cols
    out_ptrs = out_ptr + row * stride_or + ks[:, None] * stride_ok + cols[None, :]
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_N:
            codes = tl.load(code_ptrs)
            scale = tl.load(scale_ptrs + (k0 // GROUP) * stride_sg)
        else:
            codes = tl.load(code_ptrs, mask=(bytes_ < N // 2)[None, :], other=0)
            scale = tl.load(scale_ptrs + (k0 // GROUP) * stride_sg, mask=cols < N, other=0.0)
        levels = tl.load(byte_levels_ptr + codes.to(tl.int32)[:, :, None] * 2 + pair[None, None, :])
        w = tl.reshape(levels, (BLOCK_K, BLOCK_N)) * scale.to(tl.float32)[None, :]
        w = round_to(w, out_ptr, OUT_ROUND)
        if EVEN_N:
            tl.store(out_ptrs, w)
        else:
            tl.store(out_ptrs, w, mask=(cols < N)[None, :])
        code_ptrs += BLOCK_K * stride_ck
        out_ptrs += BLOCK_K * stride_ok


@functools.lru_cache(maxsize=None)
def _byte_levels(device: torch.device) -> Tensor:
    """``[256, 2]`` fp32: the two NF4 levels of every byte value, low nibble first."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([levels[byte & 15], levels[byte >> 4]], dim=1).to(device)


def _block_k(group_size: int) -> int:
    """Rows per loop step: the largest power of two that divides ``G``, at most 32 (one scale row per step)."""
    return min(_MAX_BLOCK_K, group_size & -group_size)


def dequant_launch(packed: Tensor, scale: Tensor, out: Tensor, *, interpret: bool) -> tuple[tuple, dict, tuple]:
    """``(args, kwargs, grid)`` of one :func:`dequantize_int4_triton` launch (no tensor values read: meta tensors
    work, for the GPU-target compile check); ``interpret``: built for Triton's CPU interpreter."""
    rows, k, half = packed.shape
    n, group = 2 * half, k // scale.shape[1]
    native = not (interpret and out.dtype == torch.bfloat16)
    args = (packed, scale, _byte_levels(packed.device), out, k, n, group)
    args += (packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1), out.stride(0), out.stride(1))
    kwargs = {
        "BLOCK_K": _block_k(group),
        "BLOCK_N": DEQUANT_BLOCK_N,
        "EVEN_N": n % DEQUANT_BLOCK_N == 0,
        "OUT_ROUND": rounding_mode(out.dtype, native_ok=native),
        "NUM_STAGES": DEQUANT_NUM_STAGES,
        "num_warps": DEQUANT_NUM_WARPS,
    }
    return args, kwargs, (rows, triton.cdiv(n, DEQUANT_BLOCK_N))


def dequantize_int4_triton(packed: Tensor, scale: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
    """``NF4[c] * s`` rounded once to ``out``'s dtype: :func:`~diffusers_magi2.moe.quantize_int4.dequantize_int4`
    on the GPU (or in Triton's interpreter).

    Args:
        packed: ``[R, K, N/2]`` uint8 codes (:mod:`~diffusers_magi2.moe.quantize_int4`), last dim contiguous.
        scale: ``[R, K/G, N]`` bf16/fp16 group scales, last dim contiguous.
        out: ``[R, K, N]`` bf16/fp16/fp32 with a contiguous last dim, written in place (default: a new fp32 tensor).

    Returns:
        ``out``.

    Raises:
        ValueError: shapes that do not match, a group size ``G`` that does not divide ``K``, non-contiguous last
            dims, or tensors on different devices.
    """
    if packed.dim() != 3 or packed.dtype != torch.uint8 or scale.dim() != 3:
        raise ValueError(f"packed must be uint8 [R, K, N/2] and scale [R, K/G, N]; got {packed.shape}, {scale.shape}")
    rows, k, half = packed.shape
    if out is None:
        out = torch.empty(rows, k, 2 * half, dtype=torch.float32, device=packed.device)
    groups = scale.shape[1]
    if (
        scale.shape != (rows, groups, 2 * half)
        or not groups
        or k % groups
        or out.shape != (rows, k, 2 * half)
        or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        raise ValueError(
            f"dequantize_int4_triton: packed {tuple(packed.shape)}, scale {tuple(scale.shape)} and out "
            f"{tuple(out.shape)} {out.dtype} must be [R, K, N/2], [R, K/G, N] and [R, K, N] (fp32/bf16/fp16)"
        )
    if any(t.stride(-1) != 1 for t in (packed, scale, out)):
        raise ValueError("dequantize_int4_triton needs contiguous last dims")
    if len({packed.device, scale.device, out.device}) != 1:
        raise ValueError("dequantize_int4_triton: packed, scale and out must be on one device")
    dequantize_int4_into(packed, scale, out)
    return out


def dequantize_int4_into(packed: Tensor, scale: Tensor, out: Tensor) -> None:
    """:func:`dequantize_int4_triton` into ``out`` for inputs already checked (the expert launcher's hot path)."""
    if packed.shape[0] and packed.shape[1]:
        args, kwargs, grid = dequant_launch(packed, scale, out, interpret=INTERPRET)
        _dequantize_int4_kernel[grid](*args, **kwargs)
