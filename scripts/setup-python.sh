#!/usr/bin/env bash
# Creates (or reuses) the Python virtual environment the test suite needs:
# llama-cpp-python (the llama.cpp parity reference), numpy, grpcio/grpcio-tools
# (the Python client test), grpcurl (reflection test), kubernetes-validate.
# The venv lives outside the checkout so CI and later clones reuse it; it is a
# cache, never a requirement: a missing or broken one is rebuilt from PyPI.
set -euo pipefail
VENV="${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}"
REQS="$(cd "$(dirname "$0")" && pwd)/requirements-test.txt"
stamp="$VENV/.samplerd-reqs.sha256"
want="$(sha256sum "$REQS" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$VENV/bin/python" -c 'import llama_cpp, numpy, grpc, grpc_tools' 2>/dev/null; then
  echo "setup-python: reusing $VENV"
  exit 0
fi
echo "setup-python: building $VENV (llama-cpp-python compiles llama.cpp: ~13 min on 2 cores)"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$VENV/bin/python" -m pip install -q -r "$REQS"
echo "$want" > "$stamp"
echo "setup-python: ready at $VENV"
