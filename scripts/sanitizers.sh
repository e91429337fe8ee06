#!/usr/bin/env bash
# The host backend's tests once under AddressSanitizer (LeakSanitizer is part
# of ASan on x86_64 Linux and reports leaks at exit), then the same test
# binaries under valgrind --leak-check=full as a toolchain-independent leak
# check. -Zsanitizer needs a nightly rustc.
set -euo pipefail
cd "$(dirname "$0")/.."
TESTS=(--test conformance_host --test bad_input --test fault_matrix)
echo "== AddressSanitizer + LeakSanitizer (nightly) =="
CARGO_TARGET_DIR=target-asan RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" \
  cargo +nightly test -p memgov --target x86_64-unknown-linux-gnu "${TESTS[@]}"
echo "== valgrind --leak-check=full (stable) =="
export CARGO_TARGET_DIR=target-valgrind
for t in bad_input fault_matrix; do
  bin=$(cargo test --release -p memgov --test "$t" --no-run --message-format=json 2>/dev/null \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
  valgrind --leak-check=full --errors-for-leak-kinds=definite --error-exitcode=1 -q "$bin" --test-threads=1
done
