#!/usr/bin/env bash
# Batch sampling and compression on the wire, side by side in one run
# (docs/PERFORMANCE.md, "Batch sampling" and "Compression"): against one
# `samplerd serve` on loopback, ROUNDS alternating rounds of
#   - 32 concurrent SampleStreams (one client connection), 151,936 logits
#   - one SampleBatchStream of 32 sequences per message, f32 and bf16
#   - SampleBatch (unary) of 32 rows, f32
#   - Sample with raw logits, uncompressed / gzip / zstd (one at a time)
# and prints the median of each (rows/s for the batch-vs-streams rows,
# p50 latency for the compression rows) with the ratios.
#   ROUNDS=5 SECONDS_PER_RUN=5 scripts/bench-batch.sh
# With BASELINE=<a directory holding another build's samplerd>, a second
# server runs that build and every round measures the inline-row RPCs
# (streams, batch stream f32, batch f32, Sample) on both, alternating which
# goes first, and prints this build against the baseline — the rates, and
# each server's CPU time and page faults per row (from /proc/<pid>/stat
# around each run: what the server spends, whatever else the machine runs):
#   BASELINE=/tmp/before/release ROUNDS=5 scripts/bench-batch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECONDS_PER_RUN:-5}
VOCAB=${VOCAB:-151936}
B=${BATCH:-32}
PY=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}/bin/python
[ -x "$PY" ] || PY=python3
BIN=${CARGO_TARGET_DIR:-target}/release
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
PORT=${PORT:-50932}
BASE_PORT=$((PORT + 1))
SERVERS=()
trap 'kill "${SERVERS[@]}" 2>/dev/null || true' EXIT
serve() { # binary dir, port, log name
  "$1/samplerd" serve --listen "127.0.0.1:$2" > "$OUT/$3.log" 2>&1 &
  SERVERS+=($!)
  local ready=0
  for _ in $(seq 1 100); do
    if "$BIN/samplerctl" --addr "http://127.0.0.1:$2" health >/dev/null 2>&1; then ready=1; break; fi
    sleep 0.1
  done
  [ "$ready" = 1 ] || { echo "bench-batch: $1/samplerd did not become healthy" >&2; exit 1; }
}
serve "$BIN" "$PORT" batch-server
[ -z "${BASELINE:-}" ] || serve "$BASELINE" "$BASE_PORT" batch-baseline-server
CTL="$BIN/samplerctl --addr http://127.0.0.1:$PORT"

run() { # name, then samplerctl bench flags
  local name=$1; shift
  $CTL bench --vocab "$VOCAB" --duration "$SECS" --json "$@" > "$OUT/batch-$name-$round.json"
}
if [ -n "${BASELINE:-}" ]; then
  for round in $(seq 1 "$ROUNDS"); do
    sides=(new base); [ $((round % 2)) = 0 ] && sides=(base new)
    for side in "${sides[@]}"; do
      p=$PORT pid=${SERVERS[0]}; [ "$side" = base ] && p=$BASE_PORT pid=${SERVERS[1]}
      CTL="$BIN/samplerctl --addr http://127.0.0.1:$p"
      # minor faults, then user + system clock ticks, before and after
      counted() { # name, then flags
        local name=$1; shift
        local before; before=$(awk '{print $10, $14 + $15}' "/proc/$pid/stat")
        run "$name" "$@"
        echo "$before $(awk '{print $10, $14 + $15}' "/proc/$pid/stat") $(getconf CLK_TCK)" \
          > "$OUT/batch-$name-$round.proc"
      }
      counted "$side-streams" --rpc sample-stream --concurrency "$B"
      counted "$side-batch-stream-f32" --rpc sample-batch-stream --batch "$B" --dtype f32
      counted "$side-batch-f32" --rpc sample-batch --batch "$B" --dtype f32
      counted "$side-sample" --rpc sample --compression none
    done
  done
  OUT="$OUT" ROUNDS="$ROUNDS" B="$B" VOCAB="$VOCAB" "$PY" - <<'EOF'
import json, os, statistics
out, rounds = os.environ["OUT"], int(os.environ["ROUNDS"])
def vals(name, key):
    runs = [json.load(open(f"{out}/batch-{name}-{r}.json")) for r in range(1, rounds + 1)]
    assert sum(j["errors"] for j in runs) == 0, f"{name}: errors"
    return [key(j) for j in runs]
