#!/usr/bin/env bash
# The draft model's prompt cache (docs/PERFORMANCE.md, "Speculation paced by
# measured speed"): two `samplerd serve` with a draft model, one keeping
# finished sessions (generate.prompt_cache_entries = 4, which the draft
# model's cache follows) and one not (0); each round asks both a chat's
# first turn (copy a paragraph), then a second turn whose prompt extends the
# first's (a question appended: a different one every round), greedy, with
# `--speculate model`, and prints the second turn's decode tokens/s
# (`Finished.timings`, which excludes the model's prefill but not the draft
# model's), its drafts and its cached prompt tokens. Alternates which server
# goes first.
#   ROUNDS=3 SAMPLERD_MODEL=models/SmolLM2-135M-Instruct.F16.gguf \
#     DRAFT_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf scripts/bench-draft-cache.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
TOKENS=${TOKENS:-120}
BIN=${CARGO_TARGET_DIR:-target}/release
MODEL=${SAMPLERD_MODEL:-models/SmolLM2-135M-Instruct.F16.gguf}
DRAFT_MODEL=${DRAFT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
for f in "$MODEL" "$DRAFT_MODEL"; do
  [ -f "$f" ] || { echo "bench-draft-cache: no model at $f (scripts/fetch-model.sh, scripts/requantize-model.sh F16)" >&2; exit 1; }
done
TEXT=$(sed -n 's/^TEXT="\(.*\)"$/\1/p' scripts/bench-speculate.sh)
FIRST="Copy this text exactly, word for word:

$TEXT"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
start() { # port, prompt_cache_entries
  SAMPLERD_METRICS__LISTEN=127.0.0.1:0 SAMPLERD_GENERATE__PROMPT_CACHE_ENTRIES=$2 \
    SAMPLERD_MODEL__DRAFT_PATH=$DRAFT_MODEL \
    "$BIN/samplerd" serve --model "$MODEL" --listen "127.0.0.1:$1" > "$OUT/draft-cache-$2.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 300); do
    "$BIN/samplerctl" --addr "http://127.0.0.1:$1" health >/dev/null 2>&1 && return
    sleep 0.2
  done
  echo "bench-draft-cache: samplerd on port $1 did not become healthy" >&2; exit 1
}
ask() { # port, prompt[, extra flags] -> "tok_per_s drafts cached_prompt_tokens"
  "$BIN/samplerctl" --addr "http://127.0.0.1:$1" generate --chat "$2" -n "$TOKENS" --greedy \
    "${@:3}" --json | python3 -c '
import json, sys
f = [json.loads(l)["finished"] for l in sys.stdin if "finished" in l][0]
u = f["usage"]
print(round(f["timings"]["decode_tokens_per_second"], 1), u.get("draft_tokens", 0), u.get("cached_prompt_tokens", 0))'
}
start 51001 4
start 51002 0
echo "model: $MODEL; draft model: $DRAFT_MODEL; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  ports=(51001 51002); [ $((r % 2)) = 0 ] && ports=(51002 51001)
  for port in "${ports[@]}"; do
    ask "$port" "$FIRST" --speculate model > /dev/null
    read -r tps drafts cached < <(ask "$port" "$FIRST

(Question $r) After copying it, say how many sentences it has." --speculate model)
    kept=$([ "$port" = 51001 ] && echo on || echo off)
    echo "round $r, cache $kept: second turn $tps tok/s, $drafts drafts, $cached cached prompt tokens"
  done
  read -r tps _ _ < <(ask 51001 "$FIRST

(Question $r) After copying it, how many words does it have?")
  echo "round $r, no speculation: second turn $tps tok/s"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
