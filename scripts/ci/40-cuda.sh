#!/usr/bin/env bash
# The CUDA backend (feature `cuda`): the stand-ins' shared self-test (planted
# stream-ordering violations), build the stand-in libcuda.so.1, run the CUDA
# tests on it (conformance, retirement by host function, device loss by
# sticky error and by an asynchronous fault, teardown order, cross-stream
# ordering, raw-handle refusals, the caller's current context, lost
# teardown, the default pool, planted violations that the stand-in must
# abort on, soak), the whole test file again with every queued operation
# delayed, `memgov check` and `memgov run` with the stand-in's exit check on
# (and a run that fails half-way, which must still tear everything down),
# the CUDA row of the fault matrix and the bench row in smoke mode; clippy
# with the feature; then the tests once WITHOUT the stand-in, which on a
# machine without an NVIDIA driver must skip cleanly and pass. The test
# binaries' runs go side by side in the background (in_background in
# scripts/common.sh) while the release-build checks run.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

echo "--- stand-ins common self-test"
backends/stand-ins/common/selftest.sh

target="$(cargo_target_dir)"
standins="$(backends/stand-ins/build.sh cuda)"
memgov="$(release_memgov)"
on_stand_in() {
    LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}

# The test binaries' runs mostly wait on the stand-in's queued latency and
# on their own timeouts (a run at 2000 us uses a core for about a tenth of
# its time): they are built once, then run side by side in the background
# while the release-build checks below run in the foreground; their logs
# are printed, and grepped, once all have ended.
echo "--- the CUDA test binaries, built once for the runs below"
cargo test --locked --no-run -p memgov-cuda --test cuda --test arena --test capture
trap 'wait_background || true' EXIT

# The CUDA tests on the stand-in ($standins/libcuda.so.1), printing what
# each case saw; the arena, sleep/wake and the stand-in's VMM rules; graph
# capture on the arena, the gate, and the stand-in's capture rules.
in_background "$target/cuda-stand-in.log" on_stand_in cargo test --locked -p memgov-cuda --test cuda -- --nocapture
in_background "$target/cuda-arena.log" on_stand_in cargo test --locked -p memgov-cuda --test arena -- --nocapture
in_background "$target/cuda-capture.log" on_stand_in cargo test --locked -p memgov-cuda --test capture -- --nocapture
# Releases really pend when the governor drains and tears down (children that
# set their own latency keep it).
for latency in 300 2000; do
    in_background "$target/cuda-latency-$latency.log" \
        on_stand_in env MEMGOV_STANDIN_CUDA_LATENCY_US=$latency cargo test --locked -p memgov-cuda --test cuda
done
# And with each operation's delay drawn from a seed (0 to 600 us), three
# seeds: streams interleave differently in each run.
for seed in 1 2 3; do
    in_background "$target/cuda-jitter-$seed.log" \
        on_stand_in env MEMGOV_STANDIN_CUDA_LATENCY_US=300 MEMGOV_STANDIN_CUDA_LATENCY_SEED=$seed \
        cargo test --locked -p memgov-cuda --test cuda
done
# The lost-teardown and last-release tests, repeated with latency on and
# five seeds.
for i in 1 2 3 4 5; do
    in_background "$target/cuda-lost-teardown-$i.log" \
        on_stand_in env MEMGOV_STANDIN_CUDA_LATENCY_US=2000 MEMGOV_STANDIN_CUDA_LATENCY_SEED=$i \
        cargo test --locked -p memgov-cuda --test cuda -- lost_teardown last_reference conformance_suite_alone
done
# A libcuda lacking entry points (a pre-12.0 driver): Unavailable, not a panic.
partial="$target/stand-ins-partial"
mkdir -p "$partial"
"${CC:-cc}" -std=gnu11 -O1 -fPIC -shared -pthread -Ibackends/stand-ins/common -Wl,-soname,libcuda.so.1 \
    -DMEMGOV_STANDIN_CUDA_PARTIAL \
    -o "$partial/libcuda.so.1" backends/cuda/stand-in/libcuda.c backends/stand-ins/common/standin.c
ln -sf libcuda.so.1 "$partial/libcuda.so"
in_background "$target/cuda-partial.log" env LD_LIBRARY_PATH="$partial" \
    cargo test --locked -p memgov-cuda --test cuda -- --nocapture a_missing_driver_is_unavailable_not_a_panic
# The tests once WITHOUT the stand-in: on a machine without an NVIDIA driver
# they must skip cleanly and pass.
in_background "$target/cuda-absent.log" env LD_LIBRARY_PATH="" \
    cargo test --locked -p memgov-cuda --test cuda -- --nocapture

