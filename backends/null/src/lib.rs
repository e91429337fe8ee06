//! The null backend: a device context whose every call returns at once.
//!
//! **For tests and benchmarks only.** It has no memory: `allocate` hands out
//! a token that holds the size, `write` and `read` do nothing (reads leave `dst` as it
//! was), and `free_async` fires its [`RetireSignal`] inline, on the calling
//! thread, before it returns. What is left when the governor runs on it is
//! the governor's own cost, which is what `memgov bench` measures.
//!
//! Two switches make it useful beyond that:
//!
//! * [`NullContext::deferred`] parks the signals of frees instead of firing
//!   them, so that releases really pend; [`NullContext::retire_parked`] fires
//!   them all (on the calling thread), as a device would when it reaches
//!   them. `synchronize` fires those parked on its stream.
//! * [`NullConfig::capacity`] bounds the bytes allocated and not yet freed,
//!   like a device's memory, with out-of-memory reported like a driver does.
//!   It bounds the device tier only: pinned host memory ([`Tier::PinnedHost`],
//!   a token like any other, freed in the same stream order) takes none of
//!   it.
//!
//! The allocate → free cycle of one stream writes one backend line, the
//! stream's own (its share of the probe's count of retired frees; an
//! allocation writes nothing), so that threads on different streams of one
//! context share nothing inside the backend. Capacity mode shares its count of used bytes, as a device's
//! memory is shared; deferred mode shares its park.
//!
//! No call on the cycle allocates heap memory: `create_stream` allocates the
//! stream's counter once, and `deferred` parking grows a vector whose
//! capacity can be reserved up front ([`NullConfig::park_capacity`]), so
//! that heap counts taken around the governor are the governor's own.
//!
//! ```
//! use memgov::null::NullContext;
//! use memgov::{Alloc, ContextConfig, Governor, Role};
//! use std::time::{Duration, Instant};
//!
//! let gov = Governor::new();
//! let ctx = gov.register(NullContext::new(), ContextConfig::new());
//! let stream = ctx.create_stream("s")?;
//! drop(ctx.allocate(&stream, Alloc::new(4096, Role::Activation))?); // retired inline
//! drop(stream);
//! let report = ctx.retire().wait(Instant::now() + Duration::from_secs(1))?;
//! assert_eq!(report.retired_releases, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use memgov_backend::ProbeShard;
use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireSignal, Tier,
};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const BACKEND: &str = "null";

#[cold]
fn zero_sized() -> BackendError {
    BackendError::new(
        BACKEND,
        "allocate",
        BackendErrorKind::InvalidArgument,
        "zero-byte allocation",
    )
}

#[cold]
fn lost(op: &'static str) -> BackendError {
    BackendError::new(
        BACKEND,
        op,
        BackendErrorKind::DeviceLost,
        "the null device was lost",
    )
}

use memgov_sync::lock;

/// Settings of a null context.
#[derive(Debug, Clone)]
pub struct NullConfig {
    /// Bytes that may be allocated and not yet freed. `u64::MAX` (the
    /// default) does not count at all.
    pub capacity: u64,
    /// Park the signals of frees instead of firing them inline.
    pub deferred: bool,
    /// Parked signals to reserve room for up front (deferred mode).
    pub park_capacity: usize,
    /// Whether the description claims stream-ordered reuse (CUDA/HIP pools),
    /// to exercise the governor's reuse credit.
    pub stream_ordered_reuse: bool,
}

impl Default for NullConfig {
    fn default() -> Self {
        Self {
            capacity: u64::MAX,
            deferred: false,
            park_capacity: 0,
            stream_ordered_reuse: false,
        }
    }
}

/// A raw "allocation" of the null backend: its size, nothing else (the
/// null device hands out no addresses, and numbering its allocations would
/// put a counter on the path whose cost `memgov bench` attributes to the
/// governor).
#[derive(Debug, PartialEq, Eq)]
pub struct NullMemory {
    /// Bytes requested.
    pub bytes: u64,
    /// The context that allocated it, with [`PINNED`] set for pinned host
    /// memory.
    context: u64,
}

