//! `memgov run` on every backend that needs no GPU: the device swap through
//! `migrate`, the report, and `--json` that parses.

use std::process::Command;

/// `memgov run` with a small workload (6 requests of 4 steps, no simulated
/// delay), each of those settings overridden where `args` gives it.
fn run(args: &[&str]) -> (i32, String, String) {
    run_env(args, &[])
}

/// The variables of the granted-limit family (`memgov::granted`).
const GRANTED: [&str; 3] = [
    "MEMGOV_DEVICE_LIMIT",
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
];

/// [`run`] with `vars` set, and no other variable of the granted-limit
/// family.
fn run_env(args: &[&str], vars: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memgov"));
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if GRANTED.iter().any(|g| k.starts_with(g)) {
            cmd.env_remove(k);
        }
    }
    cmd.envs(vars.iter().copied());
    let defaults = [
        ("--requests", "6"),
        ("--steps", "4"),
        ("--op-delay-us", "0"),
    ];
    let out = cmd
        .arg("run")
        .args(
            defaults
                .iter()
                .filter(|(flag, _)| !args.contains(flag))
                .flat_map(|(flag, value)| [*flag, *value]),
        )
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
        "pressure events:",
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
        assert_eq!(v["expected_refusals"].as_array().unwrap().len(), 2, "{v:#}");
        assert_eq!(v["teardown"].as_array().unwrap().len(), 3);
        assert!(v["peak_bytes"]["max"].as_u64().unwrap() >= 128 << 20);
        assert!(v["swap"]["buffers"].as_u64().unwrap() >= 8);
        // Every request either reserved its KV capacity (at once or after
        // evicting) or says it went without; blocks came out of them.
        let kv = &v["kv_reservations"];
        let n = |k: &str| kv[k].as_u64().unwrap_or_else(|| panic!("{k}: {v:#}"));
        assert_eq!(
            n("reserved") + n("reserved_after_eviction") + n("unreserved"),
            v["requests"].as_u64().unwrap(),
            "{kv:#}"
        );
        assert!(n("blocks_out_of_reservations") > 0, "{kv:#}");
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

