//! memgov's test kit: the backend contract suite, the fault-injection
//! matrix and the [`Watched`] observer, as library code for tests and tools.
//! The `memgov` library does not depend on it (as wgpu keeps `wgpu-test`
//! apart): backends and tools take it as a (dev-)dependency.
//!
//! Every backend runs the same cases: memgov's own tests, `memgov check`, and
//! any third-party backend from its own tests, with one call or one macro:
//!
//! ```
//! use memgov::host::{HostContext, HostConfig};
//! let report = memgov_conformance::run_suite(|| HostContext::new(HostConfig::default()));
//! assert!(report.all_passed(), "{report}");
//! ```
//!
//! ```ignore
//! // In a backend crate's tests: one #[test] per case.
//! memgov_conformance::conformance_tests!(my_backend, || MyContext::new(MyConfig::default()));
//! ```
//!
//! Each case builds fresh contexts from the factory, wraps them in
//! [`Watched`] to observe what the governor asks of the backend, and reports
//! [`Outcome::Passed`], [`Outcome::Failed`] with why, or [`Outcome::Skipped`]
//! with why (a factory that reports `Unavailable` skips every case).
//!
//! [`fault_matrix`] runs every backend operation under every injected fault
//! ([`FaultInjecting`](memgov::fault::FaultInjecting)) and checks that nothing
//! leaks, panics or tears down twice.
//!
//! [`capability`] holds the cases and the fault cell of the capabilities a
//! backend may declare beyond the contract (a virtual-memory arena, sleep
//! and wake, graph capture: `memgov::backend::capability`), written over
//! their traits; [`arena_faults`] the arena's cases under a driver that
//! refuses one call (a release, a page-locked allocation) and on a
//! capturing thread, run on the stand-ins with their fault knob.
//!
//! Both run again with the governor's block cache on ([`SuiteOptions`],
//! [`run_suite_probed_with`], [`fault_matrix_with`]): every case's contexts
//! then keep freed blocks, and the same checks hold. Where a case counts
//! the backend's frees, it first empties the cache
//! ([`ContextHandle::trim_cache`](memgov::ContextHandle::trim_cache)), so
//! that a block the cache still holds is not mistaken for a free that
//! never came.
//!
//! ```
//! use memgov_conformance::{run_suite_probed_with, SuiteOptions};
//! use memgov::host::{HostConfig, HostContext};
//! use memgov::CacheConfig;
//!
//! let cached = SuiteOptions::new().cache(CacheConfig::new(64 << 20));
//! let report = run_suite_probed_with(&cached, || {
//!     let c = HostContext::new(HostConfig::default())?;
//!     let probe = c.probe();
//!     Ok((c, probe))
//! });
//! assert!(report.all_passed(), "{report}");
//! ```

pub mod arena_faults;
pub mod arena_stress;
pub mod capability;
mod cases;
mod faults;
mod watch;

pub use faults::{fault_matrix, fault_matrix_with, FaultCell, FaultMatrix, LeakCheck};
pub use watch::{WatchLog, Watched};

/// The block cache's limits, for [`SuiteOptions::cache`]: re-exported so a
/// backend crate runs the cached suite and matrix without depending on
/// `memgov` itself.
pub use memgov::CacheConfig;

use memgov::{BackendError, BackendErrorKind, BackendProbe, Bytes, DeviceContext, Execution};
use memgov_backend::lock;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How the suite and the fault matrix configure the contexts they register.
///
/// The default registers them as the cases write them; [`cache`](Self::cache)
/// turns the block cache on in every one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SuiteOptions {
    pub(crate) cache: Option<CacheConfig>,
}

impl SuiteOptions {
    /// Contexts as the cases write them: the block cache off.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every context the cases register keeps freed blocks in a block cache
    /// with these limits.
    pub fn cache(mut self, cache: CacheConfig) -> Self {
        self.cache = Some(cache);
        self
    }

    /// `config` with these options applied.
    pub(crate) fn apply(&self, config: memgov::ContextConfig) -> memgov::ContextConfig {
        match self.cache {
            Some(cache) => config.cache(cache),
            None => config,
        }
    }
}

impl fmt::Display for SuiteOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cache {
            Some(c) => write!(f, "block cache of {:#}", Bytes(c.max_bytes())),
            None => f.write_str("no block cache"),
        }
    }
}

/// How one case ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every check held.
    Passed,
    /// A check failed; the text says which and with what numbers.
    Failed(String),
    /// The case could not run here; the text says why.
    Skipped(String),
}

impl Outcome {
    /// Whether this is a failure.
    pub fn is_failed(&self) -> bool {
        matches!(self, Self::Failed(_))
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Passed => f.write_str("pass"),
            Self::Failed(why) => write!(f, "FAIL: {why}"),
            Self::Skipped(why) => write!(f, "skipped: {why}"),
        }
    }
}

