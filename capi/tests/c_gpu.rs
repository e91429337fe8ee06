//! `tests/c/gpu.c`: the allocator entry points, a plugin and a teardown on
//! the GPU backends compiled in (`--features cuda`, `--features hip`), on
//! whichever driver the library path offers: the stand-ins in CI
//! (`backends/stand-ins/build.sh`), a real GPU where one is reachable.
//! Without a driver the program prints `skipped: ...` and passes.
//!
//! On a stand-in driver the example plugin runs too (`tests/c/host.c` with
//! the backend named): it writes through the device pointer from the host,
//! which only a stand-in allows.

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

/// The example plugin on a stand-in driver whose every queued operation
/// takes 1 s (its latency knob), so that releases really pend.
fn plugin_on_stand_in(backend: &str, latency_knob: &str) {
    library();
    let dir = scratch(&format!("plugin-{backend}"));
    let (plugin, host) = (dir.join("plugin.so"), dir.join("host"));
    build_plugin(&c_dir().join("plugin.c"), &plugin, &[]);
    build_c(&[c_dir().join("host.c")], &host, &[]);
    let out = run_ok(
        Command::new(&host)
            .arg(&plugin)
            .arg(backend)
            .env(latency_knob, "1000000"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    for line in [
        "close after run: MEMGOV_ERR_BUSY: streams 1, buffers 2 (8192 B), pending releases 1, pin sources 1, pins 1, callbacks 1",
        "close after releasing the rest: MEMGOV_OK",
        "host: all checks passed",
    ] {
        assert!(stdout.contains(line), "missing '{line}' in:\n{stdout}");
    }
    println!("plugin on the {backend} stand-in: ok");
}

#[cfg(feature = "cuda")]
#[test]
fn allocator_entry_points_on_cuda() {
    run("cuda");
}

#[cfg(feature = "cuda")]
#[test]
fn plugin_on_the_cuda_stand_in() {
    use memgov::DeviceContext;
    match memgov::cuda::CudaContext::new(Default::default()) {
        Ok(c) if c.is_stand_in() => c.teardown(false).expect("teardown"),
        Ok(c) => {
            c.teardown(false).expect("teardown");
            println!("skipped: a real CUDA driver; the plugin writes device memory from the host");
            return;
        }
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    }
    plugin_on_stand_in("cuda", "MEMGOV_STANDIN_CUDA_LATENCY_US");
}

#[cfg(feature = "hip")]
#[test]
fn allocator_entry_points_on_hip() {
    run("hip");
}

#[cfg(feature = "hip")]
#[test]
fn plugin_on_the_hip_stand_in() {
    use memgov::DeviceContext;
    match memgov::hip::HipContext::new(Default::default()) {
        Ok(c) if c.is_stand_in() => c.teardown(false).expect("teardown"),
        Ok(c) => {
            c.teardown(false).expect("teardown");
            println!("skipped: a real HIP device; the plugin writes device memory from the host");
            return;
        }
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    }
    plugin_on_stand_in("hip", "MEMGOV_STANDIN_HIP_LATENCY_US");
}
