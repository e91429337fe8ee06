#!/usr/bin/env bash
# The C ABI (capi/, package memgov-capi): the header compiled as C11 and
# C++17 with warnings as errors, the ABI layout test (every struct's size and
# offsets, every constant, every exported function against memgov.h), the C
# API tests from C and from Rust (bad handles, double releases, calls after
# retire, the PyTorch and OrtAllocator entry points), and the example plugin
# loaded by a C host that is refused unload until nothing is outstanding,
# two copies of the library refusing each other's handles, and 16 threads
# removing pressure callbacks while others call them: every C program plain,
# under AddressSanitizer with UndefinedBehaviorSanitizer, and under
# valgrind. Build output and logs go where cargo puts them
# (cargo_target_dir: CARGO_TARGET_DIR honoured). Then the allocator entry
# points, a plugin and a teardown from C, and the example plugin again, with
# the CUDA and the HIP backend compiled in, on their stand-in drivers and
# (skipping) without; the first program of docs/c-api.md, built and run
# with the page's own commands; and clippy. The runs that mostly wait on
# releases left pending (the example plugin's, the GPU test's) go in the
# background (in_background, scripts/common.sh) beside the others.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
# A C++ compiler for the C++17 header check; valgrind for the plugin test.
command -v c++ >/dev/null || apt_install g++
command -v valgrind >/dev/null || apt_install valgrind || echo "valgrind not installable: its test will print skipped"

