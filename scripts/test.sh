#!/usr/bin/env bash
# The whole test suite, from a clean clone on a fresh Debian machine (root).
# Installs what the cross-vendor matrix needs when it is missing (Mesa's
# lavapipe, the Vulkan loader and the Khronos validation layers; ROCm's HIP
# headers and runtime for building the `hip` feature), builds the stand-in
# CUDA and HIP driver libraries, then runs: unit, integration and doc tests;
# the conformance matrix on every backend (Vulkan on lavapipe, CUDA and HIP on
# their stand-ins); the reliability suites (loom, Miri, properties, fault
# matrix, bad input, soaks); ONNX Runtime on governed memory; the C ABI
# (header, layout, C tests, the example plugin under ASan and valgrind); and
# the benches in smoke mode. Prints which backends ran on real hardware, on software
# drivers, on stand-ins, or embedded.
#
# The installs are the set-up (`suite_setup` in scripts/common.sh), done once
# before the first step; with MEMGOV_INSTALL=0 (`cargo xtask test`, on a
# prepared machine) nothing is installed and a missing package is an error
# naming the command that installs it.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ensure_rust
if [ "${MEMGOV_INSTALL:-1}" = 0 ]; then
    echo "memgov setup: MEMGOV_INSTALL=0: installing nothing"
else
    suite_setup
fi

export CARGO_TERM_COLOR=never
target="$(cargo_target_dir)"
export RUST_BACKTRACE=1
start=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - start ))s)"; }

step "build (the tests of the next steps; the library alone)"
# The packages the test step runs, built once with the same selection, so
# that step compiles nothing again (another selection unifies other features
# and recompiles the library). Every target of every crate is compiled by
# clippy below with every feature, and built by the step that runs it.
# (MEMGOV_TEST_PACKAGES, `debug_test` in scripts/common.sh: the later
# steps' debug runs of these packages' tests select the same.)
debug_test --no-run
cargo build --locked -p memgov --lib
# The library without the tool, the development commands or the test kit:
# no clap, no xtask and no memgov-conformance in its tree.
lib_tree="$(cargo tree --locked -p memgov -e normal --prefix none)"
for crate in clap xtask memgov-conformance; do
    if grep -q "^$crate v" <<<"$lib_tree"; then
        echo "FAILED: $crate is in the library's dependency tree"
        exit 1
    fi
done
# The pin contract a plugin depends on has no dependencies at all.
if [ "$(cargo tree --locked -p memgov-api -e normal --prefix none | wc -l)" -ne 1 ]; then
    cargo tree --locked -p memgov-api -e normal
    echo "FAILED: memgov-api has dependencies"
    exit 1
fi

step "lints: rustfmt and clippy (every feature)"
if cargo fmt --version >/dev/null 2>&1; then cargo fmt --all -- --check; else echo "skipped: rustfmt is not installed"; fi
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --locked --workspace --all-targets --features serde,tracing,vulkan,cuda,hip,metrics -- -D warnings
    cargo clippy --locked -p memgov --lib -- -D warnings
else
    echo "skipped: clippy is not installed; compiling every target without it"
    cargo check --locked --workspace --all-targets --features serde,tracing,vulkan,cuda,hip,metrics
fi

step "tests: host backend, governor, conformance, doc tests"
# Every default member but the C ABI, whose tests (the C programs, plain,
# under ASan+UBSan and under valgrind) run once, in scripts/ci/55-capi.sh.
debug_test
# The governor's tests again with the optional features' code compiled in,
# in the one debug feature set of the memgov package alone
# (MEMGOV_DEBUG_FEATURES in scripts/common.sh), which the GPU examples below
# and the Prometheus step's worker build with too: the library and its
# backends are compiled once for all of them.
cargo test --locked -p memgov --features "$MEMGOV_DEBUG_FEATURES" --test governor

step "examples: host, best backend, LLM serving, Vulkan on lavapipe, CUDA and HIP on their stand-ins and without a driver"
cargo run --locked -p memgov --example host
cargo run --locked -p memgov --example best_backend
cargo run --locked -p memgov --example llm_serving
# The three GPU examples build with the governor's feature set above, so
# that the library and its backends are not compiled again.
gpu_features="$MEMGOV_DEBUG_FEATURES"
cargo run --locked -p memgov --features "$gpu_features" --example vulkan
LD_LIBRARY_PATH="$(backends/stand-ins/build.sh cuda)" cargo run --locked -p memgov --features "$gpu_features" --example cuda
LD_LIBRARY_PATH="$(backends/stand-ins/build.sh hip)" cargo run --locked -p memgov --features "$gpu_features" --example hip
cargo run --locked -p memgov --features "$gpu_features" --example cuda | grep -q "skipped: no CUDA driver"

