#!/usr/bin/env bash
# The machine ledger shared by processes (docs/sharing-a-gpu.md), beyond the
# plain `cargo test` run of tests/machine.rs: the multi-process tests in
# release under three seeds, on the host backend and on the CUDA stand-in (each run: 8 processes x 8 threads, 1,000
# SIGKILLs at points drawn from the seed, a trim across processes and a
# stopped process named at its deadline; ~10 s a run on 2 cores) and the
# bench's ratio in smoke mode. Each test uses a temporary directory of its
# own, never /dev/shm.
# The debug tests run from the test step's build (debug_test in
# scripts/common.sh): nothing here compiles the library again.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
target="$(cargo_target_dir)"
log="$target/machine.log"
: >"$log"
for seed in 1 2 3; do
    MEMGOV_MACHINE_SEED=$seed release_test --test machine -- --nocapture 2>&1 | tee -a "$log"
done
# Liveness and books (tests/machine_liveness.rs): pid namespaces (as root;
# each namespaced test prints "skipped: <why>" where unshare is refused), a
# process whose main thread exited, concurrent joins with floors, a forked
# child, consistent snapshots under charging processes.
release_test --test machine_liveness -- --nocapture 2>&1 | tee -a "$log"
n=$(grep -c "two pid namespaces: neither reclaimed the other\|skipped: .*unshare" "$log" || true)
[ "$n" -ge 1 ] || { echo "FAILED: the pid-namespace test neither ran nor said why it skipped"; exit 1; }
# The same processes governing CUDA contexts on the CUDA stand-in, the
# ledger keyed by the device's UUID as the driver reports it, and the NVML
# and ROCm SMI stand-ins reporting the devices' processes.
standins="$(backends/stand-ins/build.sh cuda nvml rocm-smi)"
for seed in 1 2 3; do
    MEMGOV_MACHINE_SEED=$seed MEMGOV_MACHINE_BACKEND=cuda \
        LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        release_test --test machine -- --nocapture 2>&1 | tee -a "$log"
done
# Every seed ran the kill test to its end with the ledger exact, on both.
n=$(grep -c "1000 kills in .* ledger exact after each" "$log" || true)
[ "$n" -eq 6 ] || { echo "FAILED: $n of 6 kill runs reported an exact ledger"; exit 1; }
n=$(grep -c "the processes govern cuda (stand-in), on ledger 'gpu-6d656d67-6f76-2d73-7461-6e64696e0000'" "$log" || true)
[ "$n" -eq 3 ] || { echo "FAILED: $n of 3 CUDA runs governed the stand-in's device under its UUID"; exit 1; }
n=$(grep -c "nvml: 3 of 4 processes outside the ledger" "$log" || true)
[ "$n" -eq 3 ] || { echo "FAILED: NVML's stand-in was read in $n of the 3 CUDA runs"; exit 1; }
n=$(grep -c "rocm-smi: 1 of 2 processes on the device outside the ledger" "$log" || true)
[ "$n" -eq 3 ] || { echo "FAILED: ROCm SMI's stand-in was read in $n of the 3 CUDA runs"; exit 1; }
# NVML's lists in each entry layout (16, 24 and 32 bytes) with up to 64
# processes, the 32-byte one under valgrind, and hostile answers of NVML
# and ROCm SMI, on their stand-ins.
command -v valgrind >/dev/null || apt_install valgrind || echo "valgrind not installable: its NVML test will print skipped"
LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    debug_test --test machine_management -- --nocapture --test-threads=1 2>&1 | tee -a "$log"
for layout in 16 24 32; do
    grep -q "nvml layout $layout: 1, 2, 28 and 64 processes read exactly" "$log" ||
        { echo "FAILED: NVML's $layout-byte layout was not read exactly"; exit 1; }
done
grep -Eq "valgrind: clean, the 32-byte layout|skipped: valgrind" "$log" ||
    { echo "FAILED: the NVML lists did not run under valgrind"; exit 1; }
for answer in "nvml huge-count" "nvml over-count" "nvml null-names" "nvml pid0" \
    "rocm-smi huge-count" "rocm-smi over-count" "rocm-smi pid0"; do
    grep -q "$answer: " "$log" || { echo "FAILED: no result for the hostile answer $answer"; exit 1; }
done
# The segment's edges: a tmpfs too small (mounted by the test as root), a
# creator killed half-way (strace's fault injection), a segment cut short
# under its member, what is accepted as a segment, reset while members live;
# and `memgov top`'s escaping and --reset.
command -v strace >/dev/null || apt_install strace || echo "strace not installable: the killed-creator test will print skipped"
debug_test --test machine_segment -- --nocapture --test-threads=1 2>&1 | tee -a "$log"
grep -Eq "full tmpfs: refused with the numbers|skipped: mount" "$log" ||
    { echo "FAILED: the full-tmpfs test neither ran nor said why it skipped"; exit 1; }
grep -Eq "killed creators: nothing blocks the key|skipped: strace" "$log" ||
    { echo "FAILED: the killed-creator test neither ran nor said why it skipped"; exit 1; }
grep -q "cut short: alive after touching the truncated segment" "$log" ||
    { echo "FAILED: a member of a segment cut short did not live on"; exit 1; }
debug_test --test top_trust 2>&1 | tee -a "$log"
# A pressure responder that panics on the doorbell thread: caught, the
# thread keeps serving.
debug_test --test machine_doorbell -- --nocapture 2>&1 | tee -a "$log"
grep -q "doorbell: a responder's panic caught (1 caught), the ring answered, the next ring served" "$log" ||
    { echo "FAILED: the doorbell thread did not survive a panicking responder"; exit 1; }
# `memgov top` lists the processes outside memgov that NVML names.
LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    debug_test --test cli top_lists_the_processes_outside_memgov -- --nocapture 2>&1 | tee -a "$log"
grep -q "memgov top listed pid 4000001 (200.0 MiB) outside memgov, from NVML" "$log" ||
    { echo "FAILED: memgov top did not list the process outside memgov from NVML's stand-in"; exit 1; }
grep -q "skipped: no libnvidia-ml.so.1" "$log" ||
    { echo "FAILED: without NVML the host runs did not say they skipped it"; exit 1; }
release_bench --bench machine -- --test 2>&1 | tee -a "$log"
grep -q "machine ledger: .* ratio" "$log" || { echo "FAILED: the bench printed no ratio"; exit 1; }