target_dir="$(cargo_target_dir)"
mkdir -p "$target_dir"
log="$target_dir/capi.log"
echo "--- memgov-capi tests (host and null backends)"
# cargo keeps one unhashed cdylib per profile; rebuild it for this feature set.
touch capi/src/lib.rs
cargo test --locked -p memgov-capi --no-run
# The example plugin's test (tests/c_plugin.rs) mostly waits on the
# releases it leaves pending: it runs in the background (in_background,
# scripts/common.sh) beside the other tests of the package, which are named
# from cargo's metadata so that a test file added later runs too; its
# output joins theirs in the log before the checks below.
trap 'wait_background || true' EXIT
in_background "$target_dir/capi-plugin.log" cargo test --locked -p memgov-capi --test c_plugin -- --nocapture
mapfile -t capi_tests < <(cargo metadata --locked --format-version 1 --no-deps | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "memgov-capi":
        for t in p["targets"]:
            if "test" in t["kind"] and t["name"] != "c_plugin":
                print("--test"); print(t["name"])')
[ "${#capi_tests[@]}" -ge 8 ] || { echo "FAILED: cargo metadata named only ${#capi_tests[@]} arguments for memgov-capi's test files"; exit 1; }
cargo test --locked -p memgov-capi --lib --bins "${capi_tests[@]}" -- --nocapture 2>&1 | tee "$log"
cargo test --locked -p memgov-capi --doc 2>&1 | tee -a "$log"
echo "--- docs/c-api.md: the first program, built and run as the page says"
# The program, its build commands and what it prints are taken from the
# page; the commands run as written, from a scratch directory inside the
# repository (so that cargo finds the workspace) where `capi` and `target`
# lead to the real ones.
first="$(mktemp -d "$PWD/.c-api-first.XXXXXX")"
trap 'wait_background || true; rm -rf "$first"' EXIT
python3 - docs/c-api.md "$first" <<'PY'
import re, sys
page, out = sys.argv[1], sys.argv[2]
text = open(page).read()
def block(marker, lang):
    at = text.index(marker)
    return re.compile(r"```" + lang + r"\n(.*?)```", re.S).search(text, at).group(1)
for name, marker, lang in [("first.c", "<!-- first-program:", "c"),
                           ("build.sh", "<!-- first-program-build -->", "sh"),
                           ("expected.txt", "It prints:", "text")]:
    open(f"{out}/{name}", "w").write(block(marker, lang))
PY
ln -s "$PWD/capi" "$first/capi"
ln -s "$target_dir" "$first/target"
(cd "$first" && bash -euo pipefail build.sh) >"$first/printed.txt"
diff -u "$first/expected.txt" "$first/printed.txt" || { echo "FAILED: the first program of docs/c-api.md printed something else"; exit 1; }
echo "c-api.md first program: built and run with the page's commands, printed what the page says"

echo "--- memgov-capi tests (host and null backends): the checks of their output"
wait_background
cat "$target_dir/capi-plugin.log" >>"$log"
grep -q "memgov.h: C11 -Wall -Wextra -Wpedantic -Werror: ok" "$log"
grep -q "memgov.h: C++17 -Wall -Wextra -Wpedantic -Werror: ok" "$log"
grep -q "ABI layout: 7 structs, .* agree" "$log"
grep -q "memgov.h declares the .* functions the library exports" "$log"
# Each C program: plain, under ASan+UBSan, and under valgrind (skipped only
# where valgrind could not be installed).
for prog in api copies stress; do
    grep -q "^$prog (Plain): plain: clean" "$log" || { echo "FAILED: $prog did not pass plain"; exit 1; }
    grep -q "^$prog (Sanitizers): asan: clean" "$log" || { echo "FAILED: $prog did not pass under ASan+UBSan"; exit 1; }
    grep -Eq "^$prog \(Valgrind\): valgrind: clean|skipped: valgrind" "$log" || { echo "FAILED: $prog did not pass under valgrind"; exit 1; }
done
[ "$(grep -c "api: all checks passed" "$log")" -ge 2 ] || { echo "FAILED: the C API test did not pass plain and under ASan"; exit 1; }
[ "$(grep -c "host: all checks passed" "$log")" -ge 2 ] || { echo "FAILED: the plugin test did not pass plain and under ASan"; exit 1; }
grep -q "^plain: clean" "$log"
grep -q "^asan: clean" "$log"
grep -Eq "^valgrind: clean|skipped: valgrind" "$log"
grep -q "copies: each of two copies refuses the other's handles of every kind" "$log"
grep -q "stress: 16 threads x .* calls, 0 calls after remove returned" "$log"
grep -q "close from inside init: MEMGOV_ERR_BUSY, unregister: MEMGOV_ERR_BUSY" "$log"


echo "--- memgov-capi with the CUDA backend on the stand-in libcuda"
standins="$(backends/stand-ins/build.sh cuda)"
touch capi/src/lib.rs
cargo test --locked -p memgov-capi --features cuda --no-run --test c_gpu --test c_api --test header
# The GPU test (its plugin's releases pend a second each on the stand-in)
# beside the C API and header tests.
in_background "$target_dir/capi-cuda-gpu.log" env LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -p memgov-capi --features cuda --test c_gpu -- --nocapture
LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -p memgov-capi --features cuda --test c_api --test header -- --nocapture 2>&1 | tee "$target_dir/capi-cuda.log"
wait_background
cat "$target_dir/capi-cuda-gpu.log" >>"$target_dir/capi-cuda.log"
grep -q "gpu: cuda: torch pair, OrtAllocator, plugin, record_stream: 5 releases retired" "$target_dir/capi-cuda.log"
grep -q "plugin on the cuda stand-in: ok" "$target_dir/capi-cuda.log"
LD_LIBRARY_PATH="" cargo test --locked -p memgov-capi --features cuda --test c_gpu -- --nocapture 2>&1 | tee "$target_dir/capi-cuda-absent.log"
grep -q "skipped: cuda: .*no CUDA driver" "$target_dir/capi-cuda-absent.log"

echo "--- memgov-capi with the HIP backend on the stand-in libamdhip64"
apt_install libamdhip64-dev
standins="$(backends/stand-ins/build.sh hip)"
touch capi/src/lib.rs
cargo test --locked -p memgov-capi --features hip --no-run --test c_gpu
# On the stand-in in the background beside clippy (which compiles no
# library to link: it checks); then without it (the same executable: the
# two runs would share its scratch directories).
in_background "$target_dir/capi-hip.log" env LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -p memgov-capi --features hip --test c_gpu -- --nocapture

echo "--- clippy (memgov-capi)"
cargo clippy --locked -p memgov-capi --all-targets --no-deps -- -D warnings
cargo clippy --locked -p memgov-capi --all-targets --no-deps --features cuda,hip,vulkan -- -D warnings

echo "--- memgov-capi with the HIP backend: the checks of its runs"
wait_background
LD_LIBRARY_PATH="" cargo test --locked -p memgov-capi --features hip --test c_gpu -- --nocapture 2>&1 | tee "$target_dir/capi-hip-absent.log"
grep -q "gpu: hip: torch pair, OrtAllocator, plugin, record_stream: 5 releases retired" "$target_dir/capi-hip.log"
grep -q "plugin on the hip stand-in: ok" "$target_dir/capi-hip.log"
grep -Eq "skipped: hip: .*no HIP (device|runtime)" "$target_dir/capi-hip-absent.log"
# Leave the library of the default features in place for whoever runs next.
touch capi/src/lib.rs
