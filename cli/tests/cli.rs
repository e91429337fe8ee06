//! The `memgov` binary: the main job's commands exit as documented.

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
    let cases = memgov_conformance::cases::<memgov::host::HostContext>().len();
    assert!(
        row.contains("embedded") && row.contains(&format!("{cases} passed, 0 failed, 0 skipped")),
        "{row}"
    );
    assert!(out.contains("ran on real hardware: none"), "{out}");
    assert!(out.contains("embedded: host"), "{out}");
}

#[test]
fn check_without_backend_reports_skips_and_passes() {
    // No backend named: one that cannot run is a skipped row, not a failure.
    let (code, out) = memgov(&["check"]);
    assert_eq!(code, 0, "{out}");
    let row = out
        .lines()
        .find(|l| l.starts_with("null "))
        .expect("null row");
    assert!(
        row.contains("skipped: the null device stores no data"),
        "{row}"
    );
    assert!(out.contains("every case that ran passed"), "{out}");
    assert!(!out.contains("0 cases ran"), "{out}");
}

#[test]
fn check_fails_when_a_named_backend_runs_no_case() {
    // Cargo unifies features across a workspace build, so ask the tool
    // itself whether Vulkan is compiled in.
    let (_, info) = memgov(&["info"]);
    if !info.contains("build with --features vulkan") {
        println!("skipped: built with `vulkan`, so its row may run");
        return;
    }
    let (code, out) = memgov(&["check", "--backend", "vulkan"]);
    assert_eq!(code, 1, "a named backend that ran nothing must fail: {out}");
    let row = out
        .lines()
        .find(|l| l.starts_with("vulkan "))
        .expect("vulkan row");
    assert!(
        row.contains("skipped: not compiled in (build with --features vulkan)"),
        "{row}"
    );
    assert!(
        out.contains(
            "vulkan: 0 cases ran: not compiled in (build with --features vulkan). \
             It was named with --backend, so it is required."
        ),
        "{out}"
    );
    assert!(out.contains("memgov check: FAILED"), "{out}");
    assert!(!out.contains("every case that ran passed"), "{out}");
}

#[test]
fn check_names_match_in_any_case_and_as_a_comma_list() {
    let all_pass = format!(
        "{} passed, 0 failed, 0 skipped",
        memgov_conformance::cases::<memgov::host::HostContext>().len()
    );
    let (code, out) = memgov(&["check", "--backend", "HOST"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&all_pass), "{out}");
    assert!(
        out.contains("every named backend ran and every case passed"),
        "{out}"
    );

    // Both rows of the list run; the null device cannot run the suite by
    // design, so naming it fails the check and says why.
    let (code, out) = memgov(&["check", "--backend", "host,Null"]);
    assert_eq!(code, 1, "{out}");
    let host = out
        .lines()
        .find(|l| l.starts_with("host "))
        .expect("host row");
    assert!(host.contains(&all_pass), "{host}");
    assert!(
        out.lines().any(|l| l.starts_with("null ")),
        "no null row: {out}"
    );
    assert!(
        out.contains("null: 0 cases ran: the null device stores no data"),
        "{out}"
    );
    assert!(!out.contains("host: 0 cases ran"), "{out}");

    // The flag repeated is the same as a list; a name given twice runs once.
    let (code, out) = memgov(&["check", "--backend", "host", "--backend", " host"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("host ")).count(),
        1,
        "{out}"
    );
}

#[test]
fn info_lists_every_known_backend() {
    let (code, out) = memgov(&["info"]);
    assert_eq!(code, 0, "{out}");
    for name in ["host", "null", "cuda", "hip", "vulkan"] {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{name} "))),
            "no {name} row in:\n{out}"
        );
    }
}

