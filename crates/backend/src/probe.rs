//! [`BackendProbe`]: what every backend reports about its own bookkeeping, in
//! one type, so that conformance checks, the fault matrix, soaks and
//! `memgov check` read the same counters whatever the backend.
//!
//! A backend keeps one probe per context and records into it as its driver
//! work happens (through its recording methods); callers get a
//! clone that outlives the context, so the counts can be read after teardown.
//! Backend-specific observations (validation messages, fault knobs) stay on
//! the backend's own types.

use memgov_sync::lock;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Violations kept verbatim; the count goes on past this.
const KEPT_VIOLATIONS: usize = 256;

#[derive(Default)]
struct Counters {
    /// Retired frees counted here, plus the counts that destroyed shards
    /// folded in. [`BackendProbe::frees_retired`] adds the live shards.
    frees_retired: AtomicU64,
    /// The live shards of `frees_retired`. A shard is in this list or folded
    /// into `frees_retired`, never both and never neither: it leaves the list
    /// and folds under this lock, and the sum is taken under it.
    shards: Mutex<Vec<Arc<ShardCell>>>,
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
        let shards = lock(&self.0.shards);
        shards
            .iter()
            .fold(self.0.frees_retired.load(Ordering::SeqCst), |sum, shard| {
                sum + shard.retired.load(Ordering::SeqCst)
            })
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

    // Recording. The counts are statistics, each independent of the others:
    // relaxed read-modify-writes suffice, and the reader sees them complete
    // once it has synchronized with the backend (a joined stream worker, a
    // fired signal, a finished teardown). Counts saturate at zero so that a
    // backend bug shows as a wrong count, not a wrapped one.

    /// An allocation was made.
    pub fn allocated(&self, bytes: u64) {
        self.0.live_allocations.fetch_add(1, Ordering::Relaxed);
        self.0.used_bytes.fetch_add(bytes, Ordering::Relaxed);
    }
    /// Memory returned to the device other than by a retired stream-ordered
    /// free (a failed allocation's undo, teardown reclaiming what force left).
    pub fn freed(&self, bytes: u64) {
        sub(&self.0.live_allocations, 1);
        sub(&self.0.used_bytes, bytes);
    }
    /// A stream-ordered free executed; call before firing its signal.
    pub fn free_retired(&self, bytes: u64) {
        self.freed(bytes);
        self.0.frees_retired.fetch_add(1, Ordering::Relaxed);
    }
    /// A stream-ordered free executed on a backend that does not count its
    /// allocations (the null backend without a capacity): one increment.
    pub fn count_retired(&self) {
        self.0.frees_retired.fetch_add(1, Ordering::Relaxed);
    }
    /// A share of the retired-free count for one stream, on a cache line of
    /// its own, so that streams counting their inline frees write no line in
    /// common. [`frees_retired`](Self::frees_retired) includes it at once
    /// and, once the shard is dropped, forever after.
    pub fn shard(&self) -> ProbeShard {
        let cell = Arc::new(ShardCell {
            retired: AtomicU64::new(0),
        });
        lock(&self.0.shards).push(cell.clone());
        ProbeShard {
            cell,
            probe: self.clone(),
        }
    }
    /// A stream-ordered free abandoned on a backend that does not count its
    /// allocations.
    pub fn count_abandoned(&self) {
        self.0.frees_abandoned.fetch_add(1, Ordering::Relaxed);
    }
    /// A stream-ordered free will never execute (device lost); call before
    /// dropping its signal. The memory died with the device.
    pub fn free_abandoned(&self, bytes: u64) {
        self.freed(bytes);
        self.0.frees_abandoned.fetch_add(1, Ordering::Relaxed);
    }
    /// Teardown released every allocation and stream still alive (what
    /// `force` or a lost device left); returns how many allocations, bytes
    /// and streams that was.
    pub fn reclaim_rest(&self) -> (u64, u64, u64) {
        (
            self.0.live_allocations.swap(0, Ordering::Relaxed),
            self.0.used_bytes.swap(0, Ordering::Relaxed),
            self.0.live_streams.swap(0, Ordering::Relaxed),
        )
    }
    /// A stream was created.
    pub fn stream_created(&self) {
        self.0.live_streams.fetch_add(1, Ordering::Relaxed);
    }
    /// A stream was destroyed.
    pub fn stream_destroyed(&self) {
        sub(&self.0.live_streams, 1);
    }
    /// The device is lost (seen by the backend or told by the governor).
    pub fn device_lost(&self) {
        self.0.lost.store(true, Ordering::SeqCst);
    }
    /// Teardown has finished (count it once per call).
    pub fn torn_down_now(&self) {
        self.0.teardowns.fetch_add(1, Ordering::SeqCst);
        self.0.torn_down.store(true, Ordering::SeqCst);
    }
    /// A contract violation: counted, kept, and printed to stderr.
    pub fn violation(&self, backend: &str, what: String) {
        eprintln!("memgov {backend} backend: CONTRACT VIOLATION: {what}");
        self.violation_unprinted(what);
    }
    /// A contract violation the backend reports its own way (the Vulkan
    /// validation messages, printed when asked): counted and kept.
    #[allow(dead_code)] // only the Vulkan backend reports its own way
    pub fn violation_unprinted(&self, what: String) {
        self.0.violations.fetch_add(1, Ordering::SeqCst);
        let mut log = lock(&self.0.violation_log);
        if log.len() < KEPT_VIOLATIONS {
            log.push(what);
        }
    }
}

