#!/usr/bin/env bash
# Runs samplerd's main job on a fresh machine: fetches the default model
# (SmolLM2-135M-Instruct Q4_1) if it is missing, builds the release binaries
# (server + core plugin library) and serves on 127.0.0.1:50051 with the
# default chain. Extra arguments go to `samplerd serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || scripts/fetch-model.sh
cargo build --release --workspace --bins --lib
TARGET_DIR=${CARGO_TARGET_DIR:-target}
exec "$TARGET_DIR/release/samplerd" serve --model "$MODEL" "$@"
