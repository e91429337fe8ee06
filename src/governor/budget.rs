//! Byte budgets: one per context, optionally one shared by several contexts
//! on the same physical device. Reservation is a compare-and-swap on the
//! charged total; nothing here takes a lock.

use crate::sync::Notifier;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Charged bytes against a limit. `charged` counts live bytes, bytes whose
/// stream-ordered release has not retired yet, and quarantined bytes.
#[derive(Debug)]
pub(crate) struct Budget {
    limit: AtomicU64,
    charged: AtomicU64,
    peak: AtomicU64,
}

/// Numbers seen by a failed reservation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refusal {
    pub charged: u64,
    pub limit: u64,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            limit: AtomicU64::new(limit),
            charged: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// Charge `bytes` if `charged + bytes - credit <= limit`.
    ///
    /// `credit` is what allocations on the requesting stream may reuse at once
    /// (bytes pending release on that stream, where the backend reuses
    /// stream-ordered frees); it lowers the bar but the full size is charged.
    #[inline]
    pub(crate) fn try_charge(&self, bytes: u64, credit: u64) -> Result<(), Refusal> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut cur = self.charged.load(Ordering::Relaxed);
        loop {
            let needed = cur.checked_add(bytes.saturating_sub(credit));
            let Some(new) = cur
                .checked_add(bytes)
                .filter(|_| needed.is_some_and(|n| n <= limit))
            else {
                return Err(Refusal {
                    charged: cur,
                    limit,
                });
            };
            match self
                .charged
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    if new > self.peak.load(Ordering::Relaxed) {
                        self.peak.fetch_max(new, Ordering::Relaxed);
                    }
                    return Ok(());
                }
                Err(actual) => cur = actual,
            }
        }
    }

    #[inline]
    pub(crate) fn uncharge(&self, bytes: u64) {
        let prev = self.charged.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(
            prev >= bytes,
            "uncharged {bytes} B from a budget holding {prev} B"
        );
    }

    pub(crate) fn charged(&self) -> u64 {
        self.charged.load(Ordering::Acquire)
    }

    pub(crate) fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    pub(crate) fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

pub(crate) struct SharedBudgetInner {
    pub(crate) label: String,
    pub(crate) budget: Budget,
    /// Pending-release bytes of every context charged here.
    pub(crate) pending: AtomicU64,
    /// Quarantined bytes of every context charged here.
    pub(crate) quarantined: AtomicU64,
    /// Bumped whenever a release charged here settles.
    pub(crate) epoch: AtomicU64,
    /// Woken when a release charged here retires.
    pub(crate) retired: Notifier,
}

/// A byte budget shared by several contexts, typically those on one physical
/// device. Cloning it shares the same budget.
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

impl SharedBudget {
    /// A new shared budget of `limit` bytes.
    pub fn new(label: impl Into<String>, limit: u64) -> Self {
        Self(Arc::new(SharedBudgetInner {
            label: label.into(),
            budget: Budget::new(limit),
            pending: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            retired: Notifier::new(),
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

    /// Bytes charged by all contexts sharing this budget.
    pub fn charged(&self) -> u64 {
        self.0.budget.charged()
    }
}

impl fmt::Debug for SharedBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBudget")
            .field("label", &self.0.label)
            .field("limit", &self.limit())
            .field("charged", &self.charged())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charge_respects_limit_and_credit() {
        let b = Budget::new(100);
        b.try_charge(60, 0).unwrap();
        assert!(b.try_charge(50, 0).is_err());
        b.try_charge(50, 20).unwrap(); // 60 + 50 - 20 = 90 <= 100
        assert_eq!(b.charged(), 110);
        assert_eq!(b.peak(), 110);
        b.uncharge(110);
        let r = b.try_charge(u64::MAX, 0).unwrap_err();
        assert_eq!((r.charged, r.limit), (0, 100));
    }

    #[test]
    fn charge_never_overflows() {
        let b = Budget::new(u64::MAX);
        b.try_charge(u64::MAX - 1, 0).unwrap();
        assert!(b.try_charge(2, 0).is_err());
    }
}
