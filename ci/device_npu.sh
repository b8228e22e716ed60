#!/usr/bin/env bash
# The npu backend on a real Ascend machine (Atlas A2 / A3), for Ascend owners: one command that
# runs the conformance suite and a bench and writes a report.
#
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh     # CANN
#   bash ci/device_npu.sh                 # every step; logs and report.md under $OUT
#   bash ci/device_npu.sh conformance     # env, then only the steps named (name without NN-)
#
# Needs an environment with torch==2.10.0 (CPU build), torch-npu==2.10.0.post4,
# triton-ascend==3.2.2 and polyspec installed (docs/backends/npu.md, "Running it on an Ascend
# machine"). Steps (each logs to $OUT/NN-name.log; a failing step is recorded, the next runs):
#   env          python / torch / torch_npu / triton versions, npu-smi info
#   backends     polyspec backends (npu must be available)
#   static       tests/core/test_npu_static.py tests/core/test_npu_sim.py (no NPU used; the
#                simulator tests run with TORCH_DEVICE_BACKEND_AUTOLOAD=0 so that importing
#                torch does not load the real torch_npu)
#   conformance  pytest --pyargs polyspec.testing --polyspec-backend npu -q (the real NPU)
#   compare      the bench the simulator ran (BENCH_FLAGS, 2 prompts, 32 new tokens), to set its
#                acceptance length next to the simulator's; --json $OUT/compare.json
#   bench        polyspec bench --backend npu on SmolLM2-135M with the shipped EAGLE-3 head
#                (BENCH_FLAGS), $BENCH_PROMPTS prompts (default 10) of $DATASET (default
#                mt_bench), 128 new tokens, graphs on, --json $OUT/bench.json
#   report       $OUT/report.md: the summary, the bench table, and the figures the simulator
#                gave for the same bench (EXPECTED_* below) to compare with
# $OUT/summary.txt lists every step with its exit status; the script exits non-zero if any failed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out-npu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
WANTED=("$@")

# What the simulator gave for the compare step's command (python ci/npu_sim_bench.py -- <the
# same flags>, docs/backends/npu.md). Real NPU numerics may move it a little.
EXPECTED_ACCEPT_LENGTH="${EXPECTED_ACCEPT_LENGTH:-1.94}"

wanted() {
  [ "${#WANTED[@]}" -eq 0 ] && return 0
  local w
  for w in "${WANTED[@]}"; do [ "${1#*-}" = "$w" ] && return 0; done
  return 1
}

run_step() {  # run_step NAME TIMEOUT_S COMMAND...
  local name="$1" limit="$2"
  shift 2
  case "$name" in 00-*) ;; *) wanted "$name" || return 0 ;; esac
  local log="$OUT/$name.log" start=$SECONDS
  echo "=== $name: $*" | tee "$log"
  if declare -F "$1" >/dev/null; then "$@" >>"$log" 2>&1; else timeout "$limit" "$@" >>"$log" 2>&1; fi
  local rc=$?
  tail -n 15 "$log"
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$SUMMARY"
  [ "$rc" -ne 0 ] && FAILED=1
  return 0
}

env_info() {
  "$PY" - <<'PY'
import sys, importlib.metadata as md
print("python", sys.version.split()[0])
for dist in ("torch", "torch-npu", "triton-ascend", "triton", "polyspec"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
import torch
import torch_npu  # noqa: F401
print("npu available", torch.npu.is_available(), "devices", torch.npu.device_count())
PY
  npu-smi info || true
}

static_tests() {
  TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PY" -m pytest tests/core/test_npu_static.py \
    tests/core/test_npu_sim.py -q -p no:randomly
}

BENCH_FLAGS=(--dtype bfloat16 --page-size 128 --algorithm eagle3 --draft core/heads/smollm2-135m-eagle3
  --num-steps 3 --topk 1 --num-draft-tokens 4 --no-transformers --no-progress)

compare() {  # the simulator's bench (docs/backends/npu.md): same flags, same prompts
  "$PY" -m polyspec.cli bench --backend npu "${BENCH_FLAGS[@]}" --dataset "${DATASET:-mt_bench}" \
    --num-prompts 2 --max-new-tokens 32 --json "$OUT/compare.json"
}

bench() {
  "$PY" -m polyspec.cli bench --backend npu "${BENCH_FLAGS[@]}" --dataset "${DATASET:-mt_bench}" \
    --num-prompts "${BENCH_PROMPTS:-10}" --max-new-tokens 128 --graphs on --json "$OUT/bench.json"
}

report() {
  {
    echo "# npu backend on $(hostname) ($(date -u +%Y-%m-%dT%H:%MZ))"
    echo
    echo '```'
    cat "$SUMMARY"
    echo '```'
    echo
    echo "## compare (the simulator's bench, $OUT/compare.json)"
    echo '```'
    tail -n 25 "$OUT/04-compare.log" 2>/dev/null || echo "(compare did not run)"
    echo '```'
    echo
    echo "## bench (polyspec bench --backend npu, $OUT/bench.json)"
    echo '```'
    tail -n 25 "$OUT/05-bench.log" 2>/dev/null || echo "(bench did not run)"
    echo '```'
    echo
    echo "Expected from the simulator for compare (docs/backends/npu.md): mean acceptance length"
    echo "$EXPECTED_ACCEPT_LENGTH. Timings have no simulator counterpart."
  } >"$OUT/report.md"
  cat "$OUT/report.md"
}

run_step 00-env 120 env_info
run_step 01-backends 120 "$PY" -m polyspec.cli backends
run_step 02-static 600 static_tests
run_step 03-conformance 3600 "$PY" -m pytest --pyargs polyspec.testing --polyspec-backend npu -q
run_step 04-compare 900 compare
run_step 05-bench 1800 bench
report
exit "$FAILED"
