#!/usr/bin/env bash
# State-machine property tests against a reference model; thousands of cases.
# Each file is one property, run on one thread: the four run side by side
# (in_background, scripts/common.sh) from the one release build, made
# first, and their output is printed when all have ended.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
target="$(cargo_target_dir)"
release_test --no-run --test properties --test properties_tiers --test properties_tree --test properties_cache
trap 'wait_background || true' EXIT
property() { # CASES TEST
    PROPTEST_CASES="$1" release_test --test "$2" -- --nocapture
}
# The governor against its model (about 10 s in release at 10000 cases).
in_background "$target/properties.log" property "${PROPTEST_CASES:-10000}" properties
# Tiers against their own model (device and pinned host limits, pinned bytes
# never on the device budgets, every byte back): 10 to 25 s in release.
in_background "$target/properties-tiers.log" property "${PROPTEST_TIERS_CASES:-10000}" properties_tiers
# The budget tree (process → devices → contexts) against its model; ~15 s.
in_background "$target/properties-tree.log" property "${PROPTEST_TREE_CASES:-10000}" properties_tree
# The block cache against its own model (about 25 s at 10000 cases).
in_background "$target/properties-cache.log" property "${PROPTEST_CASES_CACHE:-10000}" properties_cache
wait_background
