//! The fault matrix: every backend operation × every fault kind, through
//! [`FaultInjecting`], on any backend.
//!
//! Each cell registers a fresh context `Watched<FaultInjecting<C>>`, arms one
//! fault on the first call of one operation, and runs a script that calls
//! every operation (memory_info, create_stream, allocate, write, read,
//! synchronize, free_async by `release_on` and by drop, a release ordered
//! after another stream, destroy_stream, and teardown through retire /
//! force). A cell survives when:
//!
//! * nothing panics;
//! * the fault was really injected;
//! * the faulted operation came back with the specific error the fault means
//!   (`Backend`, `BudgetExceeded` of the device, `DeviceLost`, a failed
//!   teardown result, an abandoned release, or, for a delay, success);
//! * teardown ran exactly once and the context terminated;
//! * accounting is consistent: nothing charged, no pins, every queued release
//!   settled (retired or abandoned) exactly once;
//! * the backend's own bookkeeping is clean: the factory's leak check (a
//!   [`BackendProbe`](memgov::BackendProbe)'s `check_clean_teardown`, say)
//!   passes after teardown.
//!
//! The operations on a buffer (allocate, write, read, free_async,
//! order_after) run once more with the faulted buffers in pinned host memory
//! ([`Tier::PinnedHost`]): rows `allocate [pinned-host]` and so on, where an
//! out-of-memory allocation is refused under the pinned tier and every
//! tier's accounting must be back at zero after teardown.
//!
//! One more cell checks a panicking pressure responder: the panic reaches the
//! caller of `allocate`, and nothing is left charged or pinned.

use super::{SuiteOptions, Watched};
use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
use memgov::{
    Alloc, BudgetScope, ContextConfig, ContextState, DeviceContext, Governor, GovernorError, Role,
    Tier,
};
use memgov_backend::{BackendErrorKind, RetireSignal};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What a backend runs after a cell's teardown to check its own
/// bookkeeping: `Err` says what was left behind.
pub type LeakCheck = Box<dyn Fn() -> Result<(), String>>;

/// A fresh context for one cell and the check to run after its teardown;
/// `None` when no context can be opened here.
type Factory<'a, C> = dyn Fn() -> Option<(C, LeakCheck)> + 'a;

/// One cell of the matrix.
#[derive(Debug, Clone)]
pub struct FaultCell {
    /// The operation the fault was armed on (`allocate`, `free_async`, ...).
    pub operation: String,
    /// The fault (`error`, `out-of-memory`, `delay`, ...).
    pub fault: String,
    /// What the cell saw when it survived, or why it failed.
    pub outcome: Result<String, String>,
}

/// The matrix of one backend.
#[derive(Debug, Clone)]
pub struct FaultMatrix {
    /// The backend's name as given to [`fault_matrix`].
    pub backend: String,
    /// How the cells configured their contexts.
    pub options: SuiteOptions,
    /// Whether the backend has a pinned host tier. A backend that refuses
    /// [`Tier::PinnedHost`] with [`BackendErrorKind::Unsupported`] (the
    /// default [`DeviceContext::allocate_in`]) runs no `[pinned-host]` rows,
    /// as the suite skips its pinned-host cases.
    pub pinned_host_tier: bool,
    /// Every cell, in operation order.
    pub cells: Vec<FaultCell>,
}

impl FaultMatrix {
    /// How many cells the matrix has: every operation under every fault that
    /// applies to it, the buffer operations again with pinned host buffers,
    /// plus the panicking pressure responder.
    pub fn expected_cells() -> usize {
        let faults = |op: Operation| Fault::ALL.iter().filter(|f| f.applies_to(op)).count();
        Operation::ALL.iter().map(|&op| faults(op)).sum::<usize>()
            + PINNED_OPERATIONS
                .iter()
                .map(|&op| faults(op))
                .sum::<usize>()
            + 1
    }

    /// Cells that survived.
    pub fn survived(&self) -> usize {
        self.cells.iter().filter(|c| c.outcome.is_ok()).count()
    }

    /// One line per failed cell: backend, operation, fault and why.
    pub fn failures(&self) -> Vec<String> {
        self.cells
            .iter()
            .filter_map(|c| {
                c.outcome
                    .as_ref()
                    .err()
                    .map(|why| format!("{} {} × {}: {why}", self.backend, c.operation, c.fault))
            })
            .collect()
    }

