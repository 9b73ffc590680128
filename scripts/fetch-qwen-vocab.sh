#!/usr/bin/env bash
# Fetches Qwen's BPE vocabulary (151,643 tokens as `qwen.tiktoken`: each
# line a token's bytes in base64 and its id) into models/qwen.tiktoken, for
# the constraint stage's mask benchmark at Qwen2's 151,936-logit vocabulary
# (plugins/constraint/benches/mask.rs). The file ships inside the PyPI wheel
# dashscope==2.0.2 (Apache-2.0); we download that wheel (no dependencies)
# with pip, extract the one file and verify its SHA-256. Idempotent like
# scripts/fetch-model.sh. Nothing but that benchmark needs it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${SAMPLERD_MODEL_DIR:-$ROOT/models}/qwen.tiktoken"
SHA256="b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
MEMBER="dashscope/resources/qwen.tiktoken"
PIP="${PIP:-}"
if [ -z "$PIP" ]; then
  if command -v pip3 >/dev/null 2>&1; then PIP="pip3"; else PIP="python3 -m pip"; fi
fi

verify() { [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if [ -f "$DEST" ] && verify "$DEST"; then
  echo "fetch-qwen-vocab: $DEST present and verified"
  exit 0
fi

mkdir -p "$(dirname "$DEST")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetch-qwen-vocab: downloading dashscope==2.0.2 from PyPI"
$PIP download --quiet --no-deps --dest "$tmp" dashscope==2.0.2
wheel="$(ls "$tmp"/dashscope-2.0.2-*.whl)"
python3 - "$wheel" "$MEMBER" "$tmp/qwen.tiktoken" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "$tmp/qwen.tiktoken"; then
  echo "fetch-qwen-vocab: SHA-256 mismatch for $MEMBER (expected $SHA256)" >&2
  exit 1
fi
mv "$tmp/qwen.tiktoken" "$DEST"
echo "fetch-qwen-vocab: wrote $DEST"
