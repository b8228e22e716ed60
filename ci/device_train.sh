#!/usr/bin/env bash
# Train the shipped SmolLM2 EAGLE-3 head on the H200 (run by the lead through the device tool).
#
#   bash ci/device_train.sh gen     # answers: 1400 prompts x 5 answers (greedy + 4 sampled)
#   bash ci/device_train.sh train   # features + training on whatever answers are complete
#
# Expects the model at $MODEL (default /root/m/model.gguf) and the prompt file at $PROMPTS
# (default /root/train.jsonl: ../shared/data/prompts/train.jsonl, carried over). Writes to
# $HEAD_DIR (default /root/head) and copies logs and the head to $OUT. The device tool limits a
# command to 10 minutes, hence two calls; gen writes each prompt's greedy answer before any
# sampled one, so a cut-short gen still trains on every prompt (train passes the number of
# complete sample rounds as --samples-per-prompt).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/out}"
MODEL="${MODEL:-/root/m/model.gguf}"
PROMPTS="${PROMPTS:-/root/train.jsonl}"
HEAD_DIR="${HEAD_DIR:-/root/head}"
NUM_PROMPTS="${NUM_PROMPTS:-1400}"
SAMPLES="${SAMPLES:-5}"
mkdir -p "$OUT" "$HEAD_DIR"
COMMON=(--target "$MODEL" --prompts "$PROMPTS" --out "$HEAD_DIR" --backend cuda
        --dtype bfloat16 --num-prompts "$NUM_PROMPTS" --max-new-tokens 384 --seed 0
        --graphs "${GRAPHS:-auto}")
case "${1:-}" in
  gen)
    timeout "${GEN_TIMEOUT:-480}" polyspec train-draft "${COMMON[@]}" --samples-per-prompt "$SAMPLES" \
      --sample-temperature 0.8 --gen-batch-size 128 --generate-only 2>&1 | tr '\r' '\n' | grep -v "^answers: .*it/s\]$" | tail -n 20
    echo "answers: $(wc -l < "$HEAD_DIR/answers.jsonl")"
    ;;
  train)
    lines=$(wc -l < "$HEAD_DIR/answers.jsonl")
    done_rounds=$(( lines / NUM_PROMPTS ))
    [ "$done_rounds" -gt "$SAMPLES" ] && done_rounds=$SAMPLES
    echo "answers $lines -> samples-per-prompt $done_rounds"
    timeout "${TRAIN_TIMEOUT:-540}" polyspec train-draft "${COMMON[@]}" --samples-per-prompt "$done_rounds" \
      --steps "${STEPS:-1200}" --batch-tokens 16384 --ttt-steps 6 --draft-vocab-size 8192 \
      --lr 1e-3 --resume 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -n 40
    cp "$HEAD_DIR"/{config.json,train_args.json,train_log.jsonl,summary.json} "$OUT/" 2>/dev/null
    if [ -f "$HEAD_DIR/model.safetensors" ]; then
      split -b 12000000 "$HEAD_DIR/model.safetensors" "$OUT/model.safetensors.part_"
      sha256sum "$HEAD_DIR/model.safetensors" > "$OUT/model.sha256"
    fi
    ;;
  *) echo "usage: $0 gen|train"; exit 2 ;;
esac
