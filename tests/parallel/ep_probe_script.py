"""Launch probe: set up expert parallelism for ``--ep_degree`` and print what each rank got (one JSON line per rank).

Run under ``accelerate launch`` by ``test_ep_accelerate_launch.py``. Uses the product's EP set-up only: the example
scripts' ``init_distributed_from_launch`` (``PartialState(cpu=not torch.cuda.is_available())`` when launched), then
``resolve_expert_parallel`` and a ``Magi2MultiHeadMoE`` built on the EP group. Exits non-zero when EP cannot be honoured (e.g. one process).
"""

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.parallel.expert_parallel import Magi2ExpertParallelConfig, resolve_expert_parallel


# the example script's teardown (barrier, destroy the group, os._exit on CPU), not a copy of it
_spec = importlib.util.spec_from_file_location(
    "magi2_generate", Path(__file__).parents[2] / "examples" / "generate.py"
)
_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_generate)
_rules_spec = importlib.util.spec_from_file_location("magi2_launch_rules", _generate.EXAMPLES + "/launch_rules.py")
_rules = importlib.util.module_from_spec(_rules_spec)
_rules_spec.loader.exec_module(_rules)

parser = argparse.ArgumentParser()
parser.add_argument("--ep_degree", type=int, required=True)
args = parser.parse_args()

_rules.init_distributed_from_launch()
ep = resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=args.ep_degree))
cfg = Magi2MultiHeadMoEConfig(
    hidden_size=128, num_heads=4, num_experts=8, top_k=2, expert_intermediate_size=64, params_dtype=torch.bfloat16
)
moe = Magi2MultiHeadMoE(cfg, ep.group)
x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
y = moe(x)  # one real EP forward (layout a) through the group
from accelerate import PartialState  # noqa: E402


state = PartialState()
_line = (
    "EP_PROBE "
    + json.dumps(
        {
            "rank": ep.rank,
            "world_size": dist.get_world_size(),
            "backend": str(dist.get_backend()),
            "distributed_type": str(state.distributed_type),
            "ep_group_size": dist.get_world_size(ep.group),
            "local_expert_rows": moe.W_gate.shape[0],
            "full_expert_rows": cfg.num_heads * cfg.num_experts,
            "out_shape": list(y.shape),
        }
    )
    + "\n"
)
# one write(2) of the whole line: both ranks share the pipe, and print()'s separate writes could interleave
sys.stdout.flush()
os.write(sys.stdout.fileno(), _line.encode())
_generate.end_distributed_run(0)
