//! Byte budgets: one per context, optionally one shared by several contexts
//! on the same physical device. A charge is a compare-and-swap on the
//! charged total; nothing here takes a lock.

use crate::sync::{lock, Notifier};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Charged bytes against a limit: the one compare-and-swap word every
/// budget is, loom-checked in `memgov-sync`. `charged` counts live bytes,
/// bytes whose stream-ordered release has not retired yet, quarantined
/// bytes, reserved bytes, and bytes awaiting teardown (whose free never ran
/// on the device).
pub(crate) use crate::sync::{BudgetWord, Refusal};

/// A context charged to a [`SharedBudget`], as the budget sees it: something
/// that can be declared lost with its device. Type-erased so that one budget
/// can list contexts of any backend.
pub(crate) trait DeviceMember: Send + Sync {
    /// The physical device is lost: mark this context lost with `reason`.
    fn device_lost(&self, reason: &str);

    /// Bytes charged here that this context's teardown will give back
    /// because the context is retiring: pending, quarantined and awaiting
    /// teardown; at least 1 while its teardown runs (it gives back all it
    /// still holds before it ends). Zero for a context that is not retiring
    /// (nothing says it will ever go) or that has terminated (it gave them
    /// back). A shared-budget admission waits while this is nonzero; the
    /// teardown bumps the level's `epoch` once it ends.
    fn returning_at_teardown(&self) -> u64;

    /// The context's identity, as a [`PressureRequest`](crate::PressureRequest)
    /// names it.
    fn identity(&self) -> crate::ProviderContextIdentity;

    /// The context's pressure responders now (clones: the caller asks them
    /// with no lock held). Empty once the context stopped accepting work.
    fn pressure_responders(&self) -> Vec<crate::governor::pressure::RegisteredResponder>;

    /// Free up to `bytes` of the context's block cache (at least that many
    /// when it holds them; everything when `bytes` is 0), stream-ordered, for
    /// a refusal on a level above it. Returns the bytes released.
    fn release_cache_for_pressure(&self, bytes: u64) -> u64;

    /// Bytes in the context's block cache now.
    fn cached_bytes(&self) -> u64;

    /// The context's call sites with live bytes now (site, then its label
    /// in quotes when it has one; live bytes), with attribution on; empty
    /// with it off.
    fn live_sites(&self) -> Vec<(String, u64)>;

    /// A trim of the process budget for another process asked this
    /// context's cache and responders for room (`asked` bytes for the whole
    /// process): they gave back `released`. For the context's timeline.
    fn trimmed(&self, asked: u64, released: u64);
}

/// One level of the budget tree above the contexts (a device's
/// [`SharedBudget`], a [`ProcessBudget`]): its budget and the totals an
/// admission refused there reads. They change only through the contexts'
/// [`Charges`](super::charges::Charges) and the outside records (both in
/// `charges.rs`), which keep every level in step; nothing else reaches these
/// fields.
pub(crate) struct Level {
    pub(super) label: String,
    pub(super) budget: BudgetWord,
    /// Pending-release bytes of every context under this level.
    pub(super) pending: AtomicU64,
    /// Quarantined bytes of every context under this level.
    pub(super) quarantined: AtomicU64,
    /// Bytes whose free never ran on the device (abandoned releases, buffers
    /// reclaimed by force or released on a lost device), of every context
    /// under this level: charged until that context's teardown returns.
    pub(super) awaiting_teardown: AtomicU64,
    /// Bytes recorded as allocated outside memgov at this level or below
    /// (see `outside.rs`): charged, never released by memgov.
    pub(super) outside: AtomicU64,
    /// Bumped whenever bytes charged here come back (a release settles, a
    /// teardown returns, an outside record is dropped).
    pub(super) epoch: AtomicU64,
    /// Woken when the epoch moves, and when a context under this level is
    /// lost or retires (its admission waiters give up).
    pub(super) retired: Notifier,
}

impl Level {
    fn new(label: String, limit: u64) -> Self {
        Self {
            label,
            budget: BudgetWord::new(limit),
            pending: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            awaiting_teardown: AtomicU64::new(0),
            outside: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            retired: Notifier::new(),
        }
    }

