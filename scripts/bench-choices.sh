#!/usr/bin/env bash
# n choices from one prefill against one choice, side by side in one run
# (docs/PERFORMANCE.md, "Generate with n choices"): one `samplerd serve` on
# loopback with the default model and 2 forward-pass threads; each round
# times a Generate of 64 tokens (ignore_eos, seeded) with n = 1 and with
# n = N (default 4), alternating which goes first, from the request to the
# stream's end. Prints the medians, their ratio and the spread of the
# per-round ratios.
#   ROUNDS=9 N=4 scripts/bench-choices.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${CARGO_TARGET_DIR:-target}/release
MODEL=${SAMPLERD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
VENV=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}
OUT=${OUT:-bench-results}
PORT=${PORT:-50951}
mkdir -p "$OUT"
SAMPLERD_METRICS__LISTEN=127.0.0.1:0 SAMPLERD_GENERATE__N_THREADS=2 \
  "$BIN/samplerd" serve --model "$MODEL" --listen 127.0.0.1:$PORT > "$OUT/choices.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
ready=0
for _ in $(seq 1 300); do
  if "$BIN/samplerctl" --addr "http://127.0.0.1:$PORT" health >/dev/null 2>&1; then ready=1; break; fi
  sleep 0.1
done
[ "$ready" = 1 ] || { echo "bench-choices: samplerd did not become healthy" >&2; exit 1; }
SAMPLERD_PY_GEN_DIR="$OUT/python-gen" "$VENV/bin/python" - "127.0.0.1:$PORT" "${ROUNDS:-9}" "${N:-4}" <<'PY'
import statistics, sys, time
sys.path.insert(0, "clients/python")
import samplerd_client as sc

addr, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
_, stub = sc.connect(addr)
pb = sc.pb

def run(choices, seed):
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Tell me a story about a lighthouse keeper.")],
        max_tokens=64, ignore_eos=True, n=choices, params=pb.SamplingParams(seed=seed))
    t0 = time.perf_counter()
    tokens = sum(1 for m in stub.Generate(req, timeout=300) if m.HasField("token"))
    dt = time.perf_counter() - t0
    assert tokens == 64 * choices, tokens
    return dt

run(1, 0)  # warm-up
one, many, ratios = [], [], []
for r in range(rounds):
    if r % 2:
        b = run(n, 100 + r); a = run(1, 100 + r)
    else:
        a = run(1, 100 + r); b = run(n, 100 + r)
    one.append(a); many.append(b); ratios.append(b / a)
    print(f"round {r + 1}: n=1 {a * 1e3:.0f} ms, n={n} {b * 1e3:.0f} ms, ratio {b / a:.2f}")
m1, mn = statistics.median(one), statistics.median(many)
print(f"median: n=1 {m1 * 1e3:.0f} ms ({64 / m1:.0f} tok/s), n={n} {mn * 1e3:.0f} ms "
      f"({64 * n / mn:.0f} tok/s); ratio of medians {mn / m1:.2f} "
      f"(per-round ratios {min(ratios):.2f}-{max(ratios):.2f})")
PY
