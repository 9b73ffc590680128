#!/usr/bin/env bash
# Builds the emulated CUDA driver and NVRTC (driver.cpp, nvrtc.cpp) into
# DIR, under the names cudarc's loader tries (libcuda.so / libcuda.so.1,
# libnvrtc.so): put DIR first on LD_LIBRARY_PATH to run the CUDA backend on
# them. IEEE arithmetic as in the kernel emulation test: no contraction of
# a * b + c, no fast math. Rebuilds only when a source is newer.
# Usage: build.sh DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh DIR}
mkdir -p "$out"
CXX=${CXX:-g++}
flags=(-std=c++20 -O2 -fPIC -shared -ffp-contract=off -fno-fast-math -w -fvisibility=hidden -U_FORTIFY_SOURCE)
newer() { [ ! -f "$1" ] || [ -n "$(find "${@:2}" -newer "$1" 2>/dev/null | head -1)" ]; }
if newer "$out/libcuda.so.1" "$here"/driver.cpp "$here"/fibers.h "$here"/../emulation/prelude.h "$here"/../kernels; then
  "$CXX" "${flags[@]}" -o "$out/libcuda.so.1.tmp" "$here/driver.cpp" -pthread
  mv "$out/libcuda.so.1.tmp" "$out/libcuda.so.1"
fi
if newer "$out/libnvrtc.so" "$here"/nvrtc.cpp; then
  "$CXX" "${flags[@]}" -o "$out/libnvrtc.so.tmp" "$here/nvrtc.cpp"
  mv "$out/libnvrtc.so.tmp" "$out/libnvrtc.so"
fi
ln -sf libcuda.so.1 "$out/libcuda.so"
