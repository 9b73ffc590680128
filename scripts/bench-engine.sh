#!/usr/bin/env bash
# samplerd as an engine's sampler against llama.cpp's own sampler chain
# (docs/PERFORMANCE.md, "An engine with samplerd as its sampler"): starts
# `samplerd serve` on a Unix socket and runs
# clients/python/examples/llama_cpp_engine.py --bench: the same llama.cpp
# forward pass (the default model, THREADS threads) sampled by samplerd over
# shared-memory rows (one SampleBatchStream message per step) or by
# llama.cpp's chain, alternated, ROUNDS rounds at 1 and 8 sequences of
# TOKENS tokens each; prints the median decode tokens/s of each, the spread
# (min-max) and the ratio samplerd/llama, the median per-step sampling and
# forward times with the ratio they imply (steadier than whole-run tokens/s
# on a shared machine), the sampling per step with no forward pass between
# steps, and the load average before and after.
#   ROUNDS=3 TOKENS=64 THREADS=2 scripts/bench-engine.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
TOKENS=${TOKENS:-64}
THREADS=${THREADS:-2}
SEQUENCES=${SEQUENCES:-1,8}
PY=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}/bin/python
BIN=${SAMPLERD_BIN:-${CARGO_TARGET_DIR:-target}/release/samplerd}
MODEL=${SAMPLERD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
[ -f "$MODEL" ] || { echo "bench-engine: no model at $MODEL (scripts/fetch-model.sh)" >&2; exit 1; }
DIR=$(mktemp -d)
SOCK="$DIR/samplerd.sock"
"$BIN" serve --listen "unix:$SOCK" > "$OUT/engine-server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$DIR"' EXIT
for _ in $(seq 1 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
[ -S "$SOCK" ] || { echo "bench-engine: samplerd did not listen on $SOCK" >&2; exit 1; }

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" clients/python/examples/llama_cpp_engine.py --model "$MODEL" --address "unix://$SOCK" --threads "$THREADS" \
  --bench "$ROUNDS" --bench-sequences "$SEQUENCES" --max-tokens "$TOKENS" > "$OUT/engine.json"
echo "load after:  $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" - "$OUT/engine.json" <<'PYEOF'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"{j['rounds']} rounds, {j['max_tokens']} tokens per sequence (median decode tok/s [min-max])")
for r in j["results"]:
    print(f"  {r['sequences']} sequence(s): samplerd {r['samplerd_tok_s']:7.1f} [{r['samplerd_min']:.1f}-{r['samplerd_max']:.1f}]"
          f"  llama {r['llama_tok_s']:7.1f} [{r['llama_min']:.1f}-{r['llama_max']:.1f}]  ratio {r['ratio']:.3f}")
    print(f"    per step (median): sampling samplerd {r['samplerd_sample_ms']:.3f} ms, llama {r['llama_sample_ms']:.3f} ms;"
          f" forward {r['forward_ms']:.2f} ms; implied ratio {r['step_ratio']:.3f}")
    print(f"    sampling per step without forward passes (median): samplerd {r['samplerd_hot_sample_ms']:.3f} ms,"
          f" llama {r['llama_hot_sample_ms']:.3f} ms")
PYEOF