    /// How many cells this backend's matrix has: [`expected_cells`](Self::expected_cells)
    /// less the `[pinned-host]` rows when the backend has no pinned host tier.
    pub fn expected_cells_here(&self) -> usize {
        if self.pinned_host_tier {
            return Self::expected_cells();
        }
        let faults = |op: Operation| Fault::ALL.iter().filter(|f| f.applies_to(op)).count();
        Self::expected_cells()
            - PINNED_OPERATIONS
                .iter()
                .map(|&op| faults(op))
                .sum::<usize>()
    }

    /// Whether every cell survived and the matrix is complete.
    pub fn all_survived(&self) -> bool {
        self.cells.len() == self.expected_cells_here() && self.survived() == self.cells.len()
    }
}

impl fmt::Display for FaultMatrix {
    /// A Markdown table, then a one-line total.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| backend | operation | fault | outcome |\n|---|---|---|---|"
        )?;
        for c in &self.cells {
            let outcome = match &c.outcome {
                Ok(what) => format!("survived: {what}"),
                Err(why) => format!("FAILED: {why}"),
            };
            writeln!(
                f,
                "| {} | {} | {} | {outcome} |",
                self.backend, c.operation, c.fault
            )?;
        }
        write!(
            f,
            "\nfault matrix: {} ({}): {} tried, {} survived",
            self.backend,
            self.options,
            self.cells.len(),
            self.survived()
        )
    }
}

/// Runs the fault matrix on the backend `factory` opens: a fresh context per
/// cell, with the check to run after its teardown. `None` when the factory
/// opens nothing here (the caller prints why it skipped).
///
/// ```
/// use memgov_conformance::fault_matrix;
/// use memgov::host::{HostConfig, HostContext};
///
/// let matrix = fault_matrix("host", || {
///     let ctx = HostContext::new(HostConfig::default()).ok()?;
///     let probe = ctx.probe();
///     Some((ctx, Box::new(move || probe.check_clean_teardown()) as _))
/// })
/// .expect("the host backend is always present");
/// assert!(matrix.all_survived(), "{matrix}");
/// ```
pub fn fault_matrix<C: DeviceContext>(
    backend: &str,
    factory: impl Fn() -> Option<(C, LeakCheck)>,
) -> Option<FaultMatrix> {
    fault_matrix_with(backend, &SuiteOptions::new(), factory)
}

/// [`fault_matrix`] with every cell's context configured by `options`.
///
/// With the block cache on, a buffer released on its own stream is kept
/// rather than freed, so the cells empty the cache
/// ([`trim_cache`](memgov::ContextHandle::trim_cache)) once their buffers
/// are released: a fault armed on `free_async` then strikes a free the
/// cache gives back, which has no caller to report to, and the cell checks
/// that the block was quarantined (or the context lost) and that nothing
/// leaked, exactly as for a release.
pub fn fault_matrix_with<C: DeviceContext>(
    backend: &str,
    options: &SuiteOptions,
    factory: impl Fn() -> Option<(C, LeakCheck)>,
) -> Option<FaultMatrix> {
    let factory: &Factory<'_, C> = &factory;
    // One context, opened and torn down, says whether the backend is here.
    // Torn down, not dropped: a dropped context calls no driver function,
    // so it would keep its driver objects (a CUDA context reference, a
    // memory pool) until the process exits.
    let (ctx, _) = factory()?;
    let pinned_host_tier = has_pinned_host_tier(&ctx);
    if let Err(e) = ctx.teardown(false) {
        eprintln!("fault matrix: {backend}: the availability probe's teardown failed: {e}");
    }
    let mut cells = Vec::new();
    let rows = Operation::ALL
        .into_iter()
        .map(|op| (op, Tier::Device))
        .chain(
            PINNED_OPERATIONS
                .into_iter()
                .filter(|_| pinned_host_tier)
                .map(|op| (op, Tier::PinnedHost)),
        );
    for (op, tier) in rows {
        for fault in Fault::ALL {
            if !fault.applies_to(op) {
                continue;
            }
            cells.push(FaultCell {
                operation: match tier {
                    Tier::Device => op.to_string(),
                    _ => format!("{op} [{tier}]"),
                },
                fault: fault.name().to_owned(),
                outcome: cell(factory, options, op, fault, tier),
            });
        }
    }
    cells.push(FaultCell {
        operation: "allocate".into(),
        fault: "panicking pressure responder".into(),
        outcome: responder_panic_cell(factory, options),
    });
    Some(FaultMatrix {
        backend: backend.to_owned(),
        options: *options,
        pinned_host_tier,
        cells,
    })
}

