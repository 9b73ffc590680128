#!/usr/bin/env bash
# Fleet test: samplerd as Kubernetes runs it — replicas behind a real gRPC
# balancer and behind client-side round-robin, killed, restarted, drained,
# joined and cut off under mixed load, with nothing lost.
#
# Topology (all on real addresses, every packet crossing a veth and a
# Linux bridge; nothing on loopback):
#
#   netns hub     bridge br0 (no address: a switch)
#   netns r1..r4  one samplerd each on 10.77.0.11..14:50051 (metrics :9090);
#                 r4 joins later
#   netns lb      HAProxy (Debian package; `proto h2` both sides, per-request
#                 round-robin over r1..r4) on 10.77.0.2:50051
#   netns client  the driver (tests/fleet/driver.py, grpcio from the venv,
#                 clients/service-config.json): clients through the
#                 balancer, and clients balancing themselves (round_robin
#                 over the name `samplerd-fleet`, which the client netns'
#                 own /etc/hosts resolves to the replicas, as a headless
#                 Service's DNS does)
#
# The replicas serve plaintext on non-loopback addresses, which samplerd
# refuses unless told: their config sets `tls.allow_insecure = true` (as
# the Kubernetes ConfigMap does, where a mesh adds mTLS). They run with a
# short maximum connection age (3 s, grace 4 s) so a joining replica is
# found within seconds.
#
# Scenarios, each under mixed load (Sample, SampleStream, SampleBatchStream,
# Generate) from both kinds of client — see tests/fleet/driver.py. Prints a
# table and exits non-zero if any call failed or any result differed.
#
#   scripts/fleet-test.sh
#
# Needs root (or passwordless sudo) for network namespaces, and installs
# HAProxy (and iproute2) with apt-get when missing. Where the machine
# cannot do it — no root, a container without the right to create network
# namespaces and veth pairs, no HAProxy and no way to install it — it says
# why and exits 77 (skipped; scripts/test.sh lists skipped suites apart);
# FLEET_REQUIRED=1 makes that a failure. Everything else missing (the
# binaries, the model, the venv) is a failure. The whole run is bounded by
# FLEET_TIMEOUT_S (420 s; the scenarios take about a minute).
#
# SAMPLERD_BIN, SAMPLERD_PLUGIN, SAMPLERD_MODEL and SAMPLERD_VENV as in
# scripts/test.sh. KEEP_LOGS=DIR keeps the replicas' and HAProxy's logs.
# Namespaces, processes and files are removed on every exit path.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="$(realpath -m "${SAMPLERD_BIN:-$ROOT/target/release/samplerd}")"
PLUGIN="$(realpath -m "${SAMPLERD_PLUGIN:-$(dirname "$BIN")/libsamplerd_core_stages.so}")"
MODEL="$(realpath -m "${SAMPLERD_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}")"
VENV="${SAMPLERD_VENV:-$HOME/.cache/samplerd/venv}"
PY="$VENV/bin/python"
# The driver's whole run: starting the replicas, the scenarios (about a
# minute) and the replicas' stop.
FLEET_TIMEOUT_S="${FLEET_TIMEOUT_S:-420}"

# What the machine cannot do is a skip (exit 77), unless FLEET_REQUIRED=1.
skip() {
  if [ "${FLEET_REQUIRED:-0}" = 1 ]; then
    echo "fleet-test: FAILED: $* (FLEET_REQUIRED=1)" >&2
    exit 1
  fi
  echo "fleet-test: SKIPPED: $*"
  exit 77
}

for f in "$BIN" "$PLUGIN" "$MODEL"; do
  [ -f "$f" ] || { echo "fleet-test: missing $f (cargo build --release; scripts/fetch-model.sh)" >&2; exit 2; }
