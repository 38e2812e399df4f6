"""The int4 expert path that was not taken, built for GPU targets on CPU: the fused MoE kernel with the int4 codes
decoded inside its ``De`` loop (W4A16, the form of vLLM's ``fused_moe_kernel_gptq_awq``), next to the path taken
(one head's banks dequantized to bf16, then the bf16 kernel; ``diffusers_magi2/moe/dequantize_triton.py`` gives the
comparison). Not collected by pytest; ``python -m tests.benchmarks.bench_moe --w4a16_builds`` prints the table.

The variant keeps the kernel's structure (one program per (expert, tile of ``BLOCK_T`` routes), the three weight
tiles of a ``De`` chunk loaded per step) and replaces each weight tile by its codes ``[K, BLOCK/2]`` and the scale
rows of its groups, decoded in registers (nibbles, NF4 levels from the byte table, times the scale) before its
``tl.dot``; atomic mode only, ``BLOCK_DE`` dividing ``G``. :func:`run_variant` runs it (for the interpreter check).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from diffusers_magi2.moe.experts_triton import _swiglu7, tile_expert, tile_offsets_for


#: the bf16 kernel's first launch-table rows at the released shape, and the half-``De``-chunk tile of sm_90
CONFIGS = {90: [(64, 32, 8, 3), (64, 16, 8, 3)], 89: [(32, 16, 4, 3)], 80: [(32, 32, 8, 3)]}


@triton.jit
def _decode(codes, byte_levels_ptr, scale, ROWS: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr):
    """``[ROWS, COLS]`` weights of ``codes [ROWS, COLS/2]`` with the scale rows ``scale [ROWS/GROUP, COLS]``."""
    pair = tl.arange(0, 2)
    levels = tl.load(byte_levels_ptr + codes.to(tl.int32)[:, :, None] * 2 + pair[None, None, :])
    levels = tl.reshape(levels, (ROWS // GROUP, GROUP, COLS))
    return tl.reshape(levels * scale.to(tl.float32)[:, None, :], (ROWS, COLS))


@triton.jit
def _w4a16_moe_kernel(
    x_ptr,  # [S, H, Dh]
    wg_ptr,  # [H*E, Dh, De/2] uint8 codes
    wu_ptr,  # [H*E, Dh, De/2]
    wd_ptr,  # [H*E, De, Dh/2]
    sg_ptr,  # [H*E, Dh/G, De] bf16 group scales
    su_ptr,  # [H*E, Dh/G, De]
    sd_ptr,  # [H*E, De/G, Dh]
    byte_levels_ptr,  # [256, 2] fp32
    gather_ids_ptr,
    probs_ptr,
    offsets_ptr,
    tile_offsets_ptr,
    out_ptr,  # [S, H, Dh] fp32
    stride_xs,
    stride_xh,
    NUM_EXPERTS,
    NUM_FLAT,
    LOG2_FLAT,
    HEAD_DIM: tl.constexpr,
    EXPERT_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_DE: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid >= tl.load(tile_offsets_ptr + NUM_FLAT):
        return
    g = tile_expert(tile_offsets_ptr, pid, NUM_FLAT, LOG2_FLAT)
    head = g // NUM_EXPERTS
    row_start = tl.load(offsets_ptr + g).to(tl.int64) + (pid - tl.load(tile_offsets_ptr + g)).to(tl.int64) * BLOCK_T
    row_end = tl.load(offsets_ptr + g + 1).to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_T).to(tl.int64)
    rmask = rows < row_end
    tok = tl.load(gather_ids_ptr + rows, mask=rmask, other=0).to(tl.int64)
    cols_k = tl.arange(0, HEAD_DIM)
    xt = tl.load(x_ptr + tok[:, None] * stride_xs + head * stride_xh + cols_k[None, :], mask=rmask[:, None], other=0.0)
    half_c, cols_c = tl.arange(0, BLOCK_DE // 2), tl.arange(0, BLOCK_DE)
    half_k, groups_k = tl.arange(0, HEAD_DIM // 2), tl.arange(0, HEAD_DIM // GROUP)
    wg_ptrs = wg_ptr + g * HEAD_DIM * (EXPERT_DIM // 2) + cols_k[:, None] * (EXPERT_DIM // 2) + half_c[None, :]
    wu_ptrs = wu_ptr + g * HEAD_DIM * (EXPERT_DIM // 2) + cols_k[:, None] * (EXPERT_DIM // 2) + half_c[None, :]
    wd_ptrs = wd_ptr + g * EXPERT_DIM * (HEAD_DIM // 2) + cols_c[:, None] * (HEAD_DIM // 2) + half_k[None, :]
    sg_ptrs = sg_ptr + g * (HEAD_DIM // GROUP) * EXPERT_DIM + groups_k[:, None] * EXPERT_DIM + cols_c[None, :]
    su_ptrs = su_ptr + g * (HEAD_DIM // GROUP) * EXPERT_DIM + groups_k[:, None] * EXPERT_DIM + cols_c[None, :]
    sd_ptrs = sd_ptr + g * (EXPERT_DIM // GROUP) * HEAD_DIM + cols_k[None, :]
    acc = tl.zeros((BLOCK_T, HEAD_DIM), dtype=tl.float32)
    for n0 in range(0, EXPERT_DIM, BLOCK_DE):
        wg = tl.load(wg_ptrs)
        wu = tl.load(wu_ptrs)
        wd = tl.load(wd_ptrs)
        wg = _decode(wg, byte_levels_ptr, tl.load(sg_ptrs), HEAD_DIM, BLOCK_DE, GROUP).to(xt.dtype)
        wu = _decode(wu, byte_levels_ptr, tl.load(su_ptrs), HEAD_DIM, BLOCK_DE, GROUP).to(xt.dtype)
        wd = _decode(wd, byte_levels_ptr, tl.load(sd_ptrs + (n0 // GROUP) * HEAD_DIM), BLOCK_DE, HEAD_DIM, BLOCK_DE)
        gate = tl.dot(xt, wg, input_precision="ieee")
        up = tl.dot(xt, wu, input_precision="ieee")
        hid = _swiglu7(gate, up, 7.0, 1.702).to(xt.dtype)
        acc = tl.dot(hid, wd.to(xt.dtype), acc, input_precision="ieee")
        wg_ptrs += BLOCK_DE // 2
        wu_ptrs += BLOCK_DE // 2
        wd_ptrs += BLOCK_DE * (HEAD_DIM // 2)
        sg_ptrs += BLOCK_DE
        su_ptrs += BLOCK_DE
    prob = tl.load(probs_ptr + rows, mask=rmask, other=0.0)
    dst = out_ptr + tok[:, None] * stride_xs + head * stride_xh + cols_k[None, :]
    tl.atomic_add(dst, acc * prob[:, None], mask=rmask[:, None], sem="relaxed")


def _launch_args(x, routes, weights, scales, config):
    """Positional and keyword arguments of one launch (no tensor values read: meta tensors work)."""
    from diffusers_magi2.moe.dequantize_triton import _byte_levels

    (gather_ids, probs, offsets), (_, num_heads, head_dim) = routes, x.shape
    block_t, block_de, num_warps, num_stages = config
    num_flat, expert_dim = weights[0].shape[0], 2 * weights[0].shape[2]
    group = head_dim // scales[0].shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    args = (x, *weights, *scales, _byte_levels(x.device), gather_ids, probs.float(), offsets.long())
    args += (tile_offsets_for(offsets.long(), block_t), out, x.stride(0), x.stride(1))
    args += (num_flat // num_heads, num_flat, max(1, (num_flat - 1).bit_length()))
    kwargs = {"HEAD_DIM": head_dim, "EXPERT_DIM": expert_dim, "GROUP": group, "BLOCK_T": block_t}
    kwargs.update(BLOCK_DE=block_de, num_warps=num_warps, num_stages=num_stages)
    grid = gather_ids.numel() // block_t + min(num_flat, gather_ids.numel())
    return args, kwargs, out, max(grid, 1)


def run_variant(x, routes, weights, scales, config=(16, 16, 4, 1)) -> torch.Tensor:
    """The variant's output ``[S, H, Dh]`` (fp32) for ``torch_mh_moe_forward``'s int4 arguments (fp32 ``x``)."""
    args, kwargs, out, grid = _launch_args(x, routes, weights, scales, config)
    _w4a16_moe_kernel[(grid,)](*args, **kwargs)
    return out


def builds(configs: dict = CONFIGS) -> list:
    """``BuildResult``s of the variant at the released shape (bf16 activations) per architecture and config."""
    from tests.helpers import kernel_build as kb

    x, routes, banks, scales = kb._meta_moe_inputs("int4")
    results = []
    for arch, rows in configs.items():
        for config in rows:
            result = kb.BuildResult(kb.KernelBuild("_w4a16_moe_kernel", arch, "int4", False, config, "variant"))
            result.num_stages = config[-1]
            try:
                args, kwargs, _, _ = _launch_args(x, routes, banks, scales, config)
                compiled = kb._compile(_w4a16_moe_kernel, args, kwargs, arch)
                kb._read(result, compiled, kb.MOE_WEIGHT_OPERANDS)
            except Exception as err:  # reported per build
                result.error = f"{type(err).__name__}: {str(err).strip()[:200]}"
            results.append(result)
    return results


def main() -> dict:
    from tests.helpers import kernel_build as kb

    results = builds()
    print(kb.format_table(results))
    return {
        "builds": [{"arch": r.build.arch, "config": r.build.config, "problems": kb.build_problems(r)} for r in results]
    }


if __name__ == "__main__":
    main()
    sys.exit(0)
