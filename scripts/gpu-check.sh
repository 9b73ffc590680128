#!/usr/bin/env bash
# GPU verification of the CUDA model host, in one script:
#   1. device facts (nvidia-smi, the driver / NVRTC libraries found);
#   1b. the emulated CUDA suite's cases (scripts/ci/cuda-emulated.sh) on the
#      real driver, first, so GPU minutes go to what only a GPU can show:
#      tiny models in every weight format bit-identical to the CPU, graphs,
#      batching, the server's Generate equal to the CPU server's, a
#      cancelled stream's memory, check-config (the emulator-only checks
#      skip with a notice);
#   2. the CUDA unit tests with SAMPLERD_EXPECT_GPU=1 (auto/cuda pick the GPU);
#   3. the GPU tests (server/tests/cuda_gpu.rs): GPU vs CPU logits (relative
#      error <= 1e-2 at every position), greedy tokens identical to the CPU
#      for 32 tokens of three prompts, the device sampling prefix equal to
#      the CPU chain on 1,000 random logit vectors of 151,936;
#   4. compute-sanitizer --tool memcheck over the GPU tests, and synccheck
#      over the device-sampling test, when present;
#   5. the decode benchmark (server/benches/cuda_decode.rs): tok/s for 1 and
#      8 streams (8 as one batched pass per step, and as a pass per stream
#      for comparison), per-step forward / sampling / copy / host time, bytes
#      copied device -> host per token (targets: >= 1,000 tok/s for one
#      stream on an H200, <= 4 KB/token with the default chain), then the
#      forward time alone at cache positions 32 / 256 / 1024 with CUDA
#      graphs on and off, both weight-product kernel layouts and attention
#      scores in their own kernel or inside attention;
# then prints a short table (also written to $OUT/gpu-check.txt when $OUT is set).
#
# Usage:
#   scripts/gpu-check.sh            build with `--features cuda` here, then run
#                                   (a GPU machine with cargo and the crates);
#   scripts/gpu-check.sh prepare    build on a CPU machine (no toolkit needed:
#                                   cudarc loads the driver at run time) into
#                                   .gpu-bundle/ (stripped test and bench
#                                   binaries, the core plugin, the model in
#                                   40 MB parts), for a GPU machine that
#                                   cannot reach crates.io and takes files
#                                   in transfers of at most 64 MiB;
#   scripts/gpu-check.sh run        on the GPU machine, from .gpu-bundle/.
#
# The model (98 MB) does not fit one transfer: `prepare` splits it into
# .gpu-model/model.part.NN (40 MB). Copy each part but the last to
# .gpu-model/ on the GPU machine and run `scripts/gpu-check.sh stash` there after each (it copies
# the part to $SCRATCH/model-parts/); then copy .gpu-bundle/ and the
# last part and run `scripts/gpu-check.sh run`, which joins and checks them
# (sha256). The binaries (~16 MB stripped) and the core plugin travel in
# .gpu-bundle/.
# SAMPLERD_MODEL may instead point to any GGUF already on the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUNDLE="$ROOT/.gpu-bundle"
MODEL_PARTS_DIR="$ROOT/.gpu-model"
# Scratch space outside the checkout (which is laid anew for each run on the
# GPU machine), so stashed parts survive from one run to the next: the
# system's temporary directory unless GPU_CHECK_SCRATCH names another.
SCRATCH=${GPU_CHECK_SCRATCH:-${TMPDIR:-/tmp}/samplerd-gpu-check}
PARTS="$SCRATCH/model-parts"
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
mode=${1:-all}
export CARGO_TERM_COLOR=never

step() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

# The executables cargo built for `$@` (test / bench binaries), from its
# JSON messages.
built_executables() {
  cargo "$@" --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])'
}

