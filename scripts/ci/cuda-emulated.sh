#!/usr/bin/env bash
# CI: the CUDA model host end to end without a GPU. Builds the emulated CUDA
# driver and NVRTC (server/model/src/cuda/emu: the driver API on host
# memory, the kernels compiled as C++), puts them first on the library path
# so cudarc loads them instead of libcuda / libnvrtc, and runs with
# SAMPLERD_EXPECT_CUDA=1 (a missing device fails instead of skipping):
#   1. the CUDA unit tests (device selection picks the emulated device);
#   2. the backend tests (server/model/tests/cuda_device.rs): every weight
#      format's logits equal to the CPU backend's bit for bit, graphs,
#      batched sequences, device memory given back, the driver's refusals;
#   3. the server with model.device = "cuda" (server/tests/cuda_generate.rs).
# scripts/gpu-check.sh runs the same tests on a real GPU. Reuses the
# release target dir of scripts/test.sh (only the feature build differs).
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
TARGET_DIR=${CARGO_TARGET_DIR:-$(pwd)/target}
EMU="$TARGET_DIR/cuda-emu"
server/model/src/cuda/emu/build.sh "$EMU"
export LD_LIBRARY_PATH="$EMU${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SAMPLERD_EXPECT_CUDA=1
# The check-config test runs the binary cargo builds with the feature.
unset SAMPLERD_BIN
# (cuda::emulation, the kernels' own check, runs in every `cargo test`.)
timeout 1200 cargo test --release -p samplerd-model --features cuda --lib cuda:: -- --skip cuda::emulation
timeout 1200 cargo test --release -p samplerd-model --features cuda --test cuda_device
timeout 1200 cargo test --release -p samplerd --features cuda --test cuda_generate
