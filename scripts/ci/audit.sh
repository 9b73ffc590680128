#!/usr/bin/env bash
# Dependency audit with cargo-deny and deny.toml: licenses, bans and
# sources, all offline. `--advisories` adds the RustSec advisory check,
# which needs GitHub (unreachable from this project's machines; see
# docs/RELIABILITY.md, "Dependency audit").
#
# cargo-deny is built once from crates.io into $SAMPLERD_TOOLS (default
# ~/.cache/samplerd/cargo-tools) and reused; a warm run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."

DENY_VERSION=0.20.2
TOOLS=${SAMPLERD_TOOLS:-$HOME/.cache/samplerd/cargo-tools}
DENY="$TOOLS/bin/cargo-deny"

if ! "$DENY" --version 2>/dev/null | grep -qF "$DENY_VERSION"; then
  echo "audit: installing cargo-deny $DENY_VERSION into $TOOLS (first run only; ~10 min on 2 cores)"
  # No default features: the native-certs/git backends are not needed for
  # offline checks.
  timeout 2400 cargo install cargo-deny --version "$DENY_VERSION" --locked \
    --no-default-features --root "$TOOLS"
fi

checks=(licenses bans sources)
if [ "${1:-}" = "--advisories" ]; then
  checks=(advisories "${checks[@]}")
fi
# `cargo deny` resolves metadata through cargo (the registry cache when
# warm); bounded in time like every CI step.
PATH="$TOOLS/bin:$PATH" timeout 600 cargo deny check "${checks[@]}"
