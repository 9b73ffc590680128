#!/usr/bin/env bash
# Client kits test: the Python, Node.js and Go kits in clients/ against one
# real server. Installs what the kits need (Debian Go packages only when
# missing; `npm ci`; the Python packages come from the venv of
# scripts/setup-python.sh), starts `samplerd serve` with the core stages
# library and the model (so Generate works) on a free loopback port, waits
# for its health check (bounded), runs each kit's test and example, the
# kit installed as a package (Python, Node), docs/API.md's every-RPC example
# in that language (docs/examples/), and checks the server is still serving
# at the end.
#
#   scripts/ci/clients.sh [python] [node] [go]      (default: all three)
#
# SAMPLERD_BIN (the server), SAMPLERD_PLUGIN (libsamplerd_core_stages.so),
# SAMPLERD_MODEL (the GGUF) and SAMPLERD_VENV as in scripts/test.sh.
# KEEP_LOG=FILE keeps the server log. Exits non-zero if any kit fails.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BIN="$(realpath -m "${SAMPLERD_BIN:-$ROOT/target/release/samplerd}")"
PLUGIN="$(realpath -m "${SAMPLERD_PLUGIN:-$(dirname "$BIN")/libsamplerd_core_stages.so}")"
MODEL="$(realpath -m "${SAMPLERD_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}")"
VENV="${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}"
PY="$VENV/bin/python"
GRPCURL="${GRPCURL:-$VENV/bin/grpcurl}"
# Health turns SERVING once the plugins and the model are loaded (a few
# seconds for the default model; more on a loaded machine).
READY_TIMEOUT_S="${READY_TIMEOUT_S:-90}"
KIT_TIMEOUT_S="${KIT_TIMEOUT_S:-600}"

KITS=("$@")
[ ${#KITS[@]} -gt 0 ] || KITS=(python node go)
for k in "${KITS[@]}"; do
  case "$k" in python | node | go) ;; *) echo "clients.sh: unknown kit '$k' (python, node, go)" >&2; exit 2 ;; esac
done
wants() { [[ " ${KITS[*]} " == *" $1 "* ]]; }

for f in "$BIN" "$PLUGIN" "$MODEL"; do
  [ -f "$f" ] || { echo "clients.sh: missing $f (cargo build --release; scripts/fetch-model.sh)" >&2; exit 2; }
done
command -v "$GRPCURL" >/dev/null 2>&1 || { echo "clients.sh: no grpcurl at $GRPCURL (scripts/setup-python.sh)" >&2; exit 2; }

ts() { date -u +%H:%M:%S; }
failed=0
fail() { echo "FAIL $*"; failed=$((failed + 1)); }

# --- installs -------------------------------------------------------------
GO_PACKAGES=(golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev
  golang-google-protobuf-dev golang-google-genproto-dev
  # grpc-go's Debian package would otherwise pull protobuf 1.3, whose
  # github.com/golang/protobuf panics on APIv2 generated code ("protobuf
  # tag not enough fields"); 1.5 is the APIv2-backed one.
  golang-github-golang-protobuf-1-5-dev)
if wants go; then
  missing=()
  for p in "${GO_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "clients.sh: installing ${missing[*]} ($(ts))"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
    start=$SECONDS
    # Only when an install fails for want of package lists, fetch them.
    if ! timeout 900 $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; then
      timeout 600 $SUDO apt-get update
      timeout 900 $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
    fi
    echo "clients.sh: apt install took $((SECONDS - start)) s"
  fi
fi
if wants node; then
  command -v npm >/dev/null 2>&1 || { echo "clients.sh: the node kit needs Node.js 18+ and npm" >&2; exit 2; }
  start=$SECONDS
  (cd "$ROOT/clients/node" && timeout 600 npm ci --no-audit --no-fund)
  echo "clients.sh: npm ci took $((SECONDS - start)) s"
fi
if wants python; then
  "$PY" -c 'import grpc, grpc_tools, grpc_status, google.rpc.error_details_pb2, numpy' \
    || { echo "clients.sh: the venv at $VENV lacks the kit's packages (scripts/setup-python.sh)" >&2; exit 2; }
fi

# --- the server -----------------------------------------------------------
WORK="$(mktemp -d)"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
ADDR="127.0.0.1:$PORT"
LOG="$WORK/samplerd.log"
case "$PLUGIN$MODEL" in *"'"*) echo "clients.sh: a path with a quote: $PLUGIN $MODEL" >&2; exit 2 ;; esac
# An explicit config: just the core stages library (no plugin directory
# scan), the model, and no metrics listener (its default port may be taken
# by another local server).
cat >"$WORK/samplerd.toml" <<EOF
[plugins]
files = ['$PLUGIN']
[model]
path = '$MODEL'
[metrics]
enabled = false
EOF
# No inherited SAMPLERD_* configuration (SAMPLERD_SAMPLING__TOP_K and the
# like would change the defaults the tests rely on).
unset_env=()
while IFS= read -r v; do unset_env+=(-u "$v"); done < <(env | sed -n 's/^\(SAMPLERD_[A-Za-z0-9_]*\)=.*/\1/p')
(cd "$WORK" && exec env "${unset_env[@]}" "$BIN" serve --config "$WORK/samplerd.toml" --listen "$ADDR" >"$LOG" 2>&1) &
SERVER_PID=$!
cleanup() {
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  [ -n "${KEEP_LOG:-}" ] && cp "$LOG" "$KEEP_LOG"
  rm -rf "$WORK"
}
trap cleanup EXIT
# A killed run still stops its server: exit through the EXIT trap.
trap 'exit 130' INT
trap 'exit 143' TERM

