"""Bad context-parallel set-ups raise a clear error before any work starts.

The multi-rank errors (EP over other ranks than CP, saving a sharded model) are checked in ``test_cp_models.py``;
a bad ``--ulysses_degree`` under a two-process launch is checked here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from diffusers import ContextParallelConfig, ParallelConfig
from helpers.fixtures import REPO_ROOT
from helpers.launch import load_launch_rules

from diffusers_magi2 import Magi2Pipeline
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from diffusers_magi2.parallel.context_parallel import Magi2ContextParallelGroup


TINY_PREVIEW = {
    "num_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_key_value_heads": 2,
    "in_channels": 4,
    "audio_in_channels": 4,
    "text_in_channels": 8,
    "multimodal_layers": (0,),
    "moe_layers": (1,),
    "num_streams": 2,
    "moe_num_heads": 4,
    "moe_num_experts": 2,
    "moe_top_k": 1,
    "moe_expert_intermediate_size": 8,
    "shared_expert_intermediate_size": 8,
    "modality_specific_expert_intermediate_size": 8,
    "time_embed_dim": 4,
}

TINY_REFINER = {
    "num_layers": 1,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_key_value_heads": 1,
    "in_channels": 4,
    "audio_in_channels": 4,
    "text_in_channels": 8,
    "multimodal_layers": (0,),
}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("cls", [Magi2Transformer3DModel, Magi2RefinerTransformer3DModel])
def test_enable_parallelism_rejects_bad_configs(cls):
    model = Magi2Transformer3DModel(**TINY_PREVIEW) if cls is Magi2Transformer3DModel else cls(**TINY_REFINER)
    with pytest.raises(ValueError, match=r"ulysses_degree=2\) must equal the world size \(1\)"):
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    with pytest.raises(ValueError, match="ring attention is not supported"):
        model.enable_parallelism(config=ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=2)))
    with pytest.raises(ValueError, match="takes no cp_plan"):
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2), cp_plan={})
    with pytest.raises(TypeError, match="must be a diffusers ContextParallelConfig"):
        model.enable_parallelism(config={"ulysses_degree": 2})
    assert model.context_parallel_degree == 1 and model._parallel_config is None  # nothing was applied


def test_ep_degree_that_does_not_divide_the_cp_degree_is_refused():
    model = Magi2Transformer3DModel(**TINY_PREVIEW)
    moe = model.transformer_blocks[1].mlp.moe_mlp
    model.transformer_blocks[1].mlp.moe_mlp = type(moe)(moe.config, ep_rank=0, ep_size=3)  # as if over 3 ranks
    with pytest.raises(
        ValueError, match=r"expert-parallel degree \(3\) divides neither the context-parallel degree \(4\)"
    ):
        model._install_context_parallel_exchanges(Magi2ContextParallelGroup(None, 0, 4, None))


def test_launch_rules_fail_before_loading():
    context_parallel_from_launch = load_launch_rules().context_parallel_from_launch
    with pytest.raises(ValueError, match="--ulysses_degree 2 requested but this run has 1 process"):
        context_parallel_from_launch(2)
    with pytest.raises(ValueError, match="--ulysses_degree must be a positive int"):
        context_parallel_from_launch(0)
    assert context_parallel_from_launch(None) is None and context_parallel_from_launch(1) is None
    with pytest.raises(
        ValueError, match=r"--ep_degree 3 requested but this run has 1 process\(es\), which it does not"
    ):
        context_parallel_from_launch(None, 3)
    # the pipeline checks the degree before it looks for the weights
    with pytest.raises(ValueError, match="must equal the world size"):
        Magi2Pipeline.from_pretrained("/nonexistent/repo", context_parallel=ContextParallelConfig(ulysses_degree=2))


def test_generate_script_refuses_a_bad_ulysses_degree_before_loading(tmp_path):
    out = tmp_path / "never.mp4"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "examples" / "generate.py"),
        "--prompt",
        "x",
        "--ulysses_degree",
        "2",
        "--output",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert res.returncode != 0 and not out.exists()
    assert "--ulysses_degree 2 requested but this run has 1 process(es)" in res.stderr


@pytest.mark.distributed
def test_generate_under_a_launcher_refuses_a_bad_ulysses_degree_on_every_rank(tmp_path):
    """Two launched processes, --ulysses_degree 3: both stop with the error before torch is imported (the run ends
    well inside the timeout: nothing waits on a dead group); rank 0 alone prints it."""
    from helpers.launch import GENERATE, multi_cpu_launch, run_launched

    out = tmp_path / "never.mp4"
    res = run_launched(
        multi_cpu_launch(GENERATE, "--prompt", "x", "--ulysses_degree", "3", "--output", str(out)), tmp_path, 180
    )
    assert res.returncode != 0 and not out.exists(), res.stderr[-3000:]
    # one line from rank 0 (the first on stderr); what follows is the launcher's own failure summary
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and res.stderr.startswith(errors[0]), res.stderr[-3000:]
    assert "--ulysses_degree 3 requested but this run has 2 process(es)" in errors[0]
    assert 'generate.py", line' not in res.stderr  # no traceback from the script
    assert "wrote " not in res.stdout
