#!/usr/bin/env bash
# The host backend's tests once under AddressSanitizer (LeakSanitizer is part
# of ASan on x86_64 Linux and reports leaks at exit), then the same test
# binaries under valgrind --leak-check=full as a toolchain-independent leak
# check. -Zsanitizer needs a nightly rustc. Then the C API's C programs
# (capi/tests/c: the API, two copies of the library, the 16-thread pressure
# callback stress, the example plugin and its host) built with
# -fsanitize=address,undefined and run under valgrind. Build output goes
# under cargo's target directory (CARGO_TARGET_DIR honoured).
set -euo pipefail
cd "$(dirname "$0")/.."
target_dir="$(cargo metadata --locked --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
TESTS=(--test conformance_host --test bad_input --test fault_matrix)
echo "== AddressSanitizer + LeakSanitizer (nightly) =="
CARGO_TARGET_DIR="$target_dir/sanitizers-asan" RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" \
  cargo +nightly test -p memgov --target x86_64-unknown-linux-gnu "${TESTS[@]}"
echo "== valgrind --leak-check=full (stable) =="
for t in bad_input fault_matrix; do
  bin=$(CARGO_TARGET_DIR="$target_dir/sanitizers-valgrind" \
        cargo test --release -p memgov --test "$t" --no-run --message-format=json 2>/dev/null \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
  valgrind --leak-check=full --errors-for-leak-kinds=definite --error-exitcode=1 -q "$bin" --test-threads=1
done
echo "== the C API's C programs: ASan + UBSan, valgrind =="
log="$target_dir/sanitizers-capi.log"
# cargo keeps one unhashed cdylib per profile: rebuild it for the default
# features, whatever was built last.
touch capi/src/lib.rs
cargo test --locked -p memgov-capi --test c_api --test c_plugin -- --nocapture \
    under_sanitizers under_address_sanitizer under_valgrind 2>&1 | tee "$log"
for prog in api copies stress; do
  grep -q "^$prog (Sanitizers): asan: clean" "$log" || { echo "FAILED: $prog under ASan+UBSan"; exit 1; }
  grep -q "^$prog (Valgrind): valgrind: clean" "$log" || { echo "FAILED: $prog under valgrind"; exit 1; }
done
grep -q "^asan: clean" "$log" && grep -q "^valgrind: clean" "$log" ||
  { echo "FAILED: the example plugin under ASan+UBSan or valgrind"; exit 1; }
