#!/usr/bin/env bash
# Runs every benchmark behind docs/PERFORMANCE.md, side by side in one
# session, and leaves the raw outputs in $OUT (default bench-results/):
#   chain.txt        criterion: max-scan, naive baseline (seed_port), our chains, each stage
#   llamacpp_sampler llama.cpp's sampler chain (same logits/params)
#   bench_chain.json samplerd bench-chain (per-stage p50/p99, as operators see it)
#   rpc.txt          loopback RPC round trips vs the transport floor
#   model.json / llamacpp_model.json  decode/prefill tok/s, ours vs llama.cpp
#   generate_c1.json / generate_c4.json  samplerctl bench --rpc generate
#   generate_one.json  one Generate with timings (sampling share of a step)
#   batch.txt        scripts/bench-batch.sh: SampleBatch(Stream) vs SampleStreams, compression
#   resume.txt       scripts/bench-resume.py: a cut Generate resumed, with and without the prompt cache
#   engine.txt       scripts/bench-engine.sh: llama.cpp's forward pass sampled by samplerd (shared rows) vs llama.cpp
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
PY=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}/bin/python
TARGET_DIR=${CARGO_TARGET_DIR:-target}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || scripts/fetch-model.sh
cargo build --release --workspace --examples
BIN=$TARGET_DIR/release

cargo bench -p samplerd-sampling --bench chain 2>&1 | grep -E "^vocab_|time:" > "$OUT/chain.txt"
"$PY" scripts/bench_llamacpp_sampler.py > "$OUT/llamacpp_sampler.txt"
(cd /tmp && "$BIN/samplerd" bench-chain --iterations 2000 --json) > "$OUT/bench_chain.json"
cargo bench -p samplerd --bench rpc 2>&1 | tail -20 > "$OUT/rpc.txt"
"$BIN/examples/model_bench" "$MODEL" --threads 2 --runs 3 --new 128 > "$OUT/model.json"
"$PY" scripts/bench_llamacpp.py --threads 2 > "$OUT/llamacpp_model.json"

PORT=50931
"$BIN/samplerd" serve --listen 127.0.0.1:$PORT --model "$MODEL" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
CTL="$BIN/samplerctl --addr http://127.0.0.1:$PORT"
for _ in $(seq 1 100); do $CTL health >/dev/null 2>&1 && break; sleep 0.2; done
$CTL generate "Tell me a story about a lighthouse keeper." -n 128 --seed 1 --json | tail -1 > "$OUT/generate_one.json"
$CTL bench --rpc generate --concurrency 1 --requests 4 -n 64 --json > "$OUT/generate_c1.json"
$CTL bench --rpc generate --concurrency 4 --requests 8 -n 64 --json > "$OUT/generate_c4.json"
OUT="$OUT" scripts/bench-batch.sh > "$OUT/batch.txt"
SAMPLERD_BIN="$BIN/samplerd" "$PY" scripts/bench-resume.py > "$OUT/resume.txt"
OUT="$OUT" SAMPLERD_BIN="$BIN/samplerd" scripts/bench-engine.sh > "$OUT/engine.txt"
echo "results in $OUT/"
