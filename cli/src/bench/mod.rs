//! `memgov bench`: the governor's cost against the physical floor, measured
//! against a baseline in the same run, printed as medians and ratios.
//!
//! Every figure is compared with a baseline measured in the same process,
//! samples of figure and baseline interleaved, so that a noisy machine moves
//! both. Ratios are what the targets are about; absolute numbers are printed
//! for orientation only. The same workloads exist as criterion benches under
//! `benches/` (see `docs/performance.md`).
//!
//! The rows are one table, [`ROWS`]: the governor's own rows, then one
//! raw-vs-governed cycle row per GPU backend. A backend's row lives in
//! `bench/<backend>.rs`, which exposes
//! `pub fn cycle_ratio(iterations: u32) -> Result<(u64, u64), memgov::BackendError>`
//! (nanoseconds per governed cycle, per raw cycle); adding one is one line in
//! `backend_rows!` below.
//!
//! The heap-bytes rows need [`CountingAllocator`] as the process's global
//! allocator (the `memgov` binary installs it); without it they print `n/a`.

// Criterion benches include this module for the parts they use.
#![allow(dead_code)]

pub mod alloc;
pub mod cycle;
pub mod floor;
pub mod measure;
pub mod report;
pub mod row;
pub mod rows;
pub mod teardown;

pub use alloc::CountingAllocator;

use clap::Parser;
use measure::Plan;
use row::{Row, Target};

/// `memgov bench` arguments.
#[derive(Debug, Parser)]
#[command(
    name = "memgov bench",
    about = "Measure the governor against its baselines (see docs/performance.md)",
    after_help = "Exit status: 0 (also when a target is missed, unless --check), 1 when --check \
                  finds a missed target, 2 on bad usage (also a --filter that matches no row). \
                  With --json a failure still prints one JSON object, with \"error\"."
)]
pub struct BenchArgs {
    /// A smoke run of a few seconds (rough numbers).
    #[arg(long)]
    pub quick: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Only rows whose key contains WORD (`--list` prints the keys); one
    /// that matches no key is an error.
    #[arg(long, value_name = "WORD", allow_hyphen_values = true)]
    pub filter: Option<String>,
    /// Exit with status 1 when a measured row misses its target.
    #[arg(long)]
    pub check: bool,
    /// Print the row keys and exit.
    #[arg(long)]
    pub list: bool,
    /// Passed by `cargo bench` to harness-less bench targets; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}

/// One entry of the row table: its key and what measures it.
pub struct RowSpec {
    /// Short key, for `--filter` and `--list`.
    pub key: &'static str,
    /// Measures the row (some keys produce several rows).
    pub measure: fn(&Plan) -> Vec<Row>,
}

/// `bench/<backend>.rs`'s `cycle_ratio`: nanoseconds per governed cycle and
/// per raw cycle, over `iterations` cycles of each.
pub type CycleRatio = fn(iterations: u32) -> Result<(u64, u64), memgov::BackendError>;

/// The raw-vs-governed cycle row of a GPU backend.
pub struct BackendRow {
    /// Row key (`<backend>-cycle`).
    pub key: &'static str,
    /// The backend's cargo feature.
    pub feature: &'static str,
    /// What is measured and against what, and the target.
    pub figure: &'static str,
    /// The raw baseline.
    pub baseline: &'static str,
    /// `governed / raw` must be at most this.
    pub target: f64,
    /// `bench/<backend>.rs`'s `cycle_ratio`, when the backend is compiled in.
    pub cycle: Option<CycleRatio>,
}

/// The backend rows, one line each:
/// `(module, "feature", target, "figure", "baseline")`.
macro_rules! backend_rows {
    ($( ($module:ident, $feature:literal, $target:expr, $figure:literal, $baseline:literal) ),* $(,)?) => {
        $(
            #[cfg(feature = $feature)]
            pub mod $module;
        )*

        /// Every backend's cycle row, compiled in or not.
        pub const BACKEND_ROWS: &[BackendRow] = &[
            $(
                BackendRow {
                    key: concat!($feature, "-cycle"),
                    feature: $feature,
                    figure: $figure,
                    baseline: $baseline,
                    target: $target,
                    cycle: {
                        #[cfg(feature = $feature)]
                        let cycle = Some($module::cycle_ratio as CycleRatio);
                        #[cfg(not(feature = $feature))]
                        let cycle = None;
                        cycle
                    },
                },
            )*
        ];
    };
}

backend_rows! {
    (cuda, "cuda", 1.05, "governed allocate + stream-ordered free, CUDA backend", "raw cuMemAllocAsync + cuMemFreeAsync on the same stream"),
    (hip, "hip", 1.05, "governed allocate + stream-ordered free, HIP backend", "raw hipMallocAsync + hipFreeAsync on the same stream"),
    (vulkan, "vulkan", 1.3, "governed allocate + write + stream-ordered free, Vulkan backend", "the same cycle with raw ash + gpu-allocator"),
}

/// The governor's rows, in the order the table prints them.
pub const ROWS: &[RowSpec] = &[
    RowSpec {
        key: "pin",
        measure: |p| vec![rows::pin(p)],
    },
    RowSpec {
        key: "boxed-pin",
        measure: |p| vec![rows::boxed_pin(p)],
    },
    RowSpec {
        key: "null-cycle",
        measure: |p| vec![rows::null_cycle(p)],
    },
    RowSpec {
        key: "attributed-null-cycle",
        measure: |p| vec![rows::attributed_null_cycle(p)],
    },
    RowSpec {
        key: "any-null-cycle",
        measure: |p| vec![rows::any_null_cycle(p)],
    },
    RowSpec {
        key: "reserve-cycle",
        measure: |p| vec![rows::reserve_cycle(p)],
    },
    RowSpec {
        key: "host-cycle",
        measure: |p| vec![rows::host_cycle(p)],
    },
    RowSpec {
        key: "cached-cycle",
        measure: rows::cached_cycle,
    },
    RowSpec {
        key: "two-threads",
        measure: |p| vec![rows::two_threads(p)],
    },
    RowSpec {
        key: "thread-curve",
        measure: |p| vec![rows::thread_curve(p)],
    },
    RowSpec {
        key: "wakeup",
        measure: |p| vec![rows::wakeup(p)],
    },
    RowSpec {
        key: "heap",
        measure: rows::heap,
    },
    RowSpec {
        key: "drain",
        measure: |p| vec![rows::drain(p)],
    },
];

impl BackendRow {
    /// How the backend's default device runs (real hardware, software driver,
    /// stand-in), so that the row never passes a stand-in figure off as a
    /// GPU figure.
    fn execution(&self) -> Option<memgov::Execution> {
        use memgov::DeviceContext;
        let kind: memgov::any::BackendKind = self.feature.parse().ok()?;
        let ctx = memgov::any::AnyContext::open(kind).ok()?;
        let execution = ctx.describe().execution;
        let _ = ctx.teardown(false);
        Some(execution)
    }

