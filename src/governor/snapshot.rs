//! Point-in-time views of a context and of the whole governor: plain data
//! (built by `view.rs`). Imports nothing from its neighbours but the
//! roles and the teardown report it shows.
//!
//! Built from relaxed atomic reads: each number is exact when read, but a
//! snapshot taken while other threads allocate is not one atomic cut.

use super::report::TeardownReport;
use super::role::Role;
use crate::{Execution, ProviderContextIdentity, Tier};

/// Where a context is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum ContextState {
    /// Accepting work.
    Active,
    /// Refusing new work; waiting for outstanding work to drain.
    Retiring,
    /// The device is lost; refusing work; waiting for holders to let go.
    Lost,
    /// Torn down.
    Terminated,
}

/// What one tier holds, under its own limit.
///
/// Every buffer is in exactly one tier, so the tiers' `live_bytes` add up to
/// the roles' (and likewise pending and quarantined).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct TierUsage {
    /// The tier.
    #[cfg_attr(feature = "serde", serde(serialize_with = "ser_display"))]
    pub tier: Tier,
    /// Its limit (`u64::MAX`: none); the device tier's is the context
    /// budget.
    pub limit: u64,
    /// Bytes charged to its limit: live, reserved, pending, quarantined,
    /// awaiting teardown and sleep's host copies (the device tier's as in
    /// `ContextSnapshot::charged`).
    pub charged: u64,
    /// Bytes held by reservations in this tier and not allocated yet.
    pub reserved: u64,
    /// Bytes of live buffers in it.
    pub live_bytes: u64,
    /// Bytes whose stream-ordered release is queued and has not executed.
    pub pending_bytes: u64,
    /// Bytes whose release was refused, held until teardown.
    pub quarantined_bytes: u64,
    /// Bytes whose free never ran, charged until teardown.
    pub awaiting_teardown: u64,
    /// Page-locked host memory holding the contents of sleeping device
    /// memory (a sleep that keeps contents, through
    /// [`ContextHandle::sleep_with`](super::ContextHandle::sleep_with)):
    /// charged to this tier until the wake frees it. The pinned host tier
    /// only; 0 on the others.
    pub sleep_copies: u64,
}

/// Bytes and objects of one role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RoleUsage {
    /// Bytes in live buffers.
    pub live_bytes: u64,
    /// Live buffers.
    pub live_count: u64,
    /// Bytes whose release is queued and has not retired.
    pub pending_bytes: u64,
    /// Releases queued and not retired.
    pub pending_count: u64,
    /// Bytes whose release the backend refused.
    pub quarantined_bytes: u64,
    /// Releases the backend refused.
    pub quarantined_count: u64,
    /// Device-tier bytes of live buffers whose memory sleeps
    /// ([`ContextHandle::sleep_with`](super::ContextHandle::sleep_with)):
    /// part of `live_bytes`, on no budget.
    pub suspended_bytes: u64,
    /// Whether the role's memory sleeps: put to sleep by
    /// [`ContextHandle::sleep_with`](super::ContextHandle::sleep_with) and
    /// not woken since by
    /// [`wake_with`](super::ContextHandle::wake_with). In a sum over
    /// roles or contexts: whether any sleeps.
    pub asleep: bool,
}

/// Saturating: sums over contexts can pass `u64::MAX` (the unbounded null
/// device admits allocations of any size), and a total that pins at the
/// maximum says more than one that wraps to a small number.
impl std::ops::Add for RoleUsage {
    type Output = RoleUsage;
    fn add(self, r: RoleUsage) -> RoleUsage {
        RoleUsage {
            live_bytes: self.live_bytes.saturating_add(r.live_bytes),
            live_count: self.live_count.saturating_add(r.live_count),
            pending_bytes: self.pending_bytes.saturating_add(r.pending_bytes),
            pending_count: self.pending_count.saturating_add(r.pending_count),
            quarantined_bytes: self.quarantined_bytes.saturating_add(r.quarantined_bytes),
            quarantined_count: self.quarantined_count.saturating_add(r.quarantined_count),
            suspended_bytes: self.suspended_bytes.saturating_add(r.suspended_bytes),
            asleep: self.asleep || r.asleep,
        }
    }
}