step "tests: Vulkan backend on lavapipe with validation layers"
cargo test --locked -p memgov-vulkan --lib
cargo test --locked -p memgov-vulkan --test vulkan
cargo test --locked -p memgov-vulkan --test vulkan_layers_env
MEMGOV_FAULT_MATRIX_BACKENDS=vulkan release_test --test fault_matrix -- --nocapture --test-threads=1
release_test --test soak_vulkan -- --nocapture
release_bench --bench vulkan_cycle -- --test

for s in scripts/ci/*.sh; do
    [ -e "$s" ] || continue
    step "reliability/perf: $s"
    bash "$s"
done

step "memgov check: every backend compiled in, CUDA and HIP on their stand-ins"
standins="$(backends/stand-ins/build.sh)"
memgov="$(release_memgov)"
LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$memgov" check 2>&1 | tee "$target/check-stand-ins.log"
for row in "cuda .*stand-in" "hip .*stand-in" "vulkan .*software driver" "host .*embedded"; do
    grep -Eq "$row" "$target/check-stand-ins.log" || { echo "FAILED: memgov check has no row matching '$row'"; exit 1; }
done
# The capabilities are probed: the CUDA stand-in offers an arena, the
# others say why they do not.
grep -q "^virtual-memory arena " "$target/check-stand-ins.log" || { echo "FAILED: memgov check printed no capabilities"; exit 1; }
if grep -Eq "^cuda: (virtual-memory arena|graph-capture gate): no" "$target/check-stand-ins.log"; then
    echo "FAILED: the CUDA stand-in offers no virtual-memory arena or no capture gate"; exit 1
fi
grep -q "^host: virtual-memory arena: no: the host backend has no virtual-memory arena" "$target/check-stand-ins.log" ||
    { echo "FAILED: memgov check did not say why the host has no arena"; exit 1; }
step "memgov check without the stand-ins: CUDA and HIP skip cleanly"
"$memgov" check 2>&1 | tee "$target/check-no-stand-ins.log"
grep -q "skipped: no CUDA driver" "$target/check-no-stand-ins.log"
grep -Eq "skipped: no HIP (device|runtime)" "$target/check-no-stand-ins.log"

step "memgov run on every backend present: device swap with verified data, JSON report"
for b in host vulkan cuda hip; do
    LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$memgov" run --backend "$b" --json > "$target/run-$b.json"
    python3 - "$b" "$target/run-$b.json" <<'PY'
import json, sys
backend, path = sys.argv[1:]
r = json.load(open(path))
assert r["backend"] == backend, r["backend"]
assert r["swap"]["verified"] is True, ("swap not verified", r["swap"])
assert r["leak"]["verdict"] == "clean" and r["leak"]["charged_bytes"] == 0, r["leak"]
a = r["arena"]
if backend in ("cuda", "hip"):
    # The virtual-memory arena slept (every mapped byte released) and woke
    # with every buffer at its address and every byte intact.
    assert a["same_addresses"] and a["intact"], a
    assert a["released_by_sleep"] == a["mapped_before_sleep"] > 0 and a["mapped_by_wake"] > 0, a
    # The governor took the sleeping buffers' bytes off the budget and
    # admitted them back on wake.
    assert a["suspended"] == a["bytes"] == a["resumed_by_wake"], a
    assert a["charged_asleep"] == a["charged_before_sleep"] - a["bytes"], a
    print(f"memgov run --backend {backend}: arena of {a['bytes']} bytes slept and woke at the same addresses")
    # A graph captured on a governed stream: its pool charged before the
    # capture and while the graph lived, given back at destroy; every
    # replay's output intact.
    c = r["capture"]
    assert c["verified"] == c["replays"] > 0, c
    assert c["charged_while_graph_lives"] >= c["charged_before"] + c["pool_bytes"] > 0, c
    assert c["charged_after_destroy"] == c["charged_before"], c
    print(f"memgov run --backend {backend}: a graph with a {c['pool_bytes']}-byte governed pool replayed {c['replays']} times")
else:
    assert a is None, a
    assert r["capture"] is None, r["capture"]
print(f"memgov run --backend {backend}: {r['swap']['buffers']} buffers moved and verified, "
      f"allocation p50/p99 {r['allocation_latency']['p50_us']:.1f}/{r['allocation_latency']['p99_us']:.1f} us, leak verdict clean")
PY
done

step "done"
echo "memgov test suite: all steps passed in $(( $(date +%s) - start ))s"
