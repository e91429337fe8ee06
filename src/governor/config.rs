//! What a caller chooses when registering a context: the admission
//! policy, the block cache's limits, the lease chunks and the rest of
//! [`ContextConfig`].
//!
//! Imports nothing from its neighbours but the budgets a context is
//! charged to and the words it is configured in (roles, pressure).

use super::error::BudgetExceeded;
use super::ledger::SharedBudget;
use super::snapshot::ContextSnapshot;
use crate::Tier;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// What the governor does when an allocation does not fit its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Admission {
    /// Fail at once with [`GovernorError::BudgetExceeded`](super::GovernorError::BudgetExceeded)
    /// (after asking pressure responders, if any are registered).
    #[default]
    FailFast,
    /// Wait up to `timeout` for pending stream-ordered releases to retire (and
    /// for pressure responders' releases), then fail. A refusal by a
    /// [`SharedBudget`] also waits for what a retiring
    /// context on it will give back at its teardown (quarantined bytes and
    /// bytes awaiting teardown): a model swap waits for the old model's
    /// teardown. If this context stops accepting work meanwhile (retire,
    /// force, device loss), the allocation is refused with
    /// `ContextUnavailable` (`DeviceLost` on a lost device), even where the
    /// room came back.
    WaitForPending {
        /// The longest an allocation waits.
        timeout: Duration,
    },
}

/// The default lease chunk: 2 MiB, the size of the smallest large-page
/// allocation most GPU drivers make.
pub(crate) const DEFAULT_CHUNK: u64 = 2 << 20;

/// The default pin lease chunk: enough claims that a stream allocating
/// and releasing a few dozen buffers at a time stays on its own lease.
pub(crate) const DEFAULT_PIN_CHUNK: u64 = 32;

/// The limits of a context's block cache.
///
/// ```
/// use memgov::{CacheConfig, ContextConfig};
/// // Keep up to 256 MiB of freed blocks, none larger than 64 MiB.
/// let config = ContextConfig::new().cache(CacheConfig::new(256 << 20).max_block(64 << 20));
/// # let _ = config;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub(crate) max_bytes: u64,
    pub(crate) max_block: u64,
}

impl CacheConfig {
    /// Keep at most `max_bytes` of freed blocks, over all the context's
    /// streams. A block that would pass it makes room by freeing the oldest
    /// blocks of its own stream, when they are enough; otherwise it is
    /// freed itself. Blocks of any size up to that are
    /// cached until [`max_block`](Self::max_block) says otherwise.
    pub fn new(max_bytes: u64) -> Self {
        Self {
            max_bytes,
            max_block: max_bytes,
        }
    }

    /// Requests larger than `bytes` are neither rounded to a class nor
    /// cached: allocated and freed as they are.
    pub fn max_block(mut self, bytes: u64) -> Self {
        self.max_block = bytes;
        self
    }

    /// The most freed bytes kept ([`new`](Self::new)).
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }
}

/// Registration options for one context.
#[derive(Clone)]
pub struct ContextConfig {
    pub(crate) label: String,
    pub(crate) budget: Option<u64>,
    pub(crate) pinned_budget: Option<u64>,
    pub(crate) shared: Option<SharedBudget>,
    pub(crate) admission: Admission,
    pub(crate) max_pins: u64,
    pub(crate) tuning: Tuning,
    pub(crate) trace: Option<crate::trace::Trace>,
    pub(crate) cache: Option<CacheConfig>,
    pub(crate) attribution: Option<bool>,
    pub(crate) on_refusal: Option<RefusalHook>,
}

/// What [`ContextConfig::on_refusal`] calls.
pub(crate) type RefusalHook = Arc<dyn Fn(&ContextSnapshot, &BudgetExceeded) + Send + Sync>;

impl Default for ContextConfig {
    fn default() -> Self {
        Self {
            label: String::new(),
            budget: None,
            pinned_budget: None,
            shared: None,
            admission: Admission::FailFast,
            max_pins: crate::sync::MAX_CLAIMS,
            tuning: Tuning::new(),
            trace: None,
            cache: None,
            attribution: None,
            on_refusal: None,
        }
    }
}

impl fmt::Debug for ContextConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextConfig")
            .field("label", &self.label)
            .field("budget", &self.budget)
            .field("pinned_budget", &self.pinned_budget)
            .field(
                "shared",
                &self.shared.as_ref().map(|s| s.label().to_owned()),
            )
            .field("admission", &self.admission)
            .field("max_pins", &self.max_pins)
            .field("tuning", &self.tuning)
            .field("traced", &self.trace.is_some())
            .field("cache", &self.cache)
            .field("attribution", &self.attribution)
            .field("on_refusal", &self.on_refusal.is_some())
            .finish()
    }
}

