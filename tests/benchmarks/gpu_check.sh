#!/usr/bin/env bash
# The prepared GPU check: one run on one H200 or H100, every result under one folder. The step limits add up to
# 565 s, 595 s with the environment check (a device call may run 600 s); within 8.5 minutes (510 s) run it with
# GPU_CHECK_SKIP="memory_plan bench_moe" (their limits 125 s: the memory plan is CPU work that runs off the GPU, and
# bench_moe_int4 times the bf16 and FP8 kernels beside int4 in its own run), i.e. 470 s in all. It has never run on a
# GPU (none was lent while it was written); --dry-run runs its CPU parts.
#
#   bash tests/benchmarks/gpu_check.sh [--dry-run] [RESULTS_DIR]     (from anywhere; default: $OUT, else ./gpu_check)
#
# Interpreter: $PYTHON if set, else the repository's .venv/bin/python (the README's set-up), else it stops and
# says what to do. On a machine with torch (CUDA) but without this package's other needs (diffusers, av, ...),
# e.g. a bare Python 3.12 GPU box, carry cp312 wheels in a folder and name it in $WHEELS: the script installs
# them there with `pip install --no-index --no-deps --target` and puts them on PYTHONPATH:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl diffusers==0.38.0 av==...  (etc.)
#   WHEELS=.whl PYTHON=python3 bash tests/benchmarks/gpu_check.sh
#
# Steps (each has its own time limit, log and line in summary.txt; a failing step does not stop the others,
# and the exit status is non-zero when any step failed):
#   1. nvidia_smi.log, environment.log   the GPU, torch / CUDA / cuDNN / triton / diffusers / peft versions (the
#                              environment is read by the interpreter check that comes before every step)
#   2. gpu_tests.log/.xml      the `gpu`-marked tests (pytest -m gpu)
#   3. attention_sinks.json    attention with sinks per backend: time and max error vs the padded path and an fp32
#                              reference (one 540p CFG segment, 24 heads of 128, bf16)
#   4. bench_moe.json          the MoE kernel per config (bf16 and FP8 experts, atomic and deterministic) against
#                              torch._grouped_mm and a dense bf16 GEMM of equal FLOPs, released shape
#   4b. bench_moe_int4.json    the MoE kernel with int4 experts (one head's banks dequantized, then the bf16 kernel)
#                              against bf16 and FP8 experts in the same run (over_bf16), and its dequantization pass
#                              alone; on CPU (--dry-run) the int4 path's bandwidth-based estimate
#   5. gpu_block.json          one released-width block in bf16 and with FP8 experts, SDPA flash / cuDNN
#   6. preview_step.json       one 540p CFG preview step, a 4-layer model at the released width (40-layer time
#                              estimated from per-block times): time and peak memory against the plan, for the
#                              141 GB recipe (FP8 experts) and the 80 GB one (int4 experts on the Triton path,
#                              FP8-stored dense weights, the default 16,384-token chunks): the 80 GB plan's check
#   7. streaming_24gb.json     the 24 GB recipe under a 24 GB cap (set_per_process_memory_fraction): a 4-block
#                              released-width model (int4 experts, FP8-stored dense weights) on one 540p CFG forward,
#                              resident then streamed through a 2-slot ring: time per block streamed vs resident
#                              (target <= 1.15), the fraction of copy time hidden behind compute, peak memory against
#                              the plan (bench_weight_streaming --recipe_24gb)
#   8. memory_plan.json        the memory plan's 540p rows (CPU work; the README table's numbers; the 80 GB plan,
#                              bench_memory --gpu_gb 80, is CPU work too and runs off the GPU)
# --dry-run: steps 3-7 at CPU sizes, 2 and 8 skipped, time limits x6 (a shared CPU is slow); the suite runs it
# so the script cannot rot. GPU_CHECK_SKIP="name ..." skips steps by name.

set -u -o pipefail

DRY=0
LIMIT_SCALE=1
if [ "${1:-}" = "--dry-run" ]; then DRY=1; LIMIT_SCALE=6; shift; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS="${1:-${OUT:-$ROOT/gpu_check}}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then
        PYTHON="$ROOT/.venv/bin/python"
    else
        echo "gpu_check: no interpreter: set PYTHON=/path/to/python, or create the venv as the README says" >&2
        echo "  (python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 triton==3.9.0 &&" >&2
        echo "   .venv/bin/pip install -c ci-constraints.txt -e '.[test]'), or carry wheels: see WHEELS above" >&2
        exit 2
    fi
