#!/usr/bin/env bash
# Builds the Go kit in GOPATH mode from Debian's Go packages (no module
# downloads): generates the proto's Go code into a scratch GOPATH, copies the
# kit beside it, vets and builds it, and runs its tests when SAMPLERD_ADDR
# names a server.
#
#   clients/go/build.sh [GOPATH_DIR]      (default: clients/go/build, kept)
#
# The example binary is GOPATH_DIR/bin/samplerd-example.
#
# Needs: golang-go, protobuf-compiler, protoc-gen-go, protoc-gen-go-grpc,
# golang-google-grpc-dev, golang-google-protobuf-dev,
# golang-google-genproto-dev, golang-github-golang-protobuf-1-5-dev.
set -euo pipefail
KIT="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$KIT/../.." && pwd)"
WORK="$(mkdir -p "${1:-$KIT/build}" && cd "${1:-$KIT/build}" && pwd)"
# The Debian packages install their sources under /usr/share/gocode.
SYSTEM_GOPATH="${SYSTEM_GOPATH:-/usr/share/gocode}"
# GOFLAGS is cleared: module flags (-mod=...) are errors in GOPATH mode.
export GO111MODULE=off GOPATH="$WORK:$SYSTEM_GOPATH" GOFLAGS=

GEN_PKG=github.com/samplerd/samplerd/gen/go/samplerd/v1
KIT_PKG=github.com/samplerd/samplerd/clients/go
# The M mapping gives the proto its Go package whether or not the proto
# declares `option go_package` (when it does, the two agree).
M="Msamplerd/v1/sampler.proto=$GEN_PKG;samplerdv1"
mkdir -p "$WORK/src"
protoc -I "$ROOT/proto" \
  --go_out="$WORK/src" --go_opt="$M" \
  --go-grpc_out="$WORK/src" --go-grpc_opt="$M" \
  samplerd/v1/sampler.proto
mkdir -p "$WORK/src/$KIT_PKG"
cp -r "$KIT/samplerdclient" "$KIT/cmd" "$WORK/src/$KIT_PKG/"
# The kit embeds the service config shared by every kit.
cp "$ROOT/clients/service-config.json" "$WORK/src/$KIT_PKG/samplerdclient/"

cd "$WORK/src/$KIT_PKG"
go vet ./...
go build -o "$WORK/bin/samplerd-example" ./cmd/samplerd-example
echo "go kit: built $WORK/bin/samplerd-example"
if [ -n "${SAMPLERD_ADDR:-}" ]; then
  # grpc-go 1.33 retries only when asked (1.40+ always does).
  GRPC_GO_RETRY=on go test -count=1 -v ./samplerdclient/
fi