impl std::iter::Sum for RoleUsage {
    fn sum<I: Iterator<Item = RoleUsage>>(iter: I) -> RoleUsage {
        iter.fold(RoleUsage::default(), |a, r| a + r)
    }
}

/// A quarantined release.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct QuarantineEntry {
    /// Role of the memory.
    pub role: Role,
    /// Its size.
    pub bytes: u64,
    /// Why the backend refused to free it.
    pub reason: String,
}

/// Outstanding pins by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PinCounts {
    /// Live streams.
    pub streams: u64,
    /// Live buffers.
    pub buffers: u64,
    /// Releases queued and not retired.
    pub pending_releases: u64,
    /// Pins held through pin sources.
    pub external: u64,
    /// Borrowed pins and allocations in flight.
    pub other: u64,
}

impl PinCounts {
    /// All pins.
    pub fn total(&self) -> u64 {
        self.streams + self.buffers + self.pending_releases + self.external + self.other
    }
}

/// Event counters since registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CounterSnapshot {
    /// Allocations admitted.
    pub allocations: u64,
    /// Releases queued on a stream.
    pub releases_queued: u64,
    /// Releases whose free executed.
    pub retired: u64,
    /// Releases whose signal was dropped unfired.
    pub abandoned: u64,
    /// Buffers of a lost device settled without calling it.
    pub settled_lost: u64,
    /// Releases the backend refused.
    pub quarantined: u64,
    /// Buffers reclaimed by force.
    pub reclaimed: u64,
    /// Allocations refused for lack of room.
    pub admission_refusals: u64,
    /// Times an allocation waited for pending releases.
    pub admission_waits: u64,
    /// Pressure responder calls.
    pub pressure_calls: u64,
    /// Backend calls that returned an error.
    pub backend_errors: u64,
    /// Releases that settled after teardown (a backend bug; must be zero).
    pub late_settlements: u64,
}

/// What the allocations made at one call site (and under one label) hold,
/// with attribution on ([`ContextConfig::attribution`](super::ContextConfig::attribution),
/// or `MEMGOV_ATTRIBUTION=1`). A label
/// ([`Alloc::label`](super::Alloc::label)) aggregates like a site: one row
/// per site and label.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SiteUsage {
    /// Where the allocations were made: `file:line:col` of the caller of
    /// [`ContextHandle::allocate`](super::ContextHandle::allocate) or
    /// [`Reservation::allocate`](super::Reservation::allocate) (or the site
    /// a C caller or a runtime's glue named).
    pub site: String,
    /// The label the allocations were given, if any.
    pub label: Option<String>,
    /// Bytes in live buffers made there (charged bytes: with the block
    /// cache on, the size class).
    pub live_bytes: u64,
    /// Live buffers made there.
    pub live_count: u64,
    /// The most bytes live from there at once.
    pub peak_bytes: u64,
    /// Allocations made there since registration.
    pub allocations: u64,
    /// Allocations refused there since registration.
    pub refusals: u64,
}

/// A call site whose live bytes grew between two snapshots
/// ([`ContextSnapshot::sites_grown_since`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SiteGrowth {
    /// `file:line:col`.
    pub site: String,
    /// The allocations' label, if any.
    pub label: Option<String>,
    /// Live bytes there in the earlier snapshot (0 when it was not listed).
    pub before: u64,
    /// Live bytes there in the later one.
    pub after: u64,
    /// Live buffers there in the earlier snapshot.
    pub count_before: u64,
    /// Live buffers there in the later one.
    pub count_after: u64,
}

impl SiteGrowth {
    /// Bytes the site grew by.
    pub fn grown(&self) -> u64 {
        self.after - self.before
    }
}

/// Where a process level's limit came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(
    feature = "serde",
    serde(tag = "kind", content = "variable", rename_all = "kebab-case")
)]
pub enum LimitSource {
    /// The program gave it
    /// ([`ProcessBudget::new`](crate::ProcessBudget::new), a limit of its
    /// own), or no variable lowered it.
    Program,
    /// The cluster granted it: the variable it was read from
    /// ([`crate::granted`]), as the process level records it (with
    /// `", capped to the ledger"` when a machine ledger capped the grant).
    Granted(String),
}

