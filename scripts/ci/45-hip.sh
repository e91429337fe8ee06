#!/usr/bin/env bash
# The HIP backend (feature `hip`): build the stand-in libamdhip64.so.5, run
# the HIP tests (conformance on the pool and on the hipMalloc fallback,
# retirement, cross-stream order, device loss, pool trim, planted
# violations, soak) at several stand-in latencies, the virtual-memory arena
# and sleep/wake with the stand-in's VMM rules planted (tests/arena.rs) and
# graph capture with the gate and the stand-in's capture rules planted
# (tests/capture.rs), with the capability cases and fault cells of
# memgov-conformance on both, one run each: their cases pick their own latencies
# and seeds, `memgov check` and
# `memgov run`, and the HIP row of the fault matrix on it, all with the
# stand-in's exit check on; clippy with the feature; that the binary does
# not link libamdhip64 and skips cleanly with no HIP runtime ("skipped: no
# HIP runtime"); then the same tests once against Debian's real ROCm
# runtime, which on a machine without an AMD GPU must skip cleanly
# ("skipped: no HIP device") and pass.
# The test binaries' runs go side by side in the background (in_background
# in scripts/common.sh) while the release binary's checks run.
#
# memgov opens libamdhip64 at run time: building needs nothing of ROCm.
# Debian's libamdhip64-dev (ROCm 5.2.3) provides the header the stand-in is
# compiled against and the real runtime the last step runs on.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
apt_install libamdhip64-dev
# The stand-ins' self-test again, now that the HIP header is installed: its
# HIP half (the documented differences from CUDA) needs it.
backends/stand-ins/common/selftest.sh 2>&1 | tee "$(cargo_target_dir)/stand-ins-selftest.log"
grep -q "^stand-in vendor differences: passed" "$(cargo_target_dir)/stand-ins-selftest.log"
if grep -q "skipped: the HIP stand-in's differences" "$(cargo_target_dir)/stand-ins-selftest.log"; then
    echo "FAILED: the HIP stand-in's differences were not checked with the HIP header installed"; exit 1
fi

target="$(cargo_target_dir)"
memgov="$(release_memgov)"
standins="$(backends/stand-ins/build.sh hip)"
on_stand_in() {
    LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}

# The stand-in's exit check is on for every run below: anything a torn-down
# context (lost or not) leaves on the device, a pool memgov created and did
# not destroy, or a changed default-pool attribute aborts the process.
export MEMGOV_STANDIN_HIP_EXIT_CHECK=1

# The test binaries' runs mostly wait on the stand-in's queued latency and
# on their own timeouts: they are built once, then run side by side in the
# background while `memgov check`, `memgov run` and the fault matrix run in
# the foreground; their logs are printed, and grepped, once all have ended.
echo "--- the HIP test binaries, built once for the runs below"
cargo test --locked --no-run -p memgov-hip --test hip --test pinned --test arena --test capture
trap 'wait_background || true' EXIT
# The HIP tests on the stand-in ($standins/libamdhip64.so.5), printing
# what each case saw; the arena, sleep/wake and the stand-in's VMM rules;
# graph capture on the arena, the gate, and the stand-in's capture rules.
in_background "$target/hip-stand-in.log" on_stand_in cargo test --locked -p memgov-hip --test hip --test pinned -- --nocapture
in_background "$target/hip-arena.log" on_stand_in cargo test --locked -p memgov-hip --test arena -- --nocapture
in_background "$target/hip-capture.log" on_stand_in cargo test --locked -p memgov-hip --test capture -- --nocapture
# The whole file again with every queued operation delayed, at the delays
# CUDA's run at, so that releases really pend when the governor drains and
# tears down and cross-stream work is really in flight when a free is queued.
for latency in 300 2000; do
    in_background "$target/hip-latency-$latency.log" \
        on_stand_in env MEMGOV_STANDIN_HIP_LATENCY_US=$latency cargo test --locked -p memgov-hip --test hip --test pinned
done
# And with each operation's delay drawn from a seed (0 to 600 us), three
# seeds: streams interleave differently in each run.
for seed in 1 2 3; do
    in_background "$target/hip-jitter-$seed.log" \
        on_stand_in env MEMGOV_STANDIN_HIP_LATENCY_US=300 MEMGOV_STANDIN_HIP_LATENCY_SEED=$seed \
        cargo test --locked -p memgov-hip --test hip --test pinned
