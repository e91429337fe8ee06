//! `memgov`: inspect backends, run the conformance matrix, run a demonstration
//! workload, and measure the governor's overhead.
//!
//! The backends come from the library's one list, `memgov::any::BACKENDS`:
//! every backend memgov knows gets a row, and one compiled out of this build
//! says which feature builds it.

#![deny(unsafe_op_in_unsafe_fn)]

mod bench;
#[cfg(target_os = "linux")]
mod exporter;
mod report;
mod snapshots;
#[cfg(target_os = "linux")]
mod top;
mod workload;

use clap::{Parser, Subcommand};
use memgov::any::{AnyContext, BackendEntry, BACKENDS};
use memgov::{Bytes, DeviceContext};
use memgov_conformance::{self as conformance, Outcome, SuiteReport};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};

/// Counts heap bytes for `memgov bench`'s heap rows; one relaxed load per
/// allocation while no count is running.
#[global_allocator]
static ALLOC: bench::CountingAllocator = bench::CountingAllocator::new();

#[derive(Parser)]
#[command(
    name = "memgov",
    version,
    about = "Governs GPU memory for ML runtimes across vendors"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the backends memgov knows and the devices they can reach.
    Info,
    /// Run the conformance suite on every backend compiled in and present,
    /// and print the matrix. Exits non-zero if any case fails, or if a
    /// backend named with `--backend` ran no case.
    Check {
        /// Only these backends, and each of them required: one that runs no
        /// case (not compiled in, no driver, no device) fails the check.
        /// Names as `memgov info` lists them, in any case; repeat the flag or
        /// give a comma list (`--backend host,null`). Default: every backend,
        /// and one that cannot run is reported as skipped.
        #[arg(
            long = "backend",
            value_name = "NAME[,NAME]",
            value_delimiter = ',',
            value_parser = backend_name
        )]
        backends: Vec<String>,
        /// Print one JSON object on stdout instead of the matrix; on failure
        /// it carries `"error"`.
        #[arg(long)]
        json: bool,
    },
    /// Run a serving-style workload on any backend (default: host): weights,
    /// KV cache under pressure, a device swap with live data, and a report.
    Run(workload::RunArgs),
    /// Measure the governor against its baselines (see docs/performance.md).
    Bench(bench::BenchArgs),
    /// Turn a trace (`memgov run --trace FILE`) into one self-contained HTML
    /// page plotting live, pending and cached bytes over time; print a
    /// snapshot (`memgov run --snapshot FILE`) as who holds what, by role
    /// and call site, or two snapshots as what grew between them.
    Report(report::ReportArgs),
    /// The machine ledger a device's processes share: every process, its
    /// limit, floor, charges and caches, and the bytes in use outside
    /// memgov, redrawn in place (`--once`: printed once; `--json`: one
    /// snapshot).
    #[cfg(target_os = "linux")]
    Top(top::TopArgs),
    /// Serve every machine ledger on the machine (the `memgov-*` segments
    /// in /dev/shm and those named with --ledger) as a Prometheus /metrics
    /// page, with the device figures NVML / ROCm SMI give
    /// (docs/metrics.md).
    #[cfg(target_os = "linux")]
    Exporter(exporter::ExporterArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    match cli.command {
        Command::Info => info(),
        Command::Check { backends, json } => check(&backends, json),
        Command::Run(args) => workload::run(args),
        Command::Bench(args) => ExitCode::from(bench::main(&args)),
        Command::Report(args) => report::main(&args),
        #[cfg(target_os = "linux")]
        Command::Top(args) => top::main(&args),
        #[cfg(target_os = "linux")]
        Command::Exporter(args) => exporter::main(&args),
    }
}

