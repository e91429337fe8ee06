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
# machine without an NVIDIA driver must skip cleanly and pass.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

echo "--- stand-ins common self-test"
backends/stand-ins/common/selftest.sh

target="$(cargo_target_dir)"
standins="$(backends/stand-ins/build.sh cuda)"
memgov="$(release_memgov)"
on_stand_in() {
    LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}

echo "--- CUDA tests on the stand-in ($standins/libcuda.so.1)"
on_stand_in cargo test --locked -p memgov-cuda --test cuda -- --nocapture 2>&1 | tee "$target/cuda-stand-in.log"
grep -q "cuda on memgov stand-in CUDA device 0 (stand-in)" "$target/cuda-stand-in.log"
expect_all_passed "$target/cuda-stand-in.log" "CUDA suite on the stand-in"
grep -q "cuda on memgov stand-in CUDA device 0 (stand-in), block cache of 64.0 MiB" "$target/cuda-stand-in.log"
grep -q "soak: cuda: " "$target/cuda-stand-in.log"
echo "--- CUDA arena, sleep/wake and the stand-in's VMM rules"; on_stand_in cargo test --locked -p memgov-cuda --test arena -- --nocapture 2>&1 | tee "$target/cuda-arena.log"; grep -q "child sleep_wake: ok" "$target/cuda-arena.log"; grep -q "capability case sleep_wake_restores_bytes_at_the_same_addresses: ok" "$target/cuda-arena.log"; grep -q "fault cells cuMemRelease: positions 1 to" "$target/cuda-arena.log"; for seed in 1 2 3; do grep -q "child arena_stress:$seed: ok" "$target/cuda-arena.log"; done; grep -q "child sync_during_reap: ok" "$target/cuda-arena.log"; on_stand_in release_bench --bench arena -- --test
grep -q "device identity: gpu-6d656d67-6f76-2d73-7461-6e64696e0000 (PCI 0000:10:00.0)" "$target/cuda-stand-in.log"
# Releases really pend when the governor drains and tears down (children that
# set their own latency keep it).
for latency in 300 2000; do
    MEMGOV_STANDIN_CUDA_LATENCY_US=$latency on_stand_in cargo test --locked -p memgov-cuda --test cuda
done
# And with each operation's delay drawn from a seed (0 to 600 us), three
# seeds: streams interleave differently in each run.
for seed in 1 2 3; do
    echo "--- CUDA tests, stand-in latency 300 us jittered, seed $seed"
    MEMGOV_STANDIN_CUDA_LATENCY_US=300 MEMGOV_STANDIN_CUDA_LATENCY_SEED=$seed on_stand_in cargo test --locked -p memgov-cuda --test cuda
done
echo "--- memgov check / run on the stand-in, nothing left at exit"
# No delay, a fixed delay, and a delay drawn from a seed: the test binaries
# above ran at more latencies and seeds.
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
# The lost-teardown and last-release tests, repeated with latency on and
# five seeds.
for i in 1 2 3 4 5; do
    MEMGOV_STANDIN_CUDA_LATENCY_US=2000 MEMGOV_STANDIN_CUDA_LATENCY_SEED=$i \
        on_stand_in cargo test --locked -p memgov-cuda --test cuda -- lost_teardown last_reference conformance_suite_alone
done
on_stand_in release_bench --bench cuda_cycle -- --test

echo "--- a libcuda lacking entry points (a pre-12.0 driver): Unavailable, not a panic"
partial="$target/stand-ins-partial"
mkdir -p "$partial"
"${CC:-cc}" -std=gnu11 -O1 -fPIC -shared -pthread -Ibackends/stand-ins/common -Wl,-soname,libcuda.so.1 \
    -o "$partial/libcuda.so.1" backends/cuda/stand-in/libcuda.c backends/stand-ins/common/standin.c
ln -sf libcuda.so.1 "$partial/libcuda.so"
LD_LIBRARY_PATH="$partial" cargo test --locked -p memgov-cuda --test cuda -- --nocapture \
    a_missing_driver_is_unavailable_not_a_panic 2>&1 | tee "$target/cuda-partial.log"
grep -q "skipped: no CUDA driver usable by memgov: the libcuda found lacks entry points" "$target/cuda-partial.log"

echo "--- clippy with the cuda feature"
cargo clippy --locked -p memgov -p memgov-cuda -p memgov-cli --features cuda --all-targets -- -D warnings

echo "--- CUDA tests without the stand-in"
LD_LIBRARY_PATH="" cargo test --locked -p memgov-cuda --test cuda -- --nocapture 2>&1 | tee "$target/cuda-absent.log"
if grep -q "skipped: no CUDA driver" "$target/cuda-absent.log"; then
    echo "without the stand-in: skipped: no CUDA driver, exit 0"
else
    echo "without the stand-in: an NVIDIA driver answered; the CUDA tests above ran on it"
fi

echo "--- CUDA graph capture on the arena, the gate, and the stand-in's capture rules"
on_stand_in cargo test --locked -p memgov-cuda --test capture -- --nocapture 2>&1 | tee "$target/cuda-capture.log"
grep -q "child replay_under_churn: ok" "$target/cuda-capture.log"
grep -q "capability case capture_defers_trims_to_its_end: ok" "$target/cuda-capture.log"
grep -q "fault cells cuStreamEndCapture: positions 1 to" "$target/cuda-capture.log"
grep -q "governed capture: teardown waited for the live graph" "$target/cuda-capture.log"
# Page-locked allocation and free wait for a global capture; launches and
# copies racing sleeps are refused as asleep or run on mapped memory.
grep -q "child page_locked_waits: ok" "$target/cuda-capture.log"
grep -q "child standin_page_locked: ok" "$target/cuda-capture.log"
grep -q "launch/sleep race: " "$target/cuda-capture.log"
