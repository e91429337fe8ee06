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
pub(crate) use crate::sync::{BudgetWord as Budget, Refusal};

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
    /// teardown bumps [`SharedBudgetInner::epoch`] once it ends.
    fn returning_at_teardown(&self) -> u64;
}

/// What a [`SharedBudget`] shares. Its budget and totals change only through
/// the contexts' [`Charges`](super::charges::Charges), which keep them in step
/// with each context's own budget; nothing else reaches these fields.
pub(crate) struct SharedBudgetInner {
    pub(super) label: String,
    pub(super) budget: Budget,
    /// Pending-release bytes of every context charged here.
    pub(super) pending: AtomicU64,
    /// Quarantined bytes of every context charged here.
    pub(super) quarantined: AtomicU64,
    /// Bytes whose free never ran on the device (abandoned releases, buffers
    /// reclaimed by force or released on a lost device), of every context
    /// charged here: charged until that context's teardown returns.
    pub(super) awaiting_teardown: AtomicU64,
    /// Bumped whenever a release charged here settles.
    pub(super) epoch: AtomicU64,
    /// Woken when a release charged here retires, and when a context charged
    /// here is lost or retires (its admission waiters give up).
    pub(super) retired: Notifier,
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
#[derive(Clone)]
pub struct SharedBudget(pub(crate) Arc<SharedBudgetInner>);

impl SharedBudgetInner {
    /// Bytes that retiring contexts on this budget will give back at their
    /// teardown (see [`DeviceMember::returning_at_teardown`]). The slow path
    /// of a refused admission only: it takes the members lock, and asks the
    /// members with the lock released.
    pub(crate) fn returning_at_teardown(&self) -> u64 {
        let members: Vec<_> = lock(&self.members)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        members
            .iter()
            .map(|m| m.returning_at_teardown())
            .fold(0, u64::saturating_add)
    }

    /// Charges went back to this budget outside a settlement (a teardown
    /// returned them): wake the admissions waiting for room here.
    pub(crate) fn announce_returned(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.retired.notify();
    }
}

impl SharedBudget {
    /// A new shared budget of `limit` bytes.
    pub fn new(label: impl Into<String>, limit: u64) -> Self {
        Self(Arc::new(SharedBudgetInner {
            label: label.into(),
            budget: Budget::new(limit),
            pending: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            awaiting_teardown: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            retired: Notifier::new(),
            lost: Mutex::new(None),
            members: Mutex::new(Vec::new()),
        }))
    }

    /// The label given at creation.
    pub fn label(&self) -> &str {
        &self.0.label
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.0.budget.limit()
    }

    /// Change the limit. Allocations already charged are not affected.
    pub fn set_limit(&self, limit: u64) {
        self.0.budget.set_limit(limit)
    }

    /// Bytes charged by all contexts sharing this budget: live, pending
    /// release, quarantined and awaiting teardown.
    pub fn charged(&self) -> u64 {
        self.0.budget.charged()
    }

    /// Bytes whose stream-ordered release is queued and has not retired.
    pub fn pending(&self) -> u64 {
        self.0.pending.load(Ordering::Acquire)
    }

    /// Bytes whose release the backend refused: charged until their
    /// context terminates.
    pub fn quarantined(&self) -> u64 {
        self.0.quarantined.load(Ordering::Acquire)
    }

    /// Bytes whose free never ran on the device (releases abandoned, buffers
    /// reclaimed by `force` or released on a lost device): charged until
    /// their context's teardown has returned the memory to the device.
    pub fn awaiting_teardown(&self) -> u64 {
        self.0.awaiting_teardown.load(Ordering::Acquire)
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
        let members: Vec<_> = lock(&self.0.members)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for m in members {
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

impl fmt::Debug for SharedBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBudget")
            .field("label", &self.0.label)
            .field("limit", &self.limit())
            .field("charged", &self.charged())
            .field("pending", &self.pending())
            .field("quarantined", &self.quarantined())
            .field("awaiting_teardown", &self.awaiting_teardown())
            .field("lost", &self.is_lost())
            .finish()
    }
}
