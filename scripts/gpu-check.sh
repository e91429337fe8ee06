#!/usr/bin/env bash
# The CUDA backend on a real NVIDIA GPU. Two halves, so that the GPU machine
# needs no network and no Rust toolchain:
#
#   scripts/gpu-check.sh prepare [DIR]   # on a build machine (default DIR: gpu-check/ in cargo's target directory)
#       builds, in release mode with the `cuda` feature, the CUDA test binary,
#       the fault-matrix test binary, the cuda_cycle bench binary and the
#       `memgov` binary, and copies them with this script into DIR.
#   DIR/gpu-check.sh run [DIR]           # on the GPU machine (x86_64 Linux, NVIDIA driver)
#       runs the CUDA conformance and backend tests, the fault matrix row,
#       `memgov check --backend cuda`, the CUDA bench row and, where
#       compute-sanitizer exists, the conformance tests under it with leak
#       checking; prints a short report and exits non-zero if a step failed.
#
# The stand-in must NOT be on LD_LIBRARY_PATH there: `run` refuses to go on
# unless the tests report "real hardware". (MEMGOV_GPU_CHECK_ALLOW_STAND_IN=1
# lets it go on with the stand-in, to try the script itself without a GPU;
# its report then says "stand-in".)
set -uo pipefail

mode="${1:-}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

prepare() {
    set -e
    local root dir
    root="$(cd "$here/.." && pwd)"
    cd "$root"
    # Default: gpu-check/ under cargo's target directory.
    dir="${1:-$(cargo metadata --locked --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/gpu-check}"
    mkdir -p "$dir"
    # The executable of the target named $1 in cargo's JSON messages (other
    # artifacts, such as the memgov binary built for integration tests, are
    # reported too).
    exe_of() {
        grep "\"kind\":\[\"$2\"\]" | grep "\"name\":\"$1\"" |
            grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//' | tail -1
    }
    local cuda matrix bench memgov
    cuda="$(cargo test --locked --release -p memgov-cuda --test cuda --no-run --message-format=json 2>/dev/null | exe_of cuda test)"
    matrix="$(cargo test --locked --release -p memgov --features cuda --test fault_matrix --no-run --message-format=json 2>/dev/null | exe_of fault_matrix test)"
    bench="$(cargo bench --locked -p memgov-cli --features cuda --bench cuda_cycle --no-run --message-format=json 2>/dev/null | exe_of cuda_cycle bench)"
    # Where cargo says it put the binary: under CARGO_TARGET_DIR (or a
    # configured target-dir) when set, not necessarily ./target.
    memgov="$(cargo build --locked --release -p memgov-cli --features cuda --bin memgov --message-format=json 2>/dev/null | exe_of memgov bin)"
    for f in "$cuda" "$matrix" "$bench" "$memgov"; do
        if [ -z "$f" ] || [ ! -x "$f" ]; then
            echo "gpu-check prepare: a test, bench or memgov binary was not found in cargo's output" >&2
            exit 1
        fi
    done
    cp "$cuda" "$dir/cuda-tests"
    cp "$matrix" "$dir/fault-matrix"
    cp "$bench" "$dir/cuda-cycle-bench"
    cp "$memgov" "$dir/memgov"
    cp "$here/gpu-check.sh" "$dir/gpu-check.sh"
    git rev-parse HEAD > "$dir/commit" 2>/dev/null || true
    echo "prepared $dir; copy it to the GPU machine and run: $dir/gpu-check.sh run"
}

run() {
    local dir="${1:-$here}"
    local report=() failed=0
    cd "$dir" || exit 2
    log() { echo; echo "=== $*"; }
    note() { report+=("$*"); }
    step() { # name, command...
        local name="$1"; shift
        log "$name"
        if "$@" 2>&1 | tee "$dir/$name.log"; [ "${PIPESTATUS[0]}" -eq 0 ]; then
            note "$name: ok"
        else
            note "$name: FAILED (see $dir/$name.log)"
            failed=1
        fi
    }
    log "machine"
    date -u
    uname -srm
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$dir/gpu.txt"
    else
        echo "nvidia-smi not found" | tee "$dir/gpu.txt"
    fi
    [ -f commit ] && echo "memgov commit $(cat commit)"

    step conformance ./cuda-tests whole_suite_report --exact --nocapture
    if grep -q "(stand-in)" "$dir/conformance.log" && [ "${MEMGOV_GPU_CHECK_ALLOW_STAND_IN:-0}" = 1 ]; then
        note "conformance: ran on the STAND-IN (MEMGOV_GPU_CHECK_ALLOW_STAND_IN=1): a dry run of this script, not a GPU check"
    elif ! grep -q "(real hardware)" "$dir/conformance.log"; then
        note "conformance: did not run on real hardware (stand-in on LD_LIBRARY_PATH, or no driver): stopping"
        printf '%s\n' "" "gpu-check report:" "${report[@]}"
        exit 1
    fi
    step cuda-tests ./cuda-tests --test-threads=1
    step fault-matrix ./fault-matrix fault_matrix_cuda --exact --nocapture --test-threads=1
    step memgov-check ./memgov check --backend cuda
    step bench-row ./cuda-cycle-bench --bench
    if command -v compute-sanitizer >/dev/null; then
        step sanitizer compute-sanitizer --tool memcheck --leak-check full --error-exitcode 1 \
            ./cuda-tests conformance:: --test-threads=1
    else
        note "sanitizer: skipped: compute-sanitizer not found"
    fi
    local ratio
    ratio="$(grep -o 'ratio [0-9.]*' "$dir/bench-row.log" 2>/dev/null | tail -1)"
    printf '%s\n' "" "gpu-check report ($(cat "$dir/gpu.txt"))" "${report[@]}" "bench: ${ratio:-no figure} (target <= 1.05)"
    exit "$failed"
}

case "$mode" in
prepare) shift; prepare "$@" ;;
run) shift; run "$@" ;;
*)
    echo "usage: $0 prepare [DIR]   (build machine)  |  $0 run [DIR]   (GPU machine)" >&2
    exit 2
    ;;
esac
