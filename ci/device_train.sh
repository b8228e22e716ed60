#!/usr/bin/env bash
# Train the shipped SmolLM2 EAGLE-3 head on the H200 (run by the lead through the device tool).
#
#   bash ci/device_train.sh gen     # prompts written by the target + answers (10-minute call)
#   bash ci/device_train.sh train   # features + training on the answers written, then the
#                                   # end-to-end bench of the new head (another call;
#                                   # BENCH=0 skips the bench)
#   bash ci/device_train.sh bench   # the bench alone: batch 1 and 16 for each S-K-N in
#                                   # $BENCH_SETTINGS (default "3-3-8 5-4-16")
#
# Expects the model at $MODEL (default /root/m/model.gguf), the prompt file at $PROMPTS
# (default /root/train.jsonl: ../shared/data/prompts/train.jsonl, carried over) and MT-bench at
# $MT_BENCH (default /root/mt_bench.jsonl). Writes to $HEAD_DIR (default /root/head) and copies
# the head to $OUT (head.tar: config, arguments, log, summary, sha256; the weights in parts:
# cat model.safetensors.part_* > model.safetensors). The device tool limits a command to 10
# minutes, hence two calls.
# gen writes every prompt's greedy answer before any sampled one and stops at $GEN_TIMEOUT;
# train then uses exactly the answers written (--max-answers), and sets its step count from
# $TIME_BUDGET seconds of training (--time-budget; the count used is in train_log.jsonl).
# INIT_FROM=HEAD_DIR warm-starts from a trained head (e.g. core/heads/smollm2-135m-eagle3) to go
# on training it over new answers; LR sets the peak learning rate (default 1e-3).
# DRAFT_VOCAB sets --draft-vocab-size (default 8192 for a new head; with INIT_FROM the head's own,
# and a larger value grows it).
# SEED=1 draws other self-written prompts (and sampled answers) than the default seed 0;
# EXTRA_ANSWERS=FILE adds an earlier run's answers.jsonl to the training text.
# OPENERS=builtin|FILE starts the self-written prompts with task openings (--self-prompt-openers).
# CONTENT_FROM=ANSWERS.jsonl adds $CONTENT_PROMPTS (default 4096) prompts that carry content: an
# earlier run's answers inside a task (--content-prompts-from; .xz and .gz files read as they are).
# TRAIN_DTYPE=float32 trains in fp32 (the default, bfloat16, is mixed precision: stages 1-7 ran fp32).
# The bench runs polyspec plain and speculative only (transformers' figure does not depend on the
# head; BENCH_TRANSFORMERS=1 adds it); each polyspec system is timed $BENCH_REPEATS times (default 3)
# and reported by its median (bench --repeats).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out}"
MODEL="${MODEL:-/root/m/model.gguf}"
PROMPTS="${PROMPTS-/root/train.jsonl}"  # PROMPTS= (empty): self-written prompts only
MT_BENCH="${MT_BENCH:-/root/mt_bench.jsonl}"
HEAD_DIR="${HEAD_DIR:-/root/head}"
mkdir -p "$OUT" "$HEAD_DIR"
python3 -c 'import polyspec.backends.cuda.plugin' 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
BACKEND="${BACKEND:-cuda}"
COMMON=(--target "$MODEL" ${PROMPTS:+--prompts "$PROMPTS"} --out "$HEAD_DIR" --backend "$BACKEND"
        --dtype bfloat16 --num-prompts "${NUM_PROMPTS:-1400}" --self-prompts "${SELF_PROMPTS:-12000}"
        --samples-per-prompt "${SAMPLES:-2}" --sample-temperature 0.8 --max-new-tokens "${MAX_NEW_TOKENS:-384}"
        --gen-batch-size "${GEN_BATCH:-256}" --seed "${SEED:-0}" --graphs "${GRAPHS:-auto}"
        ${OPENERS:+--self-prompt-openers "$OPENERS"}
        ${CONTENT_FROM:+--content-prompts-from "$CONTENT_FROM" --content-prompts "${CONTENT_PROMPTS:-4096}"})