/// Whether `ctx` allocates in [`Tier::PinnedHost`]: anything but
/// [`BackendErrorKind::Unsupported`] counts as having the tier, so that a
/// tier that fails for another reason still runs (and fails) its rows.
fn has_pinned_host_tier<C: DeviceContext>(ctx: &C) -> bool {
    let Ok(stream) = ctx.create_stream() else {
        return true;
    };
    let has = match ctx.allocate_in(&stream, 4096, Tier::PinnedHost) {
        Ok(memory) => {
            if let Err((_, _, e)) = ctx.free_async(&stream, memory, RetireSignal::from_fn(|_| {})) {
                eprintln!("fault matrix: the pinned-host probe's free failed: {e}");
            }
            let _ = ctx.synchronize(&stream);
            true
        }
        Err(e) => e.kind != BackendErrorKind::Unsupported,
    };
    let _ = ctx.destroy_stream(stream);
    has
}

/// The operations whose cells run again with pinned host buffers: those
/// that act on a buffer, and so on its tier.
const PINNED_OPERATIONS: [Operation; 5] = [
    Operation::Allocate,
    Operation::FreeAsync,
    Operation::Write,
    Operation::Read,
    Operation::OrderAfter,
];

/// What the faulted operation returned, for the error check.
#[derive(Default, Debug)]
struct Seen {
    errors: Vec<(Operation, String)>,
}

fn kind_of(e: &GovernorError) -> String {
    match e {
        GovernorError::Backend { source, .. } => format!("Backend({:?})", source.kind),
        GovernorError::BudgetExceeded(b) => format!("BudgetExceeded({})", b.scope),
        GovernorError::DeviceLost { .. } => "DeviceLost".into(),
        GovernorError::Reclaimed { .. } => "Reclaimed".into(),
        GovernorError::Pin { refusal, .. } => format!("Pin({refusal})"),
        other => format!("{other:?}"),
    }
}