    /// Charges went back to this level outside a settlement (a teardown
    /// returned them, an outside record was dropped): wake the admissions
    /// waiting for room here.
    pub(crate) fn announce_returned(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.retired.notify();
    }

    /// The totals a refusal at this level reports.
    pub(crate) fn amounts(&self) -> LevelAmounts {
        LevelAmounts {
            pending: self.pending.load(Ordering::Acquire),
            quarantined: self.quarantined.load(Ordering::Acquire),
            awaiting_teardown: self.awaiting_teardown.load(Ordering::Acquire),
            outside: self.outside.load(Ordering::Acquire),
        }
    }
}

/// A level's totals, as a refused admission reports them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LevelAmounts {
    pub pending: u64,
    pub quarantined: u64,
    pub awaiting_teardown: u64,
    pub outside: u64,
}

/// What a [`SharedBudget`] shares: its level of the tree, the process level
/// above it, and the contexts charged to it.
pub(crate) struct SharedBudgetInner {
    pub(super) level: Level,
    /// The process budget every charge here is also charged to.
    pub(super) parent: Option<ProcessBudget>,
    /// Why the device was declared lost, once it was.
    lost: Mutex<Option<String>>,
    /// Every context registered with this budget (pruned as they go).
    members: Mutex<Vec<Weak<dyn DeviceMember>>>,
}

/// A byte budget shared by several contexts, typically those on one physical
/// device. Cloning it shares the same budget.
///
/// It is also the device's identity for device-wide loss:
/// [`mark_lost`](Self::mark_lost) declares every context on it lost at once.
///
/// ```
/// use memgov::{Governor, ContextConfig, SharedBudget, host::{HostContext, HostConfig}};
/// let gov = Governor::new();
/// let gpu0 = SharedBudget::new("gpu0", 1 << 20);
/// let a = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().shared_budget(gpu0.clone()));
/// let b = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().shared_budget(gpu0.clone()));
/// # let _ = (a, b);
/// # Ok::<(), memgov::BackendError>(())
/// ```
///
/// Under a [`ProcessBudget`] ([`with_parent`](Self::with_parent)), every
/// byte charged here is charged to the process level too.
#[derive(Clone)]
pub struct SharedBudget(pub(crate) Arc<SharedBudgetInner>);

impl SharedBudgetInner {
    /// The contexts on this budget now, for a caller to ask with no lock
    /// held.
    pub(crate) fn members(&self) -> Vec<Arc<dyn DeviceMember>> {
        lock(&self.members)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Bytes that retiring contexts on this budget will give back at their
    /// teardown (see [`DeviceMember::returning_at_teardown`]). The slow path
    /// of a refused admission only: it takes the members lock, and asks the
    /// members with the lock released.
    pub(crate) fn returning_at_teardown(&self) -> u64 {
        self.members()
            .iter()
            .map(|m| m.returning_at_teardown())
            .fold(0, u64::saturating_add)
    }

    /// Charges went back to this budget outside a settlement (a teardown
    /// returned them): wake the admissions waiting for room here and at the
    /// process level.
    pub(crate) fn announce_returned(&self) {
        self.level.announce_returned();
        if let Some(p) = &self.parent {
            p.0.level.announce_returned();
        }
    }
}

impl SharedBudget {
    /// A new shared budget of `limit` bytes.
    pub fn new(label: impl Into<String>, limit: u64) -> Self {
        Self::build(label.into(), limit, None)
    }

    /// A new shared budget of `limit` bytes under `process`: a charge here
    /// is a charge on `process` too, both or neither, and `process` refuses
    /// what would take it over its own limit.
    ///
    /// ```
    /// use memgov::{ProcessBudget, SharedBudget};
    /// let process = ProcessBudget::new("worker", 6 << 30);
    /// let gpu0 = SharedBudget::with_parent("gpu0", 4 << 30, &process);
    /// let gpu1 = SharedBudget::with_parent("gpu1", 4 << 30, &process);
    /// assert_eq!(gpu0.parent().map(|p| p.label()), Some("worker"));
    /// # let _ = gpu1;
    /// ```
    pub fn with_parent(label: impl Into<String>, limit: u64, process: &ProcessBudget) -> Self {
        let budget = Self::build(label.into(), limit, Some(process.clone()));
        process.adopt(&budget);
        budget
    }

