#!/usr/bin/env bash
# Stale citations in the documentation: every repository path cited in
# docs/*.md, README.md and the folders' READMEs must exist, and every
# `Type::function`, `module::function` and `file.rs::function` named in
# docs/ARCHITECTURE.md must be defined. The rules, and the few paths that
# are not in the repository by design, are in docs_check.py beside this
# script. Prints each stale citation as FILE:LINE; takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 scripts/ci/docs_check.py
