#!/usr/bin/env bash
# State-machine property tests against a reference model; thousands of cases.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
PROPTEST_CASES="${PROPTEST_CASES:-10000}" release_test --test properties -- --nocapture
# Tiers against their own model (device and pinned host limits, pinned bytes
# never on the device budgets, every byte back): 10 to 25 s in release.
PROPTEST_CASES="${PROPTEST_TIERS_CASES:-10000}" release_test --test properties_tiers -- --nocapture
# The budget tree (process → devices → contexts) against its model; ~15 s.
PROPTEST_CASES="${PROPTEST_TREE_CASES:-10000}" release_test --test properties_tree -- --nocapture
# The block cache against its own model (about 25 s at 10000 cases).
PROPTEST_CASES="${PROPTEST_CASES_CACHE:-10000}" release_test --test properties_cache -- --nocapture
