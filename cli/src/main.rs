//! `memgov`: inspect backends, run the conformance matrix, run a demonstration
//! workload, and measure the governor's overhead.
//!
//! The backends come from the library's one list, `memgov::any::BACKENDS`:
//! every backend memgov knows gets a row, and one compiled out of this build
//! says which feature builds it.

#![deny(unsafe_op_in_unsafe_fn)]

mod bench;
mod workload;

use clap::{Parser, Subcommand};
use memgov::any::{AnyContext, BackendEntry, BACKENDS};
use memgov::conformance::{self, Outcome, SuiteReport};
use memgov::DeviceContext;
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
        #[arg(long = "backend", value_name = "NAME[,NAME]", value_delimiter = ',')]
        backends: Vec<String>,
    },
    /// Run a serving-style workload on any backend (default: host): weights,
    /// KV cache under pressure, a device swap with live data, and a report.
    Run(workload::RunArgs),
    /// Measure the governor against its baselines (see docs/performance.md).
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Info => info(),
        Command::Check { backends } => check(&backends),
        Command::Run(args) => workload::run(args),
        Command::Bench(args) => ExitCode::from(bench::main(&args)),
    }
}

/// Run the suite on a compiled-in backend with its own checking on
/// ([`AnyContext::open_for_check`]), holding every context's probe to a
/// clean teardown (one teardown, nothing left, no contract violation; on
/// Vulkan with validation, no validation message). Returns the report and a
/// note on how many contexts the probes checked.
fn run(entry: &BackendEntry, kind: memgov::any::BackendKind) -> (SuiteReport, Option<String>) {
    let contexts = AtomicU32::new(0);
    let report = conformance::run_suite_probed(|| {
        let c = AnyContext::open_for_check(kind)?;
        contexts.fetch_add(1, Ordering::Relaxed);
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
    (report, note)
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
                    bytes => format!("{} MiB", bytes >> 20),
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

fn check(only: &[String]) -> ExitCode {
    // Naming a backend means requiring it: one that runs no case fails the
    // check, so that a job asking for a backend cannot pass having run none.
    let required = !only.is_empty();
    let rows: Vec<&BackendEntry> = if required {
        match named_backends(only) {
            Ok(rows) => rows,
            Err(unknown) => {
                let known: Vec<_> = BACKENDS.iter().map(|b| b.name).collect();
                eprintln!(
                    "memgov check: no backend is called {}; known: {}",
                    if unknown.is_empty() {
                        format!("{only:?}")
                    } else {
                        unknown.join(", ")
                    },
                    known.join(", ")
                );
                return ExitCode::from(2);
            }
        }
    } else {
        BACKENDS.iter().collect()
    };
    if required {
        let names: Vec<_> = rows.iter().map(|r| r.name).collect();
        println!(
            "memgov check: the conformance suite on {} (required)\n",
            names.join(", ")
        );
    } else {
        println!("memgov check: the conformance suite on every backend compiled in\n");
    }
    let mut reports: Vec<(&'static str, Result<SuiteReport, String>)> = Vec::new();
    let mut failed = false;
    let mut notes = Vec::new();
    for entry in &rows {
        match entry.kind {
            Some(kind) => {
                let (report, note) = run(entry, kind);
                notes.extend(note);
                if report.execution.is_some() {
                    reports.push((entry.name, Ok(report)));
                } else {
                    // No context could be made: every case was skipped for
                    // the same reason; say it once.
                    let why = report.cases.iter().find_map(|c| match &c.outcome {
                        Outcome::Skipped(why) => Some(why.clone()),
                        _ => None,
                    });
                    reports.push((entry.name, Err(why.unwrap_or(report.device))));
                }
            }
            None => reports.push((entry.name, Err(entry.not_compiled_in().unwrap_or_default()))),
        }
    }

    println!(
        "{:<8} {:<36} {:<16} result",
        "backend", "device", "how it ran"
    );
    for (name, r) in &reports {
        match r {
            Ok(rep) => {
                let how = rep
                    .execution
                    .map_or_else(|| "not run".to_owned(), |e| e.to_string());
                let (p, f, s) = rep.counts();
                let device = if rep.execution.is_some() {
                    rep.device.clone()
                } else {
                    "-".into()
                };
                println!(
                    "{:<8} {:<36} {:<16} {p} passed, {f} failed, {s} skipped",
                    name,
                    truncate(&device, 36),
                    how
                );
            }
            Err(why) => println!("{:<8} {:<36} {:<16} skipped: {why}", name, "-", "not run"),
        }
    }

    let ran: Vec<(&str, &SuiteReport)> = reports
        .iter()
        .filter_map(|(n, r)| r.as_ref().ok().map(|r| (*n, r)))
        .collect();
    if let Some((_, first)) = ran.first() {
        println!();
        print!("{:<40}", "case");
        for (n, _) in &ran {
            print!(" {:<10}", n);
        }
        println!();
        for (i, case) in first.cases.iter().enumerate() {
            print!("{:<40}", case.name);
            for (_, rep) in &ran {
                let cell = match &rep.cases[i].outcome {
                    Outcome::Passed => "pass",
                    Outcome::Failed(_) => "FAIL",
                    Outcome::Skipped(_) => "skipped",
                };
                print!(" {:<10}", cell);
            }
            println!();
        }
    }

    for (name, rep) in &ran {
        for c in &rep.cases {
            match &c.outcome {
                Outcome::Failed(why) => {
                    failed = true;
                    notes.push(format!("{name}::{}: FAIL: {why}", c.name));
                }
                Outcome::Skipped(why) => notes.push(format!("{name}::{}: skipped: {why}", c.name)),
                Outcome::Passed => {}
            }
        }
    }
    if !notes.is_empty() {
        println!();
        for n in notes {
            println!("{n}");
        }
    }
    println!();
    let hw: Vec<_> = ran
        .iter()
        .filter(|(_, r)| r.execution == Some(memgov::Execution::RealHardware))
        .map(|(n, _)| *n)
        .collect();
    let sw: Vec<_> = ran
        .iter()
        .filter(|(_, r)| r.execution == Some(memgov::Execution::SoftwareDriver))
        .map(|(n, _)| *n)
        .collect();
    let si: Vec<_> = ran
        .iter()
        .filter(|(_, r)| r.execution == Some(memgov::Execution::StandIn))
        .map(|(n, _)| *n)
        .collect();
    let em: Vec<_> = ran
        .iter()
        .filter(|(_, r)| r.execution == Some(memgov::Execution::Embedded))
        .map(|(n, _)| *n)
        .collect();
    let list = |v: &[&str]| {
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.join(", ")
        }
    };
    println!(
        "ran on real hardware: {}; on software drivers: {}; on stand-ins: {}; embedded: {}",
        list(&hw),
        list(&sw),
        list(&si),
        list(&em)
    );
    // A named backend that ran no case: why, from its skipped row, or from
    // its cases when a context opened but every case skipped.
    let mut missing = Vec::new();
    if required {
        for (name, r) in &reports {
            let why = match r {
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
                "memgov check: {name}: 0 cases ran: {why}. It was named with --backend, so it is required."
            ));
        }
    }
    if failed || !missing.is_empty() {
        for m in &missing {
            println!("{m}");
        }
        println!("memgov check: FAILED");
        ExitCode::FAILURE
    } else if required {
        println!("memgov check: every named backend ran and every case passed");
        ExitCode::SUCCESS
    } else {
        println!("memgov check: every case that ran passed");
        ExitCode::SUCCESS
    }
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