/// One cell: `fault` armed on the first call of `op`; the buffers the
/// buffer operations act on are in `tier`.
fn cell<C: DeviceContext>(
    factory: &Factory<'_, C>,
    options: &SuiteOptions,
    op: Operation,
    fault: Fault,
    tier: Tier,
) -> Result<String, String> {
    let Some((backend, leak_check)) = factory() else {
        return Err("backend unavailable".into());
    };
    let faulty = FaultInjecting::new(backend, FaultPlan::new().nth(op, 1, fault));
    let control = faulty.control();
    let watched = Watched::new(faulty);
    let log = watched.log();
    let gov = Governor::new();
    let ctx = gov.register(
        watched,
        options.apply(ContextConfig::new().label("matrix").budget(64 << 20)),
    );
    let mut seen = Seen::default();
    let mut note = |op: Operation, r: Result<(), GovernorError>| {
        if let Err(e) = r {
            seen.errors.push((op, kind_of(&e)));
        }
    };

    let run = catch_unwind(AssertUnwindSafe(|| {
        note(Operation::MemoryInfo, ctx.memory_info().map(|_| ()));
        let stream = match ctx.create_stream("a") {
            Ok(s) => Some(s),
            Err(e) => {
                note(Operation::CreateStream, Err(e));
                ctx.create_stream("a-again")
                    .map_err(|e| note(Operation::CreateStream, Err(e)))
                    .ok()
            }
        };
        let mut released = None;
        if let Some(s) = &stream {
            let buf = match ctx.allocate(s, Alloc::new(4096, Role::Activation).tier(tier)) {
                Ok(b) => Some(b),
                Err(e) => {
                    note(Operation::Allocate, Err(e));
                    ctx.allocate(s, Alloc::new(4096, Role::Activation).tier(tier))
                        .map_err(|e| note(Operation::Allocate, Err(e)))
                        .ok()
                }
            };
            if let Some(b) = buf {
                note(Operation::Write, b.write(0, b"fault matrix"));
                let mut back = [0u8; 12];
                note(Operation::Read, b.read(0, &mut back));
                note(Operation::Synchronize, s.synchronize());
                released = Some(b.release_on(s).map_err(|e| e.error));
                note(Operation::FreeAsync, released.clone().unwrap());
            }
            // A second buffer, released by drop.
            if let Ok(b2) = ctx.allocate(s, Alloc::new(8192, Role::Weights)) {
                drop(b2);
            }
            // A third, released on another stream: ordered after its own.
            if let Ok(other) = ctx.create_stream("b") {
                if let Ok(b3) = ctx.allocate(s, Alloc::new(4096, Role::KvCache).tier(tier)) {
                    note(
                        Operation::OrderAfter,
                        b3.release_on(&other).map_err(|e| e.error),
                    );
                }
            }
        }
        // With the cache on, the buffers released on their own stream are
        // kept: emptied here, the cache frees them as a trim does.
        ctx.trim_cache(u64::MAX);
        drop(stream);
        let handle = ctx.retire();
        let report = match handle.wait_timeout(Duration::from_secs(10)) {
            Ok(r) => r,
            Err(e) => {
                let forced = handle.force(std::time::Instant::now() + Duration::from_secs(10));
                forced.map_err(|f| format!("retire did not finish: {e}; force: {f}"))?
            }
        };
        Ok::<_, String>((report, released))
    }));
    let (report, _released) = match run {
        Ok(Ok(x)) => x,
        Ok(Err(why)) => return Err(why),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            return Err(format!("PANIC: {}", msg.unwrap_or_default()));
        }
    };

    // The fault really happened.
    if control.injected(op) == 0 {
        return Err(format!("{op} was never called with the fault armed"));
    }
    // Teardown once, context terminated, accounting at zero.
    let snap = ctx.snapshot();
    if log.teardowns.load(Ordering::SeqCst) != 1 {
        return Err(format!(
            "teardown ran {} times",
            log.teardowns.load(Ordering::SeqCst)
        ));
    }
    if snap.lifecycle != ContextState::Terminated {
        return Err(format!("lifecycle {:?} after teardown", snap.lifecycle));
    }
    if snap.charged != 0 || snap.pins.total() != 0 || snap.total() != Default::default() {
        return Err(format!(
            "accounting after teardown: charged {} pins {:?} usage {:?}",
            snap.charged,
            snap.pins,
            snap.total()
        ));
    }
    if let Some(t) = snap.by_tier.iter().find(|t| {
        t.charged + t.live_bytes + t.pending_bytes + t.quarantined_bytes + t.awaiting_teardown > 0
    }) {
        return Err(format!("tier accounting after teardown: {t:?}"));
    }
    let c = snap.counters;
    if c.releases_queued != c.retired + c.abandoned {
        return Err(format!(
            "releases queued {} != retired {} + abandoned {}",
            c.releases_queued, c.retired, c.abandoned
        ));
    }
    let (q, r, a) = (
        log.frees_queued.load(Ordering::SeqCst),
        log.retired.load(Ordering::SeqCst),
        log.abandoned.load(Ordering::SeqCst),
    );
    if q != r + a
        || log.settled_after_teardown.load(Ordering::SeqCst) != 0
        || c.late_settlements != 0
    {
        return Err(format!("signals: {}", log.summary()));
    }
    leak_check().map_err(|e| format!("leak: {e}"))?;

    // The specific error.
    let errs_of = |o: Operation| {
        seen.errors
            .iter()
            .filter(|(x, _)| *x == o)
            .map(|(_, k)| k.clone())
            .collect::<Vec<_>>()
    };
    // With the cache on, the releases on the buffers' own stream are kept:
    // the first free the backend is asked for is the one released on
    // another stream, whose caller (`release_on`, noted as `order_after`)
    // sees the fault.
    let first = errs_of(op).into_iter().next().or_else(|| {
        (options.cache.is_some() && op == Operation::FreeAsync)
            .then(|| errs_of(Operation::OrderAfter).into_iter().next())
            .flatten()
    });
    let specific = match (fault, op) {
        (Fault::Delay(_), _) => {
            if !seen.errors.is_empty() || report.backend_result.is_err() {
                return Err(format!(
                    "a delay caused errors: {:?} {:?}",
                    seen.errors, report.backend_result
                ));
            }
            "ok (delayed)".to_string()
        }
        (Fault::DropSignal, _) => {
            if report.abandoned_releases == 0 {
                return Err("a dropped signal was not settled as abandoned".into());
            }
            format!(
                "abandoned release ({} retired, {} abandoned)",
                report.retired_releases, report.abandoned_releases
            )
        }
        (_, Operation::Teardown) => match &report.backend_result {
            Err(e) => format!("TeardownReport.backend_result = Err({:?})", e.kind),
            Ok(()) => return Err("a faulted teardown reported success".into()),
        },
        (_, Operation::DestroyStream) => {
            // Drop has no caller to return to: the error is counted, and a
            // lost device shows in the report.
            if c.backend_errors == 0 {
                return Err("destroy_stream fault not recorded".into());
            }
            if fault == Fault::DeviceLost && !report.lost {
                return Err("device loss in destroy_stream did not mark the context lost".into());
            }
            format!(
                "counted in backend_errors{}",
                if report.lost { "; context lost" } else { "" }
            )
        }
        (Fault::DeviceLost, _) => match first.as_deref() {
            Some("DeviceLost") if report.lost => "DeviceLost".into(),
            Some(_) | None
                if matches!(op, Operation::FreeAsync | Operation::OrderAfter)
                    && report.lost
                    && report.settled_lost > 0 =>
            {
                "release settled as lost (Ok); context lost".into()
            }
            other => {
                return Err(format!(
                    "expected DeviceLost, got {other:?} (lost {})",
                    report.lost
                ))
            }
        },
        (Fault::OutOfMemory, Operation::Allocate) => {
            // The driver out of the tier's memory is refused under the tier.
            let scope = match tier {
                Tier::Device => BudgetScope::Device,
                t => BudgetScope::Tier(t),
            };
            match first.as_deref() {
                Some(k) if k == format!("BudgetExceeded({scope})") => k.to_string(),
                other => return Err(format!("expected BudgetExceeded({scope}), got {other:?}")),
            }
        }
        (Fault::Error | Fault::OutOfMemory, Operation::FreeAsync | Operation::OrderAfter) => {
            match first.as_deref() {
                Some(k) if k.starts_with("Backend(") && report.quarantined_bytes > 0 => {
                    format!(
                        "{k}; {} B quarantined until teardown",
                        report.quarantined_bytes
                    )
                }
                other => return Err(format!("expected Backend + quarantine, got {other:?}")),
            }
        }
        (Fault::Error | Fault::OutOfMemory, _) => match first.as_deref() {
            Some(k) if k.starts_with("Backend(") => k.to_string(),
            other => return Err(format!("expected Backend error, got {other:?}")),
        },
    };
    Ok(specific)
}