    fn build(label: String, limit: u64, parent: Option<ProcessBudget>) -> Self {
        Self(Arc::new(SharedBudgetInner {
            level: Level::new(label, limit),
            parent,
            lost: Mutex::new(None),
            members: Mutex::new(Vec::new()),
        }))
    }

    /// The label given at creation.
    pub fn label(&self) -> &str {
        &self.0.level.label
    }

    /// The process budget above this one, if any.
    pub fn parent(&self) -> Option<&ProcessBudget> {
        self.0.parent.as_ref()
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.0.level.budget.limit()
    }

    /// Change the limit. Allocations already charged are not affected.
    pub fn set_limit(&self, limit: u64) {
        self.0.level.budget.set_limit(limit)
    }

    /// Bytes charged by all contexts sharing this budget: live, pending
    /// release, quarantined and awaiting teardown, and what was recorded as
    /// allocated outside memgov here or on its contexts
    /// ([`outside`](Self::outside)).
    pub fn charged(&self) -> u64 {
        self.0.level.budget.charged()
    }

    /// Bytes whose stream-ordered release is queued and has not retired.
    pub fn pending(&self) -> u64 {
        self.0.level.pending.load(Ordering::Acquire)
    }

    /// Bytes whose release the backend refused: charged until their
    /// context terminates.
    pub fn quarantined(&self) -> u64 {
        self.0.level.quarantined.load(Ordering::Acquire)
    }

    /// Bytes whose free never ran on the device (releases abandoned, buffers
    /// reclaimed by `force` or released on a lost device): charged until
    /// their context's teardown has returned the memory to the device.
    pub fn awaiting_teardown(&self) -> u64 {
        self.0.level.awaiting_teardown.load(Ordering::Acquire)
    }

    /// Bytes recorded as allocated outside memgov, here
    /// ([`report_outside`](Self::report_outside)) or on a context charged
    /// here ([`ContextHandle::report_outside`](crate::ContextHandle::report_outside)):
    /// part of [`charged`](Self::charged).
    pub fn outside(&self) -> u64 {
        self.0.level.outside.load(Ordering::Acquire)
    }

    /// Declare the physical device lost: every context charged to this
    /// budget, now and registered later, becomes lost with `reason` (each
    /// settles its pending releases as a context-level loss does). Returns
    /// false if the device already was lost.
    ///
    /// No lock is held while the contexts' backends are told.
    pub fn mark_lost(&self, reason: &str) -> bool {
        {
            let mut lost = lock(&self.0.lost);
            if lost.is_some() {
                return false;
            }
            *lost = Some(reason.to_owned());
        }
        for m in self.0.members() {
            m.device_lost(reason);
        }
        true
    }

    /// Whether [`mark_lost`](Self::mark_lost) was called.
    pub fn is_lost(&self) -> bool {
        lock(&self.0.lost).is_some()
    }

