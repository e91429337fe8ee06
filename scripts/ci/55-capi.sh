#!/usr/bin/env bash
# The C ABI (capi/, package memgov-capi): the header compiled as C11 and
# C++17 with warnings as errors, the ABI layout test (every struct's size and
# offsets, every constant, every exported function against memgov.h), the C
# API tests from C and from Rust (bad handles, double releases, calls after
# retire, the PyTorch and OrtAllocator entry points), and the example plugin
# loaded by a C host that is refused unload until nothing is outstanding:
# plain, under AddressSanitizer and under valgrind. Then the allocator entry
# points, a plugin and a teardown from C, and the example plugin again, with
# the CUDA and the HIP backend compiled in, on their stand-in drivers and
# (skipping) without; and clippy.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
# A C++ compiler for the C++17 header check; valgrind for the plugin test.
command -v c++ >/dev/null || apt_install g++
command -v valgrind >/dev/null || apt_install valgrind || echo "valgrind not installable: its test will print skipped"

log=target/capi.log
echo "--- memgov-capi tests (host and null backends)"
# cargo keeps one unhashed cdylib per profile; rebuild it for this feature set.
touch capi/src/lib.rs
cargo test --locked -p memgov-capi -- --nocapture 2>&1 | tee "$log"
grep -q "memgov.h: C11 -Wall -Wextra -Wpedantic -Werror: ok" "$log"
grep -q "memgov.h: C++17 -Wall -Wextra -Wpedantic -Werror: ok" "$log"
grep -q "ABI layout: 7 structs, .* agree" "$log"
grep -q "memgov.h declares the .* functions the library exports" "$log"
[ "$(grep -c "api: all checks passed" "$log")" -eq 2 ] || { echo "FAILED: the C API test did not pass plain and under ASan"; exit 1; }
[ "$(grep -c "host: all checks passed" "$log")" -ge 2 ] || { echo "FAILED: the plugin test did not pass plain and under ASan"; exit 1; }
grep -q "asan: clean" "$log"
grep -Eq "valgrind: clean|skipped: valgrind" "$log"

echo "--- memgov-capi with the CUDA backend on the stand-in libcuda"
standins="$(backends/stand-ins/build.sh cuda)"
touch capi/src/lib.rs
LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -p memgov-capi --features cuda --test c_gpu --test c_api --test header -- --nocapture 2>&1 | tee target/capi-cuda.log
grep -q "gpu: cuda: torch pair, OrtAllocator, plugin, record_stream: 5 releases retired" target/capi-cuda.log
grep -q "plugin on the cuda stand-in: ok" target/capi-cuda.log
LD_LIBRARY_PATH="" cargo test --locked -p memgov-capi --features cuda --test c_gpu -- --nocapture 2>&1 | tee target/capi-cuda-absent.log
grep -q "skipped: cuda: .*no CUDA driver" target/capi-cuda-absent.log

echo "--- memgov-capi with the HIP backend on the stand-in libamdhip64"
apt_install libamdhip64-dev
standins="$(backends/stand-ins/build.sh hip)"
touch capi/src/lib.rs
LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -p memgov-capi --features hip --test c_gpu -- --nocapture 2>&1 | tee target/capi-hip.log
grep -q "gpu: hip: torch pair, OrtAllocator, plugin, record_stream: 5 releases retired" target/capi-hip.log
grep -q "plugin on the hip stand-in: ok" target/capi-hip.log
LD_LIBRARY_PATH="" cargo test --locked -p memgov-capi --features hip --test c_gpu -- --nocapture 2>&1 | tee target/capi-hip-absent.log
grep -Eq "skipped: hip: .*no HIP (device|runtime)" target/capi-hip-absent.log
# Leave the library of the default features in place for whoever runs next.
touch capi/src/lib.rs

echo "--- clippy (memgov-capi)"
cargo clippy --locked -p memgov-capi --all-targets --no-deps -- -D warnings
cargo clippy --locked -p memgov-capi --all-targets --no-deps --features cuda,hip,vulkan -- -D warnings
