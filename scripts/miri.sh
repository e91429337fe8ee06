#!/usr/bin/env bash
# Run the core's unit tests (pin counter, notifier, budgets, fault plans,
# context/pin types) under Miri. Needs a nightly toolchain with the `miri`
# and `rust-src` components:  rustup component add --toolchain nightly miri rust-src
#
# Not run under Miri (reason): the integration tests in tests/ drive the host
# backend, whose stream workers are OS threads blocking in channels and
# condition variables for seconds of wall time -- Miri runs them, but ~1000x
# slower than native, far beyond any CI budget; the loom target needs
# --cfg loom; the soak uses a custom global allocator and millions of cycles.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target-miri}"
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-strict-provenance}"
cargo +nightly miri test --lib "$@"
