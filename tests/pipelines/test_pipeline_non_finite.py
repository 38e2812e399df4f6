"""A NaN in a weight that no MoE router sees (the last MoE layer's experts, the preview's final projection, the
refiner, which has no router) is refused on a 1-step call of ``Magi2Pipeline`` and of ``Magi2ModularPipeline``
with the same message, naming that weight (the stage-result check); one found by a later step's router is named
too; ``examples/generate.py`` then exits non-zero and writes no file. Under context parallelism:
``tests/parallel/test_cp_non_finite.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.fixtures import REPO_ROOT
from helpers.modular_testing_utils import PROMPT, tiny_pipelines
from helpers.non_finite_cases import CASES, ONE_STEP, poisoned


@pytest.fixture(scope="module")
def pipes():
    return tiny_pipelines(with_refiner=True)


@pytest.mark.parametrize("case", list(CASES))
def test_a_nan_weight_no_router_sees_is_refused_on_a_one_step_call_naming_it(pipes, case):
    pipe, modular = pipes
    component, name, index, call, expected = CASES[case]
    with poisoned(getattr(pipe, component), name, index):
        with pytest.raises(ValueError, match=expected):
            pipe(PROMPT, generator=torch.Generator().manual_seed(3), **call)
        with pytest.raises(ValueError, match=expected):
            modular(prompt=PROMPT, generator=torch.Generator().manual_seed(3), **call)
    assert torch.isfinite(pipe(PROMPT, generator=torch.Generator().manual_seed(3), **ONE_STEP).frames).all()


def test_a_nan_projection_found_by_the_next_steps_router_is_named_not_blamed_on_the_input(pipes):
    """The NaN velocity of step 0 reaches the routers at step 1: the message names the projection."""
    pipe, _ = pipes
    _, name, index, call, _ = CASES["final projection"]
    expected = (
        r"^MoE router inputs are not finite at step index 1: first in transformer_blocks\.1\.mlp\.moe_mlp; "
        r"the weight post_adapter\.final_linear_video\.weight holds nan"
    )
    with poisoned(pipe.transformer, name, index), pytest.raises(ValueError, match=expected):
        pipe(PROMPT, generator=torch.Generator().manual_seed(3), **{**call, "num_inference_steps": 2})


def test_generate_exits_non_zero_and_writes_no_file(tmp_path, monkeypatch, capsys):
    """``examples/generate.py`` on the tiny default with a NaN final projection: one ``error:`` line naming the
    weight, exit status 2, and nothing left in the output folder."""
    from diffusers_magi2.pipelines import tiny_default

    spec = importlib.util.spec_from_file_location("magi2_generate_non_finite", REPO_ROOT / "examples" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    build = tiny_default.build_tiny_default_pipeline

    def poisoned_build(*args, **kwargs):
        pipe = build(*args, **kwargs)
        with torch.no_grad():
            pipe.transformer.post_adapter.final_linear_video.weight[0, 0] = float("nan")
        return pipe

    monkeypatch.setattr(tiny_default, "build_tiny_default_pipeline", poisoned_build)
    out = tmp_path / "out"
    argv = ["--prompt", "a cat", "--output", str(out / "clip.mp4"), "--height", "32", "--width", "32"]
    rc = generate.run([*argv, "--num_inference_steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "post_adapter.final_linear_video.weight holds nan" in err, err
    assert not out.exists() or not any(out.iterdir())
