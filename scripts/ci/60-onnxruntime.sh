#!/usr/bin/env bash
# ONNX Runtime on governed memory: fetch the CPU library from the
# onnxruntime wheel (PyPI, pinned), point ORT_DYLIB_PATH at it, and run the
# memgov-onnxruntime crate's lints, tests and example, so that its tests run
# for real rather than skip.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust

ORT_VERSION=1.32.0
crate=examples/onnxruntime/Cargo.toml
dir=target/onnxruntime
lib="$dir/onnxruntime/capi/libonnxruntime.so.$ORT_VERSION"

# The `ort` crate needs Rust 1.92 or newer (memgov itself needs 1.82).
rust_minor=$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')
if [ "$rust_minor" -lt 92 ]; then
    echo "skipped: memgov-onnxruntime needs Rust >= 1.92; this machine has $(rustc --version)"
    exit 0
fi

if [ ! -f "$lib" ]; then
    python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
    mkdir -p "$dir"
    python3 -m pip download --quiet --no-deps "onnxruntime==$ORT_VERSION" -d "$dir"
    wheel=$(ls "$dir"/onnxruntime-"$ORT_VERSION"-*.whl | head -n 1)
    python3 - "$wheel" "$dir" "onnxruntime/capi/libonnxruntime.so.$ORT_VERSION" <<'PY'
import sys, zipfile
wheel, dest, member = sys.argv[1:]
zipfile.ZipFile(wheel).extract(member, dest)
PY
fi
export ORT_DYLIB_PATH="$PWD/$lib"
echo "ORT_DYLIB_PATH=$ORT_DYLIB_PATH"

if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --manifest-path "$crate" -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --locked --manifest-path "$crate" --all-targets -- -D warnings
fi
cargo test --locked --manifest-path "$crate" -- --nocapture 2>&1 | tee "$dir/test.log"
if grep -q '^skipped:' "$dir/test.log"; then
    echo "FAILED: the ONNX Runtime tests skipped although the library was fetched"
    exit 1
fi
cargo run --locked --manifest-path "$crate" --example matmul_add