/// Bad usage: clap's message on stderr and status 2, and under `--json` also
/// a JSON error object on stdout, so that a script reading stdout gets JSON
/// whatever went wrong. Help and version go out as clap prints them.
fn usage_error(e: clap::Error) -> ExitCode {
    let json = std::env::args().skip(1).any(|a| a == "--json");
    if json && e.use_stderr() {
        let text = e.render().to_string();
        let first = text.lines().next().unwrap_or_default();
        print_json_error(first.trim_start_matches("error: "), serde_json::json!({}));
    }
    let _ = e.print();
    ExitCode::from(if e.use_stderr() { 2 } else { 0 })
}

/// Under `--json`, a failure is still one JSON object on stdout:
/// `{"error": "...", ...}` with `fields` merged in.
pub(crate) fn print_json_error(error: &str, fields: serde_json::Value) {
    let mut object = serde_json::json!({ "error": error });
    if let (Some(o), serde_json::Value::Object(extra)) = (object.as_object_mut(), fields) {
        o.extend(extra);
    }
    println!("{object:#}");
}

/// What the Vulkan validation layer saw while the suite ran: on how many of
/// the contexts it was on, and its messages by severity.
#[derive(Debug, Default, Clone, Copy)]
struct ValidationSeen {
    contexts: u64,
    layer_on: u64,
    errors: u64,
    warnings: u64,
    infos: u64,
}

impl ValidationSeen {
    fn line(&self, backend: &str) -> String {
        let layer = "VK_LAYER_KHRONOS_validation";
        if self.layer_on == 0 {
            format!(
                "{backend}: validation layer off ({layer} is not installed): no validation messages were checked; install vulkan-validationlayers to check them"
            )
        } else {
            format!(
                "{backend}: validation layer on ({layer}) for {} of {} contexts: {} errors, {} warnings, {} info messages",
                self.layer_on, self.contexts, self.errors, self.warnings, self.infos
            )
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "layer_on": self.layer_on > 0,
            "contexts": self.contexts,
            "contexts_with_layer": self.layer_on,
            "errors": self.errors,
            "warnings": self.warnings,
            "infos": self.infos,
        })
    }
}

/// Run the suite on a compiled-in backend with its own checking on
/// ([`AnyContext::open_for_check`]), holding every context's probe to a
/// clean teardown (one teardown, nothing left, no contract violation; on
/// Vulkan with validation, no validation message). Returns the report, a
/// note on how many contexts the probes checked, and on Vulkan what the
/// validation layer saw.
fn run(
    entry: &BackendEntry,
    kind: memgov::any::BackendKind,
) -> (SuiteReport, Option<String>, Option<ValidationSeen>) {
    let contexts = AtomicU32::new(0);
    #[cfg(feature = "vulkan")]
    let seen = std::sync::Mutex::new(Vec::new());
    let report = conformance::run_suite_probed(|| {
        let c = AnyContext::open_for_check(kind)?;
        contexts.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "vulkan")]
        if let AnyContext::Vulkan(v) = &c {
            if let Ok(mut seen) = seen.lock() {
                seen.push((v.validation_layer_on(), v.validation()));
            }
        }
        let probe = c.probe();
        Ok((c, probe))
    });
    let note = report.execution.map(|_| {
        format!(
            "{}: the backend probes of {} contexts were checked after every case",
            entry.name,
            contexts.load(Ordering::Relaxed)
        )
    });
    #[cfg(feature = "vulkan")]
    let validation = {
        let seen = seen.into_inner().unwrap_or_else(|e| e.into_inner());
        (!seen.is_empty()).then(|| {
            seen.iter()
                .fold(ValidationSeen::default(), |acc, (on, v)| ValidationSeen {
                    contexts: acc.contexts + 1,
                    layer_on: acc.layer_on + u64::from(*on),
                    errors: acc.errors + v.validation_errors(),
                    warnings: acc.warnings + v.validation_warnings(),
                    infos: acc.infos + v.validation_infos(),
                })
        })
    };
    #[cfg(not(feature = "vulkan"))]
    let validation = None;
    (report, note, validation)
}