impl ContextConfig {
    /// Defaults: no budget beyond the device, fail fast, no shared budget.
    pub fn new() -> Self {
        Self::default()
    }

    /// A label used in messages, snapshots and reports.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// Records this context's memory timeline into `trace` (allocations,
    /// releases, retirements, refusals, pressure, retire and teardown, per
    /// stream and role): see [`crate::trace`]. Off by default.
    pub fn trace(mut self, trace: &crate::trace::Trace) -> Self {
        self.trace = Some(trace.clone());
        self
    }

    /// Record where each allocation was made (`on`), or not, whatever the
    /// environment says. Without this call, attribution is on when the
    /// environment has `MEMGOV_ATTRIBUTION=1` (read at registration), so
    /// that it can be switched on without a code change.
    ///
    /// With it on, every allocation is counted at its call site (the
    /// caller of [`ContextHandle::allocate`](super::ContextHandle::allocate)
    /// or [`Reservation::allocate`](super::Reservation::allocate), through
    /// `#[track_caller]`) and under its [`Alloc::label`](super::Alloc::label):
    /// [`ContextSnapshot::sites`](super::ContextSnapshot::sites) lists what
    /// each site holds, and a refusal names the largest holders
    /// ([`BudgetExceeded::holders`](super::BudgetExceeded::holders)). It
    /// costs two relaxed read-modify-writes per allocation and two per
    /// release; off, nothing but a test.
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Role, host::{HostConfig, HostContext}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().attribution(true));
    /// let stream = ctx.create_stream("main")?;
    /// let kv = ctx.allocate(&stream, Alloc::new(4096, Role::KvCache).label("kv-cache layer 12"))?;
    /// let site = &ctx.snapshot().sites[0];
    /// assert_eq!((site.label.as_deref(), site.live_bytes), (Some("kv-cache layer 12"), 4096));
    /// assert!(site.site.starts_with(file!()));
    /// # drop(kv);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn attribution(mut self, on: bool) -> Self {
        self.attribution = Some(on);
        self
    }

    /// Call `hook` with the context's snapshot when a budget refuses one of
    /// its allocations ([`GovernorError::BudgetExceeded`](super::GovernorError::BudgetExceeded),
    /// through [`ContextHandle::allocate`](super::ContextHandle::allocate),
    /// [`Reservation::allocate`](super::Reservation::allocate) or
    /// [`ContextHandle::reserve`](super::ContextHandle::reserve)), before
    /// the error is returned: the place to write the snapshot to a file
    /// (with the `serde` feature, `serde_json::to_writer`), as PyTorch users
    /// dump a memory snapshot on out-of-memory. Called on the allocating
    /// thread with no lock held and the refused allocation's pin given back
    /// (the hook may retire the context); the snapshot lists the sites
    /// ([`attribution`](Self::attribution)) when attribution is on.
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Role, host::{HostConfig, HostContext}};
    /// use std::sync::{Arc, Mutex};
    /// let seen = Arc::new(Mutex::new(None));
    /// let keep = seen.clone();
    /// let gov = Governor::new();
    /// let ctx = gov.register(
    ///     HostContext::new(HostConfig::default())?,
    ///     ContextConfig::new().budget(4096).on_refusal(move |snapshot, refusal| {
    ///         *keep.lock().unwrap() = Some((snapshot.total().live_bytes, refusal.requested));
    ///     }),
    /// );
    /// let stream = ctx.create_stream("main")?;
    /// let _a = ctx.allocate(&stream, Alloc::new(4096, Role::Activation))?;
    /// assert!(ctx.allocate(&stream, Alloc::new(1, Role::Activation)).is_err());
    /// assert_eq!(*seen.lock().unwrap(), Some((4096, 1)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_refusal(
        mut self,
        hook: impl Fn(&ContextSnapshot, &BudgetExceeded) + Send + Sync + 'static,
    ) -> Self {
        self.on_refusal = Some(Arc::new(hook));
        self
    }

    /// Keep freed blocks for reuse, within `limits` (default off).
    ///
    /// A buffer released on its own stream is kept in that stream's cache
    /// instead of being freed, and the next allocation of its size class on
    /// that stream gets it back without calling the backend (no new pages,
    /// no driver call). Requests up to
    /// [`CacheConfig::max_block`](super::CacheConfig::max_block) are rounded
    /// up to their [`size_class`](super::size_class), so
    /// [`DeviceBuffer::len`](super::DeviceBuffer::len) reports the class.
    /// A block is reused only on the stream that freed it: every other
    /// stream gets the bytes through an ordinary stream-ordered free, after
    /// it has retired.
    ///
    /// Cached bytes stay charged to the budgets and are reported apart
    /// ([`ContextSnapshot::cache`](super::ContextSnapshot::cache)); any
    /// refused admission releases them before it waits or asks a pressure
    /// responder, [`ContextHandle::trim_cache`](super::ContextHandle::trim_cache)
    /// releases them on demand, and retire and device loss release them all.
    /// Those are stream-ordered frees: a refused admission under
    /// [`Admission::WaitForPending`] waits for them to retire, one under
    /// [`Admission::FailFast`] tries once more and then goes on to the
    /// pressure responders. Allocations out of a
    /// [`Reservation`](super::Reservation) are not served from the cache
    /// (their size is what was asked for, not rounded); a released one is
    /// kept when its size happens to be a size class.
    ///
    /// A traced context ([`trace`](Self::trace)) caches like any other, and
    /// its timeline shows the cache: a release the cache keeps is
    /// [`EventKind::Cached`](crate::trace::EventKind::Cached) (live to
    /// cached), an allocation it serves is
    /// [`EventKind::Reused`](crate::trace::EventKind::Reused) (cached to
    /// live, no backend allocation), and every block it gives back (trim,
    /// pressure, eviction, retire, device loss, a dropped stream) is
    /// [`EventKind::Trimmed`](crate::trace::EventKind::Trimmed) with its
    /// role (cached to pending, then retired); `Allocated` and `Released`
    /// keep meaning a backend allocation and a stream-ordered free.
    ///
    /// Off by default: a cached block keeps its bytes charged to this
    /// context until pressure, a trim or retire reaches it, which a context
    /// that shares its device expects to see only from live buffers; and
    /// backends that already reuse stream-ordered frees (CUDA and HIP memory
    /// pools) gain less from it than the host and Vulkan backends, whose
    /// every allocation is fresh memory.
    ///
    /// ```
    /// use memgov::{Alloc, CacheConfig, ContextConfig, Governor, Role, host::{HostConfig, HostContext}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(
    ///     HostContext::new(HostConfig::default())?,
    ///     ContextConfig::new().budget(64 << 20).cache(CacheConfig::new(16 << 20)),
    /// );
    /// let stream = ctx.create_stream("main")?;
    /// drop(ctx.allocate(&stream, Alloc::new(1000, Role::Workspace))?); // kept: 1024 B
    /// let again = ctx.allocate(&stream, Alloc::new(900, Role::Workspace))?; // the same block
    /// assert_eq!((again.len(), again.charged()), (900, 1024)); // its class is charged
    /// assert_eq!(ctx.snapshot().cache.hits, 1);
    /// drop(again);
    /// assert_eq!(ctx.trim_cache(u64::MAX), 1024); // freed stream-ordered
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cache(mut self, limits: CacheConfig) -> Self {
        self.cache = Some(limits);
        self
    }

    /// Bytes this context may hold (live + pending release + quarantined).
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// The limit of `tier`: bytes this context may hold in it (live +
    /// pending release + quarantined), each tier under its own limit. The
    /// device tier's is [`budget`](Self::budget); pinned host memory has
    /// none by default (the OS's page-locking limit is the bound), and its
    /// bytes are never charged to the device budget or a shared one. The
    /// pinned host tier also holds the page-locked copies a governed sleep
    /// keeps of device memory
    /// ([`ContextHandle::sleep_with`](super::ContextHandle::sleep_with)).
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Role, Tier, host::{HostContext, HostConfig}};
    /// let gov = Governor::new();
    /// let config = ContextConfig::new()
    ///     .budget(1 << 20)
    ///     .tier_budget(Tier::PinnedHost, 64 << 10);
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, config);
    /// let stream = ctx.create_stream("copy")?;
    /// let staging = ctx.allocate(&stream, Alloc::new(64 << 10, Role::Other).tier(Tier::PinnedHost))?;
    /// assert_eq!(staging.tier(), Tier::PinnedHost);
    /// // The pinned tier is full; the device tier is untouched.
    /// assert!(ctx.allocate(&stream, Alloc::new(1, Role::Other).tier(Tier::PinnedHost)).is_err());
    /// let weights = ctx.allocate(&stream, Alloc::new(1 << 20, Role::Weights))?;
    /// drop((staging, weights));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tier_budget(mut self, tier: Tier, bytes: u64) -> Self {
        match tier {
            Tier::Device => self.budget = Some(bytes),
            _ => self.pinned_budget = Some(bytes),
        }
        self
    }

    /// A budget shared with other contexts on the same physical device.
    pub fn shared_budget(mut self, shared: SharedBudget) -> Self {
        self.shared = Some(shared);
        self
    }

    /// What to do when an allocation does not fit.
    pub fn admission(mut self, admission: Admission) -> Self {
        self.admission = admission;
        self
    }

    /// The fast path's tuning (leases, the exact peak): see [`Tuning`].
    /// The defaults suit most runtimes; change them when a bench says so.
    pub fn tuning(mut self, tuning: Tuning) -> Self {
        self.tuning = tuning;
        self
    }

    /// The most pins that may be outstanding at once (default 2^63 - 1).
    /// Acquiring beyond it fails with `PinCountOverflow`. Lower it to test
    /// overflow handling.
    ///
    /// # Panics
    ///
    /// If `max` is zero or above 2^63 - 1.
    pub fn max_pins(mut self, max: u64) -> Self {
        assert!(
            (1..=crate::sync::MAX_CLAIMS).contains(&max),
            "max_pins must be in 1..=2^63-1, got {max}"
        );
        self.max_pins = max;
        self
    }
}

