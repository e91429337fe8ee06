//! The governor: budgets, admission, stream-ordered release, retire and
//! teardown, over any [`DeviceContext`].
//!
//! See `docs/architecture.md` for how the pieces fit and `docs/teardown.md`
//! for the lifecycle state machine.

mod admission;
mod backend_access;
mod buffer;
mod cache;
mod config;
mod error;
mod handle;
mod ledger;
mod member;
mod migrate;
mod outside;
mod pin_source;
mod pressure;
mod record;
mod release;
mod report;
mod request;
mod reservation;
mod retire;
mod role;
mod shards;
mod snapshot;
mod stream;
mod suspend;
mod units;
mod view;

pub use buffer::{DeviceBuffer, ReleaseError};
pub use cache::size_class;
pub use config::{Admission, CacheConfig, ContextConfig, Tuning};
pub use error::{
    BudgetExceeded, BudgetScope, ContextName, ContextOperation, ForeignObject, GovernorError,
    Holders, RetireError, RetiredBy, TeardownStep,
};
pub use handle::ContextHandle;
pub use ledger::{Imbalance, ProcessBudget, SharedBudget};
pub use migrate::MigrateError;
pub use outside::{OutsideRecord, OutsideUsage};
pub use pin_source::ContextPin;
pub use pressure::{PressureLevel, PressureRequest, PressureResponder, DEFAULT_PRESSURE_PRIORITY};
pub use report::{Outstanding, OutstandingItem, PinKind, TeardownReport};
pub use request::{Alloc, Reserve};
pub use reservation::Reservation;
pub use retire::{Finished, RetireHandle};
pub use role::Role;
pub use snapshot::{
    CacheUsage, ContextSnapshot, ContextState, CounterSnapshot, GovernorSnapshot, LimitSource,
    PinCounts, ProcessLimit, QuarantineEntry, ReservationUsage, RoleUsage, SiteGrowth, SiteUsage,
    SleepState, TierUsage,
};
pub use stream::GovernedStream;
pub use suspend::{Slept, Woken};
pub use units::{Bytes, Elapsed};

use crate::sync::lock;
use crate::{DeviceContext, ProviderContextIdentity};
use record::ContextInner;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

static NEXT_GOVERNOR: AtomicU32 = AtomicU32::new(1);

/// Governs the memory of every context registered with it.
///
/// ```
/// use memgov::{Alloc, Governor, ContextConfig, Role, host::{HostContext, HostConfig}};
/// use std::time::{Duration, Instant};
///
/// let gov = Governor::new();
/// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().label("llm").budget(64 << 20));
/// let stream = ctx.create_stream("decode")?;
/// let weights = ctx.allocate(&stream, Alloc::new(1 << 20, Role::Weights))?;
/// drop(weights);
/// drop(stream);
/// let report = ctx.retire().wait(Instant::now() + Duration::from_secs(5))?;
/// assert_eq!(report.retired_releases, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Governor<C: DeviceContext> {
    id: NonZeroU32,
    next_index: AtomicU32,
    contexts: Mutex<Vec<Arc<ContextInner<C>>>>,
}

impl<C: DeviceContext> Default for Governor<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: DeviceContext> fmt::Debug for Governor<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Governor")
            .field("id", &self.id)
            .field("contexts", &lock(&self.contexts).len())
            .finish()
    }
}

impl<C: DeviceContext> Governor<C> {
    /// A governor with no contexts.
    pub fn new() -> Self {
        let n = NEXT_GOVERNOR.fetch_add(1, Ordering::Relaxed);
        Self {
            id: NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN),
            next_index: AtomicU32::new(0),
            contexts: Mutex::new(Vec::new()),
        }
    }

    /// Take ownership of a backend context and govern it.
    ///
    /// The registry keeps every context, terminated ones included, so that
    /// [`snapshot`](Self::snapshot) can report how they ended. A runtime that
    /// swaps devices for a long time calls
    /// [`prune_terminated`](Self::prune_terminated) after each swap; a
    /// terminated record no longer holds its backend, only its counters.
    pub fn register(&self, backend: C, config: ContextConfig) -> ContextHandle<C> {
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        assert!(
            index != u32::MAX,
            "fewer than 2^32 - 1 contexts per governor"
        );
        let id = ProviderContextIdentity::new(self.id, index);
        // `describe()` runs in `new`, with no lock held.
        let inner = Arc::new_cyclic(|this| {
            ContextInner::new(id, backend, config, this.clone(), cache::flush_all)
        });
        lock(&self.contexts).push(inner.clone());
        if let Some(shared) = inner.ledger.charges().shared() {
            // After the push: a device lost already marks this context lost
            // at once, with the registry holding it like any other.
            let member: Arc<dyn ledger::DeviceMember> = inner.clone();
            shared.join(Arc::downgrade(&member));
        }
        ContextHandle { inner }
    }

    /// Handles of every registered context, terminated ones included.
    pub fn contexts(&self) -> Vec<ContextHandle<C>> {
        lock(&self.contexts)
            .iter()
            .map(|inner| ContextHandle {
                inner: inner.clone(),
            })
            .collect()
    }

    /// The handle of one context.
    pub fn context(&self, id: ProviderContextIdentity) -> Option<ContextHandle<C>> {
        lock(&self.contexts)
            .iter()
            .find(|c| c.id == id)
            .map(|inner| ContextHandle {
                inner: inner.clone(),
            })
    }

    /// Drop terminated contexts from the registry. Returns how many.
    pub fn prune_terminated(&self) -> usize {
        let mut contexts = lock(&self.contexts);
        let before = contexts.len();
        contexts.retain(|c| c.phase() != record::Phase::Terminated);
        before - contexts.len()
    }

    /// A view of every context.
    pub fn snapshot(&self) -> GovernorSnapshot {
        let contexts: Vec<_> = lock(&self.contexts).clone();
        GovernorSnapshot {
            contexts: contexts.iter().map(|c| view::snapshot(c)).collect(),
        }
    }

    /// The snapshot the metrics render: [`snapshot`](Self::snapshot) less
    /// each cache's count by size class (`CacheUsage::by_class` empty), so
    /// that it takes no lock an allocation takes.
    #[cfg(feature = "metrics")]
    pub(crate) fn snapshot_for_metrics(&self) -> GovernorSnapshot {
        let contexts: Vec<_> = lock(&self.contexts).clone();
        GovernorSnapshot {
            contexts: contexts
                .iter()
                .map(|c| {
                    #[cfg(all(test, feature = "metrics"))]
                    crate::metrics::before_context(c.label());
                    view::snapshot_with(c, false)
                })
                .collect(),
        }
    }
}

impl<C: DeviceContext> Drop for Governor<C> {
    /// Retire every context still registered, then finish those already
    /// drained and join the reapers already started. The rest finish when
    /// their last holder lets go, on a reaper thread of their own (which
    /// holds only the context's record and backend).
    ///
    /// Also while unwinding: every context is retired before any teardown
    /// runs, and a teardown that panics is reported in its
    /// [`TeardownReport`], so no context is left accepting work.
    fn drop(&mut self) {
        let contexts = std::mem::take(&mut *lock(&self.contexts));
        for c in &contexts {
            c.begin_retire(RetiredBy::GovernorDropped);
        }
        for c in &contexts {
            if c.phase() != record::Phase::Terminated && c.drained() {
                // Kept on the record for its handles (a failure also goes
                // to the tracing subscriber): nobody waits here.
                let _ = c.finish();
            }
        }
        for c in &contexts {
            c.join_reaper();
        }
    }
}
