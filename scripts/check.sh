#!/usr/bin/env bash
# The inner loop, `cargo xtask check` (CONTRIBUTING.md): rustfmt, clippy on
# every crate with every backend compiled in, and the tests of every crate
# that needs no GPU driver. Under three minutes from a warm build on a 2-core
# machine; installs nothing; a step that cannot run says `skipped: <why>`.
# The other tiers: `cargo xtask gpu <backend>` (a backend on its GPU or its
# stand-in), `cargo xtask loom`, `cargo xtask miri`, `cargo xtask test` (the
# whole suite on a prepared machine).
#
#   bash scripts/check.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec cargo xtask check "$@"
