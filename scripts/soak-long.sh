#!/usr/bin/env bash
# The long soak: 100 million allocate/release cycles (about 2-3 minutes on 2
# cores) over 4 threads x 2 streams with random retires and device swaps.
# Override with SOAK_CYCLES / SOAK_THREADS / SOAK_SEED.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target-rel}"
SOAK_CYCLES="${SOAK_CYCLES:-100000000}" SOAK_THREADS="${SOAK_THREADS:-4}" \
  cargo test --release -p memgov --test soak -- --nocapture "$@"
