#!/usr/bin/env bash
# The prepared GPU check: one run on one H200, at most 8 minutes (the step limits add up to 465 s), every result
# under one folder.
#
#   bash tests/benchmarks/gpu_check.sh [RESULTS_DIR]       (from the repository root; default: $OUT, else ./gpu_check)
#
# Steps (each has its own time limit, log and line in summary.txt; a failing step does not stop the others,
# and the exit status is non-zero when any step failed):
#   1. nvidia_smi.log, environment.log   the GPU, torch / CUDA / cuDNN / triton / diffusers / peft versions
#   2. gpu_tests.log/.xml     the `gpu`-marked tests (pytest -m gpu)
#   3. bench_moe.json/.log  the MoE benchmark: released shape, bf16 and FP8 experts (--expert_dtype), Triton
#                        atomic and deterministic, TFLOP/s against a dense bf16 GEMM of equal FLOPs, same run
#   4. gpu_block.json/.log  one released-width block forward in bf16 and with FP8 experts, SDPA flash and cuDNN
#                        against the torch path; a 2-block released-width model under enable_group_offload
# Needs no network. PYTHON selects the interpreter (default: python).

set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS="${1:-${OUT:-$ROOT/gpu_check}}"
PYTHON="${PYTHON:-python}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$(date +%s)

# step NAME LIMIT_SECONDS COMMAND...: run with a time limit, stdout+stderr to NAME.log, one summary line
step() {
    local name="$1" limit="$2"
    shift 2
    local t0=$(date +%s) rc=0
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1 || rc=$?
    local secs=$(( $(date +%s) - t0 ))
    local verdict="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMED OUT after ${limit}s"; FAILED=1
    elif [ "$rc" -ne 0 ]; then verdict="FAILED (exit $rc)"; FAILED=1; fi
    local cmd="$*"
    cmd="${cmd%%$'\n'*}"
    printf '%-14s %-26s %4ss  %s\n' "$name" "$verdict" "$secs" "${cmd:0:110}" | tee -a "$SUMMARY"
}

ENV_PY='import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
for mod in ("triton", "diffusers", "peft"):
    try:
        print(mod, __import__(mod).__version__)
    except ImportError as error:
        print(mod, "not installed:", error)'

step nvidia_smi 15 nvidia-smi
step environment 30 "$PYTHON" -c "$ENV_PY"
step gpu_tests 180 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests \
    --junitxml="$RESULTS/gpu_tests.xml" -o console_output_style=classic -rA
# short CPU part (--tokens, --repeats); the GPU part runs the released shape in both expert dtypes
step bench_moe 130 "$PYTHON" -m tests.benchmarks.bench_moe --out "$RESULTS/bench_moe.json" --tokens 1024 --repeats 1 \
    --expert_dtype bf16 fp8_e4m3
step gpu_block 110 "$PYTHON" -m tests.benchmarks.bench_gpu_block --out "$RESULTS/gpu_block.json"

echo "total $(( $(date +%s) - START ))s; results in $RESULTS" | tee -a "$SUMMARY"
exit "$FAILED"
