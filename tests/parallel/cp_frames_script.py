"""Decode the tiny random pipeline's frames under the launch rules of ``examples/generate.py`` (CP = EP = the
number of processes under ``accelerate launch --multi_gpu``, nothing parallel when run alone) and let rank 0 save
the uint8 frames, before any video encoding, to ``--out`` (``.npy``). Launched, each rank first prints one
``EP_PROBE`` JSON line: its world, backend, accelerate's distributed type, its EP group and a MoE layer's expert rows.
Run by ``test_cp_launch.py``."""

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline


# the example script's teardown, not a copy of it
_spec = importlib.util.spec_from_file_location(
    "magi2_generate", Path(__file__).parents[2] / "examples" / "generate.py"
)
_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_generate)
end_distributed_run = _generate.end_distributed_run
# the example scripts' launch rules, not a copy of them
_rules_spec = importlib.util.spec_from_file_location("magi2_launch_rules", _generate.EXAMPLES + "/launch_rules.py")
_rules = importlib.util.module_from_spec(_rules_spec)
_rules_spec.loader.exec_module(_rules)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

_rules.init_distributed_from_launch()
expert_parallel = _rules.expert_parallel_from_launch(None)
context_parallel = _rules.context_parallel_from_launch(None)
pipe = build_tiny_random_pipeline(dtype=torch.float32)
if expert_parallel is not None:
    pipe.transformer.enable_expert_parallel(expert_parallel)
if context_parallel is not None:
    pipe.enable_context_parallel(context_parallel)
if expert_parallel is not None:
    import torch.distributed as dist
    from accelerate import PartialState

    from diffusers_magi2 import Magi2MultiHeadMoE

    moe = next(m for m in pipe.transformer.modules() if isinstance(m, Magi2MultiHeadMoE))
    probe = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "distributed_type": str(PartialState().distributed_type),
        "ep_group_size": dist.get_world_size(moe.ep_group),
        "local_expert_rows": moe.W_gate.shape[0],
        "full_expert_rows": moe.config.num_heads * moe.config.num_experts,
    }
    # one write(2) of the whole line: both ranks share the pipe, and print()'s separate writes could interleave
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("EP_PROBE " + json.dumps(probe) + "\n").encode())
calls = {"text_encoder": 0, "video_decoder": 0, "audio_decoder": 0}


def _counting(name, fn):
    def wrapped(*a, **k):
        calls[name] += 1
        return fn(*a, **k)

    return wrapped


pipe.text_encoder.register_forward_pre_hook(lambda *a: calls.__setitem__("text_encoder", calls["text_encoder"] + 1))
pipe.video_decoder.decode = _counting("video_decoder", pipe.video_decoder.decode)
pipe.audio_vae.decode = _counting("audio_decoder", pipe.audio_vae.decode)
output = pipe(
    prompt="a cat on a piano",
    height=64,
    width=64,
    num_inference_steps=2,
    generator=torch.Generator("cpu").manual_seed(42),
    output_type="np",
)
rank = int(os.environ.get("RANK", "0"))
print(
    f"CP_CALLS rank={rank} "
    + " ".join(f"{k}={v}" for k, v in calls.items())
    + f" frames={'none' if output.frames is None else 'array'} audio={'none' if output.audio is None else 'array'}",
    flush=True,
)
if rank == 0:
    frames = np.asarray(output.frames[0])
    if frames.dtype != np.uint8:
        frames = (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    np.save(args.out, frames)
    print(f"CP_FRAMES cp={pipe.transformer.context_parallel_degree} shape={frames.shape}")
end_distributed_run(0)