#[test]
fn check_refuses_an_unknown_backend() {
    let (code, out) = memgov(&["check", "--backend", "tpu"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("known: host, null, cuda, hip, vulkan"),
        "{out}"
    );
    // One unknown name in a list refuses the whole list, naming it.
    let (code, out) = memgov(&["check", "--backend", "host,tpu"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("no backend is called tpu;"), "{out}");
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
    assert!(
        out.contains("0 bytes charged, 0 contract violations"),
        "{out}"
    );
    assert!(
        out.contains("no longer accepting work"),
        "a retiring context must refuse: {out}"
    );
}

/// Whether this build of the tool has the Vulkan backend (cargo unifies
/// features across a workspace build, so ask the tool itself).
fn vulkan_compiled_in() -> bool {
    let (_, info) = memgov(&["info"]);
    !info.contains("build with --features vulkan")
}

#[test]
fn info_prints_sizes_with_the_exact_bytes() {
    let (code, out) = memgov(&["info"]);
    assert_eq!(code, 0, "{out}");
    let host = out
        .lines()
        .find(|l| l.starts_with("host "))
        .expect("host row");
    // The simulated device's default capacity, in the unit and with the
    // exact count.
    let capacity = memgov::host::HostConfig::default().capacity;
    assert!(
        host.contains(&memgov::Bytes(capacity).to_string()),
        "{host}"
    );
    assert!(host.contains(" bytes)"), "{host}");
}

#[test]
fn check_json_is_one_object_and_carries_the_error_on_failure() {
    let (code, out) = memgov(&["check", "--json", "--backend", "host"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(v["tool"], "memgov check");
    assert!(v.get("error").is_none(), "{v:#}");
    let host = &v["backends"][0];
    assert_eq!(host["backend"], "host");
    assert_eq!(host["failed"], 0);
    assert_eq!(
        host["cases"].as_array().unwrap().len(),
        memgov_conformance::cases::<memgov::host::HostContext>().len()
    );
    // Capabilities beyond the contract, probed: the host has no arena, and
    // says why.
    let caps = &v["capabilities"]["host"];
    for key in ["arena", "sleep_wake", "capture_gate"] {
        assert_eq!(caps[key]["offered"], false, "{key}: {caps}");
    }
    assert!(
        caps["arena"]["why"]
            .as_str()
            .unwrap()
            .contains("CUDA and HIP only"),
        "{caps}"
    );

    // A named backend that runs nothing fails the check: still one object,
    // with the reason, and a non-zero status.
    let (code, out) = memgov(&["check", "--json", "--backend", "null"]);
    assert_eq!(code, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(v["error"], "1 named backend(s) ran no case", "{v:#}");
    assert_eq!(v["backends"][0]["ran"], false);

    // Bad usage too: the JSON error on stdout, clap's message on stderr.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memgov"))
        .args(["check", "--json", "--backend", "tpu"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("no backend is called tpu")),
        "{v:#}"
    );
}

#[test]
fn check_says_whether_the_validation_layer_was_on() {
    if !vulkan_compiled_in() {
        // No Vulkan, no validation line: the layer was never in question.
        let (code, out) = memgov(&["check", "--backend", "host"]);
        assert_eq!(code, 0, "{out}");
        assert!(!out.contains("validation layer"), "{out}");
        return;
    }
    let (code, out) = memgov(&["check", "--backend", "vulkan"]);
    let Some(line) = out
        .lines()
        .find(|l| l.starts_with("vulkan: validation layer "))
    else {
        // No Vulkan driver here: the row is skipped and no context was made.
        assert!(out.contains("vulkan: 0 cases ran"), "{out}");
        return;
    };
    assert_eq!(code, 0, "{out}");
    if line.starts_with("vulkan: validation layer on") {
        assert!(
            line.contains("0 errors, 0 warnings"),
            "a passing check saw no failure: {line}"
        );
        assert!(line.contains(" info messages"), "{line}");
    } else {
        assert!(
            line.contains("validation layer off")
                && line.contains("no validation messages were checked"),
            "{line}"
        );
    }
    let (_, out) = memgov(&["check", "--json", "--backend", "vulkan"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    let seen = &v["backends"][0]["validation"];
    assert!(seen["layer_on"].is_boolean(), "{v:#}");
    assert_eq!(seen["errors"], 0, "{v:#}");
    assert_eq!(seen["warnings"], 0, "{v:#}");
}

#[test]
fn run_names_the_feature_of_a_backend_not_compiled_in() {
    if vulkan_compiled_in() {
        println!("skipped: built with `vulkan`");
        return;
    }
    let (code, out) = memgov(&["run", "--backend", "vulkan"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("backend 'vulkan' is not compiled in (build with --features vulkan)"),
        "{out}"
    );
    let (code, out) = memgov(&["run", "--backend", "tpu"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("unknown backend 'tpu'; known: host, null, cuda, hip, vulkan"),
        "{out}"
    );
}

#[test]
fn bench_lists_its_rows_and_refuses_bad_arguments() {
    let (code, out) = memgov(&["bench", "--list"]);
    assert_eq!(code, 0, "{out}");
    for key in [
        "pin",
        "null-cycle",
        "host-cycle",
        "heap",
        "drain",
        "vulkan-cycle",
    ] {
        assert!(out.lines().any(|l| l == key), "no row {key} in:\n{out}");
    }
    let (code, out) = memgov(&["bench", "--no-such-flag"]);
    assert_eq!(code, 2, "{out}");
}

#[test]
fn bench_filter_matching_nothing_is_an_error_with_a_list_hint() {
    let (code, out) = memgov(&["bench", "--quick", "--filter", "no-such-row"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(
            "--filter 'no-such-row' matches no row; `memgov bench --list` prints the row keys"
        ),
        "{out}"
    );
    assert!(!out.contains("figure"), "no table is printed: {out}");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memgov"))
        .args(["bench", "--quick", "--json", "--filter", "no-such-row"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(
        v["error"].as_str().is_some_and(|e| e.contains("--list")),
        "{v:#}"
    );
    assert!(
        v["keys"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "pin")),
        "{v:#}"
    );
}

#[test]
fn bench_json_is_one_object_with_measured_rows() {
    let (code, out) = memgov(&["bench", "--quick", "--json", "--filter", "pin"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(v["tool"], "memgov bench");
    assert_eq!(v["mode"], "quick");
    let rows = v["rows"].as_array().expect("rows");
    let keys: Vec<_> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["pin", "boxed-pin"]);
    for r in rows {
        assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
        assert_eq!(r["target"]["kind"], "ratio_at_most");
    }
}

#[test]
fn run_writes_a_trace_that_report_turns_into_one_page() {
    let dir = std::env::temp_dir().join(format!("memgov-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, page) = (dir.join("trace.json"), dir.join("timeline.html"));
    let (code, out) = memgov(&[
        "run",
        "--requests",
        "8",
        "--steps",
        "2",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("trace: ") && out.contains("events written to"),
        "{out}"
    );
    let text = std::fs::read_to_string(&trace).unwrap();
    assert!(text.starts_with("{\"traceEvents\":["), "{}", &text[..80]);
    for kind in [
        "\"allocated\"",
        "\"released\"",
        "\"retired\"",
        "\"torn down\"",
    ] {
        assert!(text.contains(kind), "no {kind} event in the trace");
    }
    // Every buffer is on the timeline from its allocation to its release,
    // whichever way it was made (the kv-cache comes out of per-request
    // reservations), or, kept by the LLM's block cache, to the trim that
    // gave its block back (a `trimmed` event with a role): per context and
    // role, as many allocations as releases and trims, with the same bytes.
    let v: serde_json::Value = serde_json::from_str(&text).expect("the trace is JSON");
    let mut books = std::collections::BTreeMap::<(String, String), [(u64, u64); 2]>::new();
    for e in v["memgovEvents"].as_array().expect("memgovEvents") {
        let side = match e["kind"].as_str() {
            Some("allocated") => 0,
            Some("released") => 1,
            Some("trimmed") if e["role"].is_string() => 1,
            _ => continue,
        };
        let key = (
            e["context"].as_str().unwrap().to_owned(),
            e["role"].as_str().unwrap().to_owned(),
        );
        let entry = &mut books.entry(key).or_default()[side];
        entry.0 += 1;
        entry.1 += e["bytes"].as_u64().unwrap();
    }
    for ((context, role), [allocated, released]) in &books {
        assert_eq!(
            allocated, released,
            "{context} {role}: (allocations, bytes) vs (releases, bytes)"
        );
    }
    assert!(
        books
            .iter()
            .any(|((c, r), [a, _])| c.starts_with("llm") && r == "kv-cache" && a.0 > 0),
        "no kv-cache allocation of the llm context on the timeline: {books:?}"
    );
    let (code, out) = memgov(&[
        "report",
        trace.to_str().unwrap(),
        "-o",
        page.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("<canvas") || html.contains("createElement(\"canvas\")"));
    assert!(
        html.contains("\"kind\":\"allocated\""),
        "the page embeds the events"
    );
    assert!(
        !html.contains("src=\"http") && !html.contains("href=\"http"),
        "no network"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn report_refuses_a_file_that_is_not_a_memgov_trace() {
    let dir = std::env::temp_dir().join(format!("memgov-notrace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("other.json");
    std::fs::write(&file, r#"{"traceEvents":[]}"#).unwrap();
    let (code, out) = memgov(&[
        "report",
        file.to_str().unwrap(),
        "-o",
        dir.join("x.html").to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("not a memgov trace") && out.contains("memgov run --trace"),
        "{out}"
    );
    let (code, out) = memgov(&["report", dir.join("missing.json").to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("cannot read the trace"), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `memgov top` lists a process's largest call sites under its row (its
/// contexts with attribution on, published by its doorbell thread), `--json`
/// carries them, and the Prometheus page has no series per site.
#[cfg(target_os = "linux")]
#[test]
fn top_shows_a_processs_largest_sites() {
    use memgov::host::{HostConfig, HostContext};
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    use memgov::{Alloc, ContextConfig, Governor, ProcessBudget, Role, SharedBudget};
    use std::time::{Duration, Instant};
    let dir = std::env::temp_dir().join(format!("memgov-cli-top-sites-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ledger");
    let ledger =
        MachineLedger::open(&LedgerOptions::new("cli-sites", 64 << 20).path(&path)).unwrap();
    let me = ledger.join(JoinOptions::new("sites-test")).unwrap();
    let process = ProcessBudget::with_machine("sites-test", u64::MAX, me);
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .shared_budget(SharedBudget::with_parent("gpu", u64::MAX, &process))
            .attribution(true),
    );
    let stream = ctx.create_stream("s").unwrap();
    let kv = Alloc::new(3 << 20, Role::KvCache).site("kv_cache.py:88");
    let buffer = ctx.allocate(&stream, kv).unwrap();
    // Published with the process's figures (a state; 10 s bounds a broken run).
    let until = Instant::now() + Duration::from_secs(10);
    while ledger.snapshot().processes[0].sites.is_empty() {
        assert!(Instant::now() < until, "the sites were never published");
        std::thread::sleep(Duration::from_millis(1));
    }
    let p = path.to_str().unwrap();
    let (code, out) = memgov(&["top", "--path", p, "--once"]);
    assert_eq!(code, 0, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    let row = lines
        .iter()
        .position(|l| l.contains("sites-test"))
        .expect("our row");
    let site = lines[row + 1];
    assert!(
        site.contains("site") && site.contains("3.0 MiB") && site.ends_with("kv_cache.py:88"),
        "{out}"
    );
    let (code, out) = memgov(&["top", "--path", p, "--json"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["processes"][0]["sites"],
        serde_json::json!([{"site": "kv_cache.py:88", "live_bytes": 3 << 20}])
    );
    let (code, out) = memgov(&["top", "--path", p, "--prometheus"]);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("kv_cache.py"), "{out}");
    drop((buffer, stream));
    ctx.retire().wait_timeout(Duration::from_secs(10)).unwrap();
    drop((ctx, gov, process, ledger));
    std::fs::remove_dir_all(&dir).ok();
}

/// `memgov top` on a ledger this test joined: the table names the
/// process, `--json` carries its figures, and a path with no ledger is an
/// error that creates nothing.
#[cfg(target_os = "linux")]
#[test]
fn top_shows_the_machine_ledger() {
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    let dir = std::env::temp_dir().join(format!("memgov-cli-top-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ledger");
    let ledger =
        MachineLedger::open(&LedgerOptions::new("cli-test", 64 << 20).path(&path)).unwrap();
    let me = ledger
        .join(JoinOptions::new("top-test").floor(1 << 20).lease_chunk(0))
        .unwrap();
    me.charge(3 << 20).unwrap();
    let p = path.to_str().unwrap();

    let (code, out) = memgov(&["top", "--path", p, "--once"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("ledger 'cli-test'"), "{out}");
    let row = out
        .lines()
        .find(|l| l.contains("top-test"))
        .expect("our row");
    assert!(row.contains("live") && row.contains("3.0 MiB"), "{row}");

    let (code, out) = memgov(&["top", "--path", p, "--json"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["charged"], 3 << 20);
    assert_eq!(v["consistent"], true);
    let procs = v["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0]["name"], "top-test");
    assert_eq!(procs[0]["pid"], std::process::id());
    assert_eq!(procs[0]["floor"], 1 << 20);

    // A name key names no device a management library could be asked
    // about: said, not guessed.
    assert_eq!(v["outside_process_list"], serde_json::Value::Null);
    assert!(
        v["outside_process_list_missing"]
            .as_str()
            .unwrap()
            .contains("names no device by UUID or PCI address"),
        "{v}"
    );

    let missing = dir.join("none");
    let (code, out) = memgov(&["top", "--path", missing.to_str().unwrap(), "--json"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("\"error\""), "{out}");
    assert!(!missing.exists(), "top created a segment");
    drop(me);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `memgov top` on a ledger keyed by a device UUID lists the processes on
/// the device that have no slot, as NVML reports them: run with NVML's
/// stand-in on the library path (scripts/ci/35-machine.sh), it must list
/// them; without NVML it says why there is no list.
#[cfg(target_os = "linux")]
#[test]
fn top_lists_the_processes_outside_memgov() {
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    // The NVML stand-in's device 0.
    let key = "gpu-6d656d67-6f76-2d73-7461-6e64696e0000";
    let dir = std::env::temp_dir().join(format!("memgov-cli-top-nvml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ledger");
    let procs = dir.join("processes");
    let me = std::process::id();
    std::fs::write(&procs, format!("0 {me} 1048576\n0 4000001 209715200\n")).unwrap();
    let ledger = MachineLedger::open(&LedgerOptions::new(key, 1 << 30).path(&path)).unwrap();
    let member = ledger
        .join(JoinOptions::new("top-nvml").lease_chunk(0))
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .args(["top", "--path", path.to_str().unwrap(), "--once"])
        .env("MEMGOV_STANDIN_NVML_PROCESSES", &procs)
        .output()
        .expect("run memgov");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    if text.contains("skipped: no libnvidia-ml.so.1") {
        println!("skipped: no libnvidia-ml.so.1 on the library path (NVML's stand-in lists the processes in CI)");
    } else {
        assert!(text.contains("outside memgov on the device:"), "{text}");
        let row = text
            .lines()
            .find(|l| l.trim_start().starts_with("4000001"))
            .unwrap_or_else(|| panic!("no row for the outside process: {text}"));
        assert!(row.contains("200.0 MiB"), "{row}");
        assert!(
            !text
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{me} ")) && l.contains("1.0 MiB")),
            "this process has a slot, yet it is listed as outside: {text}"
        );
        println!("memgov top listed pid 4000001 (200.0 MiB) outside memgov, from NVML");
    }
    drop(member);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_refuses_an_empty_backend_name_naming_the_flag() {
    for args in [
        &["check", "--backend", ""][..],
        &["check", "--backend", "host,"],
        &["check", "--backend", " "],
    ] {
        let (code, out) = memgov(args);
        assert_eq!(code, 2, "{args:?}: {out}");
        assert!(out.contains("--backend"), "{args:?}: {out}");
        assert!(out.contains("empty"), "{args:?}: {out}");
        assert!(out.contains("host"), "known names listed: {out}");
        assert!(!out.contains("[\""), "no debug quoting: {out}");
    }
}

/// `memgov top` for a key no process has joined: it says so, names the
/// key, lists the ledgers that exist (each with the flag that shows it),
/// names `--device KEY`, names no Rust API, and creates nothing.
#[cfg(target_os = "linux")]
#[test]
fn top_without_a_ledger_says_no_process_joined_and_lists_the_ledgers() {
    use memgov::machine::{LedgerOptions, MachineLedger};
    let key = format!("cli-nobody-{}", std::process::id());
    let (code, out) = memgov(&["top", "--device", &key, "--once"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("no process has joined key '{key}'")),
        "{out}"
    );
    assert!(out.contains("--device KEY"), "{out}");
    assert!(out.contains("ledgers on this machine"), "{out}");
    assert!(!out.contains("LedgerOptions"), "a Rust API named: {out}");
    assert!(!memgov::machine::default_path(&key).exists());

    // With --path: the ledgers in that directory are listed by key, with
    // the --path that shows each.
    let dir = std::env::temp_dir().join(format!("memgov-cli-top-list-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let there = dir.join("memgov-cli-listed");
    let _ledger =
        MachineLedger::open(&LedgerOptions::new("cli-listed", 64 << 20).path(&there)).unwrap();
    let absent = dir.join("memgov-absent");
    let (code, out) = memgov(&["top", "--path", absent.to_str().unwrap(), "--once"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no process has joined"), "{out}");
    assert!(out.contains("'cli-listed'"), "{out}");
    assert!(
        out.contains(&format!("--path {}", there.display())),
        "{out}"
    );
    assert!(!out.contains("LedgerOptions"), "a Rust API named: {out}");
    assert!(!absent.exists(), "top created a segment");

    let (code, out) = memgov(&["top", "--path", absent.to_str().unwrap(), "--json"]);
    assert_eq!(code, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(
        out.lines()
            .take_while(|l| !l.starts_with("memgov top:"))
            .collect::<Vec<_>>()
            .join("\n")
            .as_str(),
    )
    .unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("no process has joined"),
        "{v}"
    );
    assert_eq!(v["ledgers"][0]["key"], "cli-listed", "{v}");
}

/// `memgov top` names where a process's limit came from when the cluster
/// granted it (`JoinOptions::granted`), in the table and in `--json`, and
/// shows `-` for a limit that was not granted.
#[cfg(target_os = "linux")]
#[test]
fn top_names_the_granted_limit() {
    use memgov::granted::granted_limit;
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    let dir = std::env::temp_dir().join(format!("memgov-cli-top-granted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ledger");
    let ledger =
        MachineLedger::open(&LedgerOptions::new("cli-granted", 64 << 20).path(&path)).unwrap();
    let env = |name: &str| (name == "CUDA_DEVICE_MEMORY_LIMIT_0").then(|| "16m".to_owned());
    let grant = granted_limit(0, None, env).unwrap().unwrap();
    let granted = ledger
        .join(JoinOptions::new("hami-pod").granted(&grant))
        .unwrap();
    let plain = ledger.join(JoinOptions::new("plain-pod")).unwrap();
    let p = path.to_str().unwrap();

    let (code, out) = memgov(&["top", "--path", p, "--once"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("LIMIT FROM"), "{out}");
    let row = out.lines().find(|l| l.contains("hami-pod")).expect("row");
    assert!(
        row.contains("16.0 MiB") && row.ends_with("  CUDA_DEVICE_MEMORY_LIMIT_0"),
        "{row}"
    );
    let row = out.lines().find(|l| l.contains("plain-pod")).expect("row");
    assert!(row.ends_with("  -"), "{row}");

    let (code, out) = memgov(&["top", "--path", p, "--json"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let procs = v["processes"].as_array().unwrap();
    let by = |n: &str| procs.iter().find(|p| p["name"] == n).unwrap().clone();
    assert_eq!(by("hami-pod")["limit_from"], "CUDA_DEVICE_MEMORY_LIMIT_0");
    assert_eq!(by("hami-pod")["limit"], 16 << 20);
    assert_eq!(by("plain-pod")["limit_from"], serde_json::Value::Null);
    drop((granted, plain));
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `memgov run` counts, its trace counts too, context by context
/// (allocations, releases retired or abandoned, budget refusals of
/// allocations and of reservations, pressure, reservations made and the
/// blocks allocated out of them), and the page `memgov report` makes of the
/// trace titles each context with the peak its snapshot reports.
#[test]
fn the_trace_counts_what_the_run_counts_and_the_page_shows_the_snapshots_peaks() {
    let dir = std::env::temp_dir().join(format!("memgov-counts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, page) = (dir.join("trace.json"), dir.join("timeline.html"));
    let out = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .args(["run", "--json", "--requests", "12", "--steps", "3"])
        .args(["--op-delay-us", "0", "--trace", trace.to_str().unwrap()])
        .output()
        .expect("run memgov");
    assert!(out.status.success(), "{out:?}");
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json");
    let text = std::fs::read_to_string(&trace).unwrap();
    let t: serde_json::Value = serde_json::from_str(&text).expect("the trace is JSON");
    let events = t["memgovEvents"].as_array().expect("memgovEvents");
    // The refusals the run provokes on purpose are not budget refusals.
    let provoked: Vec<&str> = run["expected_refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["error"].as_str().unwrap())
        .collect();
    let count = |context: &str, kind: &str| {
        events
            .iter()
            .filter(|e| e["context"] == context && e["kind"] == kind)
            .filter(|e| !provoked.contains(&e["note"].as_str().unwrap_or("")))
            .count() as u64
    };
    for c in run["per_context"].as_array().unwrap() {
        let name = c["context"].as_str().unwrap();
        for (kind, figure) in [
            ("allocated", "allocations"),
            ("pressure", "pressure_events"),
            ("refused", "refusals"),
            ("retired", "retired"),
            ("abandoned", "abandoned"),
        ] {
            assert_eq!(
                count(name, kind),
                c[figure].as_u64().unwrap(),
                "{name}: '{kind}' events against the run's {figure}"
            );
        }
        // A backend allocation ends in a release, or, kept by the block
        // cache, in its block's trim; a cached block is reused or trimmed.
        let blocks = events
            .iter()
            .filter(|e| e["context"] == name && e["kind"] == "trimmed" && e["role"].is_string())
            .count() as u64;
        let allocated = count(name, "allocated");
        assert_eq!(count(name, "released") + blocks, allocated, "{name}");
        assert_eq!(
            count(name, "cached"),
            count(name, "reused") + blocks,
            "{name}"
        );
    }
    let total = |kind: &str| events.iter().filter(|e| e["kind"] == kind).count() as u64;
    // The LLM's block cache is on the timeline: each hit a `reused` event.
    let hits = run["cache"]["hits"].as_u64().unwrap();
    assert_eq!(total("reused"), hits, "{}", run["cache"]);
    assert!(
        total("cached") > 0,
        "the run's cache kept no block: {}",
        run["cache"]
    );
    let kv = &run["kv_reservations"];
    assert_eq!(
        total("reserved"),
        kv["reserved"].as_u64().unwrap() + kv["reserved_after_eviction"].as_u64().unwrap(),
        "{kv}"
    );
    assert!(total("reserved") > 0, "the run reserves KV capacity: {kv}");
    let out_of_reservations = events
        .iter()
        .filter(|e| e["kind"] == "allocated" && e["note"].is_string())
        .count() as u64;
    assert_eq!(out_of_reservations, kv["blocks_out_of_reservations"]);

    let (code, out) = memgov(&[
        "report",
        trace.to_str().unwrap(),
        "-o",
        page.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    let html = std::fs::read_to_string(&page).unwrap();
    let data = html
        .split_once("const DATA = ")
        .and_then(|(_, rest)| rest.split_once(";\n"))
        .map(|(data, _)| data)
        .expect("the page's data");
    let data: serde_json::Value = serde_json::from_str(data).expect("the page's data is JSON");
    let peaks = run["peak_bytes"]["per_context"].as_array().unwrap();
    assert_eq!(peaks.len(), 3);
    for c in peaks {
        assert_eq!(c["peak_exact"], true, "{c}");
        let name = c["context"].as_str().unwrap();
        assert_eq!(data["peaks"][name], c["peak"], "{name}: the page's peak");
    }
    std::fs::remove_dir_all(&dir).ok();
}