prepare() {
  step "build (release, --features cuda)"
  cargo build --release -p samplerd-core-stages || exit 1
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/deps"
  local exes
  exes=$( {
    built_executables test --release -p samplerd-model --features cuda --lib --no-run
    built_executables test --release -p samplerd --features cuda --test cuda_gpu --no-run
    built_executables test --release -p samplerd-model --features cuda --test cuda_device --no-run
    built_executables test --release -p samplerd --features cuda --test cuda_generate --no-run
    built_executables bench -p samplerd --features cuda --bench cuda_decode --no-run
  } ) || exit 1
  [ -n "$exes" ] || { echo "gpu-check: no executables were built" >&2; exit 1; }
  for e in $exes; do
    local name
    case "$e" in
      */samplerd_model-*) name=model_unit ;;
      */cuda_gpu-*) name=cuda_gpu ;;
      */cuda_device-*) name=cuda_device ;;
      */cuda_generate-*) name=cuda_generate ;;
      */cuda_decode-*) name=cuda_decode ;;
      *) continue ;;
    esac
    cp "$e" "$BUNDLE/deps/$name"
    strip "$BUNDLE/deps/$name" 2>/dev/null || true
  done
  cp target/release/libsamplerd_core_stages.so "$BUNDLE/"
  rm -rf "$MODEL_PARTS_DIR"
  if [ -f "models/$MODEL_NAME" ]; then
    mkdir -p "$MODEL_PARTS_DIR"
    split -b 40M -d "models/$MODEL_NAME" "$MODEL_PARTS_DIR/model.part."
    sha256sum <"models/$MODEL_NAME" | cut -d' ' -f1 >"$BUNDLE/model.sha256"
  fi
  for d in /.gpu-bundle/ /.gpu-model/; do
    grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude
  done
  ls -la "$BUNDLE" "$BUNDLE/deps" "$MODEL_PARTS_DIR" 2>/dev/null
  echo "device calls: carry [\".gpu-model/model.part.NN\"] + \`scripts/gpu-check.sh stash\` per part but the last;"
  echo "then carry [\".gpu-bundle\", \".gpu-model/model.part.LAST\"] + \`scripts/gpu-check.sh run\`"
}

stash() {
  mkdir -p "$PARTS"
  cp "$MODEL_PARTS_DIR"/model.part.* "$PARTS"/ 2>/dev/null || true
  ls -la "$PARTS"
}

# Finds the model: SAMPLERD_MODEL, models/, or the stashed parts.
find_model() {
  if [ -n "${SAMPLERD_MODEL:-}" ] && [ -f "$SAMPLERD_MODEL" ]; then return; fi
  if [ -f "$ROOT/models/$MODEL_NAME" ]; then
    export SAMPLERD_MODEL="$ROOT/models/$MODEL_NAME"; return
  fi
  stash >/dev/null
  if ls "$PARTS"/model.part.* >/dev/null 2>&1; then
    cat "$PARTS"/model.part.* >"$SCRATCH/$MODEL_NAME"
    if [ -f "$BUNDLE/model.sha256" ] &&
       [ "$(sha256sum <"$SCRATCH/$MODEL_NAME" | cut -d' ' -f1)" != "$(cat "$BUNDLE/model.sha256")" ]; then
      echo "gpu-check: the joined model parts do not match model.sha256 (a part is missing?)" >&2
      ls -la "$PARTS" >&2
      return
    fi
    export SAMPLERD_MODEL="$SCRATCH/$MODEL_NAME"
  fi
}

# NVRTC: the system's, or libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel
# sent like the model (`prepare-nvrtc` packs it into .gpu-nvrtc/ parts).
NVRTC_PARTS="$SCRATCH/nvrtc-parts"
NVRTC_DIR="$SCRATCH/nvrtc"
find_nvrtc() {
  if ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then return; fi
  mkdir -p "$NVRTC_PARTS"
  cp "$ROOT"/.gpu-nvrtc/nvrtc.part.* "$NVRTC_PARTS"/ 2>/dev/null || true
  if ls "$NVRTC_PARTS"/nvrtc.part.* >/dev/null 2>&1; then
    mkdir -p "$NVRTC_DIR"
    cat "$NVRTC_PARTS"/nvrtc.part.* | tar -C "$NVRTC_DIR" -xzf - &&
      export LD_LIBRARY_PATH="$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    ls -la "$NVRTC_DIR"
  fi
}

prepare_nvrtc() {
  local venv=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv} dir
  dir=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib 2>/dev/null | head -1)
  [ -n "$dir" ] || { echo "gpu-check: no nvidia-cuda-nvrtc-cu12 in $venv (scripts/ci/cuda-build.sh installs it)" >&2; exit 1; }
  rm -rf "$ROOT/.gpu-nvrtc"; mkdir -p "$ROOT/.gpu-nvrtc"
  tar -C "$dir" -czf - libnvrtc.so.12 libnvrtc-builtins.so.12.9 | split -b 40M -d - "$ROOT/.gpu-nvrtc/nvrtc.part."
  grep -qx "/.gpu-nvrtc/" .git/info/exclude 2>/dev/null || echo "/.gpu-nvrtc/" >>.git/info/exclude
  ls -la "$ROOT/.gpu-nvrtc"
}

declare -A RESULT
record() { RESULT[$1]=$2; }