/// How the governor's fast path trades exactness of what snapshots report
/// for allocations that scale across streams. None of it changes what is
/// admitted: admission is exact with every setting.
///
/// ```
/// use memgov::{ContextConfig, Tuning};
/// // One context per core-pinned stream, snapshots read rarely: bigger leases.
/// let config = ContextConfig::new().budget(8 << 30).tuning(Tuning::new().lease_chunk(8 << 20));
/// # let _ = config;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    pub(crate) lease_chunk: u64,
    pub(crate) pin_lease_chunk: u64,
    pub(crate) exact_peak: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Self::new()
    }
}

impl Tuning {
    /// The defaults: 2 MiB budget leases, 32-pin leases, per-stream peaks.
    pub const fn new() -> Self {
        Self {
            lease_chunk: DEFAULT_CHUNK,
            pin_lease_chunk: DEFAULT_PIN_CHUNK,
            exact_peak: false,
        }
    }

    /// Bytes of budget a stream leases beyond an allocation when it has to
    /// charge the budget (default 2 MiB; 0 turns leases off).
    ///
    /// Streams charge allocations out of their lease and put settled frees
    /// back into it (keeping at most two chunks), so that streams allocating
    /// at the same time do not write the same budget word. Admission stays
    /// exact: before refusing an allocation, the governor takes back every
    /// idle lease. Snapshots report bytes charged to allocations, not leased
    /// ones; while streams allocate, `charged` may be off by up to one chunk
    /// per stream refilling or settling at that instant, and `peak` may miss
    /// a short peak by as much. A context on a shared budget does not lease.
    pub const fn lease_chunk(mut self, bytes: u64) -> Self {
        self.lease_chunk = bytes;
        self
    }

