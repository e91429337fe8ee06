#!/usr/bin/env bash
# loom model of the pin protocol: every interleaving (bounded preemption) of
# acquire / release / retire / teardown wait / RetireSignal from another thread.
set -euo pipefail
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target-loom cargo test --locked --release -p memgov-sync --test loom -- --nocapture --test-threads=1
