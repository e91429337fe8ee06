#!/usr/bin/env bash
# The main job: build memgov, run the conformance matrix on every backend
# compiled in (the embedded host backend at least), then a serving-style
# workload on the host backend. Exits non-zero if anything fails.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ensure_rust
cargo build --release --locked -p memgov-cli
# Through cargo, which knows where the binary is (CARGO_TARGET_DIR, a
# build.target-dir in a cargo config); the build above makes these no-ops.
cargo run --release --locked --quiet -p memgov-cli -- check
cargo run --release --locked --quiet -p memgov-cli -- run
