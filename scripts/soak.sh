#!/usr/bin/env bash
# Load and soak test on loopback, bounded in time: starts the release
# `samplerd` with the default model, then drives it with `samplerctl bench`
#   1. warm-up: every phase for WARMUP_SECONDS (allocator and pools settle)
#   2. SampleStream, 64 concurrent streams (SMOLLM2 vocabulary, raw f32)
#   3. Sample (unary), 64 concurrent callers
#   4. Generate, 8 concurrent streams (GEN_TOKENS tokens each; the server
#      runs generate.max_concurrent_generations of them at once, the rest
#      queue, so latency includes queueing)
# each for SOAK_SECONDS, and prints a table: requests, errors, throughput,
# p50/p99 latency and the server's RSS after each phase; then
#   5. hostile, HOSTILE_SECONDS (scripts/hostile.py): 16 MB Generate
#      prompts, over-long logit_bias maps, SampleStream sessions at 262,144
#      logits held until the memory budget refuses them, and idle
#      connections that never send a byte, and hostile constraints
#      (deep, long-chained and huge grammars in GBNF, Lark, JSON Schema and
#      regex, and legal ones that take seconds to compile) through Generate
#      and Sample — with health checked every 20 ms.
# Fails if any request of phases 2–4 failed, the RSS grew by more than
# RSS_GROWTH_PCT percent between the end of the warm-up and the end of
# phase 4, or the hostile phase saw an unexpected status, a health p99 of
# 100 ms or more, or RSS above the budget plus the warmed-up RSS.
#
# Usage: scripts/soak.sh            (SOAK_SECONDS=120 per phase, ~8 min)
#        SOAK_SECONDS=20 WARMUP_SECONDS=5 scripts/soak.sh   (quick check)
# Binaries: SAMPLERD_BIN / SAMPLERCTL_BIN, else target/release (built).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SOAK_SECONDS=${SOAK_SECONDS:-120}
WARMUP_SECONDS=${WARMUP_SECONDS:-15}
SAMPLE_CONCURRENCY=${SAMPLE_CONCURRENCY:-64}
GEN_CONCURRENCY=${GEN_CONCURRENCY:-8}
GEN_TOKENS=${GEN_TOKENS:-32}
VOCAB=${VOCAB:-49152}
RSS_GROWTH_PCT=${RSS_GROWTH_PCT:-10}
HOSTILE_SECONDS=${HOSTILE_SECONDS:-60}
# What requests may hold (limits.memory_budget_bytes): small enough that
# the hostile phase's held streams reach it.
MEMORY_BUDGET=${MEMORY_BUDGET:-536870912}
PY=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}/bin/python
MODEL=${SAMPLERD_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
if [ -z "${SAMPLERD_BIN:-}" ] || [ -z "${SAMPLERCTL_BIN:-}" ]; then
  cargo build --release -p samplerd -p samplerctl -p samplerd-core-stages -p samplerd-constraint-stage
fi
SAMPLERD_BIN=${SAMPLERD_BIN:-$TARGET_DIR/release/samplerd}
SAMPLERCTL_BIN=${SAMPLERCTL_BIN:-$TARGET_DIR/release/samplerctl}
[ -f "$MODEL" ] || { echo "soak.sh: model $MODEL missing (scripts/fetch-model.sh)"; exit 1; }

work=$(mktemp -d)
log="$work/samplerd.log"
server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Loopback only, ephemeral ports, JSON logs (the address is read from them).
SAMPLERD_LOGGING__FORMAT=json SAMPLERD_METRICS__LISTEN=127.0.0.1:0 RUST_LOG=info \
  SAMPLERD_LIMITS__MEMORY_BUDGET_BYTES=$MEMORY_BUDGET SAMPLERD_LIMITS__HANDSHAKE_TIMEOUT_MS=2000 \
  SAMPLERD_VOCABULARIES__SMOLLM2="$MODEL" \
  "$SAMPLERD_BIN" serve --listen 127.0.0.1:0 --model "$MODEL" >"$log" 2>&1 &
server_pid=$!
addr=
for _ in $(seq 600); do   # model load: bounded at 120 s
  addr=$(grep '"samplerd serving"' "$log" 2>/dev/null | grep -o '"addr":"[^"]*"' | head -1 | cut -d'"' -f4 || true)
  [ -n "$addr" ] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$log"; echo "soak.sh: samplerd exited"; exit 1; }
  sleep 0.2
done
[ -n "$addr" ] || { cat "$log"; echo "soak.sh: samplerd did not start in 120 s"; exit 1; }
timeout 30 "$SAMPLERCTL_BIN" --addr "$addr" health >/dev/null

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$server_pid/status"; }
hwm_kb() { awk '/^VmHWM:/ {print $2}' "/proc/$server_pid/status"; }
bench() { # name seconds args...
  local name=$1 secs=$2; shift 2
  timeout $((secs + 120)) "$SAMPLERCTL_BIN" --addr "$addr" --timeout 600 bench --json \
    --duration "$secs" "$@" >"$work/$name.json" || true
  echo "$(rss_kb)" >"$work/$name.rss"
}
phases=(
  "sample-stream --rpc sample-stream -c $SAMPLE_CONCURRENCY --vocab $VOCAB"
  "sample --rpc sample -c $SAMPLE_CONCURRENCY --vocab $VOCAB"
  "generate --rpc generate -c $GEN_CONCURRENCY -n $GEN_TOKENS"
)
rss_start=$(rss_kb)
echo "soak.sh: samplerd pid $server_pid on $addr, RSS ${rss_start} kB; warm-up ${WARMUP_SECONDS}s per phase"
for p in "${phases[@]}"; do
  set -- $p; name=$1; shift
  bench "warmup-$name" "$WARMUP_SECONDS" "$@"
done
rss_warm=$(rss_kb)
echo "soak.sh: RSS after warm-up ${rss_warm} kB; ${SOAK_SECONDS}s per phase"
for p in "${phases[@]}"; do
  set -- $p; name=$1; shift
  echo "soak.sh: $name ($(date -u +%H:%M:%S))"
  bench "$name" "$SOAK_SECONDS" "$@"
done
rss_end=$(rss_kb)
echo "soak.sh: hostile phase, ${HOSTILE_SECONDS}s"
hostile_ok=1
"$PY" scripts/hostile.py --addr "$addr" --pid "$server_pid" --seconds "$HOSTILE_SECONDS" --streams 96 \
  --vocabulary smollm2 --vocab-size "$VOCAB" \
  --max-rss-bytes $((MEMORY_BUDGET + rss_warm * 1024)) || hostile_ok=0
kill -0 "$server_pid" 2>/dev/null || { echo "soak.sh: samplerd died in the hostile phase"; hostile_ok=0; }
hwm=$(hwm_kb)

[ "$hostile_ok" = 1 ] || echo "soak: FAIL: hostile phase"
python3 - "$work" "$rss_start" "$rss_warm" "$rss_end" "$hwm" "$RSS_GROWTH_PCT" "$hostile_ok" <<'PY'
import json, os, sys
work, start, warm, end, hwm, pct = sys.argv[1], *map(int, sys.argv[2:6]), float(sys.argv[6])
rows, failed = [], sys.argv[7] != "1"
for name in ["warmup-sample-stream", "warmup-sample", "warmup-generate",
             "sample-stream", "sample", "generate"]:
    path = os.path.join(work, name + ".json")
    rss = int(open(os.path.join(work, name + ".rss")).read() or 0)
    try:
        r = json.load(open(path))
    except Exception:
        print(f"soak: {name}: no report (samplerctl failed)")
        failed = True
        continue
    lat = r["latency_ms"]
    rows.append((name, r["concurrency"], r["requests"], r["errors"], r["duration_s"], r["rps"],
                 r["tokens_per_s"], lat["p50"], lat["p99"], rss / 1024))
    failed |= r["errors"] > 0 or r["requests"] == 0
hdr = ("phase", "conc", "requests", "errors", "secs", "req/s", "tok/s", "p50 ms", "p99 ms", "RSS MiB")
print("| " + " | ".join(hdr) + " |")
print("|" + "---|" * len(hdr))
for n, c, q, e, d, rps, tps, p50, p99, rss in rows:
    print(f"| {n} | {c} | {q} | {e} | {d:.0f} | {rps:.1f} | {tps:.1f} | {p50:.2f} | {p99:.2f} | {rss:.1f} |")
growth = (end - warm) * 100.0 / warm
print(f"\nRSS: start {start/1024:.1f} MiB, after warm-up {warm/1024:.1f} MiB, end {end/1024:.1f} MiB "
      f"(growth {growth:+.1f}% over the soak, limit {pct:.0f}%), peak {hwm/1024:.1f} MiB")
if growth > pct:
    print("soak: FAIL: memory grew")
    failed = True
if failed:
    print("soak: FAIL")
    sys.exit(1)
print("soak: OK (no errors, no memory growth)")
PY
