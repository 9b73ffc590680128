#!/usr/bin/env bash
# Runs every test of samplerd on a fresh machine: installs what the tests need
# (the Python venv with llama-cpp-python, grpcio, grpcurl; the default model),
# builds the workspace once (release profile: the same binaries serve the Rust
# tests, the Python/grpcurl tests and the parity scripts), then runs
#   0. the documentation's citations and the server's layer rules (before
#      the installs: they need none)
#   1. cargo fmt --check and cargo clippy -D warnings
#   2. cargo test (every crate: unit, property, loader, service tests)
#   3. the llama.cpp parity scripts, the Python/grpcurl client tests, the
#      client kits and the fleet test (several replicas in network
#      namespaces behind HAProxy: needs root)
# Caches: the venv (~/.cache/samplerd/venv) and CARGO_TARGET_DIR are reused
# when present, never required.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
export SAMPLERD_VENV=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}
PY="$SAMPLERD_VENV/bin/python"

step() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

# First, since it takes seconds and needs nothing installed.
step "documentation citations (scripts/ci/docs.sh)"; scripts/ci/docs.sh
step "server layers (scripts/ci/layers.sh)"; scripts/ci/layers.sh
step "import circles (scripts/ci/circles.py)"; python3 scripts/ci/circles.py
step "python environment"
scripts/setup-python.sh
step "default model"
scripts/fetch-model.sh

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --release --workspace --all-targets -- -D warnings
step "dependency audit (cargo deny: licenses, bans, sources)"; scripts/ci/audit.sh
step "proto checks (buf lint, format, breaking)"; scripts/ci/proto.sh
step "CUDA feature (builds and lints without a toolkit)"; scripts/ci/cuda-build.sh
step "CUDA host on the emulated driver (scripts/ci/cuda-emulated.sh)"; scripts/ci/cuda-emulated.sh

# Where the scripts find the binaries and the model (also enables the
# real-model tests of `cargo test`).
BIN="$TARGET_DIR/release"
export SAMPLERD_BIN="$BIN/samplerd" SAMPLERD_PLUGIN="$BIN/libsamplerd_core_stages.so"
export SAMPLERD_MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"

# Builds every library and binary into target/release/ — including the core
# plugin cdylib, which `cargo test` alone leaves only in deps/ (a stale copy
# could otherwise be loaded by the scripts below).
step "cargo build"
cargo build --release --workspace

step "cargo test"
cargo test --release --workspace
step "fuzzing (cargo fuzz, 40 s per target)"; scripts/ci/fuzz.sh

# Every suite runs even when one fails; the last lines name the failed
# ones, so the tail of a CI log says what to rerun. A suite that exits 77
# was skipped (the machine cannot run it; it printed why): listed apart.
failed=()
skipped=()
suite() { # NAME COMMAND...: runs one script suite, noting it when it fails
  local name=$1 rc=0; shift
  step "$name"
  "$@" || rc=$?
  case "$rc" in
    0) ;;
    77) skipped+=("$name") ;;
    *) failed+=("$name") ;;
  esac
}
for t in tests/parity/*.py server/model/tests/*_parity.py tests/python/test_*.py; do
  [ -f "$t" ] && suite "$t" "$PY" "$t"
done
for t in tests/grpcurl/*.sh; do
  [ -f "$t" ] && suite "$t" env PATH="$SAMPLERD_VENV/bin:$PATH" bash "$t"
done
suite "Kubernetes manifests and Dockerfile (scripts/ci/k8s.sh)" scripts/ci/k8s.sh
suite "client kits: Python, Node.js, Go (scripts/ci/clients.sh)" scripts/ci/clients.sh
suite "fleet: replicas behind HAProxy and client-side round-robin, killed, drained, joined, cut off (scripts/fleet-test.sh)" \
  scripts/fleet-test.sh
if [ "${#skipped[@]}" -ne 0 ]; then
  echo "scripts/test.sh: ${#skipped[@]} script test suite(s) skipped (this machine cannot run them):"
  printf '  SKIPPED %s\n' "${skipped[@]}"
fi
if [ "${#failed[@]}" -ne 0 ]; then
  echo "scripts/test.sh: ${#failed[@]} script test suite(s) failed:"
  printf '  FAILED %s\n' "${failed[@]}"
  exit 1
fi
echo "scripts/test.sh: all tests passed"
