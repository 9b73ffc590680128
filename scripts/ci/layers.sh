#!/usr/bin/env bash
# The server crate's layers (server/src/lib.rs states them), kept by grep:
#   - transport/ is plumbing: it imports nothing from app, service,
#     generate or request;
#   - nothing but main.rs (and app/ itself) imports app: the layers below
#     get their configuration as values;
#   - service imports generate, never the other way round; request/ (what
#     both stand on) imports neither, nor app;
#   - status.rs and crash.rs are the ground: they import no layer.
# `crate::x` and `super::x` are the two ways in; each hit is printed as
# FILE:LINE with the rule it breaks. Takes well under a second.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=server/src
failed=0

# forbid RULE PATTERN PATHSPEC...: no line of the pathspecs matches PATTERN.
forbid() {
  local rule=$1 pattern=$2
  shift 2
  local hits
  if hits=$(git grep -nE "$pattern" -- "$@"); then
    printf 'layer rule broken: %s\n%s\n' "$rule" "$hits" >&2
    failed=1
  fi
}

layer() { printf '\\b(crate|super)::(%s)\\b' "$1"; }

forbid "transport imports nothing from app, service, generate or request" \
  "$(layer 'app|service|generate|request')" "$src/transport/"
forbid "only main.rs imports app" \
  "$(layer app)" "$src/" ":!$src/app/" ":!$src/main.rs"
forbid "generate does not import service (service imports generate)" \
  "$(layer service)" "$src/generate/"
forbid "request/ is below service and generate" \
  "$(layer 'service|generate')" "$src/request/"
forbid "status.rs and crash.rs import no layer" \
  "$(layer 'app|service|generate|request|transport')" "$src/status.rs" "$src/crash.rs"

if [ "$failed" -ne 0 ]; then
  echo "the layers are described in $src/lib.rs" >&2
  exit 1
fi
echo "server layers hold"
