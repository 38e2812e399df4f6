"""The package's Triton kernels built for real GPU targets on CPU (sm_120, sm_90, sm_89, sm_86, sm_80), read with
cuobjdump.

The builds the launch table chooses at the released MoE shape (bf16, FP8 and int4 experts, atomic and
deterministic; int4 runs the kernel per head on dequantized bf16 banks) must compile without spills, on tensor cores
(HGMMA on sm_90, HMMA elsewhere), with every weight operand prefetched by the software pipeliner (>= 3 stages),
within the architecture's shared memory, and with native atomic adds; so must the int4 dequantization kernel at both
bank shapes (no spills, its code tiles prefetched); FP8 on sm_80 and sm_86 is refused by the launcher. The builds use
the installed Triton (the pinned one in CI; ``tests/benchmarks/check_version_floor.sh`` runs them under the declared
floor). They run once per session in a subprocess without ``TRITON_INTERPRET`` (which conftest sets for the rest of
the suite); the table is printed (``pytest -s``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import kernel_build
from helpers.fixtures import REPO_ROOT
from helpers.kernel_build import BuildResult, KernelBuild, build_problems


#: The checked targets: RTX 5090, H100/H200, RTX 4090/L40S, RTX 3090/A6000, A100.
ARCHS = (120, 90, 89, 86, 80)


@pytest.fixture(scope="module")
def report() -> dict:
    missing = kernel_build.missing_tools()
    if missing:
        pytest.skip(f"GPU-target compile check needs Triton's bundled ptxas and cuobjdump: {missing}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.kernel_build", "--json", "--jobs", "2"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skipped" in result:
        pytest.skip(f"GPU-target compile check: {result['skipped']}")
    return result


def _results(report: dict) -> list[BuildResult]:
    out = []
    for row in report["builds"]:
        fields = {k: v for k, v in row.items() if k not in ("build", "problems")}
        build = KernelBuild(**{**row["build"], "config": tuple(row["build"]["config"])})
        out.append(BuildResult(build, **fields))
    return out


@pytest.mark.slow  # the GPU-target builds (module fixture)
def test_every_triton_kernel_of_the_package_is_built(report: dict) -> None:
    kernels = {name for names in report["kernels"].values() for name in names}
    assert {"_mh_moe_fwd_kernel", kernel_build.DEQUANT_KERNEL} <= kernels  # the scan finds the kernels it must
    assert "round_to" not in kernels  # a helper called from another module is no kernel
    assert kernels <= {row["build"]["kernel"] for row in report["builds"]}


@pytest.mark.slow  # the GPU-target builds (module fixture)
def test_chosen_launch_configs_build_clean_for_gpu_targets(report: dict) -> None:
    results = _results(report)
    print("\n" + kernel_build.format_table(results))
    moe = [r for r in results if r.build.kernel == "_mh_moe_fwd_kernel"]
    covered = {(r.build.arch, r.build.weights, r.build.deterministic) for r in moe}
    expected = {
        (arch, weights, det)
        for arch in ARCHS
        for weights in ("bfloat16", "float8_e4m3fn", "int4")
        for det in (False, True)
        if not (arch in (80, 86) and weights == "float8_e4m3fn")
    }
    assert covered == expected
    dequant = {(r.build.arch, r.build.mode) for r in results if r.build.kernel == kernel_build.DEQUANT_KERNEL}
    assert dequant == {(arch, bank) for arch in ARCHS for bank in kernel_build.RELEASED_INT4_BANKS}
    failing = {
        f"sm_{r.build.arch} {r.build.weights} {r.build.mode} {r.build.config}": build_problems(r) for r in results
    }
    assert not {k: v for k, v in failing.items() if v}
    for r in results:
        operands = kernel_build.MOE_WEIGHT_OPERANDS if r in moe else kernel_build.DEQUANT_OPERANDS
        assert set(r.prefetch) == set(operands) and min(r.prefetch.values()) >= 2


@pytest.mark.slow  # the GPU-target builds (module fixture)
def test_fp8_experts_below_sm89_are_refused_by_the_launcher(report: dict) -> None:
    refusals = {(r["arch"], r["weights"]): r["error"] for r in report["refusals"]}
    assert set(refusals) == {(80, "float8_e4m3fn"), (86, "float8_e4m3fn")}
    for error in refusals.values():
        assert "compute capability >= 8.9" in error and "bf16" in error


def test_build_checks_flag_each_defect() -> None:
    """The checker itself: spills, missing tensor cores, an unprefetched operand, too few stages, too much shared
    memory, CAS-loop atomics and a failed compile are each reported."""
    good = {
        "registers": 190,
        "shared_bytes": 180224,
        "mma": "HGMMA",
        "num_stages": 3,
        "prefetch": {"wg": 3, "wu": 3, "wd": 3},
        "ldgsts": 36,
        "atomics": "native",
    }
    build = KernelBuild("_mh_moe_fwd_kernel", 90, "bfloat16", False, (64, 32, 8, 3), "test")
    assert build_problems(BuildResult(build, **good)) == []
    defects = {
        "spills": {"spill_stores": 2, "spill_loads": 2, "stack_bytes": 8},
        "expected HGMMA": {"mma": "HMMA"},
        "not prefetched": {"prefetch": {"wg": 3, "wu": 3, "wd": 0}},
        "num_stages 2": {"num_stages": 2},
        "shared memory": {"shared_bytes": 240000},
        "compare-and-swap": {"atomics": "CAS loop"},
        "does not compile": {"error": "CompilationError: boom"},
    }
    for needle, change in defects.items():
        problems = build_problems(BuildResult(build, **{**good, **change}))
        assert any(needle in p for p in problems), (needle, problems)
    # the dequantization kernel has no GEMM: no MMA is asked of it, the rest is
    dequant = KernelBuild(kernel_build.DEQUANT_KERNEL, 90, "int4", False, (128, 4, 3), "W_down [256 x 1280 x 256]")
    plain = {**good, "mma": "none", "prefetch": {"codes": 2}, "atomics": "-"}
    assert build_problems(BuildResult(dequant, **plain)) == []
    assert build_problems(BuildResult(dequant, **{**plain, "prefetch": {"codes": 0}}))