fn info() -> ExitCode {
    println!("memgov {}", env!("CARGO_PKG_VERSION"));
    println!(
        "{:<8} {:<40} {:<16} memory",
        "backend", "device", "how it runs"
    );
    for entry in BACKENDS {
        let Some(kind) = entry.kind else {
            println!(
                "{:<8} skipped: {}",
                entry.name,
                entry.not_compiled_in().unwrap_or_default()
            );
            continue;
        };
        match AnyContext::open(kind) {
            Ok(c) => {
                let d = c.describe();
                let memory = match d.total_bytes {
                    u64::MAX => "unbounded".to_owned(),
                    bytes => Bytes(bytes).to_string(),
                };
                println!(
                    "{:<8} {:<40} {:<16} {memory} ({})",
                    entry.name,
                    truncate(&d.name, 40),
                    d.execution.to_string(),
                    d.driver
                );
                let _ = c.teardown(false);
            }
            Err(e) => println!(
                "{:<8} skipped: {}",
                entry.name,
                conformance::unavailable_reason(&e)
            ),
        }
    }
    ExitCode::SUCCESS
}

/// One `--backend` name of `check`: refused when empty (an empty flag, or a
/// comma list with an empty item), listing the names there are.
fn backend_name(name: &str) -> Result<String, String> {
    if name.trim().is_empty() {
        let known: Vec<_> = BACKENDS.iter().map(|b| b.name).collect();
        return Err(format!(
            "an empty backend name; give one of: {}",
            known.join(", ")
        ));
    }
    Ok(name.to_owned())
}

/// The backends `--backend` names, in `BACKENDS` order, each once; names
/// match in any case and surrounding blanks are ignored. `Err` names those
/// that match no backend.
fn named_backends(names: &[String]) -> Result<Vec<&'static BackendEntry>, Vec<String>> {
    let wanted: Vec<String> = names
        .iter()
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    let unknown: Vec<String> = wanted
        .iter()
        .filter(|n| !BACKENDS.iter().any(|b| b.name == n.as_str()))
        .cloned()
        .collect();
    if !unknown.is_empty() || wanted.is_empty() {
        return Err(unknown);
    }
    Ok(BACKENDS
        .iter()
        .filter(|b| wanted.iter().any(|n| n == b.name))
        .collect())
}

/// What `memgov check` found for one backend.
struct BackendResult {
    name: &'static str,
    /// The suite's report, or why it could not run at all.
    report: Result<SuiteReport, String>,
    validation: Option<ValidationSeen>,
}