run_checks() {
  local bin_dir=$1
  export SAMPLERD_EXPECT_GPU=1
  find_model
  find_nvrtc
  step "device"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc\.so' || echo "(ldconfig lists no libcuda/libnvrtc)"
  echo "model: ${SAMPLERD_MODEL:-<none>} ($(stat -c %s "${SAMPLERD_MODEL:-/dev/null}" 2>/dev/null) bytes)"
  mkdir -p "$SCRATCH"
  local log="$SCRATCH/gpu-check.log"
  : >"$log"

  step "the emulated suite's cases on the GPU (tiny models, every format; the server)"
  if SAMPLERD_EXPECT_CUDA=1 timeout "${GPU_CHECK_EMULATED_TIMEOUT:-240}" sh -c \
      '"$1/cuda_device" --test-threads=1 && "$1/cuda_generate" --test-threads=1' _ "$bin_dir" 2>&1 | tee -a "$log"; then
    record emulated PASS; else record emulated FAIL; fi

  step "CUDA unit tests (device selection)"
  if timeout "${GPU_CHECK_UNIT_TIMEOUT:-300}" "$bin_dir/model_unit" cuda:: 2>&1 | tee -a "$log"; then
    record unit PASS; else record unit FAIL; fi

  step "GPU tests"
  if timeout "${GPU_CHECK_TESTS_TIMEOUT:-600}" "$bin_dir/cuda_gpu" --test-threads=1 --nocapture 2>&1 | tee -a "$log"; then
    record gpu_tests PASS; else record gpu_tests FAIL; fi

  step "compute-sanitizer memcheck"
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$cs" ]; then
    # The logits and greedy tests cover every forward kernel; the sampling
    # test every sampling kernel (its 1,000 vectors make memcheck slow, so
    # it runs with its own filter and a time bound).
    if timeout "${GPU_CHECK_MEMCHECK_TIMEOUT:-420}" "$cs" --tool memcheck --error-exitcode 99 \
        "$bin_dir/cuda_gpu" --test-threads=1 greedy_tokens device_prefix 2>&1 | tail -40 | tee -a "$log"; then
      record memcheck CLEAN; else record memcheck "ERRORS (rc $?)"; fi
  else
    record memcheck "not installed"
  fi
  if [ -n "$cs" ]; then
    # Barrier divergence (a __syncthreads some threads of a block skip):
    # the single-block top_k kernel once had such a race (fixed).
    step "compute-sanitizer synccheck (device prefix)"
    if timeout "${GPU_CHECK_SYNCCHECK_TIMEOUT:-180}" "$cs" --tool synccheck --error-exitcode 99 \
        "$bin_dir/cuda_gpu" --test-threads=1 device_prefix 2>&1 | tail -20 | tee -a "$log"; then
      record synccheck CLEAN; else record synccheck "ERRORS (rc $?)"; fi
  fi

  step "benchmark"
  if timeout "${GPU_CHECK_BENCH_TIMEOUT:-300}" "$bin_dir/cuda_decode" 2>&1 | tee -a "$log"; then
    record bench DONE; else record bench FAIL; fi

  step "summary"
  {
    echo "GPU check $(date -u +%Y-%m-%dT%H:%MZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    printf '%-28s %s\n' "emulated suite's cases" "${RESULT[emulated]:-?}"
    printf '%-28s %s\n' "CUDA unit tests" "${RESULT[unit]:-?}"
    printf '%-28s %s\n' "GPU tests (3 + placement)" "${RESULT[gpu_tests]:-?}"
    printf '%-28s %s\n' "compute-sanitizer memcheck" "${RESULT[memcheck]:-?}"
    printf '%-28s %s\n' "compute-sanitizer synccheck" "${RESULT[synccheck]:-?}"
    printf '%-28s %s\n' "benchmark" "${RESULT[bench]:-?}"
    grep -h '^GPU-CHECK' "$log" | sed 's/^GPU-CHECK /  /'
    grep -hE '^(mode|[18] stream)' "$log"
  } | tee "${OUT:-$SCRATCH}/gpu-check.txt"
  [ "${RESULT[emulated]:-}" = PASS ] && [ "${RESULT[unit]:-}" = PASS ] && [ "${RESULT[gpu_tests]:-}" = PASS ] && [ "${RESULT[bench]:-}" = DONE ]
}

case "$mode" in
  prepare) prepare ;;
  stash) stash ;;
  prepare-nvrtc) prepare_nvrtc ;;
  stash-nvrtc) mkdir -p "$NVRTC_PARTS"; cp "$ROOT"/.gpu-nvrtc/nvrtc.part.* "$NVRTC_PARTS"/; ls -la "$NVRTC_PARTS" ;;
  run) run_checks "$BUNDLE/deps" ;;
  all)
    prepare || exit 1
    run_checks "$BUNDLE/deps"
    ;;
  *) echo "usage: $0 [prepare|prepare-nvrtc|stash|stash-nvrtc|run|all]" >&2; exit 2 ;;
esac
