//! `tests/c/gpu.c`: the allocator entry points, a plugin and a teardown on
//! the GPU backends compiled in (`--features cuda`, `--features hip`), on
//! whichever driver the library path offers: the stand-ins in CI
//! (`backends/stand-ins/build.sh`), a real GPU where one is reachable.
//! Without a driver the program prints `skipped: ...` and passes.

#![cfg(any(feature = "cuda", feature = "hip"))]

mod common;

use common::*;
use std::process::Command;

fn run(backend: &str) {
    library();
    let dir = scratch(&format!("gpu-{backend}"));
    let exe = dir.join("gpu");
    build_c(&[c_dir().join("gpu.c")], &exe, &[]);
    let out = run_ok(Command::new(&exe).arg(backend));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("gpu: all checks passed") || stdout.starts_with("skipped: "),
        "{stdout}"
    );
}

#[cfg(feature = "cuda")]
#[test]
fn allocator_entry_points_on_cuda() {
    run("cuda");
}

#[cfg(feature = "hip")]
#[test]
fn allocator_entry_points_on_hip() {
    run("hip");
}