/// One case's result.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// Case name.
    pub name: &'static str,
    /// How it ended.
    pub outcome: Outcome,
    /// How long it took.
    pub elapsed: Duration,
}

/// The result of a whole suite run against one backend.
#[derive(Debug, Clone)]
pub struct SuiteReport {
    /// Backend name (`"host"`, `"vulkan"`, ...).
    pub backend: String,
    /// Device name, or why there is none.
    pub device: String,
    /// How the backend reached the device, when it did.
    pub execution: Option<Execution>,
    /// How the cases configured their contexts.
    pub options: SuiteOptions,
    /// Per case.
    pub cases: Vec<CaseResult>,
}

impl SuiteReport {
    /// No case failed (skips are not failures, but are printed).
    pub fn all_passed(&self) -> bool {
        !self.cases.iter().any(|c| c.outcome.is_failed())
    }

    /// (passed, failed, skipped).
    pub fn counts(&self) -> (usize, usize, usize) {
        let p = self
            .cases
            .iter()
            .filter(|c| c.outcome == Outcome::Passed)
            .count();
        let f = self.cases.iter().filter(|c| c.outcome.is_failed()).count();
        (p, f, self.cases.len() - p - f)
    }
}

impl fmt::Display for SuiteReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = self
            .execution
            .map_or_else(|| "not run".to_owned(), |e| e.to_string());
        writeln!(
            f,
            "{} on {} ({how}), {}",
            self.backend, self.device, self.options
        )?;
        for c in &self.cases {
            writeln!(f, "  {:<48} {} ({:.1?})", c.name, c.outcome, c.elapsed)?;
        }
        let (p, fl, s) = self.counts();
        write!(f, "  {p} passed, {fl} failed, {s} skipped")
    }
}

/// A case: a name and a function over a context factory.
pub struct Case<C: DeviceContext> {
    /// Stable name, also the name of the generated `#[test]`.
    pub name: &'static str,
    /// Runs the case: contexts come from the factory, and the governor's
    /// contexts are configured with the options.
    pub run: fn(&dyn Fn() -> Result<C, BackendError>, &SuiteOptions) -> Outcome,
}

/// Every case of the suite, in order.
pub fn cases<C: DeviceContext>() -> Vec<Case<C>> {
    cases::all()
}

/// Run one case by name. Unknown names fail.
pub fn run_case<C: DeviceContext>(
    name: &str,
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> Outcome {
    run_case_with(name, &SuiteOptions::new(), factory)
}

/// Run one case by name with `options`. Unknown names fail.
pub fn run_case_with<C: DeviceContext>(
    name: &str,
    options: &SuiteOptions,
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> Outcome {
    match cases::<C>().into_iter().find(|c| c.name == name) {
        Some(case) => run_guarded(&case, options, factory),
        None => Outcome::Failed(format!("no conformance case named '{name}'")),
    }
}

fn run_guarded<C: DeviceContext>(
    case: &Case<C>,
    options: &SuiteOptions,
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> Outcome {
    // A panic inside a case (in the backend or the governor) is a failure of
    // that case, not of the whole run.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (case.run)(factory, options)
    })) {
        Ok(o) => o,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "non-string panic".into());
            Outcome::Failed(format!("panicked: {msg}"))
        }
    }
}

/// Run every case against contexts made by `factory`.
pub fn run_suite<C: DeviceContext>(factory: impl Fn() -> Result<C, BackendError>) -> SuiteReport {
    run_suite_with(&SuiteOptions::new(), factory)
}

/// Run every case with `options` against contexts made by `factory`.
pub fn run_suite_with<C: DeviceContext>(
    options: &SuiteOptions,
    factory: impl Fn() -> Result<C, BackendError>,
) -> SuiteReport {
    suite(&factory, options, &|| None)
}

/// Run every case against contexts made by `factory`, which also returns
/// each context's [`BackendProbe`], and hold the backend to its own
/// bookkeeping too: after each case, every context the case created must
/// have been torn down exactly once, with no violation and nothing left
/// allocated or open ([`BackendProbe::check_clean_teardown`]). A case whose
/// checks held but whose backend is not clean fails, with the numbers.
///
/// ```
/// use memgov::host::{HostConfig, HostContext};
/// let report = memgov_conformance::run_suite_probed(|| {
///     let c = HostContext::new(HostConfig::default())?;
///     let probe = c.probe();
///     Ok((c, probe))
/// });
/// assert!(report.all_passed(), "{report}");
/// ```
pub fn run_suite_probed<C: DeviceContext>(
    factory: impl Fn() -> Result<(C, BackendProbe), BackendError>,
) -> SuiteReport {
    run_suite_probed_with(&SuiteOptions::new(), factory)
}