echo "--- the arena bench in smoke mode"
on_stand_in release_bench --bench arena -- --test
echo "--- memgov check / run on the stand-in, nothing left at exit"
# No delay, a fixed delay, and a delay drawn from a seed: the test binaries
# run at more latencies and seeds.
for latency in 0 300 300:1; do
    seed=""
    case "$latency" in *:*) seed=${latency#*:}; latency=${latency%%:*} ;; esac
    for cmd in "check --backend cuda" "run --backend cuda"; do
        # shellcheck disable=SC2086
        MEMGOV_STANDIN_CUDA_LATENCY_US=$latency MEMGOV_STANDIN_CUDA_LATENCY_SEED=$seed MEMGOV_STANDIN_CUDA_EXIT_CHECK=1 \
            on_stand_in "$memgov" $cmd
    done
done
# A run that fails half-way (the weights do not fit the LLM's budget) still
# tears down every context before it exits: exit status 1, not the exit
# check's abort.
for latency in 0 300; do
    status=0
    MEMGOV_STANDIN_CUDA_LATENCY_US=$latency MEMGOV_STANDIN_CUDA_EXIT_CHECK=1 \
        on_stand_in "$memgov" run --backend cuda --llm-budget-mib 64 \
        > "$target/cuda-failed-run.log" 2>&1 || status=$?
    cat "$target/cuda-failed-run.log"
    [ "$status" -eq 1 ] || { echo "FAILED: a failing memgov run exited $status, expected 1"; exit 1; }
    grep -q "memgov run: retired the 2 contexts the run left, every teardown clean" "$target/cuda-failed-run.log"
done
MEMGOV_FAULT_MATRIX_BACKENDS=cuda on_stand_in release_test --test fault_matrix -- --nocapture --test-threads=1 2>&1 | tee "$target/cuda-fault-matrix.log"
# The matrix runs as is and with the block cache on in every cell.
expect_matrix_survived "$target/cuda-fault-matrix.log" "cuda (no block cache)"
expect_matrix_survived "$target/cuda-fault-matrix.log" "cuda (block cache of 64.0 MiB)"
# Every fault-matrix cell's context torn down, nothing left at exit (exact
# and jittered latency).
for spec in 0 300 300:1; do
    seed=""; case "$spec" in *:*) seed=${spec#*:}; spec=${spec%%:*} ;; esac
    MEMGOV_STANDIN_CUDA_EXIT_CHECK=1 MEMGOV_STANDIN_CUDA_LATENCY_US=$spec MEMGOV_STANDIN_CUDA_LATENCY_SEED=$seed \
        MEMGOV_FAULT_MATRIX_BACKENDS=cuda on_stand_in release_test --test fault_matrix -- --test-threads=1
done
on_stand_in release_bench --bench cuda_cycle -- --test

echo "--- clippy with the cuda feature"
cargo clippy --locked -p memgov -p memgov-cuda -p memgov-cli --features cuda --all-targets -- -D warnings

echo "--- the CUDA test runs in the background"
wait_background

echo "--- CUDA tests on the stand-in ($standins/libcuda.so.1)"
grep -q "cuda on memgov stand-in CUDA device 0 (stand-in)" "$target/cuda-stand-in.log"
expect_all_passed "$target/cuda-stand-in.log" "CUDA suite on the stand-in"
grep -q "cuda on memgov stand-in CUDA device 0 (stand-in), block cache of 64.0 MiB" "$target/cuda-stand-in.log"
grep -q "soak: cuda: " "$target/cuda-stand-in.log"
grep -q "device identity: gpu-6d656d67-6f76-2d73-7461-6e64696e0000 (PCI 0000:10:00.0)" "$target/cuda-stand-in.log"
echo "--- CUDA arena, sleep/wake and the stand-in's VMM rules"
grep -q "child sleep_wake: ok" "$target/cuda-arena.log"
grep -q "capability case sleep_wake_restores_bytes_at_the_same_addresses: ok" "$target/cuda-arena.log"
grep -q "fault cells cuMemRelease: positions 1 to" "$target/cuda-arena.log"
for seed in 1 2 3; do grep -q "child arena_stress:$seed: ok" "$target/cuda-arena.log"; done
grep -q "child sync_during_reap: ok" "$target/cuda-arena.log"

echo "--- a libcuda lacking entry points (a pre-12.0 driver): Unavailable, not a panic"
grep -q "skipped: no CUDA driver usable by memgov: the libcuda found lacks entry points" "$target/cuda-partial.log"

echo "--- CUDA tests without the stand-in"
if grep -q "skipped: no CUDA driver" "$target/cuda-absent.log"; then
    echo "without the stand-in: skipped: no CUDA driver, exit 0"
else
    echo "without the stand-in: an NVIDIA driver answered; the CUDA tests above ran on it"
fi

echo "--- CUDA graph capture on the arena, the gate, and the stand-in's capture rules"
grep -q "child replay_under_churn: ok" "$target/cuda-capture.log"
grep -q "capability case capture_defers_trims_to_its_end: ok" "$target/cuda-capture.log"
grep -q "fault cells cuStreamEndCapture: positions 1 to" "$target/cuda-capture.log"
grep -q "governed capture: teardown waited for the live graph" "$target/cuda-capture.log"
# Page-locked allocation and free wait for a global capture; launches and
# copies racing sleeps are refused as asleep or run on mapped memory.
grep -q "child page_locked_waits: ok" "$target/cuda-capture.log"
grep -q "child standin_page_locked: ok" "$target/cuda-capture.log"
grep -q "launch/sleep race: " "$target/cuda-capture.log"