health() { "$GRPCURL" -plaintext -max-time 2 -d '{"service":""}' "$ADDR" grpc.health.v1.Health/Check 2>/dev/null || true; }
deadline=$((SECONDS + READY_TIMEOUT_S))
until [[ "$(health)" == *'"SERVING"'* ]]; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    cat "$LOG"; echo "clients.sh: samplerd exited before serving" >&2; exit 1
  fi
  if [ $SECONDS -ge $deadline ]; then
    tail -n 40 "$LOG"; echo "clients.sh: samplerd not SERVING within ${READY_TIMEOUT_S}s" >&2; exit 1
  fi
  sleep 0.2
done
echo "clients.sh: samplerd serving on $ADDR ($(ts))"
export SAMPLERD_ADDR="$ADDR"

run_kit() { # name, command...
  local name=$1; shift
  echo; echo "--- $name ($(ts))"
  if ! timeout "$KIT_TIMEOUT_S" "$@"; then fail "$name"; fi
}

if wants python; then
  # Stubs go to the scratch directory, not the checkout.
  export SAMPLERD_PY_GEN_DIR="$WORK/python-gen"
  run_kit "python kit test" "$PY" "$ROOT/clients/python/test_kit.py" -v
  run_kit "python example" "$PY" "$ROOT/clients/python/example.py"
  # docs/API.md's worked example (plain grpcio), on the kit's stubs.
  run_kit "python every-RPC example" env PYTHONPATH="$SAMPLERD_PY_GEN_DIR" \
    "$PY" "$ROOT/docs/examples/python/every_rpc.py"
  # The kit as a package (pip install ./clients/python), used from outside
  # the checkout: its stubs and service config come with it.
  run_kit "python kit installed" bash -c '
    "$1" -m pip install -q --no-deps --no-build-isolation --target "$2/pykit" "$3/clients/python" &&
    cd "$2" && PYTHONPATH="$2/pykit" "$1" -c "
import samplerd_client as sc
assert sc.INSTALLED, sc.__file__
channel, stub = sc.connect(\"$SAMPLERD_ADDR\")
r = sc.sample_logits(stub, [0.5, 1.0, 4.25, 3.0], temperature=0.0)
assert r.token_id == 2, r
print(\"installed kit:\", sc.__file__, \"token\", r.token_id)"' _ "$PY" "$WORK" "$ROOT"
fi
if wants node; then
  run_kit "node kit test" bash -c 'cd "$1" && node --test test/kit.test.js' _ "$ROOT/clients/node"
  run_kit "node example" node "$ROOT/clients/node/example.js"
  # docs/API.md's worked example (plain grpc-js), with the kit's packages.
  run_kit "node every-RPC example" bash -c 'cd "$1" && NODE_PATH="$1/clients/node/node_modules" node docs/examples/node/every_rpc.js' _ "$ROOT"
  # The kit as a package (npm pack, then npm install of the tarball), used
  # from outside the checkout: the proto and service config come with it.
  run_kit "node kit installed" bash -c '
    mkdir -p "$2/nodekit" && (cd "$3/clients/node" && npm pack --silent --pack-destination "$2/nodekit" >/dev/null) &&
    cd "$2/nodekit" && npm install --silent --prefer-offline --no-audit --no-fund ./samplerd-client-*.tgz &&
    node -e "
const sc = require(\"samplerd-client\");
(async () => {
  const client = sc.connect(process.env.SAMPLERD_ADDR);
  await sc.waitForReady(client, 10000);
  const r = await sc.sample(client, [0.5, 1.0, 4.25, 3.0], { temperature: 0 });
  if (r.token_id !== 2) throw new Error(\"token \" + r.token_id);
  console.log(\"installed kit:\", require.resolve(\"samplerd-client\"), \"token\", r.token_id);
  client.close();
})().catch((e) => { console.error(e); process.exit(1); });"' _ node "$WORK" "$ROOT"
fi
if wants go; then
  # build.sh vets and builds the kit and, with SAMPLERD_ADDR set, runs its tests.
  run_kit "go kit build + test" "$ROOT/clients/go/build.sh" "$WORK/gopath"
  run_kit "go example" "$WORK/gopath/bin/samplerd-example"
  # docs/API.md's worked example (plain grpc-go), in the kit's GOPATH.
  run_kit "go every-RPC example" bash -c '
    dir="$2/src/github.com/samplerd/samplerd/docs/examples/go" && mkdir -p "$dir" &&
    cp -r "$1/docs/examples/go/every_rpc" "$dir/" && cd "$dir/every_rpc" &&
    GO111MODULE=off GOPATH="$2:/usr/share/gocode" GOFLAGS= go vet . &&
    GO111MODULE=off GOPATH="$2:/usr/share/gocode" GOFLAGS= go build -o "$2/bin/every_rpc" . &&
    "$2/bin/every_rpc"' _ "$ROOT" "$WORK/gopath"
fi

# Every test above cancelled or timed out streams; the server must still
# be up and answering.
echo
if kill -0 "$SERVER_PID" 2>/dev/null && [[ "$(health)" == *'"SERVING"'* ]]; then
  echo "ok   samplerd still SERVING after the kits"
else
  fail "samplerd no longer serving"; tail -n 40 "$LOG"
fi
if [ "$failed" -ne 0 ]; then
  tail -n 20 "$LOG"
  echo "clients.sh: $failed failure(s)"
  exit 1
fi
echo "clients.sh: all client kits passed (${KITS[*]})"
