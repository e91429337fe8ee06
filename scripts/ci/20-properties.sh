#!/usr/bin/env bash
# State-machine property tests against a reference model; thousands of cases.
set -euo pipefail
PROPTEST_CASES="${PROPTEST_CASES:-10000}" cargo test --locked --release -p memgov --test properties -- --nocapture
# The block cache against its own model (about 25 s at 10000 cases).
PROPTEST_CASES="${PROPTEST_CASES_CACHE:-10000}" cargo test --locked --release -p memgov --test properties_cache -- --nocapture