    /// Add a context; one registered on a lost device is lost at once.
    pub(crate) fn join(&self, member: Weak<dyn DeviceMember>) {
        let lost = {
            let mut members = lock(&self.0.members);
            members.retain(|m| m.strong_count() > 0);
            members.push(member.clone());
            // Read under the members lock: a concurrent `mark_lost` either
            // sees this member or is seen here.
            lock(&self.0.lost).clone()
        };
        if let (Some(reason), Some(m)) = (lost, member.upgrade()) {
            m.device_lost(&reason);
        }
    }
}

/// What a [`ProcessBudget`] shares: its level of the tree and the device
/// budgets under it.
pub(crate) struct ProcessBudgetInner {
    pub(super) level: Level,
    /// Every device budget made under this one (pruned as they go).
    devices: Mutex<Vec<Weak<SharedBudgetInner>>>,
    /// The machine ledger above, when the process joined one: every charge
    /// here is charged there too.
    #[cfg(target_os = "linux")]
    pub(super) machine: Option<crate::machine::MachineMember>,
    /// Where the limit came from, when the cluster granted it.
    limit_from: Option<String>,
}

/// The top of the budget tree: a byte budget for the whole process, over
/// the device budgets ([`SharedBudget::with_parent`]) made under it.
/// Cloning it shares the same budget.
///
/// A charge on a device budget under it is a charge here too (all levels
/// or none); a refusal here is reported with [`BudgetScope::Process`] and
/// this level's numbers, and waits for (with
/// [`Admission::WaitForPending`]) or reclaims (with pressure responders)
/// memory anywhere under it.
///
/// ```
/// use memgov::{Alloc, Governor, ContextConfig, ProcessBudget, Role, SharedBudget, BudgetScope};
/// use memgov::host::{HostConfig, HostContext};
/// let process = ProcessBudget::new("worker", 3 << 20);
/// let gpu0 = SharedBudget::with_parent("gpu0", 2 << 20, &process);
/// let gpu1 = SharedBudget::with_parent("gpu1", 2 << 20, &process);
/// let gov = Governor::new();
/// let a = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().shared_budget(gpu0));
/// let b = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().shared_budget(gpu1));
/// let (sa, sb) = (a.create_stream("a")?, b.create_stream("b")?);
/// let _x = a.allocate(&sa, Alloc::new(2 << 20, Role::Weights))?;
/// // gpu1 has room, the process does not.
/// let err = b.allocate(&sb, Alloc::new(2 << 20, Role::Weights)).unwrap_err();
/// assert_eq!(err.budget().unwrap().scope, BudgetScope::Process("worker".into()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`BudgetScope::Process`]: crate::BudgetScope::Process
/// [`Admission::WaitForPending`]: crate::Admission::WaitForPending
#[derive(Clone)]
pub struct ProcessBudget(pub(crate) Arc<ProcessBudgetInner>);

impl ProcessBudget {
    /// A new process budget of `limit` bytes.
    pub fn new(label: impl Into<String>, limit: u64) -> Self {
        Self::build(label.into(), limit, None)
    }

    fn build(label: String, limit: u64, limit_from: Option<String>) -> Self {
        Self(Arc::new(ProcessBudgetInner {
            level: Level::new(label, limit),
            devices: Mutex::new(Vec::new()),
            #[cfg(target_os = "linux")]
            machine: None,
            limit_from,
        }))
    }

    /// A new process budget of at most `limit` bytes, lowered to the limit
    /// the cluster granted the process
    /// ([`granted_limit_from_env`](crate::granted::granted_limit_from_env))
    /// when that is smaller; [`limit_from`](Self::limit_from) then names
    /// the variable it came from, and refusals at this level say so. Under
    /// a machine ledger, give the grant to
    /// [`JoinOptions::granted`](crate::machine::JoinOptions::granted)
    /// instead and build the budget with [`with_machine`](Self::with_machine).
    ///
    /// ```
    /// use memgov::granted::granted_limit;
    /// use memgov::ProcessBudget;
    /// let env = |name: &str| (name == "CUDA_DEVICE_MEMORY_LIMIT_0").then(|| "3000m".to_owned());
    /// let grant = granted_limit(0, Some(16 << 30), env)?.expect("a grant");
    /// let process = ProcessBudget::granted("worker", u64::MAX, &grant);
    /// assert_eq!(process.limit(), 3000 << 20);
    /// assert_eq!(process.limit_from(), Some("CUDA_DEVICE_MEMORY_LIMIT_0"));
    /// # Ok::<(), memgov::granted::GrantedLimitError>(())
    /// ```
    pub fn granted(
        label: impl Into<String>,
        limit: u64,
        granted: &crate::granted::GrantedLimit,
    ) -> Self {
        if granted.bytes <= limit {
            Self::build(label.into(), granted.bytes, Some(granted.variable.clone()))
        } else {
            Self::build(label.into(), limit, None)
        }
    }

    /// A new process budget of at most `limit` bytes, lowered to the limit
    /// the cluster granted this process, read from its environment as a
    /// machine ledger's join reads it
    /// ([`JoinOptions::new`](crate::machine::JoinOptions::new)): the entry
    /// point of a process with no machine ledger. `device` is the CUDA
    /// ordinal the process opens (`None`: only a limit for every device
    /// counts, and a variable that grants limits per device is an error),
    /// `device_total` that device's memory when known. A variable that does
    /// not read is an error naming it; nothing falls back to a default.
    /// Under a machine ledger, the join reads the grant and
    /// [`with_machine`](Self::with_machine) takes it.
    pub fn from_env(
        label: impl Into<String>,
        limit: u64,
        device: Option<u32>,
        device_total: Option<u64>,
    ) -> Result<Self, crate::granted::GrantedLimitError> {
        Ok(match crate::granted::read_grant(device, device_total)? {
            Some(grant) => Self::granted(label, limit, &grant),
            None => Self::new(label, limit),
        })
    }

