#!/usr/bin/env bash
# CI: the `cuda` feature (the CUDA model host, server/model/src/cuda) builds
# and lints on a machine with no CUDA toolkit and no GPU — cudarc loads the
# driver and NVRTC at run time — and, without a driver, asking for the GPU is
# a clean error rather than cudarc's panic. NVRTC itself needs no GPU, so the
# kernels' CUDA C is compiled here too, with NVRTC from NVIDIA's PyPI wheel
# (installed into the test venv once; ~90 MB). Reuses the release target dir
# of scripts/test.sh; only samplerd-model and samplerd are re-checked.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
NVRTC_WHEEL="nvidia-cuda-nvrtc-cu12==12.9.86"
VENV=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}

# Lints every target of the two crates with the feature on, including the
# GPU tests (server/tests/cuda_gpu.rs) and the benchmark (benches/cuda_decode.rs).
timeout 1200 cargo clippy --release -p samplerd-model -p samplerd --features cuda --all-targets -- -D warnings

nvrtc_dir() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import os, nvidia.cuda_nvrtc as m
print(os.path.join(list(m.__path__)[0], "lib"))
PY
}
if [ -x "$VENV/bin/python" ] && ! nvrtc_dir >/dev/null; then
  timeout 600 "$VENV/bin/python" -m pip install -q --no-deps "$NVRTC_WHEEL" ||
    echo "cuda-build: could not install $NVRTC_WHEEL; the kernel compile check will skip"
fi
NVRTC_LIB=$(nvrtc_dir || true)
# The device probe with the real (dynamically loaded) cudarc: no driver here,
# so `cuda` is DeviceError::NoDriver and `auto` the CPU, without a panic; and
# with NVRTC on the library path the kernels compile for compute_90.
LD_LIBRARY_PATH="${NVRTC_LIB:+$NVRTC_LIB:}${LD_LIBRARY_PATH:-}" \
  timeout 1200 cargo test --release -p samplerd-model --features cuda --lib cuda:: -- --nocapture
