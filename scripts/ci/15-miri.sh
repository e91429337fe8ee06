#!/usr/bin/env bash
# Miri: undefined-behaviour checks of everything that runs without FFI.
#
# Runs the library's unit tests and the integration tests of the host and
# null backends that fit the time (bad_input, governor) with strict
# provenance, under both borrow models: the unit tests (where the unsafe
# code and the lock-free bookkeeping are exercised directly) under each; the
# governor's tests split between the two, each under one (its racing tests
# under stacked borrows, the others alternately by name), so that the
# whole of the governor's API is checked under both models in half the
# time; the null backend's governed tests under stacked borrows, the
# bad-input tests under tree borrows. Needs the nightly toolchain with the
# `miri` and `rust-src` components: installs them when rustup can, otherwise
# prints "skipped: <why>" and exits 0.
#
# Not run here, and why: the Vulkan backend (and any FFI backend): Miri
# cannot call into a driver; the loom target (needs --cfg loom and explores
# interleavings itself); the property tests, fault matrix, conformance and
# soaks (thousands of cases or a million cycles: hours under Miri). Single
# tests that cannot run under Miri carry `#[cfg_attr(miri, ignore = "why")]`.
#
# The two borrow models run side by side, one per core: the crates are built
# once for Miri first (the aliasing model is an interpreter flag, read when a
# test runs, not a build input, so both runs use the same artifacts and
# neither rebuilds nor waits on the other's build lock), then each model's
# runs go in order in a lane of its own, logged to its own file and printed
# when the lane ends. With MEMGOV_INSTALL=0 the toolchain is not installed.
#
# Extra arguments go to every `cargo miri test`, before its `--`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

skip() {
    echo "skipped: $*"
    exit 0
}

if ! cargo +nightly miri --version >/dev/null 2>&1; then
    [ "${MEMGOV_INSTALL:-1}" != 0 ] ||
        skip "Miri is not installed and MEMGOV_INSTALL=0 installs nothing (rustup toolchain install nightly --component miri,rust-src, or cargo xtask setup)"
    command -v rustup >/dev/null ||
        skip "Miri needs a nightly toolchain with the miri component, and rustup is not installed"
    echo "memgov miri: installing the nightly toolchain's miri and rust-src components"
    rustup toolchain install nightly --profile minimal --component miri,rust-src ||
        skip "could not install the nightly toolchain with miri and rust-src (no network to the toolchain server?)"
    cargo +nightly miri --version >/dev/null 2>&1 ||
        skip "cargo +nightly miri does not run even after installing it"
fi
cargo +nightly miri setup >/dev/null 2>&1 ||
    skip "cargo +nightly miri setup could not build Miri's sysroot (is rust-src installed?)"

# Miri builds the crate for its own target: keep that apart from the native
# target directory so neither invalidates the other.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target-miri}"
STRICT="-Zmiri-strict-provenance"
TREE="-Zmiri-strict-provenance -Zmiri-tree-borrows"
start=$(date +%s)

# run MODEL-FLAGS CARGO-ARGS...: one `cargo miri test`, timed.
run() {
    local flags=$1 t0
    shift
    t0=$(date +%s)
    echo "=== miri [$flags]: cargo miri test $*"
    if MIRIFLAGS="$flags" cargo +nightly miri test --locked "$@"; then
        echo "=== miri [$flags] $*: passed in $(($(date +%s) - t0))s"
        return 0
    fi
    echo "=== miri [$flags] $*: FAILED after $(($(date +%s) - t0))s"
    return 1
}

# The crates with unsafe code or lock-free bookkeeping, without a driver.
LIBS=(-p memgov -p memgov-api -p memgov-sync -p memgov-backend -p memgov-host -p memgov-null --lib)

# Build every test binary of both lanes once, before either lane starts.
t0=$(date +%s)
echo "=== miri: building the crates and tests for Miri"
cargo +nightly miri test --locked --no-run "${LIBS[@]}" "$@"
cargo +nightly miri test --locked --no-run -p memgov-null --test governed "$@"
cargo +nightly miri test --locked --no-run -p memgov --test bad_input --test governor "$@"
echo "=== miri: built in $(($(date +%s) - t0))s"

# The governor's tests, split between the lanes: the three racing tests
# (its longest under Miri, with Miri's clock: reservations racing plain
# allocations 22 s, reclaims racing on one device 15 s, the force race 5 s)
# under stacked borrows, the others alternately by name. Each lane runs its
# share with `--exact`, so a test added later lands in one lane or the other,
# never in neither.
RACING=(force_races_with_allocations_and_releases_without_leaking_pins
    reservations_and_plain_allocations_racing_never_over_admit
    reclaims_racing_on_one_device_never_over_admit)
mapfile -t governor_tests < <(MIRIFLAGS="$STRICT" cargo +nightly miri test --locked -p memgov --test governor "$@" -- --list 2>/dev/null |
    sed -n 's/: test$//p' | sort)
[ "${#governor_tests[@]}" -gt 20 ] || { echo "memgov miri: FAILED: listed only ${#governor_tests[@]} governor tests"; exit 1; }
stacked_share=("${RACING[@]}")
tree_share=()
i=0
for t in "${governor_tests[@]}"; do
    case " ${RACING[*]} " in *" $t "*) continue ;; esac
    if [ $((i % 2)) -eq 0 ]; then tree_share+=("$t"); else stacked_share+=("$t"); fi
    i=$((i + 1))
done
echo "=== miri: ${#governor_tests[@]} governor tests: ${#stacked_share[@]} under stacked borrows, ${#tree_share[@]} under tree borrows"

stacked() {
    run "$STRICT" "${LIBS[@]}" "$@" &&
        run "$STRICT" -p memgov-null --test governed "$@" &&
        run "$STRICT" -p memgov --test governor "$@" -- --exact "${stacked_share[@]}"
}
# Tree borrows checks the same code under the other aliasing model. The
# lanes are balanced so that neither waits long for the other: the bad-input
# tests run here instead of under stacked borrows.
tree() {
    run "$TREE" "${LIBS[@]}" "$@" &&
        run "$TREE" -p memgov --test bad_input "$@" &&
        run "$TREE" -p memgov --test governor "$@" -- --exact "${tree_share[@]}"
}

logs="$(mktemp -d "${TMPDIR:-/tmp}/memgov-miri.XXXXXX")"
trap 'rm -rf "$logs"' EXIT
stacked "$@" >"$logs/stacked.log" 2>&1 &
sb=$!
tree "$@" >"$logs/tree.log" 2>&1 &
tb=$!
failed=0
wait "$sb" || failed=1
echo "=== miri lane: stacked borrows"
cat "$logs/stacked.log"
wait "$tb" || failed=1
echo "=== miri lane: tree borrows"
cat "$logs/tree.log"
if [ "$failed" -ne 0 ]; then
    echo "memgov miri: FAILED after $(($(date +%s) - start))s (see the lane above with FAILED)"
    exit 1
fi
echo "memgov miri: every run passed in $(($(date +%s) - start))s"
