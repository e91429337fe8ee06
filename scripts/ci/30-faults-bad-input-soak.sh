#!/usr/bin/env bash
# Fault-injection matrix (every operation x every fault kind), bad input, and
# the short soak (1,000,000 cycles; `scripts/soak-long.sh` runs the long one).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
MEMGOV_FAULT_MATRIX_BACKENDS=host,null release_test --test fault_matrix -- --nocapture --test-threads=1
release_test --test bad_input
release_test --test soak -- --nocapture