impl std::fmt::Display for LimitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Program => f.write_str("set by the program"),
            Self::Granted(variable) => f.write_str(variable),
        }
    }
}

/// The process level of the budget tree above a context
/// ([`ProcessBudget`](crate::ProcessBudget)): its limit and where that
/// came from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ProcessLimit {
    /// The process budget's label.
    pub label: String,
    /// Its limit (`u64::MAX`: none).
    pub limit: u64,
    /// Where the limit came from.
    pub from: LimitSource,
}

/// One context at one moment.
#[derive(Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ContextSnapshot {
    /// Identity.
    #[cfg_attr(feature = "serde", serde(serialize_with = "ser_display"))]
    pub context: ProviderContextIdentity,
    /// Label.
    pub label: String,
    /// Backend name.
    pub backend: &'static str,
    /// Device name.
    pub device: String,
    /// How the backend reaches the device.
    #[cfg_attr(feature = "serde", serde(serialize_with = "ser_display"))]
    pub execution: Execution,
    /// Where the context is in its life.
    pub lifecycle: ContextState,
    /// Why the device was declared lost.
    pub lost_reason: Option<String>,
    /// The context's budget limit (`u64::MAX` when unlimited).
    pub budget_limit: u64,
    /// Bytes charged: live + pending + quarantined + awaiting teardown +
    /// reserved + outside memgov (`outside_bytes`) - suspended.
    pub charged: u64,
    /// Device-tier bytes on no budget level because their memory slept
    /// ([`ContextHandle::sleep_with`](super::ContextHandle::sleep_with)):
    /// those of live buffers, until a wake admits them again (by role in
    /// [`by_role`](Self::by_role)), and those of buffers released or
    /// quarantined while asleep, until their release settles or teardown
    /// returns them. Part of the live, pending and quarantined bytes.
    pub suspended: u64,
    /// Whether the context's memory sleeps: asleep while any role does
    /// (each role's [`RoleUsage::asleep`] says which).
    pub sleep: SleepState,
    /// Bytes whose free never ran on the device (releases abandoned, buffers
    /// reclaimed by force or released on a lost device): still charged,
    /// until the context's teardown returns them.
    pub awaiting_teardown: u64,
    /// The shared budget's label, if any.
    pub shared_budget: Option<String>,
    /// The process level above the shared budget, if any: its limit and
    /// where that came from (a variable the cluster set, or the program).
    pub process_limit: Option<ProcessLimit>,
    /// The most bytes in live buffers at once since registration (the
    /// quantity [`total`](Self::total)`().live_bytes` reads now), kept by
    /// every allocation and release whether it was served from a lease or
    /// not. What the application held at its highest; a budget also has to
    /// hold the bytes pending release at that moment (`charged`).
    ///
    /// Exact when [`peak_exact`](Self::peak_exact) is true; otherwise an upper
    /// bound: the sum of the peaks of the streams that held buffers
    /// ([`Tuning::exact_peak`](super::Tuning::exact_peak)).
    pub peak: u64,
    /// Whether [`peak`](Self::peak) is exact: with
    /// [`Tuning::exact_peak`](super::Tuning::exact_peak) on, or
    /// when the context's live buffers were all on one stream shard (one
    /// stream, or up to eight streams when only one of them allocated).
    pub peak_exact: bool,
    /// The most the context's budget ever held at once: bytes charged to
    /// allocations (live, pending, quarantined, awaiting teardown, being
    /// allocated) plus, with budget leases on
    /// ([`Tuning::lease_chunk`](super::Tuning::lease_chunk)),
    /// bytes leased to streams and idle. Exact. Leases are taken back before
    /// a refusal, so this is what the context kept from other use at its
    /// highest, not the budget it needs (with leases off it is that too).
    pub peak_budget_held: u64,
    /// Bytes a runtime recorded as allocated for this context outside
    /// memgov ([`ContextHandle::report_outside`]): part of `charged`, and
    /// of what the levels above the context charge.
    ///
    /// [`ContextHandle::report_outside`]: super::ContextHandle::report_outside
    pub outside_bytes: u64,
    /// Bytes reserved in the device tier and not yet allocated, over all
    /// its live reservations: part of `charged`, not of any role's live
    /// bytes. (Each tier's are in [`by_tier`](Self::by_tier).)
    pub reserved: u64,
    /// The live reservations of every tier with bytes left, largest first.
    pub reservations: Vec<ReservationUsage>,
    /// Usage by role, indexed like [`Role::ALL`]. A block the cache keeps
    /// is not live: it is in [`cache`](Self::cache).
    pub by_role: [RoleUsage; 5],
    /// Usage by tier, indexed like [`Tier::ALL`].
    pub by_tier: Vec<TierUsage>,
    /// What the block cache holds ([`ContextConfig::cache`](super::ContextConfig::cache)):
    /// charged, neither live nor pending.
    pub cache: CacheUsage,
    /// Quarantined releases with reasons.
    pub quarantine: Vec<QuarantineEntry>,
    /// Pins by kind.
    pub pins: PinCounts,
    /// Event counters.
    pub counters: CounterSnapshot,
    /// What each call site holds, most live bytes first (then most
    /// allocations); empty unless attribution is on
    /// ([`ContextConfig::attribution`](super::ContextConfig::attribution)).
    pub sites: Vec<SiteUsage>,
    /// How the teardown ended, once it has (also when it ran in the
    /// background, with nobody waiting).
    #[cfg_attr(feature = "serde", serde(skip))]
    pub teardown: Option<TeardownReport>,
}