/// The bit of [`NullMemory`]'s context word that marks pinned host memory.
/// Context ids come from a counter that never reaches it; the tier shares
/// the word so that the token stays two words, which the `AnyContext`
/// cycle moves on every allocation.
const PINNED: u64 = 1 << 63;

impl NullMemory {
    /// The tier it was allocated in.
    pub fn tier(&self) -> Tier {
        if self.context & PINNED == 0 {
            Tier::Device
        } else {
            Tier::PinnedHost
        }
    }

    /// The context that allocated it.
    fn owner(&self) -> u64 {
        self.context & !PINNED
    }
}

/// A null stream: a number, and the counters the stream's own calls write.
///
/// Everything an inline `free_async` writes is on one line of the stream's
/// own (its share of the probe's count of retired frees), so that threads on different streams of
/// one context write no line in common inside the backend: what is left
/// shared is the governor's, which is what `memgov bench` measures.
pub struct NullStream {
    /// Serial number, unique per context.
    pub id: u64,
    /// The context that created it.
    context: u64,
    /// This stream's share of the probe's count of retired frees.
    lane: ProbeShard,
}

impl fmt::Debug for NullStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NullStream")
            .field("id", &self.id)
            .field("lane", &self.lane)
            .finish_non_exhaustive()
    }
}

/// Equal ids: within one context, the same stream.
impl PartialEq for NullStream {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for NullStream {}

struct Parked {
    stream: u64,
    bytes: u64,
    tier: Tier,
    signal: RetireSignal,
}

#[derive(Default)]
struct Stats {
    used: AtomicU64,
    /// Frees and teardown; allocations and bytes only when `counted`, so
    /// that the unbounded null cycle stays one counter increment per free,
    /// on the freeing stream's shard of the probe.
    probe: BackendProbe,
    counted: bool,
    /// Where frees park (deferred mode).
    parked: Mutex<Vec<Parked>>,
    /// An empty vector with the reserved room, swapped with `parked` when it
    /// is drained: draining allocates and frees nothing, so a drain measures
    /// the governor, not the allocator.
    spare: Mutex<Vec<Parked>>,
}

impl Stats {
    fn execute(&self, bytes: u64, tier: Tier, signal: RetireSignal) {
        if self.counted {
            if tier == Tier::Device {
                self.used.fetch_sub(bytes, Ordering::AcqRel);
            }
            self.probe.free_retired(bytes);
        } else {
            self.probe.count_retired();
        }
        signal.retire();
    }

    fn retire_parked(&self) -> usize {
        let mut batch = std::mem::take(&mut *lock(&self.spare));
        std::mem::swap(&mut batch, &mut *lock(&self.parked));
        let n = batch.len();
        // Fired with no lock held.
        for p in batch.drain(..) {
            self.execute(p.bytes, p.tier, p.signal);
        }
        let mut spare = lock(&self.spare);
        if spare.capacity() < batch.capacity() {
            *spare = batch;
        }
        n
    }

    fn retire_one(&self) -> bool {
        let mut parked = lock(&self.parked);
        if parked.is_empty() {
            return false;
        }
        let p = parked.remove(0);
        drop(parked);
        self.execute(p.bytes, p.tier, p.signal);
        true
    }
}

/// A device context that does nothing, at once. See the [module docs](self).
pub struct NullContext {
    /// Unique per context in this process: stamped into its streams and
    /// memory, so that another context's handles are refused.
    id: u64,
    config: NullConfig,
    /// The next stream id.
    next_stream: AtomicU64,
    lost: AtomicBool,
    stats: Arc<Stats>,
}

impl fmt::Debug for NullContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NullContext")
            .field("config", &self.config)
            .field("parked", &self.parked_count())
            .finish()
    }
}

impl Default for NullContext {
    fn default() -> Self {
        Self::new()
    }
}

/// Drives the parked frees of a deferred [`NullContext`] from outside, also
/// while the context is governed: this is the device reaching the frees.
#[derive(Clone)]
pub struct NullControls(Arc<Stats>);

impl fmt::Debug for NullControls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NullControls")
            .field("parked", &self.parked_count())
            .finish()
    }
}

