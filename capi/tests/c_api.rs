//! `tests/c/api.c`: the C API from C on the host backend (bad handles,
//! double releases and calls after retire refused; sized structs; budgets,
//! pressure callbacks, cross-stream releases; the PyTorch and ONNX Runtime
//! allocator entry points), plain and under AddressSanitizer.

mod common;

use common::*;
use std::process::Command;

fn run(name: &str, extra: &[&str]) -> String {
    library();
    let dir = scratch(name);
    let exe = dir.join("api");
    build_c(&[c_dir().join("api.c")], &exe, extra);
    let out = run_ok(Command::new(&exe).env("ASAN_OPTIONS", "detect_leaks=1"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "bad handles, bad arguments, double releases: refused",
        "calls after retire and after device loss: refused",
        "budget, pressure callback, record_stream, release_on, data: ok",
        "torch: alloc/free by (size, device, stream): ok",
        "ort: OrtAllocator Alloc/Free/Info/Reserve: ok",
        "api: all checks passed",
    ] {
        assert!(stdout.contains(line), "missing '{line}' in:\n{stdout}");
    }
    stdout
}

#[test]
fn c_api_from_c() {
    run("api", &[]);
}

#[test]
fn c_api_from_c_under_address_sanitizer() {
    run(
        "api-asan",
        &["-fsanitize=address", "-fno-omit-frame-pointer"],
    );
}