    fn measure(&self, plan: &Plan) -> Row {
        let row = Row::new(
            self.key,
            self.figure,
            self.baseline,
            "ns",
            Target::AtMost(self.target),
        );
        let Some(cycle) = self.cycle else {
            return row.note(format!(
                "skipped: not compiled in (build with --features {})",
                self.feature
            ));
        };
        let iterations = plan.backend_cycles;
        match cycle(iterations) {
            Ok((governed, raw)) => {
                let (g, r) = (governed as f64, raw.max(1) as f64);
                let ran_on = match self.execution() {
                    Some(memgov::Execution::StandIn) => {
                        "; ran on a stand-in driver: a stand-in figure (host threads), not a GPU figure"
                            .to_owned()
                    }
                    Some(e) => format!("; ran on {e}"),
                    None => String::new(),
                };
                row.with(g, Some(r), Some(g / r)).note(format!(
                    "{iterations} cycles per side, interleaved rounds{ran_on}"
                ))
            }
            Err(e) => row.note(format!(
                "skipped: {}",
                memgov_conformance::unavailable_reason(&e)
            )),
        }
    }
}

/// Every row key, in table order.
pub fn keys() -> Vec<&'static str> {
    ROWS.iter()
        .map(|r| r.key)
        .chain(BACKEND_ROWS.iter().map(|r| r.key))
        .collect()
}

/// Run the rows whose key contains `filter` (all when `None`).
pub fn run(plan: &Plan, filter: Option<&str>, mut progress: impl FnMut(&str)) -> Vec<Row> {
    let wanted = |key: &str| filter.is_none_or(|f| key.contains(f));
    let mut out = Vec::new();
    for spec in ROWS.iter().filter(|r| wanted(r.key)) {
        progress(spec.key);
        out.extend((spec.measure)(plan));
    }
    for backend in BACKEND_ROWS.iter().filter(|r| wanted(r.key)) {
        progress(backend.key);
        out.push(backend.measure(plan));
    }
    out
}

/// Cores this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Run `memgov bench` with these arguments; returns the exit status.
pub fn main(args: &BenchArgs) -> u8 {
    if args.list {
        for k in keys() {
            println!("{k}");
        }
        return 0;
    }
    if let Some(filter) = args.filter.as_deref() {
        if !keys().iter().any(|k| k.contains(filter)) {
            let error = format!(
                "memgov bench: --filter '{filter}' matches no row; `memgov bench --list` prints the row keys"
            );
            if args.json {
                let mut object = serde_json::json!({ "error": error, "keys": keys() });
                if let Some(o) = object.as_object_mut() {
                    o.insert("tool".into(), "memgov bench".into());
                }
                println!("{object:#}");
            }
            eprintln!("{error}");
            return 2;
        }
    }
    let plan = if args.quick { Plan::QUICK } else { Plan::FULL };
    let rows = run(&plan, args.filter.as_deref(), |key| {
        if !args.json {
            eprintln!("memgov bench: measuring {key} ...");
        }
    });
    let missed: Vec<&str> = rows
        .iter()
        .filter(|r| r.met == Some(false))
        .map(|r| r.key)
        .collect();
    // Only `--check` makes a missed target a failure.
    let error = (args.check && !missed.is_empty()).then(|| {
        format!(
            "{} row(s) missed their target: {}",
            missed.len(),
            missed.join(", ")
        )
    });
    if args.json {
        print!(
            "{}",
            report::json(&rows, &plan, args.quick, error.as_deref())
        );
    } else {
        println!(
            "memgov bench ({} mode, {} samples per side, {} cores; medians, same-run baselines)",
            if args.quick { "quick" } else { "full" },
            plan.samples,
            cores()
        );
        print!("{}", report::table(&rows));
    }
    if let Some(e) = &error {
        eprintln!("memgov bench: FAILED: {e}");
    }
    u8::from(error.is_some())
}

/// Parse `args` (without the program name) and run; clap prints usage
/// errors and help. For bench targets that forward their command line.
pub fn main_from_args(args: impl IntoIterator<Item = String>) -> u8 {
    let argv = std::iter::once("memgov bench".to_owned()).chain(args);
    match BenchArgs::try_parse_from(argv) {
        Ok(a) => main(&a),
        Err(e) => {
            let _ = e.print();
            if e.use_stderr() {
                2
            } else {
                0
            }
        }
    }
}