impl NullControls {
    /// Signals parked now (deferred mode).
    pub fn parked_count(&self) -> usize {
        lock(&self.0.parked).len()
    }
    /// Fire every parked signal on this thread, in the order the frees were
    /// queued, with no lock held. Returns how many fired.
    pub fn retire_parked(&self) -> usize {
        self.0.retire_parked()
    }
    /// Fire the oldest parked signal only. Returns whether there was one.
    pub fn retire_one(&self) -> bool {
        self.0.retire_one()
    }
}

impl NullContext {
    /// Every free retires inline; no capacity limit.
    pub fn new() -> Self {
        Self::with_config(NullConfig::default())
    }

    /// Frees park their signals until [`retire_parked`](Self::retire_parked)
    /// (or `synchronize` on their stream), with room for `park_capacity`
    /// parked signals reserved now.
    pub fn deferred(park_capacity: usize) -> Self {
        Self::with_config(NullConfig {
            deferred: true,
            park_capacity,
            ..NullConfig::default()
        })
    }

    /// A null context with these settings.
    pub fn with_config(config: NullConfig) -> Self {
        let stats = Stats {
            counted: config.capacity != u64::MAX,
            parked: Mutex::new(Vec::with_capacity(config.park_capacity)),
            spare: Mutex::new(Vec::with_capacity(config.park_capacity)),
            ..Stats::default()
        };
        static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
            config,
            next_stream: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            stats: Arc::new(stats),
        }
    }

    /// What `memgov check` gets for the null backend: an `Unavailable`
    /// error that says why. The null device stores no data, so the
    /// conformance cases that read back what they wrote cannot pass on it;
    /// its contract checks are the fault matrix and the governor's tests.
    pub fn for_check() -> Result<Self, BackendError> {
        Err(BackendError::new(
            BACKEND,
            "new",
            BackendErrorKind::Unavailable,
            "the null device stores no data (benchmarks and tests only); the fault matrix checks it",
        ))
    }

    /// A probe that observes this context, also after its teardown. It
    /// counts allocations and bytes only with a finite
    /// [`capacity`](NullConfig::capacity).
    pub fn probe(&self) -> BackendProbe {
        self.stats.probe.clone()
    }

    /// Drives parked frees once the context is governed.
    pub fn controls(&self) -> NullControls {
        NullControls(self.stats.clone())
    }

    /// Signals parked now (deferred mode).
    pub fn parked_count(&self) -> usize {
        lock(&self.stats.parked).len()
    }

    /// Fire every parked signal; see [`NullControls::retire_parked`], which also
    /// works once the context is governed.
    pub fn retire_parked(&self) -> usize {
        self.stats.retire_parked()
    }

    #[inline]
    fn check(&self, op: &'static str) -> Result<(), BackendError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(lost(op));
        }
        Ok(())
    }

    /// Refuse a stream of another context.
    #[inline]
    fn check_stream(&self, op: &'static str, stream: &NullStream) -> Result<(), BackendError> {
        if stream.context == self.id {
            return Ok(());
        }
        Err(BackendError::new(
            BACKEND,
            op,
            BackendErrorKind::InvalidArgument,
            format!(
                "stream {} belongs to null context {}, not to context {}; pass a stream of the context you call",
                stream.id, stream.context, self.id
            ),
        ))
    }

    /// Refuse memory of another context, and a range outside it.
    #[inline]
    fn check_memory(
        &self,
        op: &'static str,
        memory: &NullMemory,
        range: Option<(u64, usize)>,
    ) -> Result<(), BackendError> {
        let refuse = |what: String| {
            Err(BackendError::new(
                BACKEND,
                op,
                BackendErrorKind::InvalidArgument,
                what,
            ))
        };
        if memory.owner() != self.id {
            return refuse(format!(
                "the {} B allocation belongs to null context {}, not to context {}; pass memory of the context you call",
                memory.bytes, memory.owner(), self.id
            ));
        }
        match range {
            Some((offset, len))
                if offset
                    .checked_add(len as u64)
                    .is_none_or(|end| end > memory.bytes) =>
            {
                refuse(format!(
                    "{len} B at offset {offset} run past the end of a {} B allocation",
                    memory.bytes
                ))
            }
            _ => Ok(()),
        }
    }
}