/// One shard's count, alone on its cache line (128 bytes: two lines on CPUs
/// that fetch lines in pairs).
#[repr(align(128))]
struct ShardCell {
    retired: AtomicU64,
}

/// One stream's share of a probe's count of retired frees (see
/// [`BackendProbe::shard`]). Dropping it folds its count into the probe.
pub struct ProbeShard {
    cell: Arc<ShardCell>,
    probe: BackendProbe,
}

impl ProbeShard {
    /// A stream-ordered free executed on a backend that does not count its
    /// allocations: one increment on this shard's own line.
    #[inline]
    pub fn count_retired(&self) {
        self.cell.retired.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for ProbeShard {
    fn drop(&mut self) {
        // Nothing counts on this shard any more (its owner is being dropped),
        // so its count is final; leaving the list and folding happen under
        // the lock every sum is taken under.
        let counters = &self.probe.0;
        let mut shards = lock(&counters.shards);
        if let Some(i) = shards.iter().position(|c| Arc::ptr_eq(c, &self.cell)) {
            shards.swap_remove(i);
        }
        counters
            .frees_retired
            .fetch_add(self.cell.retired.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl fmt::Debug for ProbeShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProbeShard")
            .field("retired", &self.cell.retired.load(Ordering::Relaxed))
            .finish()
    }
}

/// Subtract, saturating at zero.
fn sub(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_life_passes_and_each_leftover_is_named() {
        let p = BackendProbe::new();
        p.stream_created();
        p.allocated(4096);
        p.free_retired(4096);
        p.stream_destroyed();
        p.torn_down_now();
        assert_eq!(p.check_clean_teardown(), Ok(()));
        assert_eq!((p.frees_retired(), p.teardowns()), (1, 1));

        let q = BackendProbe::new();
        q.stream_created();
        q.allocated(100);
        q.torn_down_now();
        let why = q.check_clean_teardown().unwrap_err();
        assert!(
            why.contains("1 live allocations (100 B), 1 live streams"),
            "{why}"
        );
        assert_eq!(q.reclaim_rest(), (1, 100, 1));

        let r = BackendProbe::new();
        r.torn_down_now();
        r.violation_unprinted("double free of 8 B".into());
        let why = r.check_clean_teardown().unwrap_err();
        assert!(
            why.contains("1 violations") && why.contains("double free of 8 B"),
            "{why}"
        );
    }

    #[test]
    fn shards_sum_exactly_while_alive_and_after_they_are_dropped() {
        let p = BackendProbe::new();
        p.count_retired();
        let (a, b) = (p.shard(), p.shard());
        for _ in 0..3 {
            a.count_retired();
        }
        assert_eq!(p.frees_retired(), 4);
        for _ in 0..5 {
            b.count_retired();
        }
        assert_eq!(p.frees_retired(), 9);
        drop(a);
        assert_eq!(p.frees_retired(), 9, "a dropped shard's count stays");
        b.count_retired();
        assert_eq!(p.frees_retired(), 10);
        drop(b);
        assert_eq!(p.frees_retired(), 10);
        assert_eq!(lock(&p.0.shards).len(), 0, "dropped shards leave the list");

        // Counting on two threads while a third reads: never more than was
        // counted, and exact once both are done.
        // (Under Miri, fewer: each step is interpreted.)
        const N: u64 = if cfg!(miri) { 100 } else { 10_000 };
        let p = BackendProbe::new();
        let shards = [p.shard(), p.shard()];
        std::thread::scope(|s| {
            for shard in &shards {
                s.spawn(move || {
                    for _ in 0..N {
                        shard.count_retired();
                    }
                });
            }
            let mut last = 0;
            for _ in 0..100 {
                let now = p.frees_retired();
                assert!(last <= now && now <= 2 * N, "{last} then {now}");
                last = now;
            }
        });
        assert_eq!(p.frees_retired(), 2 * N);
        let [a, b] = shards;
        drop(a);
        assert_eq!(p.frees_retired(), 2 * N);
        drop(b);
        assert_eq!(p.frees_retired(), 2 * N);
    }

    #[test]
    fn counts_saturate_instead_of_wrapping() {
        let p = BackendProbe::new();
        p.freed(10);
        p.stream_destroyed();
        assert_eq!(
            (p.live_allocations(), p.used_bytes(), p.live_streams()),
            (0, 0, 0)
        );
    }
}