done
# The same tests once against Debian's real ROCm runtime
# (/usr/lib/x86_64-linux-gnu/libamdhip64.so.5), without the exit check: on a
# machine without an AMD GPU they must skip cleanly and pass.
in_background "$target/hip-real.log" env -u MEMGOV_STANDIN_HIP_EXIT_CHECK \
    cargo test --locked -p memgov-hip --test hip --test pinned --test arena --test capture -- --nocapture

echo "--- memgov check / run on the stand-in"
# No delay, a fixed delay, and a delay drawn from a seed, as for CUDA.
for latency in 0 300 300:1; do
    seed=""
    case "$latency" in *:*) seed=${latency#*:}; latency=${latency%%:*} ;; esac
    MEMGOV_STANDIN_HIP_LATENCY_US=$latency MEMGOV_STANDIN_HIP_LATENCY_SEED=$seed on_stand_in "$memgov" check --backend hip \
        | tee "$target/hip-check.log"
    # The arena, sleep/wake and the capture gate are probed on the stand-in
    # and offered.
    grep -Eq "^virtual-memory arena +yes" "$target/hip-check.log"
    grep -Eq "^sleep and wake at stable addresses +yes" "$target/hip-check.log"
    grep -Eq "^graph-capture gate +yes" "$target/hip-check.log"
    # And `memgov run` exercises what `check` said yes to: phases 4b and 4c.
    MEMGOV_STANDIN_HIP_LATENCY_US=$latency MEMGOV_STANDIN_HIP_LATENCY_SEED=$seed on_stand_in "$memgov" run --backend hip \
        | tee "$target/hip-run.log"
    grep -q "^phase 4b: a HIP virtual-memory arena" "$target/hip-run.log"
    grep -q "^phase 4c: a HIP graph captured on a governed stream" "$target/hip-run.log"
done
# A capability row says yes only once its probe ran: with the first
# hipMemMap refused the arena (and what needs it) is no, with the first
# hipStreamBeginCapture refused only the capture gate is.
on_stand_in env MEMGOV_STANDIN_HIP_FAIL_ENTRY=hipMemMap:1 "$memgov" check --backend hip | tee "$target/hip-check-nomap.log"
grep -Eq "^virtual-memory arena +no" "$target/hip-check-nomap.log"
grep -Eq "^sleep and wake at stable addresses +no" "$target/hip-check-nomap.log"
grep -q "^hip: virtual-memory arena: no: allocate: .*hipMemMap" "$target/hip-check-nomap.log"
on_stand_in env MEMGOV_STANDIN_HIP_FAIL_ENTRY=hipStreamBeginCapture:1 "$memgov" check --backend hip | tee "$target/hip-check-nocapture.log"
grep -Eq "^virtual-memory arena +yes" "$target/hip-check-nocapture.log"
grep -Eq "^graph-capture gate +no" "$target/hip-check-nocapture.log"
grep -q "^hip: graph-capture gate: no: begin_capture: .*hipStreamBeginCapture" "$target/hip-check-nocapture.log"

# A run that fails half-way (the weights do not fit the LLM's budget) still
# tears down every context before it exits: exit status 1, not the exit
# check's abort.
for latency in 0 300; do
    status=0
    MEMGOV_STANDIN_HIP_LATENCY_US=$latency on_stand_in "$memgov" run --backend hip --llm-budget-mib 64 \
        > "$target/hip-failed-run.log" 2>&1 || status=$?
    cat "$target/hip-failed-run.log"
    [ "$status" -eq 1 ] || { echo "FAILED: a failing memgov run exited $status, expected 1"; exit 1; }
    grep -q "memgov run: retired the 2 contexts the run left, every teardown clean" "$target/hip-failed-run.log"
done

echo "--- no HIP runtime: the binary does not link libamdhip64, and skips cleanly"
if ldd "$memgov" | grep -q amdhip64; then
    echo "FAILED: $memgov links libamdhip64 at load time:"
    ldd "$memgov" | grep amdhip64
    exit 1
fi
MEMGOV_HIP_RUNTIME=/nonexistent/libamdhip64.so.5 "$memgov" check 2>&1 | tee "$target/hip-absent.log"
grep -q "skipped: no HIP runtime: /nonexistent/libamdhip64.so.5" "$target/hip-absent.log"
MEMGOV_HIP_RUNTIME=/nonexistent/libamdhip64.so.5 "$memgov" info 2>&1 | tee -a "$target/hip-absent.log"
grep -q "hip      skipped: no HIP runtime" "$target/hip-absent.log"

echo "--- the fault matrix on the stand-in"
MEMGOV_FAULT_MATRIX_BACKENDS=hip on_stand_in release_test --test fault_matrix -- --nocapture --test-threads=1 2>&1 | tee "$target/hip-fault-matrix.log"
# The matrix runs as is and with the block cache on in every cell.
expect_matrix_survived "$target/hip-fault-matrix.log" "hip (no block cache)"
expect_matrix_survived "$target/hip-fault-matrix.log" "hip (block cache of 64.0 MiB)"

echo "--- clippy with the hip feature"
cargo clippy --locked -p memgov -p memgov-hip -p memgov-cli --features hip --all-targets -- -D warnings

echo "--- the HIP test runs in the background"
wait_background

echo "--- HIP tests on the stand-in ($standins/libamdhip64.so.5)"
grep -q "on memgov stand-in HIP device 0 (libamdhip64.so.5 imitation) (stand-in)" "$target/hip-stand-in.log"
grep -q "plain: hip on memgov stand-in HIP device 0 (libamdhip64.so.5 imitation) (stand-in), block cache of 64.0 MiB" "$target/hip-stand-in.log"
grep -q "soak: hip: " "$target/hip-stand-in.log"
grep -q "device identity: gpu-6d656d67-6f76-2d73-7461-6e64696e6800 (PCI 0000:20:00.0)" "$target/hip-stand-in.log"
grep -q "test pinned_tier_writes_and_reads_through_the_device_pointer_of_mapped_host_memory ... ok" "$target/hip-stand-in.log"
grep -q "test planted_copies_of_the_wrong_kind_abort_the_stand_in ... ok" "$target/hip-stand-in.log"
echo "--- HIP arena, sleep/wake and the stand-in's VMM rules"
grep -q "child grow_shrink: ok" "$target/hip-arena.log"
grep -q "child sleep_wake: ok" "$target/hip-arena.log"
grep -q "child no_vmm: ok" "$target/hip-arena.log"
grep -q "capability case sleep_wake_restores_bytes_at_the_same_addresses: ok" "$target/hip-arena.log"
grep -q "capability case sleep_wake_of_a_set_leaves_the_others_usable: ok" "$target/hip-arena.log"
grep -q "fault cells hipMemRelease: positions 1 to" "$target/hip-arena.log"
for seed in 1 2 3; do grep -q "child arena_stress:$seed: ok" "$target/hip-arena.log"; done
echo "--- HIP graph capture on the arena, the gate, and the stand-in's capture rules"
grep -q "child replay_under_churn: ok" "$target/hip-capture.log"
grep -q "child no_graphs: ok" "$target/hip-capture.log"
grep -q "capability case capture_defers_trims_to_its_end: ok" "$target/hip-capture.log"
grep -q "fault cells hipStreamEndCapture: positions 1 to" "$target/hip-capture.log"
grep -q "child page_locked_waits: ok" "$target/hip-capture.log"
grep -q "child standin_page_locked: ok" "$target/hip-capture.log"
grep -q "launch/sleep race: " "$target/hip-capture.log"
grep -q "governed capture on HIP: 64 MiB pool charged while its graph lived, 0 after destroy" "$target/hip-capture.log"

echo "--- HIP tests against the real runtime (/usr/lib/x86_64-linux-gnu/libamdhip64.so.5)"
if grep -Eq "skipped: no HIP (device|runtime)" "$target/hip-real.log"; then
    echo "real runtime: skipped: no HIP device (no AMD GPU on this machine), exit 0"
else
    echo "real runtime: an AMD GPU answered; the HIP tests above ran on it"
fi
