#!/usr/bin/env bash
# The oldest torch/triton pair the package declares (pyproject.toml's `torch>=` and `triton>=` floors), checked in a
# venv of its own: the GPU-target kernel builds (`python -m tests.helpers.kernel_build`: every config the launch
# table picks, compiled with that triton for sm_120/90/89/86/80 and read with its cuobjdump) and the test suite
# (which runs the same builds in tests/moe/test_moe_kernel_build.py, and every Triton kernel in that triton's CPU
# interpreter). CI (.ci/run) checks the pinned pair of ci-constraints.txt; this is the other end.
#
#   bash tests/benchmarks/check_version_floor.sh [PYTEST_ARGS...]     (from anywhere; default: the whole suite, -n 2)
#
# Environment: FLOOR_VENV (default .venv-floor in the checkout; created if missing, kept between runs);
# FLOOR_SKIP_SUITE=1 runs the kernel builds only. The floor's torch from PyPI is a CUDA build (several GB); no GPU is
# needed or used. Exit status: non-zero when the install, a build or a test failed.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="${FLOOR_VENV:-.venv-floor}"
# The floors, read from pyproject.toml (stated there once): e.g. torch 2.10 -> torch==2.10.*.
read -r torch_floor triton_floor < <(python3 - <<'EOF'
import re, tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
floor = lambda name: next(re.match(rf"{name}>=([\d.]+)", d).group(1) for d in deps if re.match(rf"{name}>=", d))
print(floor("torch"), floor("triton"))
EOF
)
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s.*\ntriton==%s.*\n' "$torch_floor" "$triton_floor" >"$constraints"
grep '^ruff==' ci-constraints.txt >>"$constraints"  # the same linter as CI
# Triton 3.6's CPU interpreter (the suite's kernel path) calls int() on one-element arrays, which numpy 2.4 refuses.
echo 'numpy<2.4' >>"$constraints"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q -c "$constraints" "torch==$torch_floor.*" "triton==$triton_floor.*" numpy
"$venv/bin/pip" install -q -c "$constraints" -e '.[test]'
"$venv/bin/python" -c 'import torch, triton; print(f"floor: torch {torch.__version__}, triton {triton.__version__}")'

echo "+ kernel builds (python -m tests.helpers.kernel_build)"
env -u TRITON_INTERPRET OMP_NUM_THREADS=1 TRITON_DEFAULT_FP_FUSION=1 "$venv/bin/python" -m tests.helpers.kernel_build \
    --check
if [ "${FLOOR_SKIP_SUITE:-0}" = 1 ]; then
    exit 0
fi
echo "+ test suite"
if [ "$#" -eq 0 ]; then
    set -- -q -n 2
fi
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest "$@"
