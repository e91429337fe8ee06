#!/usr/bin/env bash
# The main job: build memgov, run the conformance matrix on every backend
# compiled in (the embedded host backend at least), then a serving-style
# workload on the host backend. Exits non-zero if anything fails.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ensure_rust
cargo build --release --locked
./target/release/memgov check
./target/release/memgov run
