//! The C API from C, each program plain, built with AddressSanitizer and
//! UndefinedBehaviorSanitizer, and under valgrind (`skipped:` where a tool
//! is missing):
//!
//! * `tests/c/api.c` on the host backend: bad handles, double releases and
//!   calls after retire refused; the handles of a force-retired context;
//!   racing unregisters; sized structs; budgets, pressure callbacks (and an
//!   allocation from inside one), cross-stream releases; the last-error
//!   copy; the PyTorch and ONNX Runtime allocator entry points.
//! * `tests/c/copies.c`: two copies of the library, loaded with `dlopen`
//!   from two paths, refuse each other's handles of every kind.
//! * `tests/c/stress.c`: 16 threads remove pressure callbacks while the
//!   others call them; none is entered, or still running, after its remove
//!   returned.

mod common;

use common::*;

fn check(out: &std::process::Output, lines: &[&str]) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    for line in lines {
        assert!(stdout.contains(line), "missing '{line}' in:\n{stdout}");
    }
    stdout
}

fn api(mode: Mode) {
    if !mode.available() {
        return;
    }
    library();
    let dir = scratch(&format!("api-{mode:?}"));
    let exe = dir.join("api");
    build_c(&[c_dir().join("api.c")], &exe, mode.cflags());
    let out = run_ok(&mut mode.command(&exe));
    check(
        &out,
        &[
            "bad handles, bad arguments, double releases: refused",
            "calls after retire and after device loss: refused",
            "handles of a force-retired context: MEMGOV_ERR_RETIRING",
            "MEMGOV_ERR_INVALID_HANDLE, 0 MEMGOV_ERR_BUSY",
            "allocation inside a pressure callback: depth 1, inner allocation MEMGOV_ERR_OUT_OF_MEMORY",
            "remove from inside a callback: itself MEMGOV_OK, another MEMGOV_OK, neither called again",
            "last error copy: truncated and NUL-terminated, full length returned",
            "budget 0 admits nothing, MEMGOV_UNLIMITED sets no limit: ok",
            "budget, pressure callback, record_stream, release_on, data: ok",
            "torch: alloc/free by (size, device, stream): ok",
            "ort: OrtAllocator Alloc/Free/Info/Reserve: ok",
            "api: all checks passed",
        ],
    );
    println!("api ({mode:?}): {}", mode.clean());
}

#[test]
fn c_api_from_c() {
    api(Mode::Plain);
}

#[test]
fn c_api_from_c_under_sanitizers() {
    api(Mode::Sanitizers);
}

#[test]
fn c_api_from_c_under_valgrind() {
    api(Mode::Valgrind);
}

fn copies(mode: Mode) {
    if !mode.available() {
        return;
    }
    let lib = library();
    let dir = scratch(&format!("copies-{mode:?}"));
    let (a, b) = (dir.join("a"), dir.join("b"));
    for d in [&a, &b] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::copy(&lib, d.join("libmemgov_capi.so")).unwrap();
    }
    let exe = dir.join("copies");
    build_c_dlopen(&c_dir().join("copies.c"), &exe, mode.cflags());
    let out = run_ok(
        mode.command(&exe)
            .arg(a.join("libmemgov_capi.so"))
            .arg(b.join("libmemgov_capi.so")),
    );
    check(
        &out,
        &[
            "copies: each of two copies refuses the other's handles of every kind",
            "copies: all checks passed",
        ],
    );
    println!("copies ({mode:?}): {}", mode.clean());
}

#[test]
fn two_copies_refuse_each_others_handles() {
    copies(Mode::Plain);
}

#[test]
fn two_copies_refuse_each_others_handles_under_sanitizers() {
    copies(Mode::Sanitizers);
}

#[test]
fn two_copies_refuse_each_others_handles_under_valgrind() {
    copies(Mode::Valgrind);
}

/// Registrations per thread: `MEMGOV_STRESS_ITERATIONS` or the default of
/// the mode (valgrind runs the threads one at a time, slowly).
fn iterations(mode: Mode) -> String {
    std::env::var("MEMGOV_STRESS_ITERATIONS").unwrap_or_else(|_| {
        match mode {
            Mode::Plain => "400",
            Mode::Sanitizers => "200",
            Mode::Valgrind => "25",
        }
        .to_owned()
    })
}

fn stress(mode: Mode) {
    if !mode.available() {
        return;
    }
    library();
    let dir = scratch(&format!("stress-{mode:?}"));
    let exe = dir.join("stress");
    build_c(&[c_dir().join("stress.c")], &exe, mode.cflags());
    let out = run_ok(mode.command(&exe).arg(iterations(mode)));
    check(
        &out,
        &[
            "calls, 0 calls after remove returned",
            "stress: all checks passed",
        ],
    );
    println!("stress ({mode:?}): {}", mode.clean());
}

#[test]
fn removed_callbacks_are_never_entered_again() {
    stress(Mode::Plain);
}

#[test]
fn removed_callbacks_are_never_entered_again_under_sanitizers() {
    stress(Mode::Sanitizers);
}

#[test]
fn removed_callbacks_are_never_entered_again_under_valgrind() {
    stress(Mode::Valgrind);
}
