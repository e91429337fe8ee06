#!/usr/bin/env bash
# Benches in smoke mode: prove they build and run; nothing asserts times.
set -euo pipefail
cargo bench --locked -p memgov --bench scaling -- --test
cargo bench --locked -p memgov-cli --bench overhead --bench teardown --bench heap -- --test
cargo bench --locked -p memgov-cli --bench table -- --quick
cargo run --locked --release -p memgov-cli -- bench --quick
