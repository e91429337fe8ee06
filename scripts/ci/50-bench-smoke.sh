#!/usr/bin/env bash
# Benches in smoke mode: prove they build and run; nothing asserts times.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
release_bench --bench scaling -- --test
release_bench --bench overhead --bench teardown --bench heap -- --test
release_bench --bench table -- --quick
cargo run --locked --release -p memgov-cli -- bench --quick
