#!/usr/bin/env bash
# Generate with speculation against without it, side by side in one run
# (docs/PERFORMANCE.md, "Speculative decoding"): one `samplerd serve` on
# loopback with the default model (or SAMPLERD_MODEL); each round sends
# three input-grounded chats (copy a paragraph, extract fields to JSON,
# edit a given text), greedy, up to TOKENS tokens, once without and once
# with `--speculate $SOURCE`, alternating which goes first. SOURCE is
# prompt-lookup (default) or model: then DRAFT_MODEL is loaded as
# `model.draft_path` (scripts/requantize-model.sh makes an F16 or Q8_0
# target of the default model for it to draft for). Reads
# `Finished.timings.decode_tokens_per_second` (prefill excluded) and the
# usage's draft counts, checks that both streamed the same text, and
# prints per prompt and overall the median tokens/s [min–max] of each,
# the ratio of medians, and the acceptance rate (accepted / drafted).
#   ROUNDS=5 TOKENS=160 MAX_DRAFT=0 scripts/bench-speculate.sh
#   SOURCE=model SAMPLERD_MODEL=models/SmolLM2-135M-Instruct.F16.gguf \
#     DRAFT_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf scripts/bench-speculate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
TOKENS=${TOKENS:-160}
MAX_DRAFT=${MAX_DRAFT:-0}
SOURCE=${SOURCE:-prompt-lookup}
DRAFT_MODEL=${DRAFT_MODEL:-}
BIN=${CARGO_TARGET_DIR:-target}/release
MODEL=${SAMPLERD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
PORT=${PORT:-50951}
if [ "$SOURCE" = model ]; then
  [ -n "$DRAFT_MODEL" ] || { echo "bench-speculate: SOURCE=model needs DRAFT_MODEL" >&2; exit 1; }
  export SAMPLERD_MODEL__DRAFT_PATH=$DRAFT_MODEL
fi
SAMPLERD_METRICS__LISTEN=127.0.0.1:0 SAMPLERD_GENERATE__PROMPT_CACHE_ENTRIES=0 \
  "$BIN/samplerd" serve --model "$MODEL" --listen 127.0.0.1:$PORT > "$OUT/speculate.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
ready=0
for _ in $(seq 1 300); do
  if "$BIN/samplerctl" --addr "http://127.0.0.1:$PORT" health >/dev/null 2>&1; then ready=1; break; fi
  sleep 0.1
done
[ "$ready" = 1 ] || { echo "bench-speculate: samplerd did not become healthy" >&2; exit 1; }

TEXT="The lighthouse at Point Reyes was built in 1870 and stands on a rocky headland three hundred feet above the Pacific Ocean. Its first-order Fresnel lens, made in France, was lit by an oil lamp until electricity arrived in 1938. Keepers climbed 308 steps down from the cliff top every evening to wind the clockwork that turned the lens, and they wrote in their logs of fog so thick that the light could not be seen from the water. The station was automated in 1975, and the lens still turns today for visitors who make the long walk down the stairs on clear afternoons."
PROMPTS=(
  "copy|Copy this text exactly, word for word:

$TEXT"
  "extract|$TEXT

Extract every number in the text with the sentence it appears in, as a JSON list of objects with keys number and sentence."
  "edit|Rewrite the following text, replacing 'lighthouse' with 'tower' and 'keepers' with 'wardens', and changing nothing else:

$TEXT"
)
ask() { # speculate(on|off), prompt -> "tok_per_s drafted accepted tokens text_json"
  local extra=()
  [ "$1" = on ] && extra=(--speculate "$SOURCE")
  [ "$1" = on ] && [ "$MAX_DRAFT" != 0 ] && extra+=(--max-draft "$MAX_DRAFT")
  "$BIN/samplerctl" --addr "http://127.0.0.1:$PORT" generate --chat "$2" \
    -n "$TOKENS" --greedy "${extra[@]}" --json | python3 -c '
import json, sys
lines = [json.loads(l) for l in sys.stdin if l.strip()]
text = "".join(l["token"]["text"] for l in lines if "token" in l)
f = [l["finished"] for l in lines if "finished" in l][0]
u = f["usage"]
print(f["timings"]["decode_tokens_per_second"], u["draft_tokens"], u["accepted_draft_tokens"],
      u["completion_tokens"], json.dumps(text + f["text"]))'
}
echo "speculate: $SOURCE; model: $MODEL${DRAFT_MODEL:+; draft model: $DRAFT_MODEL}"
echo "load before: $(uptime)"
ask off "Hello" > /dev/null
ask on "Hello" > /dev/null
: > "$OUT/speculate.tsv"
for round in $(seq 1 "$ROUNDS"); do
  for p in "${PROMPTS[@]}"; do
    name=${p%%|*}; prompt=${p#*|}
    if [ $((round % 2)) = 1 ]; then a=$(ask off "$prompt"); b=$(ask on "$prompt")
    else b=$(ask on "$prompt"); a=$(ask off "$prompt"); fi
    read -r a_tps _ _ a_n a_text <<< "$a"
    read -r b_tps b_draft b_acc b_n b_text <<< "$b"
    [ "$a_text" = "$b_text" ] || { echo "round $round $name: outputs differ" >&2; exit 1; }
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$a_tps" "$b_tps" "$b_draft" "$b_acc" "$b_n" >> "$OUT/speculate.tsv"
    echo "round $round $name: $a_n tokens, off $a_tps tok/s, on $b_tps tok/s ($b_acc of $b_draft drafts accepted)"
  done
done
echo "load after: $(uptime)"
python3 - "$OUT/speculate.tsv" <<'EOF'
import collections, statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]) if l.strip()]
by = collections.defaultdict(list)
for r in rows:
    by[r[0]].append(r)
    by["all"].append(r)
print("| prompt | tokens | tok/s off | tok/s on | ratio | drafts accepted |")
print("|---|---:|---:|---:|---:|---:|")
for name, rs in by.items():
    off = [float(r[1]) for r in rs]
    on = [float(r[2]) for r in rs]
    drafted = sum(int(r[3]) for r in rs)
    acc = sum(int(r[4]) for r in rs)
    n = statistics.median(int(r[5]) for r in rs)
    print(f"| {name} | {n:.0f} | {statistics.median(off):.1f} [{min(off):.1f}–{max(off):.1f}] "
          f"| {statistics.median(on):.1f} [{min(on):.1f}–{max(on):.1f}] "
          f"| **{statistics.median(on) / statistics.median(off):.2f}×** "
          f"| {acc}/{drafted} = {acc / max(drafted, 1):.0%} |")
EOF