impl DeviceContext for NullContext {
    type Stream = NullStream;
    type Memory = NullMemory;

    fn describe(&self) -> DeviceDescription {
        DeviceDescription {
            backend: BACKEND,
            vendor: "memgov".into(),
            name: "null device (tests and benchmarks)".into(),
            ordinal: 0,
            total_bytes: self.config.capacity,
            driver: format!("memgov null backend {}", env!("CARGO_PKG_VERSION")),
            execution: Execution::Embedded,
            stream_ordered_reuse: self.config.stream_ordered_reuse,
        }
    }

    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.check("memory_info")?;
        let total = self.config.capacity;
        Ok(MemoryInfo {
            free: total.saturating_sub(self.stats.used.load(Ordering::Acquire)),
            total,
        })
    }

    fn create_stream(&self) -> Result<NullStream, BackendError> {
        self.check("create_stream")?;
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        self.stats.probe.stream_created();
        Ok(NullStream {
            id,
            context: self.id,
            lane: self.stats.probe.shard(),
        })
    }

    fn destroy_stream(&self, stream: NullStream) -> Result<(), BackendError> {
        self.check_stream("destroy_stream", &stream)?;
        // Frees parked on it stay parked: they still execute, later, when
        // `retire_parked` runs (the contract allows either order).
        self.stats.probe.stream_destroyed();
        Ok(())
    }

    #[inline]
    fn allocate(&self, stream: &NullStream, bytes: u64) -> Result<NullMemory, BackendError> {
        self.check("allocate")?;
        self.check_stream("allocate", stream)?;
        if bytes == 0 {
            return Err(zero_sized());
        }
        let capacity = self.config.capacity;
        if capacity != u64::MAX {
            let fits = self
                .stats
                .used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                    u.checked_add(bytes).filter(|&n| n <= capacity)
                });
            if let Err(used) = fits {
                return Err(BackendError::new(
                    BACKEND,
                    "allocate",
                    BackendErrorKind::OutOfMemory,
                    format!("requested {bytes} B; {used} B of {capacity} B in use"),
                ));
            }
            self.stats.probe.allocated(bytes);
        }
        Ok(NullMemory {
            bytes,
            context: self.id,
        })
    }

    /// The device tier is [`allocate`](DeviceContext::allocate); pinned
    /// host memory is a token outside the capacity.
    fn allocate_in(
        &self,
        stream: &NullStream,
        bytes: u64,
        tier: Tier,
    ) -> Result<NullMemory, BackendError> {
        if tier == Tier::Device {
            return self.allocate(stream, bytes);
        }
        self.check("allocate")?;
        self.check_stream("allocate", stream)?;
        if bytes == 0 {
            return Err(zero_sized());
        }
        if self.stats.counted {
            self.stats.probe.allocated(bytes);
        }
        Ok(NullMemory {
            bytes,
            context: self.id | PINNED,
        })
    }

    #[inline]
    fn free_async(
        &self,
        stream: &NullStream,
        memory: NullMemory,
        retired: RetireSignal,
    ) -> Result<(), (NullMemory, RetireSignal, BackendError)> {
        if let Err(e) = self
            .check("free_async")
            .and_then(|()| self.check_stream("free_async", stream))
            .and_then(|()| self.check_memory("free_async", &memory, None))
        {
            return Err((memory, retired, e));
        }
        if self.config.deferred {
            lock(&self.stats.parked).push(Parked {
                stream: stream.id,
                bytes: memory.bytes,
                tier: memory.tier(),
                signal: retired,
            });
        } else if self.stats.counted {
            self.stats.execute(memory.bytes, memory.tier(), retired);
        } else {
            // The unbounded cycle: counted on the stream's own line.
            stream.lane.count_retired();
            retired.retire();
        }
        Ok(())
    }

    fn write(
        &self,
        stream: &NullStream,
        memory: &NullMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.check("write")?;
        self.check_stream("write", stream)?;
        self.check_memory("write", memory, Some((offset, src.len())))
    }

    fn read(
        &self,
        stream: &NullStream,
        memory: &NullMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.check("read")?;
        self.check_stream("read", stream)?;
        self.check_memory("read", memory, Some((offset, dst.len())))
    }

    fn synchronize(&self, stream: &NullStream) -> Result<(), BackendError> {
        self.check("synchronize")?;
        self.check_stream("synchronize", stream)?;
        if self.config.deferred {
            let mine: Vec<Parked> = {
                let mut parked = lock(&self.stats.parked);
                let (mine, rest) = std::mem::take(&mut *parked)
                    .into_iter()
                    .partition(|p| p.stream == stream.id);
                *parked = rest;
                mine
            };
            for p in mine {
                self.stats.execute(p.bytes, p.tier, p.signal);
            }
        }
        Ok(())
    }

    /// Inline frees have already executed; deferred ones park until their
    /// stream is synchronized, so `after`'s parked frees execute now, ahead
    /// of anything queued on `stream` from here on.
    fn order_after(&self, stream: &NullStream, after: &NullStream) -> Result<(), BackendError> {
        self.check_stream("order_after", stream)?;
        self.synchronize(after)
    }

    fn device_lost(&self) {
        self.lost.store(true, Ordering::Release);
        self.stats.probe.device_lost();
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        if lost {
            self.stats.probe.device_lost();
        }
        // A lost device drops what it still holds unfired. On a healthy one
        // the governor tears down only after every release retired, so
        // nothing is parked — unless force reclaimed, and then the memory
        // dies with the context: the signals are dropped (abandoned).
        let parked = std::mem::take(&mut *lock(&self.stats.parked));
        for p in &parked {
            if self.stats.counted {
                self.stats.probe.free_abandoned(p.bytes);
            } else {
                self.stats.probe.count_abandoned();
            }
        }
        drop(parked);
        self.stats.probe.reclaim_rest();
        self.stats.probe.torn_down_now();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_count_frees_apart_and_the_probe_sums_them_exactly() {
        let c = NullContext::new();
        let probe = c.probe();
        let (a, b) = (c.create_stream().unwrap(), c.create_stream().unwrap());
        let cycle = |s: &NullStream, n: u64| {
            for _ in 0..n {
                let m = c.allocate(s, 64).unwrap();
                c.free_async(s, m, RetireSignal::from_fn(|_| {}))
                    .map_err(|(_, _, e)| e)
                    .unwrap();
            }
        };
        cycle(&a, 3);
        assert_eq!(probe.frees_retired(), 3);
        cycle(&b, 4);
        assert_eq!(probe.frees_retired(), 7);
        c.destroy_stream(a).unwrap();
        assert_eq!(
            probe.frees_retired(),
            7,
            "a destroyed stream's frees stay counted"
        );
        cycle(&b, 2);
        assert_eq!(probe.frees_retired(), 9);
        let c2 = c.create_stream().unwrap();
        cycle(&c2, 1);
        assert_eq!(probe.frees_retired(), 10);
        c.destroy_stream(b).unwrap();
        c.destroy_stream(c2).unwrap();
        assert_eq!(probe.frees_retired(), 10);
        c.teardown(false).unwrap();
        assert_eq!(probe.frees_retired(), 10);
        assert_eq!(probe.check_clean_teardown(), Ok(()));
    }

    #[test]
    fn capacity_is_enforced() {
        let c = NullContext::with_config(NullConfig {
            capacity: 100,
            ..NullConfig::default()
        });
        let s = c.create_stream().unwrap();
        let m = c.allocate(&s, 60).unwrap();
        assert_eq!(
            c.allocate(&s, 60).unwrap_err().kind,
            BackendErrorKind::OutOfMemory
        );
        c.free_async(&s, m, RetireSignal::from_fn(|_| {}))
            .map_err(|(_, _, e)| e)
            .unwrap();
        c.allocate(&s, 60).unwrap();
        let probe = c.probe();
        assert_eq!((probe.live_allocations(), probe.used_bytes()), (1, 60));
        c.destroy_stream(s).unwrap();
        c.teardown(false).unwrap();
        assert_eq!(
            probe.check_clean_teardown(),
            Ok(()),
            "teardown reclaims the rest"
        );
    }
}