    /// Where this level's limit came from, when the cluster granted it
    /// ([`granted`](Self::granted), [`from_env`](Self::from_env),
    /// [`with_machine`](Self::with_machine) on a membership whose join took
    /// a grant): the variable's name. `None`: the program set the limit.
    pub fn limit_from(&self) -> Option<&str> {
        self.0.limit_from.as_deref()
    }

    /// A new process budget of `limit` bytes under a machine ledger: every
    /// byte charged here is charged on the ledger too (through the
    /// process's lease there), all levels or none, and the ledger refuses
    /// what would take the machine over its limit
    /// ([`BudgetScope::Machine`](crate::BudgetScope::Machine)). Trim
    /// requests from other processes are answered with this budget's
    /// contexts' block caches and pressure responders. When the membership
    /// took a granted limit
    /// ([`JoinOptions::granted`](crate::machine::JoinOptions::granted)),
    /// this level's limit is that one where it is smaller than `limit`, and
    /// [`limit_from`](Self::limit_from) names its variable.
    ///
    /// ```no_run
    /// use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    /// use memgov::{ProcessBudget, SharedBudget};
    /// let ledger = MachineLedger::open(&LedgerOptions::new("host:0", 8 << 30))?;
    /// let me = ledger.join(JoinOptions::new("trainer").floor(2 << 30))?;
    /// let process = ProcessBudget::with_machine("trainer", 6 << 30, me);
    /// let gpu0 = SharedBudget::with_parent("gpu0", 6 << 30, &process);
    /// # let _ = gpu0;
    /// # Ok::<(), memgov::machine::MachineError>(())
    /// ```
    #[cfg(target_os = "linux")]
    pub fn with_machine(
        label: impl Into<String>,
        limit: u64,
        member: crate::machine::MachineMember,
    ) -> Self {
        let (limit, limit_from) = match member.limit_from() {
            Some(from) if member.limit() <= limit => (member.limit(), Some(from)),
            _ => (limit, None),
        };
        let budget = Self(Arc::new(ProcessBudgetInner {
            level: Level::new(label.into(), limit),
            devices: Mutex::new(Vec::new()),
            machine: Some(member.clone()),
            limit_from,
        }));
        member.set_host(Arc::new(MachineHost(Arc::downgrade(&budget.0))));
        budget
    }

    /// The machine ledger membership above this budget, if any.
    #[cfg(target_os = "linux")]
    pub fn machine(&self) -> Option<&crate::machine::MachineMember> {
        self.0.machine.as_ref()
    }

    /// Every context under this budget now.
    fn contexts(&self) -> Vec<Arc<dyn DeviceMember>> {
        self.devices().iter().flat_map(|d| d.members()).collect()
    }

    /// Give back about `bytes` of device memory for another process: block
    /// caches first (largest blocks first), then the pressure responders of
    /// every context under this budget, lowest priority first, until
    /// `bytes` are on their way back. Returns the bytes released.
    pub fn trim(&self, bytes: u64) -> u64 {
        let contexts = self.contexts();
        // What each context gave back, for its timeline.
        let mut gave = vec![0u64; contexts.len()];
        let mut released = 0u64;
        for (i, c) in contexts.iter().enumerate() {
            if released >= bytes {
                break;
            }
            gave[i] = c.release_cache_for_pressure(bytes - released);
            released = released.saturating_add(gave[i]);
        }
        let mut victims: Vec<_> = contexts
            .iter()
            .enumerate()
            .flat_map(|(i, c)| {
                let id = c.identity();
                c.pressure_responders().into_iter().map(move |r| (i, id, r))
            })
            .collect();
        victims.sort_by_key(|(_, _, r)| r.priority);
        let mut asked = vec![false; contexts.len()];
        for (i, id, r) in victims {
            if released >= bytes {
                break;
            }
            let req = crate::governor::pressure::PressureRequest {
                context: id,
                level: crate::governor::pressure::PressureLevel::Machine,
                role: crate::governor::role::Role::Other,
                requested: bytes,
                shortfall: bytes - released,
            };
            let freed = (r.responder)(&req);
            asked[i] = true;
            gave[i] = gave[i].saturating_add(freed);
            released = released.saturating_add(freed);
        }
        for (i, c) in contexts.iter().enumerate() {
            if asked[i] || gave[i] > 0 {
                c.trimmed(bytes, gave[i]);
            }
        }
        released
    }

