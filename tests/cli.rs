//! The `memgov` binary: the main job's commands exit as documented.
#![cfg(feature = "cli")]

use std::process::Command;

fn memgov(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .args(args)
        .output()
        .expect("run memgov");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn check_prints_the_host_row_and_passes() {
    let (code, out) = memgov(&["check", "--backend", "host"]);
    assert_eq!(code, 0, "{out}");
    let row = out
        .lines()
        .find(|l| l.starts_with("host "))
        .expect("host row");
    assert!(
        row.contains("embedded") && row.contains("11 passed, 0 failed, 0 skipped"),
        "{row}"
    );
    assert!(out.contains("ran on real hardware: none"), "{out}");
    assert!(out.contains("embedded: host"), "{out}");
}

#[test]
fn check_says_why_a_backend_is_skipped() {
    let (code, out) = memgov(&["check", "--backend", "cuda"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("skipped: not part of this build"), "{out}");
}

#[test]
fn check_refuses_an_unknown_backend() {
    let (code, out) = memgov(&["check", "--backend", "tpu"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("known: host, vulkan, cuda, hip"), "{out}");
}

#[test]
fn run_serves_swaps_and_ends_at_zero() {
    let (code, out) = memgov(&[
        "run",
        "--requests",
        "6",
        "--steps",
        "4",
        "--op-delay-us",
        "0",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("memgov run: ok"), "{out}");
    assert!(out.contains("0 B charged, 0 contract violations"), "{out}");
    assert!(
        out.contains("is no longer accepting work"),
        "a retiring context must refuse: {out}"
    );
}
