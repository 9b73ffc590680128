#!/usr/bin/env bash
# Writes the default model requantised by llama.cpp's own quantiser
# (llama-cpp-python's `llama_model_quantize`, `allow_requantize`): the
# target a draft model of the default model drafts for in
# scripts/bench-speculate.sh. The weights are the Q4_1 file's values stored
# wider, so the two models agree on most tokens — what a model's own
# smaller quantisation is as a drafter.
#   scripts/requantize-model.sh F16     # or Q8_0
#   -> models/SmolLM2-135M-Instruct.F16.gguf
set -euo pipefail
cd "$(dirname "$0")/.."
TYPE=${1:-F16}
SRC=${SRC:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
DST=${DST:-models/SmolLM2-135M-Instruct.$TYPE.gguf}
VENV=${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}
[ -f "$SRC" ] || scripts/fetch-model.sh
SAMPLERD_VENV=$VENV scripts/setup-python.sh
"$VENV/bin/python" - "$SRC" "$DST" "$TYPE" <<'PY'
import ctypes, sys
import llama_cpp
src, dst, kind = sys.argv[1:]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
p.allow_requantize = True
p.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
sys.exit(f"llama_model_quantize({src} -> {dst}) returned {rc}" if rc else 0)
PY
echo "$DST"
