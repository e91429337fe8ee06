//! `memgov run` on every backend that needs no GPU: the device swap through
//! `migrate`, the report, and `--json` that parses.

use std::process::Command;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .arg("run")
        .args(["--requests", "6", "--steps", "4", "--op-delay-us", "0"])
        .args(args)
        .output()
        .expect("run memgov");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn host_run_reports_every_figure_and_a_verified_swap() {
    let (code, out, err) = run(&["--backend", "host"]);
    assert_eq!(code, 0, "{out}{err}");
    for needle in [
        "data verified",
        "allocation latency:        p50",
        "release-to-retire latency: p50",
        "admission waits:",
        "teardown wait 'llm@gpu0'",
        "peak 'llm@gpu1'",
        "leak verdict: clean",
        "memgov run: ok",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
}

#[test]
fn json_parses_and_carries_the_same_report() {
    for backend in ["host", "null"] {
        let (code, out, err) = run(&["--backend", backend, "--json"]);
        assert_eq!(code, 0, "{backend}: {out}{err}");
        let v: serde_json::Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("{backend}: stdout is not JSON ({e}):\n{out}"));
        assert_eq!(v["backend"], backend);
        assert_eq!(v["leak"]["verdict"], "clean", "{v:#}");
        assert_eq!(v["leak"]["charged_bytes"], 0);
        assert!(v["allocations"].as_u64().unwrap() > 0);
        assert!(v["allocation_latency"]["samples"].as_u64().unwrap() > 0);
        assert!(v["release_to_retire_latency"]["p99_us"].as_f64().is_some());
        assert_eq!(v["teardown"].as_array().unwrap().len(), 3);
        assert!(v["peak_bytes"]["max"].as_u64().unwrap() >= 128 << 20);
        assert!(v["swap"]["buffers"].as_u64().unwrap() >= 8);
        // The null backend stores nothing: its swap cannot be verified, and
        // says so instead of claiming it.
        let verified = if backend == "null" {
            serde_json::Value::Null
        } else {
            serde_json::Value::Bool(true)
        };
        assert_eq!(v["swap"]["verified"], verified, "{v:#}");
    }
}

#[test]
fn an_unknown_backend_is_refused_with_the_list() {
    let (code, out, err) = run(&["--backend", "tpu"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("unknown backend 'tpu'"), "{err}");
}
