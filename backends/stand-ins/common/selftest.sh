#!/usr/bin/env bash
# Builds common/selftest.c against common/standin.c and runs every case:
# the passing ones must print "ok", the planted violations must abort with
# "contract violation". Then builds the CUDA and HIP stand-ins and runs
# common/differences.c on each: the documented differences their tables
# give the shared virtual memory imitation (common/sq_vmm.c). Exits
# non-zero on the first case that does not pass.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
# cargo_target_dir: cargo's target directory (CARGO_TARGET_DIR, a configured
# build.target-dir, or ./target).
source "$root/scripts/common.sh"
out="${MEMGOV_STANDIN_DIR:-$(cargo_target_dir)/stand-ins}"
mkdir -p "$out"
"${CC:-cc}" -std=gnu11 -Wall -Wextra -Werror -O2 -g -pthread -I"$here" \
    -o "$out/selftest" "$here/selftest.c" "$here/standin.c"
for c in ordered synced destroyed-wait host-free-synced inits; do
    got="$("$out/selftest" "$c" || echo "exit $?")"
    [ "$got" = ok ] || { echo "selftest $c: expected ok, got '$got'" >&2; exit 1; }
done
got="$(SELFTEST_LATENCY_US=300 SELFTEST_LATENCY_SEED=7 "$out/selftest" seeded)"
[ "$got" = ok ] || { echo "selftest seeded: expected ok, got '$got'" >&2; exit 1; }
for c in unordered-free early-event event-after-destroy host-free-during-copy seed-malformed; do
    seed=""
    [ "$c" = seed-malformed ] && seed=-1
    if err="$(SELFTEST_LATENCY_SEED=$seed "$out/selftest" "$c" 2>&1)"; then
        echo "selftest $c: exited 0, expected a contract violation" >&2
        exit 1
    fi
    case "$err" in
    *"contract violation"*) ;;
    *) echo "selftest $c: no contract violation in: $err" >&2; exit 1 ;;
    esac
done
echo "stand-in common self-test: 11 cases passed" >&2

# The vendors' documented differences, on the built stand-ins.
hip_header="${HIP_PATH:-/usr}/include/hip/hip_runtime_api.h"
with_hip=()
[ -f "$hip_header" ] && with_hip=(-DWITH_HIP "-I${HIP_PATH:-/usr}/include")
"${CC:-cc}" -std=gnu11 -Wall -Wextra -Werror -O2 -g "${with_hip[@]}" \
    -o "$out/differences" "$here/differences.c" -ldl
libs="$(MEMGOV_STANDIN_DIR="$out" "$here/../build.sh" cuda)"
got="$("$out/differences" cuda "$libs/libcuda.so.1")"
[ "$got" = ok ] || { echo "stand-in differences cuda: expected ok, got '$got'" >&2; exit 1; }
if [ ${#with_hip[@]} -eq 0 ]; then
    echo "skipped: the HIP stand-in's differences: $hip_header not found (install libamdhip64-dev or set HIP_PATH)" >&2
else
    libs="$(MEMGOV_STANDIN_DIR="$out" "$here/../build.sh" hip)"
    got="$("$out/differences" hip "$libs/libamdhip64.so.5")"
    [ "$got" = ok ] || { echo "stand-in differences hip: expected ok, got '$got'" >&2; exit 1; }
fi
echo "stand-in vendor differences: passed" >&2