bench_head() {  # bench_head S-K-N ...: batch 1 and 16 for each setting, JSON into $OUT
  for skn in "$@"; do
    IFS=- read -r s k n <<< "$skn"
    for bs in 1 16; do
      timeout 150 polyspec bench --backend "$BACKEND" --dtype bfloat16 --target "$MODEL" \
        --algorithm eagle3 --draft "$HEAD_DIR" --num-steps "$s" --topk "$k" --num-draft-tokens "$n" \
        --dataset "$MT_BENCH" --max-new-tokens "${BENCH_TOKENS:-128}" --batch-size "$bs" \
        --num-prompts "$([ "$bs" = 1 ] && echo "${BENCH_PROMPTS_1:-10}" || echo "${BENCH_PROMPTS_16:-80}")" --no-progress \
        $([ "${BENCH_TRANSFORMERS:-0}" = 1 ] || echo --no-transformers) \
        --repeats "${BENCH_REPEATS:-3}" --json "$OUT/e2e-bs$bs-s${s}k${k}n${n}.json" 2>&1 | tail -n 15
    done
  done
}
quiet() { tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$" | tail -n "$1"; }
# train-draft writes in .NAME.partial beside --out and renames it into place when it finishes:
# a run cut short by its timeout leaves its answers there (a --resume continues from them).
WORK_DIR="$(dirname "$HEAD_DIR")/.$(basename "$HEAD_DIR").partial"
run_dir() { if [ -d "$WORK_DIR" ]; then echo "$WORK_DIR"; else echo "$HEAD_DIR"; fi; }
case "${1:-}" in
  gen)
    start=$SECONDS
    timeout "${GEN_TIMEOUT:-500}" polyspec train-draft "${COMMON[@]}" --generate-only 2>&1 | quiet 20
    rc=${PIPESTATUS[0]}
    left=$(( ${GEN_TIMEOUT:-500} - (SECONDS - start) ))
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$left" -gt 60 ]; then
      echo "gen failed (rc $rc); resuming at batch 128 for the ${left} s left"
      timeout "$left" polyspec train-draft "${COMMON[@]}" --gen-batch-size 128 --generate-only --resume 2>&1 | quiet 20
    fi
    RUN_DIR="$(run_dir)"
    echo "self prompts: $(wc -l < "$RUN_DIR/self_prompts.jsonl"), answers: $(wc -l < "$RUN_DIR/answers.jsonl")"
    # The machine is handed back ~30 s after a call: bring the answers home too, so a lost
    # machine costs a carry (ANSWERS_FROM=dir-of-parts on the train call), not a regeneration.
    if command -v xz >/dev/null; then
      xz -T0 -c "$RUN_DIR/answers.jsonl" > "$OUT/answers.jsonl.xz"
      xz -T0 -c "$RUN_DIR/self_prompts.jsonl" > "$OUT/self_prompts.jsonl.xz" 2>/dev/null
    else
      split -b 12000000 "$RUN_DIR/answers.jsonl" "$OUT/answers.jsonl.part_"
      cp "$RUN_DIR/self_prompts.jsonl" "$OUT/" 2>/dev/null
    fi
    ;;
  train)
    if [ ! -f "$(run_dir)/answers.jsonl" ] && [ -n "${ANSWERS_FROM:-}" ]; then
      if [ -f "$ANSWERS_FROM/answers.jsonl.xz" ]; then  # what gen brings home
        xz -dc "$ANSWERS_FROM/answers.jsonl.xz" > "$HEAD_DIR/answers.jsonl"
        xz -dc "$ANSWERS_FROM/self_prompts.jsonl.xz" > "$HEAD_DIR/self_prompts.jsonl" 2>/dev/null
      else
        cat "$ANSWERS_FROM"/answers.jsonl.part_* > "$HEAD_DIR/answers.jsonl"
        cp "$ANSWERS_FROM/self_prompts.jsonl" "$HEAD_DIR/" 2>/dev/null
      fi
    fi
    VOCAB="${DRAFT_VOCAB:-$([ -n "${INIT_FROM:-}" ] || echo 8192)}"
    answers=$(wc -l < "$(run_dir)/answers.jsonl")
    echo "training on $answers answers"
    timeout "${TRAIN_TIMEOUT:-480}" polyspec train-draft "${COMMON[@]}" --max-answers "$answers" \
      --steps "${STEPS:-6000}" --time-budget "${TIME_BUDGET:-280}" --batch-tokens 16384 \
      --ttt-steps 6 ${VOCAB:+--draft-vocab-size "$VOCAB"} --lr "${LR:-1e-3}" --feature-batch-tokens 32768 \
      --train-dtype "${TRAIN_DTYPE:-bfloat16}" \
      ${INIT_FROM:+--init-from "$INIT_FROM"} ${EXTRA_ANSWERS:+--extra-answers "$EXTRA_ANSWERS"} --resume 2>&1 | quiet 40
    # The device tool brings back at most 8 files: the head's small files travel as one tar
    # (tar xf head.tar), its weights in three parts, leaving room for the bench's JSON.
    if [ -f "$HEAD_DIR/model.safetensors" ]; then
      (cd "$HEAD_DIR" && sha256sum model.safetensors > model.sha256)
      split -b 12000000 "$HEAD_DIR/model.safetensors" "$OUT/model.safetensors.part_"
    fi
    (cd "$HEAD_DIR" && tar cf "$OUT/head.tar" $(ls config.json train_args.json train_log.jsonl \
      summary.json model.sha256 2>/dev/null))
    if [ -f "$HEAD_DIR/model.safetensors" ] && [ "${BENCH:-1}" = 1 ]; then
      bench_head 3-3-8
    fi
    ;;
  bench)
    # shellcheck disable=SC2086
    bench_head ${BENCH_SETTINGS:-3-3-8 5-4-16}
    ;;
  *) echo "usage: $0 gen|train|bench"; exit 2 ;;
esac
