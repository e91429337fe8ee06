#!/usr/bin/env bash
# The machine ledger shared by processes (docs/sharing-a-gpu.md), beyond the
# plain `cargo test` run of tests/machine.rs: the multi-process tests in
# release under three seeds (each run: 8 processes x 8 threads, 1,000
# SIGKILLs at points drawn from the seed, a trim across processes and a
# stopped process named at its deadline; ~10 s a run on 2 cores) and the
# bench's ratio in smoke mode. Each test uses a temporary directory of its
# own, never /dev/shm.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
target="$(cargo_target_dir)"
log="$target/machine.log"
: >"$log"
for seed in 1 2 3; do
    MEMGOV_MACHINE_SEED=$seed cargo test --locked --release -p memgov --test machine -- --nocapture 2>&1 | tee -a "$log"
done
# Every seed ran the kill test to its end with the ledger exact.
n=$(grep -c "1000 kills in .* ledger exact after each" "$log" || true)
[ "$n" -eq 3 ] || { echo "FAILED: $n of 3 kill runs reported an exact ledger"; exit 1; }
cargo bench --locked -p memgov --bench machine -- --test 2>&1 | tee -a "$log"
grep -q "machine ledger: .* ratio" "$log" || { echo "FAILED: the bench printed no ratio"; exit 1; }