fi
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
cd "$ROOT"
if [ -n "${WHEELS:-}" ]; then
    SITE="${WHEELS_TARGET:-/tmp/gpu_check_site}"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl > "$RESULTS/wheels.log" 2>&1 || { echo "gpu_check: installing $WHEELS failed (wheels.log)" >&2; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ENV_PY='import torch, diffusers, diffusers_magi2
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
for mod in ("triton", "diffusers", "peft", "diffusers_magi2"):
    try:
        print(mod, getattr(__import__(mod), "__version__", "?"))
    except ImportError as error:
        print(mod, "not installed:", error)'
START=$(date +%s)
# the interpreter check is the environment step: one import of the package, not two
if ! timeout --kill-after=10 $(( 30 * LIMIT_SCALE )) "$PYTHON" -c "$ENV_PY" > "$RESULTS/environment.log" 2>&1; then
    echo "gpu_check: $PYTHON cannot import torch, diffusers and diffusers_magi2 (environment.log):" >&2
    tail -n 3 "$RESULTS/environment.log" >&2
    echo "  install the missing packages, or carry cp312 wheels and pass WHEELS=dir (see the header)" >&2
    exit 2
fi
ENV_SECS=$(( $(date +%s) - START ))
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
FAILED=0

# step NAME LIMIT_SECONDS COMMAND...: run with a time limit, stdout+stderr to NAME.log, one summary line
step() {
    local name="$1" limit=$(( $2 * LIMIT_SCALE ))
    shift 2
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*) skip "$name" "$*" "skipped (GPU_CHECK_SKIP)"; return;; esac
    local t0 rc=0
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1 || rc=$?
    local secs=$(( $(date +%s) - t0 ))
    local verdict="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMED OUT after ${limit}s"; FAILED=1
    elif [ "$rc" -ne 0 ]; then verdict="FAILED (exit $rc)"; FAILED=1; fi
    local cmd="$*"
    cmd="${cmd%%$'\n'*}"
    printf '%-16s %-26s %4ss  %s\n' "$name" "$verdict" "$secs" "${cmd:0:110}" | tee -a "$SUMMARY"
}

skip() {
    local cmd="$2"
    printf '%-16s %-26s %4ss  %s\n' "$1" "${3:-skipped (dry run)}" 0 "${cmd:0:110}" | tee -a "$SUMMARY"
}

environment_line() {
    printf '%-16s %-26s %4ss  %s\n' environment ok "$ENV_SECS" "$PYTHON -c (versions; environment.log)" | tee -a "$SUMMARY"
}

if [ "$DRY" -eq 1 ]; then
    SMALL="--small"
    skip nvidia_smi "nvidia-smi"
    environment_line
    skip gpu_tests "pytest -m gpu"
    MOE_ARGS=(--tokens 256 --repeats 1 --expert_dtype bf16)
else
    SMALL=""
    step nvidia_smi 15 nvidia-smi
    environment_line
    step gpu_tests 75 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests \
        --junitxml="$RESULTS/gpu_tests.xml" -o console_output_style=classic -rA
    # short CPU part (--tokens, --repeats); the GPU part runs the released shape in both expert dtypes
    MOE_ARGS=(--tokens 1024 --repeats 1 --expert_dtype bf16 fp8_e4m3)
fi
step attention_sinks 50 "$PYTHON" -m tests.benchmarks.bench_attention_sinks $SMALL --out "$RESULTS/attention_sinks.json"
step bench_moe 80 "$PYTHON" -m tests.benchmarks.bench_moe --out "$RESULTS/bench_moe.json" "${MOE_ARGS[@]}"
# int4 experts: a step of its own (bf16 and FP8 timed again beside it, so its ratios come from one run)
if [ "$DRY" -eq 1 ]; then
    step bench_moe_int4 10 "$PYTHON" -m tests.benchmarks.bench_moe --tokens 256 --repeats 1 --expert_dtype bf16 int4 \
        --out "$RESULTS/bench_moe_int4.json"
else
    step bench_moe_int4 50 "$PYTHON" -m tests.benchmarks.bench_moe --cuda_only --no_torch_path --repeats 3 \
        --cuda_tokens 4096 8192 16384 29184 \
        --expert_dtype bf16 fp8_e4m3 int4 --out "$RESULTS/bench_moe_int4.json"
fi
step gpu_block 40 "$PYTHON" -m tests.benchmarks.bench_gpu_block $SMALL --out "$RESULTS/gpu_block.json"
step preview_step 120 "$PYTHON" -m tests.benchmarks.bench_preview_step $SMALL --out "$RESULTS/preview_step.json"
step streaming_24gb 90 "$PYTHON" -m tests.benchmarks.bench_weight_streaming --recipe_24gb $SMALL \
    --out "$RESULTS/streaming_24gb.json"
if [ "$DRY" -eq 1 ]; then
    skip memory_plan "python -m tests.benchmarks.bench_memory --quick"
else
    step memory_plan 45 "$PYTHON" -m tests.benchmarks.bench_memory --quick --out "$RESULTS/memory_plan.json"
fi

echo "total $(( $(date +%s) - START ))s; results in $RESULTS" | tee -a "$SUMMARY"
exit "$FAILED"
