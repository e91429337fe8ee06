//! `memgov`: inspect backends, run the conformance matrix, run a demonstration
//! workload, and measure the governor's overhead.

use clap::{Parser, Subcommand};
use memgov::conformance::{self, Outcome, SuiteReport};
use memgov::host::{HostConfig, HostContext};
use std::process::ExitCode;

/// Counts heap bytes for `memgov bench`'s heap rows; one relaxed load per
/// allocation while no count is running.
#[global_allocator]
static ALLOC: memgov::bench::CountingAllocator = memgov::bench::CountingAllocator::new();

#[path = "memgov/workload.rs"]
mod workload;

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
    /// List the backends compiled in and the devices they can reach.
    Info,
    /// Run the conformance suite on every backend compiled in and present,
    /// and print the matrix. Exits non-zero if any case fails.
    Check {
        /// Only these backends (host, vulkan, cuda, hip). Default: all.
        #[arg(long = "backend")]
        backends: Vec<String>,
    },
    /// Run a serving-style workload on any backend (default: host): weights,
    /// KV cache under pressure, a device swap with live data, and a report.
    Run(workload::RunArgs),
    /// Measure the governor against its baselines (see docs/performance.md).
    Bench {
        /// Arguments for the bench harness (`--quick`, `--json`, ...).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Info => info(),
        Command::Check { backends } => check(&backends),
        Command::Run(args) => workload::run(args),
        Command::Bench { args } => match memgov::bench::main(&args) {
            0 => ExitCode::SUCCESS,
            n => ExitCode::from(n.clamp(1, 255) as u8),
        },
    }
}

/// What one backend's run produced: the suite report, notes for the reader,
/// and whether something outside the cases failed (validation messages).
struct Run {
    report: SuiteReport,
    notes: Vec<String>,
    failed: bool,
}

impl From<SuiteReport> for Run {
    fn from(report: SuiteReport) -> Self {
        Self {
            report,
            notes: Vec::new(),
            failed: false,
        }
    }
}

/// One row of the backend table: what it is and whether it can run here.
struct BackendRow {
    name: &'static str,
    run: Option<Box<dyn Fn() -> Run>>,
    why_not: String,
}

fn backends() -> Vec<BackendRow> {
    let mut rows = vec![BackendRow {
        name: "host",
        run: Some(Box::new(|| {
            conformance::run_suite(|| HostContext::new(HostConfig::default())).into()
        })),
        why_not: String::new(),
    }];
    rows.extend(gpu_backends());
    rows
}

fn gpu_backends() -> Vec<BackendRow> {
    #[allow(unused_mut)]
    let mut rows = Vec::new();
    #[cfg(feature = "vulkan")]
    rows.push(BackendRow {
        name: "vulkan",
        run: Some(Box::new(vulkan_run)),
        why_not: String::new(),
    });
    #[cfg(not(feature = "vulkan"))]
    rows.push(BackendRow {
        name: "vulkan",
        run: None,
        why_not: "not compiled in (build with --features vulkan)".into(),
    });
    for name in ["cuda", "hip"] {
        rows.push(BackendRow {
            name,
            run: None,
            why_not: "not part of this build: the backend has not landed yet".into(),
        });
    }
    rows
}

/// The Vulkan row: with the Khronos validation layer on when it is installed,
/// and every validation warning or error counted as a failure.
#[cfg(feature = "vulkan")]
fn vulkan_run() -> Run {
    use memgov::vulkan::{VulkanConfig, VulkanContext, VulkanProbe};
    use std::sync::Mutex;
    let probes: Mutex<Vec<VulkanProbe>> = Mutex::new(Vec::new());
    let mut notes = Vec::new();
    let validation = match VulkanContext::new(VulkanConfig::validated()) {
        Ok(c) => {
            use memgov::DeviceContext;
            let _ = c.teardown(false);
            true
        }
        Err(e) => {
            notes.push(format!(
                "vulkan: validation layers off: {}",
                conformance::unavailable_reason(&e)
            ));
            false
        }
    };
    let config = VulkanConfig {
        validation,
        ..VulkanConfig::default()
    };
    let report = conformance::run_suite(|| {
        let c = VulkanContext::new(config.clone())?;
        probes.lock().unwrap().push(c.probe());
        Ok(c)
    });
    let probes = probes.into_inner().unwrap();
    let errors: u64 = probes.iter().map(|p| p.validation_errors()).sum();
    let warnings: u64 = probes.iter().map(|p| p.validation_warnings()).sum();
    let failed = errors + warnings > 0;
    if validation {
        notes.push(format!(
            "vulkan: VK_LAYER_KHRONOS_validation on for {} contexts: {errors} errors, {warnings} warnings{}",
            probes.len(),
            if failed { " (FAIL: any validation message fails the check)" } else { "" }
        ));
    }
    Run {
        report,
        notes,
        failed,
    }
}

fn info() -> ExitCode {
    println!("memgov {}", env!("CARGO_PKG_VERSION"));
    println!(
        "{:<8} {:<40} {:<16} memory",
        "backend", "device", "how it runs"
    );
    let host = HostContext::new(HostConfig::default()).map(|c| {
        use memgov::DeviceContext;
        let d = c.describe();
        let _ = c.teardown(false);
        d
    });
    match host {
        Ok(d) => println!(
            "{:<8} {:<40} {:<16} {} MiB",
            "host",
            d.name,
            d.execution.to_string(),
            d.total_bytes >> 20
        ),
        Err(e) => println!("{:<8} unavailable: {e}", "host"),
    }
    for row in gpu_backends() {
        if row.run.is_none() {
            println!("{:<8} skipped: {}", row.name, row.why_not);
        }
    }
    #[cfg(feature = "vulkan")]
    {
        use memgov::DeviceContext;
        match memgov::vulkan::VulkanContext::new(memgov::vulkan::VulkanConfig::default()) {
            Ok(c) => {
                let d = c.describe();
                println!(
                    "{:<8} {:<40} {:<16} {} MiB ({})",
                    "vulkan",
                    d.name,
                    d.execution.to_string(),
                    d.total_bytes >> 20,
                    d.driver
                );
                let _ = c.teardown(false);
            }
            Err(e) => println!(
                "{:<8} skipped: {}",
                "vulkan",
                conformance::unavailable_reason(&e)
            ),
        }
    }
    ExitCode::SUCCESS
}

fn check(only: &[String]) -> ExitCode {
    let rows: Vec<BackendRow> = backends()
        .into_iter()
        .filter(|r| only.is_empty() || only.iter().any(|o| o == r.name))
        .collect();
    if rows.is_empty() {
        eprintln!("memgov check: no backend matches {only:?}; known: host, vulkan, cuda, hip");
        return ExitCode::from(2);
    }
    println!("memgov check: the conformance suite on every backend compiled in\n");
    let mut reports: Vec<(&'static str, Result<SuiteReport, String>)> = Vec::new();
    let mut failed = false;
    let mut notes = Vec::new();
    for row in &rows {
        match &row.run {
            Some(run) => {
                let r = run();
                failed |= r.failed;
                notes.extend(r.notes);
                reports.push((row.name, Ok(r.report)));
            }
            None => reports.push((row.name, Err(row.why_not.clone()))),
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
    if failed {
        println!("memgov check: FAILED");
        ExitCode::FAILURE
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