/// [`run_suite_probed`] with `options`: the same cases and the same check of
/// the backend's own bookkeeping after each, with the contexts configured by
/// `options` (the block cache on, say).
pub fn run_suite_probed_with<C: DeviceContext>(
    options: &SuiteOptions,
    factory: impl Fn() -> Result<(C, BackendProbe), BackendError>,
) -> SuiteReport {
    let probes: Mutex<Vec<BackendProbe>> = Mutex::new(Vec::new());
    let plain = || {
        let (c, probe) = factory()?;
        lock(&probes).push(probe);
        Ok(c)
    };
    let after_case = || {
        let created = std::mem::take(&mut *lock(&probes));
        created.iter().enumerate().find_map(|(i, p)| {
            check_probe(p)
                .err()
                .map(|why| format!("context {i}: {why}"))
        })
    };
    suite(&plain, options, &after_case)
}

/// How long a context dropped with its governor may take to be torn down
/// on the reaper thread.
const TEARDOWN_GRACE: Duration = Duration::from_secs(10);

fn check_probe(probe: &BackendProbe) -> Result<(), String> {
    let deadline = Instant::now() + TEARDOWN_GRACE;
    while !probe.torn_down() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    probe
        .check_clean_teardown()
        .map_err(|why| format!("backend probe after the case: {why}"))
}

fn suite<C: DeviceContext>(
    factory: &dyn Fn() -> Result<C, BackendError>,
    options: &SuiteOptions,
    after_case: &dyn Fn() -> Option<String>,
) -> SuiteReport {
    let first = factory();
    let (backend, device, execution, skip) = match first {
        Ok(ctx) => {
            let d = ctx.describe();
            let _ = ctx.teardown(false);
            (d.backend.to_owned(), d.name, Some(d.execution), None)
        }
        Err(e) => {
            let why = unavailable_reason(&e);
            (
                e.backend.to_owned(),
                "no device".to_owned(),
                None,
                Some(why),
            )
        }
    };
    // The describing context is torn down above; its probe is checked too.
    let mut not_clean = after_case();
    let cases = cases::<C>()
        .iter()
        .map(|case| {
            let start = Instant::now();
            let mut outcome = match &skip {
                Some(why) => Outcome::Skipped(why.clone()),
                None => run_guarded(case, options, factory),
            };
            if let Some(why) = not_clean.take().or_else(after_case) {
                if !outcome.is_failed() {
                    outcome = Outcome::Failed(why);
                }
            }
            CaseResult {
                name: case.name,
                outcome,
                elapsed: start.elapsed(),
            }
        })
        .collect();
    SuiteReport {
        backend,
        device,
        execution,
        options: *options,
        cases,
    }
}

/// The text a skip prints for a factory error.
pub fn unavailable_reason(e: &BackendError) -> String {
    match e.kind {
        BackendErrorKind::Unavailable => e.message.clone(),
        _ => format!("could not create a context: {e}"),
    }
}

/// Turn an outcome into a test result: panic on failure, print skips.
#[doc(hidden)]
pub fn assert_outcome(backend: &str, case: &str, outcome: Outcome) {
    match outcome {
        Outcome::Passed => {}
        Outcome::Skipped(why) => eprintln!("{backend}::{case}: skipped: {why}"),
        Outcome::Failed(why) => panic!("{backend}::{case} failed: {why}"),
    }
}

/// Generate one `#[test]` per conformance case for a backend.
///
/// ```ignore
/// memgov_conformance::conformance_tests!(host, || memgov::host::HostContext::new(Default::default()));
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($module:ident, $factory:expr) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $crate::for_each_conformance_case!([$crate::conformance_tests] @cases $module, $factory);
        }
    };
    ([@cases $module:ident, $factory:expr] $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let factory = $factory;
                let outcome = $crate::run_case(stringify!($case), &factory);
                $crate::assert_outcome(stringify!($module), stringify!($case), outcome);
            }
        )*
    };
}

/// Call a macro of yours with the name of every conformance case, for test
/// harnesses that wrap each case (extra checks per case, several
/// configurations). The macro is named in brackets; it receives, in brackets,
/// whatever tokens follow that, then the case names.
///
/// This is the one list of cases: [`cases`] is generated from it too.
///
/// ```ignore
/// macro_rules! my_cases {
///     ([] $($case:ident),*) => { $( #[test] fn $case() { /* run_case(stringify!($case), ..) */ } )* };
/// }
/// memgov_conformance::for_each_conformance_case!([my_cases]);
/// ```
#[macro_export]
macro_rules! for_each_conformance_case {
    ([$($callback:tt)*] $($extra:tt)*) => {
        $($callback)*! {
            [$($extra)*]
            write_read_round_trip,
            stream_order,
            every_signal_fires_once,
            teardown_once_after_drain,
            retiring_refuses_new_work,
            retire_waits_for_pending,
            deadline_error_names_outstanding,
            budget_exhaustion_error,
            device_loss_settles_without_device,
            force_reclaims_live,
            concurrent_streams,
            cross_stream_release_is_ordered,
            raw_misuse_is_refused,
            pinned_host_tier,
            pinned_host_release_is_stream_ordered
        }
    };
}
