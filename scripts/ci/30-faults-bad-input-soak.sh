#!/usr/bin/env bash
# Fault-injection matrix (every operation x every fault kind), bad input, and
# the short soak (1,000,000 cycles; `scripts/soak-long.sh` runs the long one).
set -euo pipefail
cargo test --locked --release -p memgov --test fault_matrix -- --nocapture --test-threads=1
cargo test --locked --release -p memgov --test bad_input
cargo test --locked --release -p memgov --test soak -- --nocapture
