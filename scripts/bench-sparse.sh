#!/usr/bin/env bash
# Sparse rows against inline f32 rows (docs/PERFORMANCE.md, "Sparse
# rows"): against one `samplerd serve` on loopback, ROUNDS alternating
# rounds of
#   - SampleBatch (unary), BATCH rows of VOCAB logits, inline f32 bytes
#   - the same rows sent sparse: the top SPARSE entries + the rest's log-sum-exp
#   - SampleBatchStream, BATCH sequences per message, inline f32
#   - the same, sparse
# with the default chain (which the proof accepts for every row), and
# prints the median rows/s of each [all rounds] and the sparse/inline ratio.
#   ROUNDS=5 SECONDS_PER_RUN=5 scripts/bench-sparse.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECONDS_PER_RUN:-5}
VOCAB=${VOCAB:-151936}
B=${BATCH:-32}
SPARSE=${SPARSE:-1024}
PY=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}/bin/python
[ -x "$PY" ] || PY=python3
BIN=${CARGO_TARGET_DIR:-target}/release
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
PORT=${PORT:-50933}
"$BIN/samplerd" serve --listen 127.0.0.1:$PORT > "$OUT/sparse-server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
CTL="$BIN/samplerctl --addr http://127.0.0.1:$PORT"
ready=0
for _ in $(seq 1 100); do
  if $CTL health >/dev/null 2>&1; then ready=1; break; fi
  sleep 0.1
done
[ "$ready" = 1 ] || { echo "bench-sparse: samplerd did not become healthy" >&2; exit 1; }

run() { # name, then samplerctl bench flags
  local name=$1; shift
  $CTL bench --vocab "$VOCAB" --batch "$B" --duration "$SECS" --json "$@" > "$OUT/sparse-$name-$round.json"
}
for round in $(seq 1 "$ROUNDS"); do
  run batch-inline --rpc sample-batch
  run batch-sparse --rpc sample-batch --sparse "$SPARSE"
  run stream-inline --rpc sample-batch-stream
  run stream-sparse --rpc sample-batch-stream --sparse "$SPARSE"
done

OUT="$OUT" ROUNDS="$ROUNDS" B="$B" VOCAB="$VOCAB" SPARSE="$SPARSE" "$PY" - <<'PYEOF'
import json, os, statistics
out, rounds = os.environ["OUT"], int(os.environ["ROUNDS"])
def med(name):
    runs = [json.load(open(f"{out}/sparse-{name}-{r}.json")) for r in range(1, rounds + 1)]
    errs = sum(j["errors"] for j in runs)
    assert errs == 0, f"{name}: {errs} errors"
    vals = [j["tokens_per_s"] for j in runs]
    return statistics.median(vals), vals
print(f"B = {os.environ['B']} rows x {os.environ['VOCAB']} logits, sparse = top {os.environ['SPARSE']}, "
      f"{rounds} rounds (median rows/s [all])")
for rpc in ["batch", "stream"]:
    a, all_a = med(f"{rpc}-inline")
    b, all_b = med(f"{rpc}-sparse")
    print(f"  {rpc:6s} inline f32 {a:10.0f} {[round(v) for v in all_a]}")
    print(f"  {rpc:6s} sparse     {b:10.0f} {[round(v) for v in all_b]}  x{b / a:.1f}")
PYEOF