fn check(only: &[String], json: bool) -> ExitCode {
    // Text goes to stdout unless `--json`, which prints one object instead.
    let say = |line: &str| {
        if !json {
            println!("{line}");
        }
    };
    // Naming a backend means requiring it: one that runs no case fails the
    // check, so that a job asking for a backend cannot pass having run none.
    let required = !only.is_empty();
    let rows: Vec<&BackendEntry> = if required {
        match named_backends(only) {
            Ok(rows) => rows,
            Err(unknown) => {
                let known: Vec<_> = BACKENDS.iter().map(|b| b.name).collect();
                let error = format!(
                    "memgov check: no backend is called {}; known: {}",
                    if unknown.is_empty() {
                        format!("{only:?}")
                    } else {
                        unknown.join(", ")
                    },
                    known.join(", ")
                );
                if json {
                    print_json_error(&error, serde_json::json!({ "known": known }));
                }
                eprintln!("{error}");
                return ExitCode::from(2);
            }
        }
    } else {
        BACKENDS.iter().collect()
    };
    if required {
        let names: Vec<_> = rows.iter().map(|r| r.name).collect();
        say(&format!(
            "memgov check: the conformance suite on {} (required)\n",
            names.join(", ")
        ));
    } else {
        say("memgov check: the conformance suite on every backend compiled in\n");
    }
    let mut results: Vec<BackendResult> = Vec::new();
    let mut notes = Vec::new();
    for entry in &rows {
        match entry.kind {
            Some(kind) => {
                let (report, note, validation) = run(entry, kind);
                notes.extend(note);
                notes.extend(validation.map(|v| v.line(entry.name)));
                let report = if report.execution.is_some() {
                    Ok(report)
                } else {
                    // No context could be made: every case was skipped for
                    // the same reason; say it once.
                    let why = report.cases.iter().find_map(|c| match &c.outcome {
                        Outcome::Skipped(why) => Some(why.clone()),
                        _ => None,
                    });
                    Err(why.unwrap_or(report.device))
                };
                results.push(BackendResult {
                    name: entry.name,
                    report,
                    validation,
                });
            }
            None => results.push(BackendResult {
                name: entry.name,
                report: Err(entry.not_compiled_in().unwrap_or_default()),
                validation: None,
            }),
        }
    }

    say(&format!(
        "{:<8} {:<36} {:<16} result",
        "backend", "device", "how it ran"
    ));
    for r in &results {
        match &r.report {
            Ok(rep) => {
                let how = rep
                    .execution
                    .map_or_else(|| "not run".to_owned(), |e| e.to_string());
                let (p, f, s) = rep.counts();
                say(&format!(
                    "{:<8} {:<36} {:<16} {p} passed, {f} failed, {s} skipped",
                    r.name,
                    truncate(&rep.device, 36),
                    how
                ));
            }
            Err(why) => say(&format!(
                "{:<8} {:<36} {:<16} skipped: {why}",
                r.name, "-", "not run"
            )),
        }
    }

    let ran: Vec<(&str, &SuiteReport)> = results
        .iter()
        .filter_map(|r| r.report.as_ref().ok().map(|rep| (r.name, rep)))
        .collect();
    if let Some((_, first)) = ran.first() {
        say("");
        let mut header = format!("{:<40}", "case");
        for (n, _) in &ran {
            header.push_str(&format!(" {n:<10}"));
        }
        say(header.trim_end());
        for (i, case) in first.cases.iter().enumerate() {
            let mut line = format!("{:<40}", case.name);
            for (_, rep) in &ran {
                let cell = match &rep.cases[i].outcome {
                    Outcome::Passed => "pass",
                    Outcome::Failed(_) => "FAIL",
                    Outcome::Skipped(_) => "skipped",
                };
                line.push_str(&format!(" {cell:<10}"));
            }
            say(line.trim_end());
        }
    }

    let mut failures = Vec::new();
    for (name, rep) in &ran {
        for c in &rep.cases {
            match &c.outcome {
                Outcome::Failed(why) => {
                    failures.push(format!("{name}::{}", c.name));
                    notes.push(format!("{name}::{}: FAIL: {why}", c.name));
                }
                Outcome::Skipped(why) => notes.push(format!("{name}::{}: skipped: {why}", c.name)),
                Outcome::Passed => {}
            }
        }
    }
    // What each backend that ran offers beyond the contract: probed, not
    // assumed, so a driver without virtual memory management says no.
    let caps: Vec<(&str, Vec<Capability>)> = ran
        .iter()
        .map(|(name, _)| (*name, capabilities(name)))
        .collect();
    if let Some((_, first)) = caps.first() {
        say("");
        let mut header = format!("{:<40}", "capability");
        for (n, _) in &caps {
            header.push_str(&format!(" {n:<10}"));
        }
        say(header.trim_end());
        for (i, cap) in first.iter().enumerate() {
            let mut line = format!("{:<40}", cap.name);
            for (name, list) in &caps {
                let c = &list[i];
                line.push_str(&format!(
                    " {:<10}",
                    if c.offered.is_ok() { "yes" } else { "no" }
                ));
                if let Err(why) = &c.offered {
                    notes.push(format!("{name}: {}: no: {why}", c.name));
                }
            }
            say(line.trim_end());
        }
    }
    if !notes.is_empty() {
        say("");
        for n in &notes {
            say(n);
        }
    }
    say("");
    let on = |execution: memgov::Execution| {
        let names: Vec<_> = ran
            .iter()
            .filter(|(_, r)| r.execution == Some(execution))
            .map(|(n, _)| *n)
            .collect();
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    };
    say(&format!(
        "ran on real hardware: {}; on software drivers: {}; on stand-ins: {}; embedded: {}",
        on(memgov::Execution::RealHardware),
        on(memgov::Execution::SoftwareDriver),
        on(memgov::Execution::StandIn),
        on(memgov::Execution::Embedded),
    ));
    // A named backend that ran no case: why, from its skipped row, or from
    // its cases when a context opened but every case skipped.
    let mut missing = Vec::new();
    if required {
        for r in &results {
            let why = match &r.report {
                Err(why) => why.clone(),
                Ok(rep) => {
                    let (p, f, _) = rep.counts();
                    if p + f > 0 {
                        continue;
                    }
                    rep.cases
                        .iter()
                        .find_map(|c| match &c.outcome {
                            Outcome::Skipped(why) => Some(why.clone()),
                            _ => None,
                        })
                        .unwrap_or_else(|| "the suite has no case for it".to_owned())
                }
            };
            missing.push(format!(
                "memgov check: {}: 0 cases ran: {why}. It was named with --backend, so it is required.",
                r.name
            ));
        }
    }
    let error = match (failures.is_empty(), missing.is_empty()) {
        (true, true) => None,
        (false, _) => Some(format!(
            "{} case(s) failed: {}",
            failures.len(),
            failures.join(", ")
        )),
        (true, false) => Some(format!("{} named backend(s) ran no case", missing.len())),
    };
    for m in &missing {
        say(m);
    }
    let verdict = match (&error, required) {
        (Some(_), _) => "memgov check: FAILED",
        (None, true) => "memgov check: every named backend ran and every case passed",
        (None, false) => "memgov check: every case that ran passed",
    };
    say(verdict);
    if json {
        let mut report = check_json(&results, required, &notes, &missing);
        if let (Some(e), Some(o)) = (&error, report.as_object_mut()) {
            o.insert("error".into(), e.clone().into());
        }
        if let Some(o) = report.as_object_mut() {
            let caps: serde_json::Map<_, _> = caps
                .iter()
                .map(|(name, list)| {
                    let row: serde_json::Map<_, _> = list
                        .iter()
                        .map(|c| {
                            let v = match &c.offered {
                                Ok(()) => serde_json::json!({"offered": true}),
                                Err(why) => serde_json::json!({"offered": false, "why": why}),
                            };
                            (c.key.to_owned(), v)
                        })
                        .collect();
                    ((*name).to_owned(), row.into())
                })
                .collect();
            o.insert("capabilities".into(), caps.into());
        }
        println!("{report:#}");
    }
    if error.is_some() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// A capability beyond the backend contract, and whether a backend offers
/// it here (`Err`: why not).
struct Capability {
    name: &'static str,
    key: &'static str,
    offered: Result<(), String>,
}

/// What `backend` offers beyond the contract, shown on this machine, not
/// claimed: on CUDA and HIP each row is "yes" only after its case ran on a
/// context with an arena (`memgov_conformance::capability::
/// probe_capabilities`, one code for both): the arena mapped granules as
/// allocations grew, wrote and read back at the same addresses; sleep and
/// wake released every granule and read every byte back at the same
/// address; the capture gate captured copies into a pool, launched the
/// graph and compared its output. A ROCm lacking the virtual memory or
/// graph calls answers why, naming the symbol.
fn capabilities(backend: &str) -> Vec<Capability> {
    const ROWS: [(&str, &str); 3] = [
        ("virtual-memory arena", "arena"),
        ("sleep and wake at stable addresses", "sleep_wake"),
        ("graph-capture gate", "capture_gate"),
    ];
    let probed = match backend {
        "cuda" => probe_cuda(),
        "hip" => probe_hip(),
        other => Err(format!(
            "the {other} backend has no virtual-memory arena, sleep and wake or graph-capture \
             gate (CUDA and HIP only: cuMemAddressReserve / hipMemAddressReserve and their maps, \
             cuStreamBeginCapture_v2 / hipStreamBeginCapture)"
        )),
    };
    ROWS.iter()
        .map(|&(name, key)| Capability {
            name,
            key,
            offered: match &probed {
                Ok(rows) => rows.iter().find(|(k, _)| *k == key).map_or_else(
                    || Err(format!("{key} was not probed")),
                    |(_, r)| r.clone().map(|_| ()),
                ),
                Err(why) => Err(why.clone()),
            },
        })
        .collect()
}

/// The capability probe's outcomes, or why no context could be opened.
type Probed = Result<Vec<(&'static str, memgov_conformance::capability::CaseResult)>, String>;

#[cfg(feature = "cuda")]
fn probe_cuda() -> Probed {
    use memgov::cuda::{ArenaConfig, CudaConfig, CudaContext};
    Ok(memgov_conformance::capability::probe_capabilities(|| {
        CudaContext::new(CudaConfig {
            arena: Some(ArenaConfig {
                reserve_bytes: 256 << 20,
                limit_bytes: 64 << 20,
            }),
            ..CudaConfig::default()
        })
    }))
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda() -> Probed {
    Err("this memgov was built without the cuda feature".to_owned())
}

#[cfg(feature = "hip")]
fn probe_hip() -> Probed {
    use memgov::hip::{ArenaConfig, HipConfig, HipContext};
    Ok(memgov_conformance::capability::probe_capabilities(|| {
        HipContext::new(HipConfig {
            arena: Some(ArenaConfig {
                reserve_bytes: 256 << 20,
                limit_bytes: 64 << 20,
            }),
            ..HipConfig::default()
        })
    }))
}

#[cfg(not(feature = "hip"))]
fn probe_hip() -> Probed {
    Err("this memgov was built without the hip feature".to_owned())
}

/// `memgov check --json`: every backend's row, every case's outcome, the
/// notes and, on failure, `"error"` (added by the caller).
fn check_json(
    results: &[BackendResult],
    required: bool,
    notes: &[String],
    missing: &[String],
) -> serde_json::Value {
    use serde_json::{json, Value};
    let backends: Vec<Value> = results
        .iter()
        .map(|r| match &r.report {
            Ok(rep) => {
                let (passed, failed, skipped) = rep.counts();
                let cases: Vec<Value> = rep
                    .cases
                    .iter()
                    .map(|c| match &c.outcome {
                        Outcome::Passed => json!({ "case": c.name, "outcome": "pass" }),
                        Outcome::Failed(why) => {
                            json!({ "case": c.name, "outcome": "fail", "why": why })
                        }
                        Outcome::Skipped(why) => {
                            json!({ "case": c.name, "outcome": "skipped", "why": why })
                        }
                    })
                    .collect();
                json!({
                    "backend": r.name,
                    "ran": true,
                    "device": rep.device,
                    "execution": rep.execution.map(|e| e.to_string()),
                    "passed": passed,
                    "failed": failed,
                    "skipped": skipped,
                    "cases": cases,
                    "validation": r.validation.map(|v| v.json()),
                })
            }
            Err(why) => json!({
                "backend": r.name,
                "ran": false,
                "why": why,
                "validation": r.validation.map(|v| v.json()),
            }),
        })
        .collect();
    json!({
        "tool": "memgov check",
        "version": env!("CARGO_PKG_VERSION"),
        "required": required,
        "backends": backends,
        "notes": notes,
        "missing": missing,
    })
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::bench::{measure::Plan, report};

    #[test]
    fn a_failed_bench_check_puts_the_error_in_the_json() {
        let failed: serde_json::Value = serde_json::from_str(&report::json(
            &[],
            &Plan::QUICK,
            true,
            Some("1 row(s) missed their target: pin"),
        ))
        .unwrap();
        assert_eq!(failed["error"], "1 row(s) missed their target: pin");
        assert_eq!(failed["tool"], "memgov bench");
        let passed: serde_json::Value =
            serde_json::from_str(&report::json(&[], &Plan::QUICK, true, None)).unwrap();
        assert!(passed.get("error").is_none(), "{passed:#}");
    }
}
