#!/usr/bin/env bash
# The whole test suite, from a clean clone on a fresh Debian machine (root).
# Installs what the cross-vendor matrix needs when it is missing (Mesa's
# lavapipe, the Vulkan loader and the Khronos validation layers), then runs:
# unit, integration and doc tests; the conformance matrix on every backend
# present; the reliability suites (loom, properties, fault matrix, bad input,
# short soak); and the benches in smoke mode. Prints which backends ran on
# real hardware, on software drivers, on stand-ins, or embedded.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ensure_rust
apt_install mesa-vulkan-drivers libvulkan1 vulkan-validationlayers

export CARGO_TERM_COLOR=never
export RUST_BACKTRACE=1
start=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - start ))s)"; }

step "build (default features; library without default features)"
cargo build --locked --all-targets
cargo build --locked --lib --no-default-features

step "lints: rustfmt and clippy (every feature)"
if cargo fmt --version >/dev/null 2>&1; then cargo fmt --all -- --check; else echo "skipped: rustfmt is not installed"; fi
if cargo clippy --version >/dev/null 2>&1; then
    features=serde,tracing
    [ -f backends/vulkan/mod.rs ] && features=$features,vulkan
    cargo clippy --locked --all-targets --features "$features" -- -D warnings
else
    echo "skipped: clippy is not installed"
fi

step "tests: host backend, governor, conformance, doc tests"
cargo test --locked
cargo test --locked --features serde,tracing --test governor

if [ -f backends/vulkan/mod.rs ]; then
    step "tests: Vulkan backend on lavapipe with validation layers"
    cargo test --locked --features vulkan --test vulkan
    cargo test --locked --release --features vulkan --test fault_matrix -- --nocapture --test-threads=1
    cargo test --locked --release --features vulkan --test soak_vulkan -- --nocapture
    cargo bench --locked --features vulkan --bench vulkan_cycle -- --test
fi

for s in scripts/ci/*.sh; do
    [ -e "$s" ] || continue
    step "reliability/perf: $s"
    bash "$s"
done

step "memgov check (every backend compiled in)"
if [ -f backends/vulkan/mod.rs ]; then
    cargo run --locked --release --features vulkan -- check
else
    cargo run --locked --release -- check
fi

step "done"
echo "memgov test suite: all steps passed in $(( $(date +%s) - start ))s"
