#!/usr/bin/env bash
# The prompt cache, side by side in one run (docs/PERFORMANCE.md, "Prompt
# cache"): two `samplerd serve` on loopback with the default model, one with
# the prompt cache (generate.prompt_cache_entries = 4) and one without (0).
# Each round sends a chat with a long system prompt and a new question to
# both, alternating which goes first, and reads `Finished.timings.prefill_ms`
# and `usage.cached_prompt_tokens`; the first request warms the cache. Prints
# the median prefill time of each, the ratio, and checks that both servers
# streamed the same text (the cache never changes the output).
#   ROUNDS=8 scripts/bench-prompt-cache.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-8}
BIN=${CARGO_TARGET_DIR:-target}/release
MODEL=${SAMPLERD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
PORT_ON=${PORT:-50941}
PORT_OFF=$((PORT_ON + 1))
SAMPLERD_METRICS__LISTEN=127.0.0.1:0 "$BIN/samplerd" serve --model "$MODEL" \
  --listen 127.0.0.1:$PORT_ON > "$OUT/prompt-cache-on.log" 2>&1 &
ON=$!
SAMPLERD_METRICS__LISTEN=127.0.0.1:0 SAMPLERD_GENERATE__PROMPT_CACHE_ENTRIES=0 \
  "$BIN/samplerd" serve --model "$MODEL" --listen 127.0.0.1:$PORT_OFF > "$OUT/prompt-cache-off.log" 2>&1 &
OFF=$!
trap 'kill $ON $OFF 2>/dev/null || true' EXIT
for port in $PORT_ON $PORT_OFF; do
  ready=0
  for _ in $(seq 1 300); do
    if "$BIN/samplerctl" --addr "http://127.0.0.1:$port" health >/dev/null 2>&1; then ready=1; break; fi
    sleep 0.1
  done
  [ "$ready" = 1 ] || { echo "bench-prompt-cache: samplerd on $port did not become healthy" >&2; exit 1; }
done

# ~450 tokens of system prompt, as a deployed assistant's would be.
SYSTEM="You are the support assistant of a small bicycle shop. $(for i in $(seq 1 12); do
  printf 'Rule %s: answer politely, in at most three sentences, mention opening hours (Monday to Saturday, nine to six) only when asked, never invent prices, and suggest visiting the workshop for repairs that need tools. ' "$i"
done)"
ask() { # port, question -> prints "prefill_ms cached_tokens text"
  "$BIN/samplerctl" --addr "http://127.0.0.1:$1" generate --system "$SYSTEM" "$2" \
    -n 8 --seed 7 --json | python3 -c '
import json, sys
lines = [json.loads(l) for l in sys.stdin if l.strip()]
text = "".join(l["token"]["text"] for l in lines if "token" in l)
f = [l["finished"] for l in lines if "finished" in l][0]
print(f["timings"]["prefill_ms"], f["usage"]["cached_prompt_tokens"], json.dumps(text + f["text"]))'
}
ask $PORT_ON "Hello?" > /dev/null
: > "$OUT/prompt-cache.tsv"
for round in $(seq 1 "$ROUNDS"); do
  q="Question $round: can you true a wheel by Friday?"
  if [ $((round % 2)) = 1 ]; then a=$(ask $PORT_ON "$q"); b=$(ask $PORT_OFF "$q")
  else b=$(ask $PORT_OFF "$q"); a=$(ask $PORT_ON "$q"); fi
  [ "${a#* * }" = "${b#* * }" ] || { echo "round $round: outputs differ: $a / $b" >&2; exit 1; }
  printf '%s\t%s\n' "${a%% *}" "${b%% *}" >> "$OUT/prompt-cache.tsv"
  echo "round $round: prefill ${a%% *} ms with the cache ($(echo "$a" | cut -d' ' -f2) prompt tokens from it), ${b%% *} ms without"
done
python3 - "$OUT/prompt-cache.tsv" <<'EOF'
import statistics, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1])]
on, off = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
print(f"prefill ms, median of {len(rows)} rounds: cache {on:.1f}, no cache {off:.1f}, ratio {on / off:.2f}")
EOF