/// Every field, with the usage by role keyed by role
/// (`by_role: {Weights: RoleUsage { .. }, KvCache: ..}`) rather than by
/// its index in [`Role::ALL`].
impl std::fmt::Debug for ContextSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        struct ByRole<'a>(&'a [RoleUsage; 5]);
        impl std::fmt::Debug for ByRole<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_map()
                    .entries(Role::ALL.iter().zip(self.0.iter()))
                    .finish()
            }
        }
        // Destructured so that a field added to the struct fails to compile
        // here until it is printed too.
        let Self {
            context,
            label,
            backend,
            device,
            execution,
            lifecycle,
            lost_reason,
            budget_limit,
            charged,
            suspended,
            sleep,
            awaiting_teardown,
            shared_budget,
            process_limit,
            peak,
            peak_exact,
            peak_budget_held,
            outside_bytes,
            reserved,
            reservations,
            by_role,
            by_tier,
            cache,
            quarantine,
            pins,
            counters,
            sites,
            teardown,
        } = self;
        f.debug_struct("ContextSnapshot")
            .field("context", context)
            .field("label", label)
            .field("backend", backend)
            .field("device", device)
            .field("execution", execution)
            .field("lifecycle", lifecycle)
            .field("lost_reason", lost_reason)
            .field("budget_limit", budget_limit)
            .field("charged", charged)
            .field("suspended", suspended)
            .field("sleep", sleep)
            .field("awaiting_teardown", awaiting_teardown)
            .field("shared_budget", shared_budget)
            .field("process_limit", process_limit)
            .field("peak", peak)
            .field("peak_exact", peak_exact)
            .field("peak_budget_held", peak_budget_held)
            .field("outside_bytes", outside_bytes)
            .field("reserved", reserved)
            .field("reservations", reservations)
            .field("by_role", &ByRole(by_role))
            .field("by_tier", by_tier)
            .field("cache", cache)
            .field("quarantine", quarantine)
            .field("pins", pins)
            .field("counters", counters)
            .field("sites", sites)
            .field("teardown", teardown)
            .finish()
    }
}