    fn adopt(&self, device: &SharedBudget) {
        let mut devices = lock(&self.0.devices);
        devices.retain(|d| d.strong_count() > 0);
        devices.push(Arc::downgrade(&device.0));
    }

    /// The label given at creation.
    pub fn label(&self) -> &str {
        &self.0.level.label
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.0.level.budget.limit()
    }

    /// Change the limit. Allocations already charged are not affected.
    pub fn set_limit(&self, limit: u64) {
        self.0.level.budget.set_limit(limit)
    }

    /// Bytes charged under this budget: everything charged to its device
    /// budgets, and what was recorded as allocated outside memgov here.
    pub fn charged(&self) -> u64 {
        self.0.level.budget.charged()
    }

    /// Bytes whose stream-ordered release is queued and has not retired,
    /// anywhere under this budget.
    pub fn pending(&self) -> u64 {
        self.0.level.pending.load(Ordering::Acquire)
    }

    /// Quarantined bytes anywhere under this budget.
    pub fn quarantined(&self) -> u64 {
        self.0.level.quarantined.load(Ordering::Acquire)
    }

    /// Bytes awaiting their context's teardown anywhere under this budget.
    pub fn awaiting_teardown(&self) -> u64 {
        self.0.level.awaiting_teardown.load(Ordering::Acquire)
    }

    /// Bytes recorded as allocated outside memgov at this level or below:
    /// part of [`charged`](Self::charged).
    pub fn outside(&self) -> u64 {
        self.0.level.outside.load(Ordering::Acquire)
    }

    /// The device budgets under this one now.
    pub(crate) fn devices(&self) -> Vec<Arc<SharedBudgetInner>> {
        lock(&self.0.devices)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}

/// What the machine ledger's doorbell thread calls back into: the process
/// budget, held weakly (the membership must not keep it alive).
#[cfg(target_os = "linux")]
struct MachineHost(Weak<ProcessBudgetInner>);

#[cfg(target_os = "linux")]
impl crate::machine::Host for MachineHost {
    fn trim(&self, bytes: u64) -> u64 {
        self.0.upgrade().map_or(0, |p| ProcessBudget(p).trim(bytes))
    }

    fn census(&self) -> (u64, u64) {
        self.0.upgrade().map_or((0, 0), |p| {
            let contexts = ProcessBudget(p).contexts();
            let cached = contexts.iter().map(|c| c.cached_bytes()).sum();
            (contexts.len() as u64, cached)
        })
    }

    fn top_sites(&self) -> Vec<(String, u64)> {
        let Some(p) = self.0.upgrade() else {
            return Vec::new();
        };
        // One row per site over every context of the process.
        let mut by_site: std::collections::HashMap<String, u64> = Default::default();
        for c in ProcessBudget(p).contexts() {
            for (site, live) in c.live_sites() {
                *by_site.entry(site).or_default() += live;
            }
        }
        let mut sites: Vec<(String, u64)> = by_site.into_iter().collect();
        sites.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        sites.truncate(crate::machine::SITE_ENTRIES);
        sites
    }
}

impl fmt::Debug for ProcessBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessBudget")
            .field("label", &self.label())
            .field("limit", &self.limit())
            .field("limit_from", &self.limit_from())
            .field("charged", &self.charged())
            .field("pending", &self.pending())
            .field("quarantined", &self.quarantined())
            .field("awaiting_teardown", &self.awaiting_teardown())
            .field("outside", &self.outside())
            .finish()
    }
}

impl fmt::Debug for SharedBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBudget")
            .field("label", &self.label())
            .field("parent", &self.parent().map(ProcessBudget::label))
            .field("limit", &self.limit())
            .field("charged", &self.charged())
            .field("pending", &self.pending())
            .field("quarantined", &self.quarantined())
            .field("awaiting_teardown", &self.awaiting_teardown())
            .field("outside", &self.outside())
            .field("lost", &self.is_lost())
            .finish()
    }
}
