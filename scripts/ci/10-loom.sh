#!/usr/bin/env bash
# loom model of the pin protocol: every interleaving (bounded preemption) of
# acquire / release / retire / teardown wait / RetireSignal from another thread.
# Each model explores its interleavings on one thread; two models run at a
# time, one per core (each prints its line whole when it ends, and the last
# line's running total counts every model).
set -euo pipefail
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target-loom cargo test --locked --release -p memgov-sync --test loom -- --nocapture --test-threads="${LOOM_TEST_THREADS:-2}"