rows = lambda j: j["tokens_per_s"]
p50 = lambda j: j["latency_ms"]["p50"]
def per_row(name):
    """The server's CPU µs and page faults per row, median of the rounds."""
    cpu, faults = [], []
    for r in range(1, rounds + 1):
        j = json.load(open(f"{out}/batch-{name}-{r}.json"))
        n = j["requests"] * (1 if name.endswith("streams") or name.endswith("sample") else int(os.environ["B"]))
        f0, t0, f1, t1, hz = map(int, open(f"{out}/batch-{name}-{r}.proc").read().split())
        cpu.append((t1 - t0) / hz * 1e6 / n)
        faults.append((f1 - f0) / n)
    return statistics.median(cpu), statistics.median(faults)
print(f"B = {os.environ['B']} rows x {os.environ['VOCAB']} logits, {rounds} rounds, this build"
      " against BASELINE (median [all]; ratio: median of the rounds' ratios)")
for name, key, unit in [("streams", rows, "rows/s"), ("batch-stream-f32", rows, "rows/s"),
                        ("batch-f32", rows, "rows/s"), ("sample", p50, "ms p50")]:
    new, base = vals("new-" + name, key), vals("base-" + name, key)
    ratio = statistics.median(n / b for n, b in zip(new, base))
    print(f"  {name:18s} {statistics.median(new):10.3f} {unit} {[round(v, 3) for v in new]}"
          f"  baseline {statistics.median(base):10.3f} {[round(v, 3) for v in base]}  x{ratio:.3f}")
    (nc, nf), (bc, bf) = per_row("new-" + name), per_row("base-" + name)
    print(f"  {'':18s} server per row: {nc:7.1f} µs CPU, {nf:6.1f} page faults"
          f"  baseline {bc:7.1f} µs, {bf:6.1f} faults  (CPU x{nc / bc:.3f})")
EOF
  exit 0
fi
for round in $(seq 1 "$ROUNDS"); do
  run streams --rpc sample-stream --concurrency "$B"
  run batch-stream-f32 --rpc sample-batch-stream --batch "$B" --dtype f32
  run batch-stream-bf16 --rpc sample-batch-stream --batch "$B" --dtype bf16
  run batch-f32 --rpc sample-batch --batch "$B" --dtype f32
  run sample-none --rpc sample --compression none
  run sample-gzip --rpc sample --compression gzip
  run sample-zstd --rpc sample --compression zstd
done

OUT="$OUT" ROUNDS="$ROUNDS" B="$B" VOCAB="$VOCAB" "$PY" - <<'EOF'
import json, os, statistics
out, rounds = os.environ["OUT"], int(os.environ["ROUNDS"])
def runs(name):
    return [json.load(open(f"{out}/batch-{name}-{r}.json")) for r in range(1, rounds + 1)]
def med(name, key):
    vals = [key(j) for j in runs(name)]
    errs = sum(j["errors"] for j in runs(name))
    assert errs == 0, f"{name}: {errs} errors"
    return statistics.median(vals), vals
rows = lambda j: j["tokens_per_s"]
p50 = lambda j: j["latency_ms"]["p50"]
print(f"B = {os.environ['B']} rows x {os.environ['VOCAB']} logits, {rounds} rounds (median [all])")
base, all_ = med("streams", rows)
print(f"  {os.environ['B']} SampleStreams         {base:10.0f} rows/s  {[round(v) for v in all_]}")
for name in ["batch-stream-f32", "batch-stream-bf16", "batch-f32"]:
    m, all_ = med(name, rows)
    print(f"  {name:22s} {m:10.0f} rows/s  x{m / base:.2f} of the streams  {[round(v) for v in all_]}")
plain, all_ = med("sample-none", p50)
print(f"  Sample uncompressed    p50 {plain:7.3f} ms  {all_}")
for name in ["sample-gzip", "sample-zstd"]:
    m, all_ = med(name, p50)
    print(f"  {name:22s} p50 {m:7.3f} ms  x{m / plain:.2f}  {all_}")
EOF