/// A budget too small for every request's KV cache: reservations are made
/// after offloading resident blocks to the pinned host tier, which never
/// holds more than its limit.
#[test]
fn kv_blocks_go_to_the_pinned_tier_under_pressure() {
    for backend in ["host", "null"] {
        let (code, out, err) = run(&["--backend", backend, "--llm-budget-mib", "150", "--json"]);
        assert_eq!(code, 0, "{backend}: {out}{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["leak"]["verdict"], "clean", "{v:#}");
        let n = |k: &str| v["kv_reservations"][k].as_u64().unwrap();
        assert!(n("reserved_after_eviction") > 0, "{v:#}");
        let pinned = &v["pinned_tier"];
        let p = |k: &str| pinned[k].as_u64().unwrap_or_else(|| panic!("{k}: {v:#}"));
        assert!(p("offloaded_blocks") > 0, "{pinned:#}");
        // Activations of varying sizes hit the block cache, whose bytes
        // never take the device's peak past 1.25x of its live peak (its
        // limit is an eighth of the weights alone).
        let cache = &v["cache"];
        let c = |k: &str| cache[k].as_u64().unwrap_or_else(|| panic!("{k}: {v:#}"));
        assert!(c("hits") > 0, "{cache:#}");
        assert!(
            c("live_and_cached_peak") * 4 <= c("live_peak") * 5,
            "{cache:#}"
        );
        assert!(
            p("peak_bytes") > 0 && p("peak_bytes") <= p("limit"),
            "{pinned:#}"
        );
    }
}

#[test]
fn an_unknown_backend_is_refused_with_the_list() {
    let (code, out, err) = run(&["--backend", "tpu"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("unknown backend 'tpu'"), "{err}");
}

#[test]
fn provoked_refusals_are_marked_as_expected() {
    let (code, out, err) = run(&["--backend", "host"]);
    assert_eq!(code, 0, "{out}{err}");
    let refused = out
        .lines()
        .find(|l| l.contains("allocation on the retiring context"))
        .expect("the allocation on the retiring context");
    assert!(
        refused.contains("(refused, as expected): ")
            && refused.contains("no longer accepting work"),
        "{refused}"
    );
    let unfinished = out
        .lines()
        .find(|l| l.contains("retire while the plugin holds its pin"))
        .expect("the retire the plugin holds up");
    assert!(
        unfinished.contains("(not finished, as expected): ")
            && unfinished.contains("held by 'tokenizer-plugin'"),
        "{unfinished}"
    );
    assert!(
        out.contains("expected refusals: 2 provoked on purpose and seen"),
        "{out}"
    );

    let (code, out, err) = run(&["--backend", "host", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let what: Vec<_> = v["expected_refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["what"].as_str().unwrap())
        .collect();
    assert_eq!(
        what,
        [
            "allocation on the retiring context",
            "retire while the plugin holds its pin"
        ]
    );
}

/// Every duration the text prints is `<n>.<3 digits> ms`: one unit, one
/// precision, from microsecond latencies to whole-run times.
#[test]
fn durations_read_in_one_unit_and_precision() {
    let (code, out, err) = run(&["--backend", "host"]);
    assert_eq!(code, 0, "{out}{err}");
    // No number runs into a unit of its own (`60.6µs`, `1.2s`, `435.03ms`).
    for line in out.lines() {
        for unit in ["ns", "µs", "ms", "s"] {
            for (i, _) in line.match_indices(unit) {
                let glued = line[..i].ends_with(|c: char| c.is_ascii_digit());
                assert!(!glued, "{unit:?} glued to a number in {line}");
            }
        }
        assert!(!line.contains("µs"), "{line}");
    }
    let mut durations = 0;
    for line in out.lines() {
        for (i, _) in line.match_indices(" ms") {
            let number = line[..i].rsplit(' ').next().unwrap();
            let (whole, decimals) = number
                .split_once('.')
                .unwrap_or_else(|| panic!("{number:?} has no decimals in {line}"));
            assert!(
                whole.chars().all(|c| c.is_ascii_digit())
                    && decimals.len() == 3
                    && decimals.chars().all(|c| c.is_ascii_digit()),
                "{number:?} in {line}"
            );
            durations += 1;
        }
    }
    // Two latencies of two percentiles, the swap, the held-up retire, three
    // teardowns (each twice), the run, the per-op delay.
    assert!(durations >= 12, "only {durations} durations in:\n{out}");
}

#[test]
fn empty_samples_print_n_a() {
    // No request: no release is ever timed.
    let (code, out, err) = run(&["--backend", "host", "--requests", "0"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("release-to-retire latency: n/a (0 samples)"),
        "{out}"
    );
    assert!(
        out.contains("allocation latency:        p50 "),
        "the weights were still timed: {out}"
    );
    let (code, out, err) = run(&["--backend", "host", "--requests", "0", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let r = &v["release_to_retire_latency"];
    assert_eq!(r["samples"], 0, "{v:#}");
    assert!(r["p50_us"].is_null() && r["p99_us"].is_null(), "{v:#}");
}

/// Admission waits and pressure events are one count each, printed once, the
/// sum of the per-context counts printed beside it (and in the JSON).
#[test]
fn admission_waits_are_one_count_over_the_run() {
    // An LLM budget just above its weights: the KV cache meets pressure.
    let (code, out, err) = run(&["--backend", "host", "--llm-budget-mib", "150"]);
    assert_eq!(code, 0, "{out}{err}");
    for what in ["admission waits", "pressure events"] {
        let lines: Vec<_> = out.lines().filter(|l| l.contains(what)).collect();
        assert_eq!(lines.len(), 1, "{what} printed once: {lines:#?}");
        let line = lines[0];
        let total: u64 = line
            .split(&format!("{what}: "))
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no total in {line}"));
        let inner = &line[line.find('(').unwrap() + 1..line.find(')').unwrap()];
        let sum: u64 = inner
            .split(", ")
            .map(|c| c.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum();
        assert_eq!(total, sum, "{line}");
    }

    let (code, out, err) = run(&["--backend", "host", "--llm-budget-mib", "150", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // The budget presses: the block cache gives back first, responders after.
    assert!(
        v["pressure_events"].as_u64().unwrap() > 0
            || v["cache"]["released_under_pressure"].as_u64().unwrap() > 0,
        "the budget was meant to press: {v:#}"
    );
    let per = v["per_context"].as_array().unwrap();
    assert_eq!(per.len(), 3, "{v:#}");
    for key in ["admission_waits", "pressure_events", "allocations"] {
        let sum: u64 = per.iter().map(|c| c[key].as_u64().unwrap()).sum();
        assert_eq!(v[key].as_u64(), Some(sum), "{key}: {v:#}");
    }
}

#[test]
fn a_failing_json_run_prints_a_json_error() {
    // The weights do not fit the LLM's budget: the run fails in phase 1.
    let (code, out, err) = run(&["--backend", "host", "--llm-budget-mib", "64", "--json"]);
    assert_eq!(code, 1, "{out}{err}");
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{out}"));
    let error = v["error"].as_str().expect("an error member");
    assert!(
        error.contains("cannot admit 16.0 MiB (16777216 bytes) of weights"),
        "{error}"
    );
    assert_eq!(v["backend"], "host");
    assert!(err.contains("memgov run: FAILED"), "{err}");

    // Bad usage under --json: still an object on stdout, status 2.
    let (code, out, _) = run(&["--backend", "tpu", "--json"]);
    assert_eq!(code, 2);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("unknown backend 'tpu'")),
        "{v:#}"
    );
}

#[test]
fn a_run_that_fails_half_way_retires_every_context_it_registered() {
    // The weights do not fit the LLM's budget: the run fails in phase 1 with
    // weight shards live and, at 200 us per device operation, their
    // stream-ordered releases still queued when the error returns. The run
    // tears every context down before it exits, and says so.
    let failing = [
        "--backend",
        "host",
        "--llm-budget-mib",
        "64",
        "--op-delay-us",
        "200",
    ];
    let (code, out, err) = run(&failing);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("memgov run: the run ended early; retiring the 2 contexts it left"),
        "{out}"
    );
    for label in ["llm@gpu0", "embedder@gpu0"] {
        assert!(
            out.contains(&format!("'{label}': retired")),
            "{label}: {out}"
        );
        assert!(
            out.contains(&format!("'{label}': ")) && out.contains("backend ok"),
            "{label}: {out}"
        );
    }
    assert!(!out.contains("on the way out:"), "{out}");
    assert!(
        err.contains("memgov run: retired the 2 contexts the run left, every teardown clean"),
        "{err}"
    );

    // The same under --json: the error object lists the teardowns.
    let (code, out, err) = run(&[&failing[..], &["--json"]].concat());
    assert_eq!(code, 1, "{out}{err}");
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{out}"));
    let retired = v["retired_on_exit"].as_array().expect("retired_on_exit");
    assert_eq!(retired.len(), 2, "{v:#}");
    for r in retired {
        assert_eq!(r["how"], "retired", "{v:#}");
        assert_eq!(r["backend_ok"], true, "{v:#}");
        assert_eq!(r["lost"], false, "{v:#}");
    }
    assert_eq!(
        v["exit_problems"].as_array().map(Vec::len),
        Some(0),
        "{v:#}"
    );
}

/// A bad flag value is refused before any work: the message names the flag,
/// the status is 2 (bad usage), and nothing of the workload ran (no phase
/// line, no trace written).
fn refused_before_work(args: &[&str], flag: &str) {
    let (code, stdout, stderr) = run(args);
    assert_eq!(code, 2, "{args:?}: stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.contains(flag), "{args:?} must name {flag}: {stderr}");
    assert!(
        !stdout.contains("phase") && !stderr.contains("phase"),
        "{args:?} ran the workload before refusing: {stdout}{stderr}"
    );
}

#[test]
fn zero_device_or_budget_mib_is_refused_naming_the_flag() {
    refused_before_work(&["--device-mib", "0"], "--device-mib");
    refused_before_work(&["--llm-budget-mib", "0"], "--llm-budget-mib");
}

#[test]
fn a_trace_in_a_missing_directory_is_refused_before_the_run() {
    let dir = std::env::temp_dir().join(format!("memgov-no-such-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let file = dir.join("t.json");
    refused_before_work(&["--trace", file.to_str().unwrap()], "--trace");
    let (_, _, stderr) = run(&["--trace", file.to_str().unwrap()]);
    assert!(stderr.contains(&dir.display().to_string()), "{stderr}");
    assert!(!file.exists());
    // A directory is not a file to write the trace into.
    let tmp = std::env::temp_dir();
    refused_before_work(&["--trace", tmp.to_str().unwrap()], "--trace");
}

#[test]
fn a_trace_in_a_read_only_directory_is_refused_before_the_run() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("memgov-read-only-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::File::create(dir.join("probe")).is_ok() {
        // root writes anywhere: the directory is not read-only to us.
        let _ = std::fs::remove_file(dir.join("probe"));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        println!("skipped: this user writes into a mode 0555 directory (root)");
        return;
    }
    let file = dir.join("t.json");
    refused_before_work(&["--trace", file.to_str().unwrap()], "--trace");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bytes of the table's short form: `0 bytes`, `512 B`, `1.5 KiB`,
/// `188.0 MiB`, `2.0 GiB`.
fn short_bytes(s: &str) -> f64 {
    let (n, unit) = s.trim().split_once(' ').unwrap_or_else(|| panic!("{s:?}"));
    let n: f64 = n.parse().unwrap_or_else(|_| panic!("{s:?}"));
    n * match unit {
        "bytes" | "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        _ => panic!("unit of {s:?}"),
    }
}

/// The snapshot table keeps the tiers apart: the device-tier columns of
/// the LLM context never add up past its budget (the KV blocks offloaded to
/// the pinned host tier have a column of their own); a legend explains the
/// `pins` column, broken down to its total, and the `refused` column; the
/// report's budget-refusal line, next to the expected refusals, adds the
/// column up.
#[test]
fn the_table_keeps_the_tiers_apart_and_explains_pins_and_refusals() {
    let budget_mib = 150u64;
    let (code, out, err) = run(&[
        "--backend",
        "host",
        "--llm-budget-mib",
        &budget_mib.to_string(),
        "--requests",
        "12",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("device tier (the context's budget)") && l.contains("pinned host")),
        "{out}"
    );
    // Columns after the state: weights, kv-cache, activ., reserved, cached,
    // pending (device tier), kv-cache (pinned host), pins, retired, refused.
    let rows = |label: &str| -> Vec<Vec<String>> {
        lines
            .iter()
            .filter(|l| l.trim_start().starts_with(&format!("{label} ")))
            .map(|l| {
                let cells: Vec<&str> = l.split_whitespace().collect();
                // Sizes are two words ("188.0 MiB"); counts one.
                let mut out = vec![cells[0].to_owned(), cells[1].to_owned()];
                let mut i = 2;
                while i < cells.len() {
                    if cells
                        .get(i + 1)
                        .is_some_and(|u| ["bytes", "B", "KiB", "MiB", "GiB"].contains(u))
                    {
                        out.push(format!("{} {}", cells[i], cells[i + 1]));
                        i += 2;
                    } else {
                        out.push(cells[i].to_owned());
                        i += 1;
                    }
                }
                out
            })
            .collect()
    };
    let llm = rows("llm@gpu0");
    assert!(llm.len() >= 2, "{out}");
    let mut saw_pinned = false;
    for row in &llm {
        assert_eq!(row.len(), 12, "{row:?}");
        let device: f64 = row[2..8].iter().map(|c| short_bytes(c)).sum();
        assert!(
            device <= (budget_mib << 20) as f64,
            "device-tier columns {device} B past the {budget_mib} MiB budget: {row:?}"
        );
        saw_pinned |= short_bytes(&row[8]) > 0.0;
    }
    assert!(
        saw_pinned,
        "no KV block reached the pinned host tier: {out}"
    );

    let pins = lines
        .iter()
        .find(|l| l.trim_start().starts_with("pins: "))
        .unwrap_or_else(|| panic!("no pins legend: {out}"));
    let first_pins: u64 = llm[0][9].parse().unwrap();
    assert!(
        pins.contains(&format!("'llm@gpu0' {first_pins} = 8 buffers + ")),
        "{pins}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.trim_start().starts_with("refused: ")),
        "no refused legend: {out}"
    );

    let at = lines
        .iter()
        .position(|l| l.contains("expected refusals: 2 provoked on purpose"))
        .unwrap_or_else(|| panic!("{out}"));
    let budget = lines[at - 1];
    let last_refused: u64 = ["llm@gpu0", "embedder@gpu0", "llm@gpu1"]
        .iter()
        .map(|l| rows(l).last().unwrap()[11].parse::<u64>().unwrap())
        .sum();
    assert!(last_refused > 0, "{out}");
    assert!(
        budget.contains(&format!("budget refusals: {last_refused} over the run"))
            && budget.contains("`refused` column"),
        "{budget}"
    );
}

/// `memgov run` prints who holds what by call site: every row names a line
/// of the workload's source, the largest first; `--snapshot` writes the
/// same figures, which `memgov report` prints as a page, and
/// `--snapshot-on-refusal` the refusing context's.
#[test]
fn the_run_shows_a_per_site_table_and_writes_snapshots_the_report_reads() {
    let dir = std::env::temp_dir().join(format!("memgov-sites-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (snap, on_refusal) = (dir.join("after.json"), dir.join("refused.json"));
    // A budget the workload outgrows: refusals, answered by making room.
    let (code, out, err) = run(&[
        "--backend",
        "host",
        "--llm-budget-mib",
        "150",
        "--snapshot",
        snap.to_str().unwrap(),
        "--snapshot-on-refusal",
        on_refusal.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.contains("-- by call site"))
        .skip(2)
        .take_while(|l| l.contains("cli/src/workload.rs:"))
        .collect();
    assert!(table.len() >= 2, "no per-site table in:\n{out}");
    // Largest first, within each context. Columns: live (a number and a
    // unit), count, peak (two words), allocs, refused, context, site.
    let cells = |l: &str| -> Vec<String> { l.split_whitespace().map(str::to_owned).collect() };
    let live = |l: &str| short_bytes(&format!("{} {}", cells(l)[0], cells(l)[1]));
    for pair in table.windows(2) {
        let same_context = cells(pair[0])[7] == cells(pair[1])[7];
        assert!(!same_context || live(pair[0]) >= live(pair[1]), "{pair:?}");
    }
    assert!(table.iter().any(|l| cells(l)[7] == "llm@gpu0"), "{table:?}");
    // The snapshot file lists the same sites, and the report prints them.
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&snap).unwrap()).unwrap();
    let llm = v["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["label"] == "llm@gpu0")
        .expect("llm@gpu0 in the snapshot");
    let top = &llm["sites"][0];
    assert!(
        top["site"]
            .as_str()
            .unwrap()
            .starts_with("cli/src/workload.rs:"),
        "{top}"
    );
    assert!(top["live_bytes"].as_u64().unwrap() > 0, "{top}");
    let page = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .arg("report")
        .arg(&snap)
        .output()
        .unwrap();
    let page = String::from_utf8_lossy(&page.stdout);
    assert!(page.contains("context 'llm@gpu0'"), "{page}");
    assert!(page.contains(top["site"].as_str().unwrap()), "{page}");
    // The run's budget refuses reservations (it makes room and tries
    // again): the hook wrote the refusing context's snapshot, with sites.
    let refused: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&on_refusal).unwrap()).unwrap();
    assert!(
        refused["label"].as_str().unwrap().starts_with("llm@"),
        "{refused:#}"
    );
    let held: u64 = refused["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["live_bytes"].as_u64().unwrap())
        .sum();
    assert!(held > 0, "{refused:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `memgov report OLD NEW`: the site that grew, first, with both figures.
#[test]
fn the_report_of_two_snapshots_names_what_grew_first() {
    let dir = std::env::temp_dir().join(format!("memgov-diff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let site = |name: &str, live: u64, count: u64| {
        serde_json::json!({"site": name, "label": null, "live_bytes": live, "live_count": count,
            "peak_bytes": live, "allocations": count, "refusals": 0})
    };
    let snap = |sites: Vec<serde_json::Value>| serde_json::json!({"contexts": [{"label": "llm", "by_role": [], "sites": sites}]});
    let old = snap(vec![
        site("src/kv.rs:10:5", 4096, 1),
        site("src/w.rs:3:9", 1 << 20, 1),
    ]);
    let new = snap(vec![
        site("src/kv.rs:10:5", 40960, 10),
        site("src/w.rs:3:9", 1 << 20, 1),
    ]);
    let (a, b) = (dir.join("old.json"), dir.join("new.json"));
    std::fs::write(&a, old.to_string()).unwrap();
    std::fs::write(&b, new.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .arg("report")
        .args([&a, &b])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let first = text
        .lines()
        .find(|l| l.contains("src/"))
        .unwrap_or_else(|| panic!("no site in:\n{text}"));
    assert_eq!(
        first.split_whitespace().collect::<Vec<_>>(),
        [
            "+36.0",
            "KiB",
            "4.0",
            "KiB",
            "40.0",
            "KiB",
            "1->10",
            "src/kv.rs:10:5"
        ],
        "{text}"
    );
    assert!(
        !text.contains("src/w.rs"),
        "an unchanged site is not listed:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The process level above the run's device budget says where its limit
/// came from: the table, the JSON and the report of a snapshot name the
/// variable the cluster set, or "set by the program"; a variable that does
/// not read stops the run naming it.
#[test]
fn the_process_limit_names_where_it_came_from() {
    let dir = std::env::temp_dir().join(format!("memgov-limit-from-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = dir.join("after.json");
    let (code, out, err) = run_env(
        &["--backend", "host", "--snapshot", snap.to_str().unwrap()],
        &[("MEMGOV_DEVICE_LIMIT", "0=64GiB")],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.lines()
            .any(|l| l.trim()
                == "process level 'memgov run': 64.0 GiB, granted by MEMGOV_DEVICE_LIMIT"),
        "{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&snap).unwrap()).unwrap();
    let llm = v["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["label"] == "llm@gpu0")
        .expect("llm@gpu0 in the snapshot");
    assert_eq!(
        llm["process_limit"],
        serde_json::json!({
            "label": "memgov run",
            "limit": 64u64 << 30,
            "from": {"kind": "granted", "variable": "MEMGOV_DEVICE_LIMIT"},
        })
    );
    let page = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .arg("report")
        .arg(&snap)
        .output()
        .unwrap();
    let page = String::from_utf8_lossy(&page.stdout);
    assert!(
        page.contains(
            "  process level 'memgov run': 64.0 GiB limit, granted by MEMGOV_DEVICE_LIMIT\n"
        ),
        "{page}"
    );

    // Nothing set: the program's own (no) limit, in the JSON report too.
    let (code, out, err) = run_env(&["--backend", "host", "--json"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // The contexts on gpu0 are under the process level; gpu1's budget is
    // its context's own.
    let per = v["per_context"].as_array().unwrap();
    assert!(per.iter().any(|c| c["context"] == "llm@gpu0"), "{v:#}");
    for c in per {
        let want = if c["context"].as_str().unwrap().ends_with("@gpu0") {
            serde_json::json!({"kind": "program"})
        } else {
            serde_json::Value::Null
        };
        assert_eq!(c["process_limit"]["from"], want, "{c}");
    }
    let (code, out, err) = run_env(&["--backend", "host"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.lines()
            .any(|l| l.trim() == "process level 'memgov run': no limit, set by the program"),
        "{out}"
    );

    // A value that is no limit: the run stops, naming the variable.
    let (code, out, err) = run_env(
        &["--backend", "host"],
        &[("CUDA_DEVICE_MEMORY_LIMIT_0", "4gb")],
    );
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        format!("{out}{err}").contains("CUDA_DEVICE_MEMORY_LIMIT_0=\"4gb\""),
        "{out}{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