/// The "panicking pressure responder" column: an allocation that does not
/// fit asks a responder, which panics. The panic reaches the caller of
/// `allocate`; the in-flight allocation leaves no pin and no charge behind;
/// the context then retires, tears down once and leaks nothing.
fn responder_panic_cell<C: DeviceContext>(
    factory: &Factory<'_, C>,
    options: &SuiteOptions,
) -> Result<String, String> {
    let Some((backend, leak_check)) = factory() else {
        return Err("backend unavailable".into());
    };
    let watched = Watched::new(backend);
    let log = watched.log();
    let gov = Governor::new();
    let ctx = gov.register(
        watched,
        options.apply(ContextConfig::new().label("matrix").budget(64 << 10)),
    );
    let stream = ctx
        .create_stream("a")
        .map_err(|e| format!("create_stream: {e}"))?;
    let held = ctx
        .allocate(&stream, Alloc::new(48 << 10, Role::Weights))
        .map_err(|e| format!("allocate: {e}"))?;
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, |_| {
        panic!("pressure responder panicked")
    });
    eprintln!(
        "fault matrix: a panic message 'pressure responder panicked' below is this cell's own, planted"
    );
    let caught = catch_unwind(AssertUnwindSafe(|| {
        ctx.allocate(&stream, Alloc::new(32 << 10, Role::Activation))
    }));
    match caught {
        Ok(r) => return Err(format!("the panic did not reach the caller: {r:?}")),
        Err(p) if p.downcast_ref::<&str>() == Some(&"pressure responder panicked") => {}
        Err(_) => return Err("a different panic reached the caller".into()),
    }
    let snap = ctx.snapshot();
    if snap.pins.other != 0 || snap.charged != 48 << 10 {
        return Err(format!(
            "after the panic: {} B charged (48 KiB live), pins {:?}",
            snap.charged, snap.pins
        ));
    }
    drop((held, stream));
    let report = ctx
        .retire()
        .wait_timeout(Duration::from_secs(10))
        .map_err(|e| format!("retire after the panic: {e}"))?;
    let snap = ctx.snapshot();
    if log.teardowns.load(Ordering::SeqCst) != 1 || snap.lifecycle != ContextState::Terminated {
        return Err(format!(
            "teardown ran {} times; lifecycle {:?}",
            log.teardowns.load(Ordering::SeqCst),
            snap.lifecycle
        ));
    }
    if snap.charged != 0 || snap.pins.total() != 0 || snap.total() != Default::default() {
        return Err(format!(
            "accounting after teardown: charged {} pins {:?}",
            snap.charged, snap.pins
        ));
    }
    leak_check().map_err(|e| format!("leak: {e}"))?;
    Ok(format!(
        "panic reached allocate's caller; no pin or charge left; {} release retired",
        report.retired_releases
    ))
}
