"""One 540p CFG preview denoising step: time and peak memory, against the memory plan's prediction for the same
model in the same run (not collected by pytest), for each recipe: ``fp8`` (FP8 routed experts, bf16 elsewhere:
the 141 GB H200 recipe) and ``80gb`` (int4 routed experts and FP8-stored dense weights with one scale per output
channel, ``enable_fp8_storage``: the 80 GB recipe).

    .venv/bin/python -m tests.benchmarks.bench_preview_step [--small] [--recipes fp8 80gb] [--out step.json]

CUDA: ``Magi2Transformer3DModel`` at the released width with 4 of its 40 layers (dense multimodal layers 0 and
3, MoE layers 1 and 2; random weights) on the 116,212 tokens of one 540p CFG forward (two halves of 57,344 video
+ 250 audio + 512 text tokens). Reports the forward's time, each block kind's time (CUDA events), the 40-layer step
estimate ``outer + 4 dense + 36 MoE``, the measured peak above the weights (``torch.cuda.max_memory_allocated``)
and the plan's (``trace_preview_forward``, ``kernels="cuda"``). ``--small`` (also without a GPU): a tiny model and
1,024 tokens on CPU, the plan with ``kernels="cpu"`` and the CPU allocator's peak (``torch.profiler``), i.e. the
suite's check. Exit status 1 when a recipe's plan is off by more than 10 %.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.modality import Modality
from tests.helpers.memory_plan import trace_preview_forward
from tests.helpers.memory_tracking import cpu_allocator_peak


#: ``(expert_dtype, storage dtype of the dense weights, forward chunk on the GPU)`` of each recipe (``None``: the
#: model's default chunk, 16,384 tokens).
RECIPES = {"fp8": ("float8_e4m3fn", None, None), "80gb": ("int4", torch.float8_e4m3fn, None)}


RELEASED_4_LAYERS = {"num_layers": 4, "multimodal_layers": (0, 3), "moe_layers": (1, 2)}
SMALL = {
    "num_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "num_key_value_heads": 2,
    "text_in_channels": 128,
    "multimodal_layers": (0,),
    "moe_layers": (1,),
    "moe_num_heads": 2,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "modality_specific_expert_intermediate_size": 32,
    "intermediate_factor": 2,
}


def packed_inputs(half: dict, text_channels: int, device):
    """Packed CFG inputs: two segments of ``half`` tokens per modality (video, audio, text)."""
    order = (("video", Modality.VIDEO), ("audio", Modality.AUDIO), ("text", Modality.TEXT))
    ids = torch.cat([torch.full((half[k],), int(m), dtype=torch.int32) for k, m in order] * 2).to(device)
    n, seg = ids.numel(), sum(half.values())
    t = torch.arange(n, dtype=torch.float32, device=device)
    sizes = [torch.full_like(t, s) for s in (7.0, 5.0, 3.0)]
    coords = torch.stack([t % 7, t % 5, t % 3, *sizes, *sizes], dim=1)
    hidden = torch.randn(n, text_channels, device=device)
    time_embedding = torch.randn(n, 64, device=device)
    return hidden, coords, ids, torch.tensor([0, seg, 2 * seg], dtype=torch.int32, device=device), time_embedding


def run(small: bool, recipe: str = "fp8") -> dict:
    cuda = torch.cuda.is_available() and not small
    device = torch.device("cuda" if cuda else "cpu")
    config = RELEASED_4_LAYERS if cuda else SMALL
    half = {"video": 57344, "audio": 250, "text": 512} if cuda else {"video": 480, "audio": 16, "text": 16}
    expert_dtype, storage_dtype, gpu_chunk = RECIPES[recipe]
    if expert_dtype == "int4" and not cuda:  # the tiny experts' contraction dims are 32
        config = {**config, "expert_int4_group_size": 32}
    torch.manual_seed(0)
    with torch.device(device):
        model = Magi2Transformer3DModel(**config, params_dtype=torch.bfloat16, expert_dtype=expert_dtype).eval()
    if storage_dtype is not None:
        assert storage_dtype == torch.float8_e4m3fn, storage_dtype  # what enable_fp8_storage stores
        model.enable_fp8_storage(compute_dtype=torch.bfloat16)
    if not cuda:
        model.set_moe_backend("torch_grouped")
    chunk = gpu_chunk if cuda else 256
    if chunk is not None:
        model.enable_forward_chunking(chunk)
    inputs = packed_inputs(half, model.config.text_in_channels, device)
    counts = {k: 2 * v for k, v in half.items()}
    seg = sum(half.values())
    plan = trace_preview_forward(
        counts,
        (seg, seg),
        config,
        expert_dtype,
        kernels="cuda" if cuda else "cpu",
        count_inputs=False,
        storage_dtype=storage_dtype,
        **({} if chunk is None else {"forward_chunk_size": chunk}),
    )
    result = {
        "recipe": recipe,
        "device": str(device),
        "tokens": 2 * seg,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
    }
    with torch.no_grad():
        model.forward_packed(*inputs)  # warm-up: kernels compiled, configs chosen
        if cuda:
            times = {"dense": [], "moe": []}
            events = []

            def pre(block, *_):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                events.append((block, start))

            def post(block, *_):
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events.append((block, end))

            hooks = [b.register_forward_pre_hook(pre) for b in model.transformer_blocks]
            hooks += [b.register_forward_hook(post) for b in model.transformer_blocks]
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            model.forward_packed(*inputs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            measured = torch.cuda.max_memory_allocated() - base
            for h in hooks:
                h.remove()
            for (block, start), (_, end) in zip(events[0::2], events[1::2]):
                kind = "moe" if hasattr(block.mlp, "moe_mlp") else "dense"
                times[kind].append(start.elapsed_time(end) / 1e3)
            dense = sum(times["dense"]) / len(times["dense"])
            moe = sum(times["moe"]) / len(times["moe"])
            outer = seconds - sum(times["dense"]) - sum(times["moe"])
            result.update(
                forward_seconds_4_layers=seconds,
                dense_block_seconds=dense,
                moe_block_seconds=moe,
                step_seconds_40_layers_estimate=outer + 4 * dense + 36 * moe,
            )
        else:
            _, measured = cpu_allocator_peak(lambda: model.forward_packed(*inputs))
    result.update(
        measured_peak_above_weights_bytes=int(measured),
        planned_peak_above_weights_bytes=int(plan.activations),
        planned_over_measured=plan.activations / max(int(measured), 1),
        plan_peak_at=plan.peak_at,
    )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model on CPU (the dry run)")
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = {"recipes": {recipe: run(args.small, recipe) for recipe in args.recipes}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if all(abs(r["planned_over_measured"] - 1) <= 0.10 for r in result["recipes"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