done
case "$PLUGIN$MODEL" in *"'"*) echo "fleet-test: a path with a quote: $PLUGIN $MODEL" >&2; exit 2 ;; esac
"$PY" -c 'import grpc, grpc_tools, grpc_status, numpy' \
  || { echo "fleet-test: the venv at $VENV lacks grpcio (scripts/setup-python.sh)" >&2; exit 2; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  sudo -n true 2>/dev/null || skip "network namespaces need root or passwordless sudo"
  SUDO="sudo -n"
fi

# --- packages: HAProxy, iproute2 ------------------------------------------
missing=()
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || missing+=(iproute2)
if [ "${#missing[@]}" -ne 0 ]; then
  command -v apt-get >/dev/null 2>&1 || skip "no ${missing[*]} and no apt-get to install it"
  echo "fleet-test: installing ${missing[*]}"
  apt_install() { timeout 300 $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; }
  # Only when an install fails for want of package lists, fetch them.
  apt_install || { timeout 300 $SUDO apt-get update && apt_install; } \
    || skip "could not install ${missing[*]} with apt-get (no package source reachable?)"
fi
export PATH="$PATH:/usr/sbin:/sbin"
HAPROXY="$(command -v haproxy)"

# Can this machine make a network namespace with a veth in it (a container
# without CAP_SYS_ADMIN and CAP_NET_ADMIN cannot)? A throwaway one, named
# for this run, says.
PROBE="sdf$$-probe"
if ! { $SUDO ip netns add "$PROBE" \
  && $SUDO ip -n "$PROBE" link add probe0 type veth peer name probe1; } >/dev/null 2>&1; then
  $SUDO ip netns del "$PROBE" >/dev/null 2>&1 || true
  skip "this machine may not create network namespaces and veth pairs (ip netns add / ip link add failed)"
fi
$SUDO ip netns del "$PROBE"

# --- namespaces -----------------------------------------------------------
# Names carry this run's pid, so concurrent runs do not collide.
ID="$$"
P="sdf$ID"
HUB="$P-hub"; LB="$P-lb"; CLIENT="$P-client"
REPLICAS=(r1 r2 r3 r4)
WORK="$(mktemp -d)"
HAPROXY_PID=""
created=()

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [ -n "$HAPROXY_PID" ] && kill "$HAPROXY_PID" 2>/dev/null || true
  for ns in "${created[@]}"; do
    # Whatever still runs in a namespace (replicas the driver left, HAProxy).
    for pid in $($SUDO ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  done
  for ns in "${created[@]}"; do $SUDO ip netns del "$ns" 2>/dev/null || true; done
  $SUDO rm -rf "/etc/netns/$CLIENT"
  if [ -n "${KEEP_LOGS:-}" ]; then mkdir -p "$KEEP_LOGS" && cp "$WORK"/*.log "$KEEP_LOGS"/ 2>/dev/null || true; fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
# A killed run still cleans up: exit through the EXIT trap.
trap 'exit 130' INT
trap 'exit 143' TERM

netns() { $SUDO ip netns add "$1"; created+=("$1"); $SUDO ip -n "$1" link set lo up; }
netns "$HUB"
$SUDO ip -n "$HUB" link add br0 type bridge
$SUDO ip -n "$HUB" link set br0 up
# attach NS IP: a veth from NS (eth0, IP/24) to the hub's bridge (its hub
# end named v<pid><n>: interface names have at most 15 characters).
ports=0
attach() {
  local ns=$1 ip=$2 port="v$ID$ports"
  ports=$((ports + 1))
  $SUDO ip link add "$port" netns "$HUB" type veth peer name eth0 netns "$ns"
  $SUDO ip -n "$HUB" link set "$port" master br0 up
  $SUDO ip -n "$ns" addr add "$ip/24" dev eth0
  $SUDO ip -n "$ns" link set eth0 up
}
netns "$LB"; attach "$LB" 10.77.0.2
netns "$CLIENT"; attach "$CLIENT" 10.77.0.3
i=11
for r in "${REPLICAS[@]}"; do
  netns "$P-$r"; attach "$P-$r" "10.77.0.$i"; i=$((i + 1))
done

# The clients' name for the fleet (the headless Service's DNS answer): the
# client netns gets its own /etc/hosts (ip netns exec mounts it), which the
# driver rewrites as replicas join.
$SUDO mkdir -p "/etc/netns/$CLIENT"
printf '127.0.0.1 localhost\n' | $SUDO tee "/etc/netns/$CLIENT/hosts" >/dev/null

# --- the balancer ---------------------------------------------------------
# HTTP/2 on both sides, each request (gRPC call) balanced on its own. r4 is
# disabled until the driver enables it (through the runtime API) after the
# client-side join check, so the traffic r4 gets first is the clients' own.
# A server that fails its checks, or that the driver takes down, has its
# streams shut (`on-marked-down shutdown-sessions`): the clients resume
# them elsewhere instead of waiting for a dead peer.
cat >"$WORK/haproxy.cfg" <<EOF
global
  maxconn 2000
  stats socket $WORK/haproxy.sock mode 600 level admin
defaults
  mode http
  timeout connect 1s
  timeout client 60s
  timeout server 60s
  retries 2
  option redispatch
  retry-on conn-failure empty-response response-timeout
frontend grpc
  bind 10.77.0.2:50051 proto h2
  default_backend replicas
backend replicas
  balance roundrobin
  default-server proto h2 check inter 300ms fall 2 rise 1 on-marked-down shutdown-sessions
  server r1 10.77.0.11:50051
  server r2 10.77.0.12:50051
  server r3 10.77.0.13:50051
  server r4 10.77.0.14:50051 disabled
EOF
$SUDO ip netns exec "$LB" "$HAPROXY" -f "$WORK/haproxy.cfg" -db >"$WORK/haproxy.log" 2>&1 &
HAPROXY_PID=$!

# --- the driver -----------------------------------------------------------
# No inherited SAMPLERD_* configuration reaches the replicas.
unset_env=()
while IFS= read -r v; do unset_env+=(-u "$v"); done < <(env | sed -n 's/^\(SAMPLERD_[A-Za-z0-9_]*\)=.*/\1/p')
status=0
$SUDO timeout "$FLEET_TIMEOUT_S" ip netns exec "$CLIENT" env "${unset_env[@]}" \
  FLEET_PREFIX="$P" FLEET_WORK="$WORK" FLEET_BIN="$BIN" FLEET_PLUGIN="$PLUGIN" FLEET_MODEL="$MODEL" \
  FLEET_HOSTS="/etc/netns/$CLIENT/hosts" FLEET_HAPROXY_SOCK="$WORK/haproxy.sock" \
  SAMPLERD_PY_GEN_DIR="$WORK/python-gen" GRPC_DNS_RESOLVER=native \
  "$PY" "$ROOT/tests/fleet/driver.py" || status=$?
if [ "$status" -ne 0 ]; then
  for f in "$WORK"/*.log; do echo "--- ${f##*/} (tail)"; tail -n 15 "$f"; done
  echo "fleet-test: FAILED (exit $status)"
  exit "$status"
fi
echo "fleet-test: passed"
