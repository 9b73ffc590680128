#!/usr/bin/env bash
# Proto checks with buf (buf.yaml at the repository root): the API compiles,
# follows buf's STANDARD lint rules (with the exceptions listed in
# buf.yaml), is formatted as `buf format` writes it, and has no breaking
# change against the API as released at BASELINE (wire, JSON and
# generated-code compatibility: buf's FILE rules).
#
# buf comes from npm (@bufbuild/buf ships the binary), pinned to
# BUF_VERSION and installed once into $SAMPLERD_BUF_HOME (default
# ~/.cache/samplerd/buf), outside the checkout; a warm run takes a second.
set -euo pipefail
cd "$(dirname "$0")/../.."

BUF_VERSION=1.75.0

# The released API: `buf breaking` compares proto/ with proto/ as of this
# commit, the one that gave the files their per-language package options
# (go_package, java_package, ...). The commit before it (cbff4e4) has the
# same services, messages and fields without the options, and buf's FILE
# rules rightly count setting them as a change to those languages'
# generated code: that one deliberate change is the starting point. There
# are no release tags; when a release is cut, move BASELINE to its commit
# (a full 40-digit id from the main history). Never move it to get past a
# failing check: that failure is a change that breaks existing clients. If
# this commit is rewritten away (its branch rebased or squashed), use the
# commit that carries the same proto/.
BASELINE=3370478c6b9fc80a2a9adf2d8fcc8fa7d882077d

BUF_HOME=${SAMPLERD_BUF_HOME:-$HOME/.cache/samplerd/buf}
BUF_DIR="$BUF_HOME/$BUF_VERSION"
# npm's launcher picks the platform's binary (@bufbuild/buf-<os>-<arch>).
BUF="$BUF_DIR/node_modules/.bin/buf"

if [ "$("$BUF" --version 2>/dev/null || true)" != "$BUF_VERSION" ]; then
  if ! command -v npm >/dev/null; then
    echo "proto: npm is needed to install buf $BUF_VERSION (@bufbuild/buf)" >&2
    exit 1
  fi
  echo "proto: installing buf $BUF_VERSION into $BUF_DIR (first run only)"
  rm -rf "$BUF_DIR.partial"
  # Install scripts are not needed (the binary comes with the platform
  # package) and not run; installed beside, then moved, so an interrupted
  # install is never taken for a finished one.
  timeout 600 npm install --prefix "$BUF_DIR.partial" --no-save --no-audit \
    --no-fund --ignore-scripts "@bufbuild/buf@$BUF_VERSION"
  rm -rf "$BUF_DIR"
  mv "$BUF_DIR.partial" "$BUF_DIR"
  actual=$("$BUF" --version)
  if [ "$actual" != "$BUF_VERSION" ]; then
    echo "proto: installed buf reports version $actual, expected $BUF_VERSION" >&2
    exit 1
  fi
fi

echo "proto: buf $BUF_VERSION"
timeout 120 "$BUF" build
timeout 120 "$BUF" lint
timeout 120 "$BUF" format --diff --exit-code

# The baseline must be in this clone, and in the history of what is being
# checked: a shallow clone, or a baseline that is no longer in the history,
# is an error (a skipped check would pass every breaking change).
if ! git cat-file -e "$BASELINE^{commit}" 2>/dev/null; then
  echo "proto: baseline commit $BASELINE (BASELINE in $0) is not in this clone." >&2
  echo "proto: buf breaking needs the full history: run \`git fetch --unshallow\` (a shallow CI" >&2
  echo "proto: clone), or, if the commit was rewritten away, set BASELINE to the commit of the" >&2
  echo "proto: main history that carries the released proto/." >&2
  exit 1
fi
if ! git merge-base --is-ancestor "$BASELINE" HEAD; then
  echo "proto: baseline commit $BASELINE (BASELINE in $0) is not an ancestor of HEAD:" >&2
  echo "proto: it must be a commit of the history this tree was built on." >&2
  exit 1
fi
echo "proto: buf breaking against $BASELINE"
timeout 300 "$BUF" breaking proto --against ".git#ref=$BASELINE,subdir=proto"
echo "proto: lint, format and breaking checks passed"
