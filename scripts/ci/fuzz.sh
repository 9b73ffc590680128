#!/usr/bin/env bash
# Fuzzes samplerd with cargo-fuzz (libFuzzer + AddressSanitizer): builds the
# targets in fuzz/ once, then runs each for FUZZ_SECONDS (default 40) from
# the seed corpus in fuzz/corpus/<target>/ and fails if any target finds a
# crash, a panic, a leak or a timeout (the reproducer is saved under
# fuzz/artifacts/<target>/; replay it with
# `cargo +nightly fuzz run --fuzz-dir fuzz <target> <file>`).
#
# New inputs the fuzzer finds go to $FUZZ_TARGET_DIR/corpus/<target>/ (scratch),
# not to the repository; FUZZ_UPDATE_CORPUS=1 merges those that add
# coverage (-merge=1) into fuzz/corpus/<target>/ for committing. The scratch
# corpus keeps only its FUZZ_KEEP (default 128) newest inputs: libFuzzer runs
# every input it is given before it first looks at -max_total_time, and a scratch corpus
# that grew run after run (gguf: 473 inputs, 5.5 MB, at 4-8 runs/s on 2
# loaded cores) outlasted the run's time box on its own.
#
# Needs: cargo-fuzz (installed once into ~/.cache/samplerd/bin, reused),
# a nightly toolchain (else stable with RUSTC_BOOTSTRAP=1), the core and
# constraint plugins (SAMPLERD_PLUGIN, SAMPLERD_CONSTRAINT_PLUGIN, else
# built) and optionally SAMPLERD_MODEL (the
# proto_request target then also validates Generate prompts with the real
# tokenizer and chat template).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
FUZZ_SECONDS=${FUZZ_SECONDS:-40}
FUZZ_KEEP=${FUZZ_KEEP:-128}
TARGETS=(chain stop_filter utf8_streamer gguf proto_request constraint sparse)
TOOLS=${SAMPLERD_TOOLS:-$HOME/.cache/samplerd/bin}
CARGO_FUZZ_VERSION=0.13.2
export PATH="$TOOLS:$PATH"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

if ! cargo-fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  echo "fuzz.sh: installing cargo-fuzz $CARGO_FUZZ_VERSION into $TOOLS"
  tmp=$(mktemp -d)
  timeout 1200 cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" \
    --root "$tmp" --target-dir "$tmp/target"
  mkdir -p "$TOOLS"
  mv "$tmp/bin/cargo-fuzz" "$TOOLS/"
  rm -rf "$tmp"
fi

# Sanitizer flags are nightly-only: use nightly when installed, else let the
# stable compiler accept them.
if rustup run nightly rustc --version >/dev/null 2>&1; then
  FUZZ=(cargo +nightly fuzz)
else
  echo "fuzz.sh: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1"
  export RUSTC_BOOTSTRAP=1
  FUZZ=(cargo fuzz)
fi

if [ -z "${SAMPLERD_PLUGIN:-}" ]; then
  cargo build --release -p samplerd-core-stages
  export SAMPLERD_PLUGIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/libsamplerd_core_stages.so"
fi
if [ -z "${SAMPLERD_CONSTRAINT_PLUGIN:-}" ]; then
  cargo build --release -p samplerd-constraint-stage
  export SAMPLERD_CONSTRAINT_PLUGIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/libsamplerd_constraint_stage.so"
fi

# fuzz/ is its own workspace; its sanitizer build gets its own target dir
# (it would otherwise invalidate the main build), kept outside the checkout
# so a fresh clone reuses it: the first, cold build of the whole dependency
# tree with AddressSanitizer takes 15-30 min on 2 cores, a warm one seconds
# to a few minutes.
FUZZ_TARGET_DIR=${FUZZ_TARGET_DIR:-$HOME/.cache/samplerd/fuzz-target}
timeout 2400 "${FUZZ[@]}" build --fuzz-dir fuzz -O --target-dir "$FUZZ_TARGET_DIR"
BIN="$FUZZ_TARGET_DIR/x86_64-unknown-linux-gnu/release"

declare -A MAX_LEN=([gguf]=32768 [proto_request]=8192 [constraint]=16384)
status=0
summary=()
for t in "${TARGETS[@]}"; do
  work="$FUZZ_TARGET_DIR/corpus/$t"
  mkdir -p "$work" "$ROOT/fuzz/artifacts/$t"
  # The newest FUZZ_KEEP scratch inputs stay (names are content hashes).
  find "$work" -maxdepth 1 -type f -printf '%T@ %p\n' | sort -rn |
    tail -n +$((FUZZ_KEEP + 1)) | cut -d' ' -f2- | xargs -r rm -f
  log="$FUZZ_TARGET_DIR/$t.log"
  echo "=== fuzz $t (${FUZZ_SECONDS}s)"
  set +e
  timeout $((FUZZ_SECONDS + 120)) "$BIN/$t" "$work" "$ROOT/fuzz/corpus/$t" \
    -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=4096 \
    -max_len="${MAX_LEN[$t]:-4096}" -print_final_stats=1 \
    -artifact_prefix="$ROOT/fuzz/artifacts/$t/" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  if [ "$rc" -ne 0 ]; then
    status=1
    echo "fuzz.sh: target $t FAILED (exit $rc); its panic, then the log tail:"
    # The tail alone can be all sanitizer stack; the oracle's message is the
    # line after "panicked at".
    grep -m 3 -A 1 'panicked at' "$log" || true
    tail -40 "$log"
    summary+=("$t FAILED execs=${execs:-?} see fuzz/artifacts/$t/")
  else
    summary+=("$t ok execs=${execs:-?} cov=${cov:-?}")
  fi
  if [ "${FUZZ_UPDATE_CORPUS:-0}" = 1 ] && [ "$rc" -eq 0 ]; then
    # Adds only the inputs that reach new coverage.
    "$BIN/$t" -merge=1 -max_len="${MAX_LEN[$t]:-4096}" -rss_limit_mb=4096 \
      "$ROOT/fuzz/corpus/$t" "$work" >>"$log" 2>&1
  fi
done
echo "=== fuzz summary (${FUZZ_SECONDS}s per target)"
printf '  %s\n' "${summary[@]}" | tee "$FUZZ_TARGET_DIR/summary.txt"
exit "$status"
