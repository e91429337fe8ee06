#!/usr/bin/env bash
# wgpu on governed memory: the memgov-wgpu crate (its own workspace: wgpu
# needs Rust 1.90) on Mesa's lavapipe with the Khronos validation layer on.
# First the Vulkan backend's tests of what the crate needs (adoption without
# queues, with the conformance suite on such devices). Then the crate's
# tests: buffers governed and charged, released only after wgpu's last
# submission using them (a compute pass held in flight by a semaphore only
# the test signals; the planted early release is
# reported by the layer), new buffers zero-filled on both paths (the
# device-local one, a fill on wgpu's queue, forced on lavapipe with odd
# sizes and STORAGE-only usage: the previous holder's bytes never show),
# budget refusals as errors (mapped to wgpu's error scopes), teardown in
# both orders, wgpu-core's own timestamp-normalization kernel (unchanged)
# and a tiled matmul bit for bit against wgpu's own allocator, budget
# sweeps; the live device swap 20 runs in a row; the bench once, in test
# mode and in the test build (no optimized build: it checks that the bench
# runs and both allocators agree; its ratios are measured with `cargo
# bench`).
#
# Fails on a test that skips (lavapipe and the layer are installed here), on
# any validation message, and when no test ran on the software driver.
# About 4 minutes from a cold build on two cores (3 of them clippy and the
# test build), under 30 s warm.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust

crate=wgpu/Cargo.toml
dir="$(cargo_target_dir)/wgpu-ci"
mkdir -p "$dir"

rust_minor=$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')
if [ "$rust_minor" -lt 90 ]; then
    echo "skipped: memgov-wgpu needs Rust >= 1.90 (wgpu 30); this machine has $(rustc --version)"
    exit 0
fi
apt_install mesa-vulkan-drivers libvulkan1 vulkan-validationlayers

# What the crate needs of the Vulkan backend: adoption without queues (the
# conformance suite on such devices), the after-teardown hook, the messenger
# on a runtime's instance.
cargo test --locked -p memgov-vulkan --test adopt -- --nocapture 2>&1 | tee "$dir/adopt.log"
if grep -q 'skipped:' "$dir/adopt.log"; then
    echo "FAILED: the Vulkan backend's adoption tests skipped although lavapipe and the validation layer are installed"
    exit 1
fi

if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --manifest-path "$crate" -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --locked --manifest-path "$crate" --all-targets -- -D warnings
fi

cargo test --locked --manifest-path "$crate" -- --nocapture 2>&1 | tee "$dir/test.log"
if grep -q 'skipped:' "$dir/test.log"; then
    echo "FAILED: a memgov-wgpu test skipped although lavapipe and the validation layer are installed"
    exit 1
fi
if grep -q 'memgov vulkan validation:' "$dir/test.log"; then
    echo "FAILED: the validation layer spoke (lines above)"
    exit 1
fi
ran=$(grep -c '^wgpu on memgov vulkan: .*(software driver), validation layer on: 0 validation messages' "$dir/test.log" || true)
if [ "$ran" -eq 0 ]; then
    echo "FAILED: no memgov-wgpu test reported a device on the software driver"
    exit 1
fi

passed=0
for run in $(seq 20); do
    if cargo test --locked --quiet --manifest-path "$crate" --test wgpu -- --exact live_device_swap_moves_the_workload_bit_for_bit >"$dir/swap-$run.log" 2>&1; then
        passed=$((passed + 1))
    else
        cat "$dir/swap-$run.log"
        echo "FAILED: the live device swap failed on run $run"
        exit 1
    fi
done

cargo test --locked --manifest-path "$crate" --bench governed_vs_wgpu 2>&1 | tee "$dir/bench.log"
grep -q '^matmul .* ratio' "$dir/bench.log" || { echo "FAILED: the bench printed no ratio"; exit 1; }

adapter=$(sed -n 's/^wgpu on memgov vulkan: \(.*\) (software driver).*/\1/p' "$dir/test.log" | head -n 1)
echo "memgov-wgpu: vulkan on the software driver ($adapter), validation layer on: $ran devices with 0 validation messages; live device swap $passed/20 runs passed"