    /// Pins a stream's shard leases from the context at a time (default 32;
    /// 0 turns pin leases off).
    ///
    /// A buffer's pin is taken out of its stream's lease, so streams on
    /// different threads do not write a common pin word. Leased pins count
    /// against [`ContextConfig::max_pins`] like held ones, but a refusal
    /// takes every idle lease back before it reports `PinCountOverflow`, so
    /// the maximum stays exact; snapshots count held pins only (a pin moving
    /// in or out of a lease at that instant may be half-seen). Retire and
    /// device loss close the leases before the pin count, so a pin is never
    /// taken from a lease once the context is retiring.
    pub const fn pin_lease_chunk(mut self, pins: u64) -> Self {
        self.pin_lease_chunk = pins;
        self
    }

    /// Keep the snapshot's [`peak`](super::ContextSnapshot::peak) exact
    /// across streams (default off).
    ///
    /// Off, each stream shard totals its own live bytes on its own cache
    /// line, and the peak is the sum of the shards' peaks: exact on a context
    /// whose live buffers were all on one stream (one session of a runtime),
    /// an upper bound when several streams held buffers (their peaks need not
    /// have coincided); [`ContextSnapshot::peak_exact`](super::ContextSnapshot::peak_exact)
    /// says which. On, one context-wide total is kept instead, exact across
    /// streams, and every stream writes its line twice per allocate and
    /// release: streams of one context on several cores then slow each other
    /// down (`memgov bench`'s `two-threads` row measures how much).
    pub const fn exact_peak(mut self, exact: bool) -> Self {
        self.exact_peak = exact;
        self
    }
}
