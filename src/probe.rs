//! [`BackendProbe`]: what every backend reports about its own bookkeeping, in
//! one type, so that conformance checks, the fault matrix, soaks and
//! `memgov check` read the same counters whatever the backend.
//!
//! A backend keeps one probe per context and records into it as its driver
//! work happens (the recording methods are crate-private); callers get a
//! clone that outlives the context, so the counts can be read after teardown.
//! Backend-specific observations (validation messages, fault knobs) stay on
//! the backend's own types.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use crate::sync::lock;
use std::sync::{Arc, Mutex};

/// Violations kept verbatim; the count goes on past this.
const KEPT_VIOLATIONS: usize = 256;

#[derive(Default)]
struct Counters {
    frees_retired: AtomicU64,
    frees_abandoned: AtomicU64,
    live_allocations: AtomicU64,
    used_bytes: AtomicU64,
    live_streams: AtomicU64,
    teardowns: AtomicU32,
    torn_down: AtomicBool,
    lost: AtomicBool,
    violations: AtomicU64,
    violation_log: Mutex<Vec<String>>,
}

/// Observes one backend context from outside, before and after its teardown.
///
/// After a correct teardown: `teardowns() == 1`, `violations() == 0`,
/// `live_allocations() == 0`, `used_bytes() == 0` and `live_streams() == 0`.
///
/// ```
/// let probe = memgov::BackendProbe::new();
/// // Nothing was torn down yet: the check says so, with the numbers.
/// let why = probe.check_clean_teardown().unwrap_err();
/// assert!(why.contains("saw 0 teardowns"), "{why}");
/// ```
#[derive(Clone, Default)]
pub struct BackendProbe(Arc<Counters>);

impl fmt::Debug for BackendProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendProbe")
            .field("frees_retired", &self.frees_retired())
            .field("frees_abandoned", &self.frees_abandoned())
            .field("live_allocations", &self.live_allocations())
            .field("used_bytes", &self.used_bytes())
            .field("live_streams", &self.live_streams())
            .field("teardowns", &self.teardowns())
            .field("lost", &self.lost())
            .field("violations", &self.violations())
            .finish()
    }
}

impl BackendProbe {
    /// A probe with every count at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stream-ordered frees that executed (their signal fired).
    pub fn frees_retired(&self) -> u64 {
        self.0.frees_retired.load(Ordering::SeqCst)
    }
    /// Stream-ordered frees given up because the device was lost (their
    /// signal was dropped unfired).
    pub fn frees_abandoned(&self) -> u64 {
        self.0.frees_abandoned.load(Ordering::SeqCst)
    }
    /// Allocations alive in the backend (allocated, not yet freed).
    pub fn live_allocations(&self) -> u64 {
        self.0.live_allocations.load(Ordering::SeqCst)
    }
    /// Bytes of those allocations.
    pub fn used_bytes(&self) -> u64 {
        self.0.used_bytes.load(Ordering::SeqCst)
    }
    /// Streams alive in the backend.
    pub fn live_streams(&self) -> u64 {
        self.0.live_streams.load(Ordering::SeqCst)
    }
    /// Times `teardown` ran: exactly one after a correct teardown.
    pub fn teardowns(&self) -> u32 {
        self.0.teardowns.load(Ordering::SeqCst)
    }
    /// Whether teardown has finished.
    pub fn torn_down(&self) -> bool {
        self.0.torn_down.load(Ordering::SeqCst)
    }
    /// Whether the backend saw (or was told of) device loss.
    pub fn lost(&self) -> bool {
        self.0.lost.load(Ordering::SeqCst)
    }
    /// Contract violations the backend detected (free after teardown, double
    /// free, teardown with work still queued, ...). Zero in a correct program.
    pub fn violations(&self) -> u64 {
        self.0.violations.load(Ordering::SeqCst)
    }
    /// Descriptions of the first 256 violations.
    pub fn violation_log(&self) -> Vec<String> {
        lock(&self.0.violation_log).clone()
    }

    /// The state a correct teardown leaves, or a sentence that says what is
    /// off, with the numbers.
    pub fn check_clean_teardown(&self) -> Result<(), String> {
        let (teardowns, violations) = (self.teardowns(), self.violations());
        let (allocations, bytes, streams) = (
            self.live_allocations(),
            self.used_bytes(),
            self.live_streams(),
        );
        if teardowns == 1 && violations == 0 && allocations == 0 && bytes == 0 && streams == 0 {
            return Ok(());
        }
        let mut s = format!(
            "expected 1 teardown, 0 violations, 0 live allocations (0 B) and 0 live streams; \
             saw {teardowns} teardowns, {violations} violations, {allocations} live allocations \
             ({bytes} B), {streams} live streams"
        );
        let log = self.violation_log();
        if !log.is_empty() {
            s.push_str(&format!("; violations: {}", log.join("; ")));
        }
        Err(s)
    }

    pub(crate) fn allocated(&self, bytes: u64) {
        self.0.live_allocations.fetch_add(1, Ordering::SeqCst);
        self.0.used_bytes.fetch_add(bytes, Ordering::SeqCst);
    }
    /// Memory returned to the device other than by a retired stream-ordered
    /// free (a failed allocation's undo, teardown reclaiming what force left).
    pub(crate) fn freed(&self, bytes: u64) {
        self.0.live_allocations.fetch_sub(1, Ordering::SeqCst);
        self.0.used_bytes.fetch_sub(bytes, Ordering::SeqCst);
    }
    /// A stream-ordered free executed; call before firing its signal.
    pub(crate) fn free_retired(&self, bytes: u64) {
        self.freed(bytes);
        self.0.frees_retired.fetch_add(1, Ordering::SeqCst);
    }
    /// A stream-ordered free will never execute (device lost); call before
    /// dropping its signal. The memory died with the device.
    pub(crate) fn free_abandoned(&self, bytes: u64) {
        self.freed(bytes);
        self.0.frees_abandoned.fetch_add(1, Ordering::SeqCst);
    }
    pub(crate) fn stream_created(&self) {
        self.0.live_streams.fetch_add(1, Ordering::SeqCst);
    }
    pub(crate) fn stream_destroyed(&self) {
        self.0.live_streams.fetch_sub(1, Ordering::SeqCst);
    }
    pub(crate) fn device_lost(&self) {
        self.0.lost.store(true, Ordering::SeqCst);
    }
    /// Teardown has finished (count it once per call).
    pub(crate) fn torn_down_now(&self) {
        self.0.teardowns.fetch_add(1, Ordering::SeqCst);
        self.0.torn_down.store(true, Ordering::SeqCst);
    }
    /// A contract violation: counted, kept, and printed to stderr.
    pub(crate) fn violation(&self, backend: &str, what: String) {
        self.0.violations.fetch_add(1, Ordering::SeqCst);
        eprintln!("memgov {backend} backend: CONTRACT VIOLATION: {what}");
        let mut log = lock(&self.0.violation_log);
        if log.len() < KEPT_VIOLATIONS {
            log.push(what);
        }
    }
}
