#!/usr/bin/env bash
# The inner loop: what to run before a commit. A few minutes from a warm
# build on a 2-core machine; installs nothing (scripts/test.sh, the whole
# suite, installs what the matrix needs and runs everything else: loom, Miri,
# the fault matrix on every backend, sanitizers, soaks, ONNX Runtime, the
# benches in smoke mode).
#
#   bash scripts/check.sh
#
# Runs: rustfmt; clippy on every crate with every backend compiled in; the
# tests of the default members (the governor, the host and null backends, the
# conformance suite on them, the tool, the C ABI); the CUDA tests on their
# stand-in driver; the HIP tests on theirs when ROCm's header is installed;
# the Vulkan tests when a Vulkan driver (lavapipe) is installed. What cannot
# run here says `skipped: <why>`.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
start=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - start ))s)"; }

step "rustfmt"
if cargo fmt --version >/dev/null 2>&1; then cargo fmt --all -- --check; else echo "skipped: rustfmt is not installed"; fi

step "clippy (every crate, every backend compiled in)"
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --locked --workspace --all-targets --features serde,tracing,vulkan,cuda,hip -- -D warnings
else
    echo "skipped: clippy is not installed"
fi

step "tests: the default members (governor, host, null, conformance, tool, C ABI)"
cargo test --locked

step "tests: CUDA on its stand-in driver"
if command -v "${CC:-cc}" >/dev/null; then
    LD_LIBRARY_PATH="$(backends/stand-ins/build.sh cuda)" cargo test --locked -p memgov-cuda --test cuda
else
    echo "skipped: no C compiler to build the CUDA stand-in"
fi

step "tests: HIP on its stand-in runtime"
if [ -f "${HIP_PATH:-/usr}/include/hip/hip_runtime_api.h" ]; then
    LD_LIBRARY_PATH="$(backends/stand-ins/build.sh hip)" cargo test --locked -p memgov-hip --test hip
else
    echo "skipped: ROCm's HIP header is not installed (Debian's libamdhip64-dev; scripts/test.sh installs it)"
fi

step "tests: Vulkan on lavapipe"
if ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    cargo test --locked -p memgov-vulkan --test vulkan
else
    echo "skipped: no lavapipe Vulkan driver (Debian's mesa-vulkan-drivers; scripts/test.sh installs it)"
fi

step "done"
echo "memgov check: all steps passed in $(( $(date +%s) - start ))s"
