#!/usr/bin/env bash
# The HIP backend (feature `hip`): build the stand-in libamdhip64.so.5, run
# the HIP tests (conformance on the pool and on the hipMalloc fallback,
# retirement, device loss, pool trim, planted violations, soak) and the HIP
# row of the fault matrix on it; clippy with the feature; then the same tests
# once against Debian's real ROCm runtime, which on a machine without an AMD
# GPU must skip cleanly ("skipped: no HIP device") and pass.
#
# hip-sys's build script needs ROCm's headers and links libamdhip64 at build
# time: Debian's libamdhip64-dev (ROCm 5.2.3) provides both under /usr.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
apt_install libamdhip64-dev
export HIP_PATH=/usr

standins="$(backends/stand-ins/build.sh hip)"
on_stand_in() {
    LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}

echo "--- HIP tests on the stand-in ($standins/libamdhip64.so.5)"
on_stand_in cargo test --locked --features hip --test hip -- --nocapture 2>&1 | tee target/hip-stand-in.log
grep -q "on memgov stand-in HIP device 0 (libamdhip64.so.5 imitation) (stand-in)" target/hip-stand-in.log
grep -q "soak: hip, " target/hip-stand-in.log
# The conformance cases again with every queued operation delayed, so that
# releases really pend when the governor drains and tears down.
MEMGOV_STANDIN_HIP_LATENCY_US=300 on_stand_in cargo test --locked --features hip --test hip -- hip_pool:: hip_plain::
on_stand_in cargo test --locked --release --features hip --test fault_matrix -- --nocapture --test-threads=1 2>&1 | tee target/hip-fault-matrix.log
grep -q "fault matrix: hip: 38 tried, 38 survived" target/hip-fault-matrix.log

echo "--- clippy with the hip feature"
cargo clippy --locked --features hip --all-targets -- -D warnings

echo "--- HIP tests against the real runtime (/usr/lib/x86_64-linux-gnu/libamdhip64.so.5)"
cargo test --locked --features hip --test hip -- --nocapture 2>&1 | tee target/hip-real.log
if grep -q "skipped: no HIP device" target/hip-real.log; then
    echo "real runtime: skipped: no HIP device (no AMD GPU on this machine), exit 0"
else
    echo "real runtime: an AMD GPU answered; the HIP tests above ran on it"
fi