#[cfg(feature = "serde")]
pub(crate) fn ser_display<T: std::fmt::Display, S: serde::Serializer>(
    v: &T,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl ContextSnapshot {
    /// The row of the call site `file:line` (any column), with no label or
    /// the first label found there, when attribution recorded one.
    pub fn site(&self, file_line: &str) -> Option<&SiteUsage> {
        self.sites.iter().find(|s| {
            s.site
                .strip_prefix(file_line)
                .is_some_and(|rest| rest.starts_with(':'))
        })
    }

    /// The sites holding more live bytes now than in `earlier` (a snapshot
    /// of the same context), most growth first: the leak hunt. Empty unless
    /// attribution is on
    /// ([`ContextConfig::attribution`](super::ContextConfig::attribution)).
    pub fn sites_grown_since(&self, earlier: &ContextSnapshot) -> Vec<SiteGrowth> {
        let mut grown: Vec<SiteGrowth> = self
            .sites
            .iter()
            .filter_map(|now| {
                let then = earlier
                    .sites
                    .iter()
                    .find(|s| s.site == now.site && s.label == now.label);
                let (before, count_before) = then.map_or((0, 0), |s| (s.live_bytes, s.live_count));
                (now.live_bytes > before).then(|| SiteGrowth {
                    site: now.site.clone(),
                    label: now.label.clone(),
                    before,
                    after: now.live_bytes,
                    count_before,
                    count_after: now.live_count,
                })
            })
            .collect();
        grown.sort_by(|a, b| b.grown().cmp(&a.grown()).then_with(|| a.site.cmp(&b.site)));
        grown
    }

    /// Usage of one role.
    pub fn role(&self, role: Role) -> RoleUsage {
        self.by_role[role.index()]
    }

    /// Sum over roles.
    pub fn total(&self) -> RoleUsage {
        self.by_role.iter().copied().sum()
    }

    /// Usage of one tier.
    pub fn tier(&self, tier: Tier) -> Option<TierUsage> {
        self.by_tier.iter().copied().find(|t| t.tier == tier)
    }
}

/// Every context of a governor.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct GovernorSnapshot {
    /// One entry per registered context, in registration order.
    pub contexts: Vec<ContextSnapshot>,
}

impl GovernorSnapshot {
    /// Sum of every context's usage, saturating at `u64::MAX`.
    pub fn total(&self) -> RoleUsage {
        self.contexts.iter().map(ContextSnapshot::total).sum()
    }
}

/// Whether a context's memory sleeps
/// ([`ContextHandle::sleep_with`](super::ContextHandle::sleep_with)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum SleepState {
    /// Its buffers' memory is the device's; nothing is suspended.
    Awake,
    /// A [`sleep_with`](super::ContextHandle::sleep_with) is running.
    FallingAsleep,
    /// Asleep: the live buffers of the roles put to sleep (some or all)
    /// have no device memory, and their bytes are suspended (on no
    /// budget).
    Asleep,
    /// A [`wake_with`](super::ContextHandle::wake_with) is running.
    Waking,
}

impl SleepState {
    /// Short name used in messages.
    pub const fn name(self) -> &'static str {
        match self {
            SleepState::Awake => "awake",
            SleepState::FallingAsleep => "falling asleep",
            SleepState::Asleep => "asleep",
            SleepState::Waking => "waking",
        }
    }
}

impl std::fmt::Display for SleepState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a context's block cache holds, in a
/// [`ContextSnapshot`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CacheUsage {
    /// Whether the context caches freed blocks.
    pub enabled: bool,
    /// Bytes held in freed blocks, ready for reuse: charged, not live.
    pub cached_bytes: u64,
    /// Blocks held.
    pub cached_count: u64,
    /// Cached bytes and blocks by the role of the buffer each block was,
    /// indexed like [`Role::ALL`](super::Role::ALL).
    pub by_role: [(u64, u64); 5],
    /// `(class bytes, blocks)` for every class with a block cached, smallest
    /// first. A block is reused only by a request of its own class on its
    /// own stream: bytes in classes no one asks for are the cache's
    /// fragmentation, and pressure frees them first when they are largest.
    pub by_class: Vec<(u64, u64)>,
    /// Allocations served from the cache (no backend call).
    pub hits: u64,
    /// Bytes the cache gave back to admissions under pressure.
    pub pressure_released: u64,
    /// Bytes given back by [`trim_cache`](super::ContextHandle::trim_cache).
    pub trimmed: u64,
    /// Bytes freed to make room for newer blocks when the cache was at its
    /// limit ([`CacheConfig::new`](super::CacheConfig::new)): the oldest blocks of the releasing
    /// stream go first.
    pub evicted: u64,
}

/// One live reservation as snapshots and refusals list it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ReservationUsage {
    /// The label given at [`reserve`](crate::ContextHandle::reserve).
    pub label: String,
    /// The tier its bytes are charged in.
    #[cfg_attr(feature = "serde", serde(serialize_with = "ser_display"))]
    pub tier: Tier,
    /// Bytes reserved and not yet allocated.
    pub left: u64,
}
