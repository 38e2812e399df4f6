"""Context + expert parallelism: per-rank work and communication (not collected by pytest).

Run from the repository root::

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_parallel [--ranks 8] [--text_tokens 256] [--no-measure]

Measured part (CPU, gloo, ``torch.multiprocessing.spawn``): the fp32 tiny fixture ``magi2_tiny/preview_h4``
(4 attention heads, 4 MoE heads, 4 layers, 2 of them MoE) on its packed t2v case, single process (N = 1),
CP N x EP N for N = 2, 4, and CP4 x EP2 x 2 replicas: each rank's FLOPs (FlopCounterMode, CPU SDPA counted) as a
ratio of the single-process forward, and the bytes each rank sends per block through ``all_to_all_single``
(self chunk excluded), with the ideal ``1/N`` beside it.

Analytic table for the released MAGI-2 Preview (40 layers, hidden 3072, 24 query = kv heads of 128, 4 mHC
streams, dense MLP 8192 in layers 0, 1, 38, 39, MoE in layers 2-37 with 12 heads x 256 experts, top-6, width 1280,
shared and modality-specific experts 1280) for one denoising step: one forward over the CFG pair packed as two
samples of ``video + 250 audio + text`` tokens (272p: 14,336 video tokens, 540p: 57,344). Three layouts on
``--ranks`` ranks:

* ``EP-only replicated``: every rank holds every token and does all the dense work; the routed experts are split
  by heads (padded to a multiple of the ranks) and one all-gather per MoE layer assembles them (today's layout).
* ``CP8 x EP8 (padded)``: Ulysses context parallelism over all ranks; EP over the same ranks, heads padded
  (12 -> 16 on 8 ranks: two ranks idle in the routed experts); 2 + 2 all-to-alls per MoE layer.
* ``CP8 x EP4 x 2 replicas``: the same, with EP groups of 4 tiling the 8 ranks; every owner routes half of every
  rank's tokens for 3 heads.

Per layout: the busiest rank's FLOPs (2 x MACs of every matmul and of attention's q k^T and p v), its ratio to the
ideal ``1/N`` of the single-device forward, and the bytes each rank sends per step in bf16 (the collectives'
payload to other ranks; the self chunk and the final output gather are not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import tempfile
from pathlib import Path


BYTES = 2  # bf16 on the wire


@dataclasses.dataclass(frozen=True)
class Released:
    layers: int = 40
    hidden: int = 3072
    head_dim: int = 128
    q_heads: int = 24
    kv_heads: int = 24
    streams: int = 4
    dense_layers: tuple = (0, 1, 38, 39)
    dense_width: int = 8192
    moe_heads: int = 12
    experts: int = 256
    top_k: int = 6
    expert_width: int = 1280
    shared_width: int = 1280
    specific_width: int = 1280
    video_in: int = 48
    audio_in: int = 64
    text_in: int = 5120


RESOLUTIONS = {"272p": 14_336, "540p": 57_344}
AUDIO_TOKENS = 250


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def per_token_dense_macs(cfg: Released) -> dict:
    """MACs per token and layer of the work that scales with the local tokens (everything but attention's core
    and the routed experts)."""
    c, n = cfg.hidden, cfg.streams
    proj = c * (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim + c * cfg.q_heads + cfg.q_heads * cfg.head_dim * c
    mhc = 2 * (n * c * (2 * n + n * n) + n * c + n * n * c + n * c)
    dense_mlp = c * 2 * cfg.dense_width + cfg.dense_width * c
    moe_dense = 2 * c * c + 2 * (c * 2 * cfg.shared_width + cfg.shared_width * c)  # split/merge, shared experts
    return {"attention_projections": proj, "mhc": mhc, "dense_mlp": dense_mlp, "moe_dense": moe_dense}


def routed_macs_per_token_head(cfg: Released) -> int:
    """Router + top-k experts of one MoE head for one token."""
    dh = cfg.hidden // cfg.moe_heads
    return cfg.experts * dh + cfg.top_k * (dh * 2 * cfg.expert_width + cfg.expert_width * dh)


def step_costs(cfg: Released, video_tokens: int, text_tokens: int, ranks: int, layout: str) -> dict:
    """Busiest-rank FLOPs and per-rank bytes sent for one step, for ``layout`` in ``single``, ``ep``, ``cp_ep``,
    ``cp_ep_replicas``."""
    seg = video_tokens + AUDIO_TOKENS + text_tokens
    total = 2 * seg  # CFG pair
    moe_layers = cfg.layers - len(cfg.dense_layers)
    d = per_token_dense_macs(cfg)
    dense_per_token = cfg.layers * (d["attention_projections"] + d["mhc"])
    dense_per_token += len(cfg.dense_layers) * d["dense_mlp"] + moe_layers * d["moe_dense"]
    adapters = (
        2 * video_tokens * cfg.video_in * cfg.streams * cfg.hidden * 2
        + 2 * AUDIO_TOKENS * cfg.audio_in * cfg.streams * cfg.hidden * 2
        + 2 * text_tokens * cfg.text_in * cfg.streams * cfg.hidden
    )
    attn_core_all = cfg.layers * total * 2 * cfg.q_heads * cfg.head_dim * seg  # q k^T + p v, per segment
    routed_token_head = routed_macs_per_token_head(cfg)
    moe_dh = cfg.hidden // cfg.moe_heads
    if layout == "single":
        macs = (
            dense_per_token * total + adapters + attn_core_all + moe_layers * total * cfg.moe_heads * routed_token_head
        )
        return {"flops": 2 * macs, "bytes": 0}
    n = ranks
    if layout == "ep":
        padded = _ceil_to(cfg.moe_heads, n)
        local_heads = padded // n
        real = min(local_heads, cfg.moe_heads)
        macs = dense_per_token * total + adapters + attn_core_all
        macs += moe_layers * total * real * routed_token_head
        sent = moe_layers * (n - 1) * total * local_heads * moe_dh * BYTES  # all-gather of [T, Hl, Dh]
        return {"flops": 2 * macs, "bytes": sent}
    # context parallel: the busiest rank holds ceil(T / N) tokens and ceil(Hq / N) query heads
    s_r = -(-total // n)
    q_local = -(-cfg.q_heads // n)
    macs = dense_per_token * s_r + adapters / n
    macs += attn_core_all * q_local / cfg.q_heads
    other = (n - 1) / n
    attn_bytes = cfg.layers * (s_r * cfg.head_dim * (cfg.q_heads + 2 * cfg.kv_heads) + total * cfg.head_dim * q_local)
    attn_bytes *= other * BYTES
    if layout == "cp_ep":
        ep = n
    elif layout == "cp_ep_replicas":
        ep = next(e for e in range(n, 0, -1) if n % e == 0 and cfg.moe_heads % e == 0)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    padded = _ceil_to(cfg.moe_heads, ep)
    local_heads = padded // ep
    real = min(local_heads, cfg.moe_heads)
    replicas = n // ep
    macs += moe_layers * -(-total // replicas) * real * routed_token_head
    moe_bytes = moe_layers * 2 * s_r * padded * moe_dh * other * BYTES
    return {"flops": 2 * macs, "bytes": attn_bytes + moe_bytes, "ep": ep, "replicas": replicas}


def analytic_table(ranks: int, text_tokens: int) -> list[str]:
    cfg = Released()
    lines = [
        f"released MAGI-2 Preview, one step (CFG pair), {ranks} ranks, {text_tokens} text tokens per sample",
        f"{'resolution':>10} {'layout':<26} {'FLOPs/rank':>12} {'vs 1/N':>7} {'a2a/gather bytes/rank':>22}",
    ]
    for name, video in RESOLUTIONS.items():
        single = step_costs(cfg, video, text_tokens, 1, "single")["flops"]
        ideal = single / ranks
        lines.append(f"{name:>10} {'one device':<26} {single / 1e12:>10.1f} T {single / ideal:>7.2f} {'-':>22}")
        for key, label in (
            ("ep", "EP-only replicated"),
            ("cp_ep", f"CP{ranks} x EP{ranks} (padded)"),
            ("cp_ep_replicas", None),
        ):
            cost = step_costs(cfg, video, text_tokens, ranks, key)
            if label is None:
                label = f"CP{ranks} x EP{cost['ep']} x {cost['replicas']} replicas"
            lines.append(
                f"{name:>10} {label:<26} {cost['flops'] / 1e12:>10.1f} T {cost['flops'] / ideal:>7.2f} "
                f"{cost['bytes'] / 2**30:>18.2f} GiB"
            )
    return lines


# the tests' fixture root rule (tests/helpers/fixtures.py): $MAGI2_FIXTURES, else ../shared/fixtures beside the repo
FIXTURE = (
    Path(os.environ.get("MAGI2_FIXTURES", Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"))
    / "magi2_tiny"
    / "preview_h4"
)


def _load_tiny():
    import torch
    from safetensors.torch import load_file

    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel

    model = Magi2Transformer3DModel.from_original_checkpoint(FIXTURE / "sandai_checkpoint", dtype=torch.float32)
    return model.eval(), load_file(str(FIXTURE / "fp32" / "transformer_case.safetensors"))


def _tiny_forward(model, d):
    import torch

    with torch.no_grad():
        return model.forward_packed(
            d["model.x"],
            d["model.coords_mapping"],
            d["model.modality_mapping"],
            d["model.cu_seqlens_q"],
            d["model.time_token_sequence"],
        )


def _measure_rank(rank: int, world: int, ep: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    from diffusers_magi2.parallel.expert_parallel import Magi2ExpertParallelConfig
    from tests.helpers.flop_counter import count_flops

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    model, d = _load_tiny()
    model.enable_expert_parallel(Magi2ExpertParallelConfig(ep_degree=ep))
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    sent = [0]
    orig = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        splits = list(input_split_sizes) if input_split_sizes is not None else [input.numel() // world] * world
        sent[0] += (sum(splits) - splits[rank]) * input.element_size()
        return orig(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = counting
    _, flops = count_flops(_tiny_forward, model, d)
    dist.all_to_all_single = orig
    torch.save({"flops": flops, "bytes": sent[0], "blocks": len(model.transformer_blocks)}, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: gloo runs that built a device mesh may abort there


#: measured layouts ``(N, EP degree)``: CP N x EP N, and EP 2 x 2 replicas on 4 ranks
LAYOUTS = ((2, 2), (4, 4), (4, 2))


def measured_table(layouts=LAYOUTS) -> list[str]:
    import torch
    import torch.multiprocessing as mp

    from tests.helpers.flop_counter import count_flops

    model, d = _load_tiny()
    _, single = count_flops(_tiny_forward, model, d)
    lines = [
        f"measured on CPU: magi2_tiny preview_h4 fp32, {d['model.x'].shape[0]} packed tokens; single process "
        f"{single / 1e6:.1f} MFLOPs",
        f"{'layout':<22} {'rank':>4} {'FLOPs vs N=1':>13} {'ideal 1/N':>10} {'a2a bytes/block':>16}",
        f"{'N=1 (plain model)':<22} {0:>4} {1.0:>13.3f} {1.0:>10.3f} {0:>16}",
    ]
    for world, ep in layouts:
        label = f"CP{world} x EP{ep}" + (f" x {world // ep} replicas" if ep != world else "")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_measure_rank, args=(world, ep, port, out_dir), nprocs=world, join=True)
            ranks = [torch.load(f"{out_dir}/rank{rank}.pt") for rank in range(world)]
            for rank, r in enumerate(ranks):
                lines.append(
                    f"{label:<22} {rank:>4} {r['flops'] / single:>13.3f} {1 / world:>10.3f} "
                    f"{r['bytes'] / r['blocks']:>16.0f}"
                )
            total = sum(r["flops"] for r in ranks) / single
            lines.append(f"{label:<22} {'sum':>4} {total:>13.3f} {1.0:>10.3f}  (work split, not skipped)")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--text_tokens", type=int, default=256)
    parser.add_argument("--no-measure", dest="measure", action="store_false", help="analytic table only")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.text_tokens < 0:
        raise SystemExit("--ranks must be >= 1 and --text_tokens >= 0")
    print("\n".join(analytic_table(args.ranks, args.text_tokens)))
    if args.measure:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print()
        print("\n".join(measured_table()))


if __name__ == "__main__":
    main()
