#!/usr/bin/env bash
# Benches in smoke mode: prove they build and run; nothing asserts times.
set -euo pipefail
cargo bench --locked --bench overhead --bench scaling --bench teardown --bench heap -- --test
cargo bench --locked --bench table -- --quick
cargo run --locked --release -- bench --quick
