//! Retiring a context: refuse new work, wait (without polling) for every
//! outstanding pin, and tear the backend down exactly once.

use super::cache::flush_all;
use super::error::RetireError;
use super::record::pin_source::PinSourceInner;
use super::record::{ContextInner, Phase};
use super::report::{Outstanding, OutstandingItem, PinKind, TeardownReport};
use super::role::Role;
use crate::sync::lock;
use crate::trace::EventKind;
use crate::{DeviceContext, ProviderContextIdentity};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

impl<C: DeviceContext> ContextInner<C> {
    /// Stop accepting work: new pins fail from now on, and allocations
    /// waiting for room give up.
    pub(crate) fn begin_retire(&self) {
        // Break the reference cycle of cached PendingRelease boxes before the
        // record can lose its last outside reference (before any reaper can
        // start, too).
        self.spares.close();
        lock(&self.retire_started).get_or_insert_with(Instant::now);
        self.life.begin_retire();
        // Cached blocks hold pins: close every stream's cache and free its
        // blocks now, so that the retire can drain.
        flush_all(self);
        if let Some(t) = &self.trace {
            t.event(0, None, EventKind::RetireBegun, 0, None);
        }
        // Nothing can be admitted any more: drop the pressure responders and
        // whatever they captured (a responder that holds a stream or buffers
        // of this context would otherwise keep it from ever draining). Their
        // destructors are user code: they run after the lock is released.
        let responders = std::mem::take(&mut *lock(&self.responders));
        drop(responders);
        // Admissions on the shared budget check `accepting()` too.
        self.ledger.charges().wake_shared_waiters();
        #[cfg(feature = "tracing")]
        tracing::info!(context = %self.id, label = %self.label(), pins = self.life.pin_claims(), pending = self.life.pending_count(), "memgov: retiring context");
    }
}

impl Outstanding {
    /// Everything that still holds `ctx` now, grouped by kind, role and
    /// holder.
    pub(crate) fn collect<C: DeviceContext>(ctx: &ContextInner<C>) -> Self {
        let mut items = Vec::new();
        // After force, surviving stream handles hold no pin: not outstanding.
        let streams = if ctx.is_forced() {
            Vec::new()
        } else {
            lock(&ctx.streams).clone()
        };
        for s in streams.iter().filter_map(|w| w.upgrade()) {
            items.push(OutstandingItem {
                kind: PinKind::Stream,
                role: None,
                count: 1,
                bytes: 0,
                holder: Some(s.label.clone()),
            });
        }
        for role in Role::ALL {
            let usage = ctx.ledger.stats().usage(role);
            if usage.live.count > 0 {
                items.push(OutstandingItem {
                    kind: PinKind::Buffer,
                    role: Some(role),
                    count: usage.live.count,
                    bytes: usage.live.bytes,
                    holder: None,
                });
            }
            if usage.pending.count > 0 {
                items.push(OutstandingItem {
                    kind: PinKind::PendingRelease,
                    role: Some(role),
                    count: usage.pending.count,
                    bytes: usage.pending.bytes,
                    holder: None,
                });
            }
        }
        // Counted under the lock, which keeps other upgrades out of the count.
        for (s, n) in lock(&ctx.sources)
            .iter()
            .filter_map(PinSourceInner::upgrade_counted)
        {
            if n > 0 {
                items.push(OutstandingItem {
                    kind: PinKind::External,
                    role: None,
                    count: n,
                    bytes: 0,
                    holder: s.label.clone(),
                });
            }
        }
        let listed: u64 = items
            .iter()
            .filter(|i| i.kind != PinKind::PendingRelease)
            .map(|i| i.count)
            .sum();
        let other = ctx.pin_count().saturating_sub(listed);
        if other > 0 {
            items.push(OutstandingItem {
                kind: PinKind::Other,
                role: None,
                count: other,
                bytes: 0,
                holder: None,
            });
        }
        Self { items }
    }
}

/// A retiring context. New work is already refused; this handle finishes the
/// teardown once everything outstanding has drained.
///
/// Several handles may exist (concurrent `retire()` calls); exactly one of
/// them runs the backend's teardown and all of them get the same report.
/// Dropping every handle without finishing hands the teardown to the
/// background: it runs on a reaper thread once the last holder goes (at once
/// if none is left), and its report stays readable through
/// [`ContextHandle::teardown_report`](super::ContextHandle::teardown_report)
/// and the governor's snapshot.
pub struct RetireHandle<C: DeviceContext> {
    pub(crate) ctx: Arc<ContextInner<C>>,
}

impl<C: DeviceContext> fmt::Debug for RetireHandle<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetireHandle")
            .field("context", &self.ctx.id)
            .finish()
    }
}

impl<C: DeviceContext> Drop for RetireHandle<C> {
    /// With no handle left, a drained context tears down in the background.
    fn drop(&mut self) {
        self.ctx.unattend();
    }
}

impl<C: DeviceContext> RetireHandle<C> {
    /// Retire `ctx` (if it is not already) and attend to its teardown.
    pub(crate) fn new(ctx: &Arc<ContextInner<C>>) -> Self {
        ctx.attend();
        ctx.begin_retire();
        Self { ctx: ctx.clone() }
    }

    /// The retiring context.
    pub fn context(&self) -> ProviderContextIdentity {
        self.ctx.id
    }

    /// What still holds the context now.
    pub fn outstanding(&self) -> Outstanding {
        Outstanding::collect(&self.ctx)
    }

    fn outstanding_error(&self, waited: Duration) -> RetireError {
        RetireError::Outstanding {
            context: self.ctx.name(),
            waited,
            outstanding: self.outstanding(),
        }
    }

    /// Block until everything outstanding has drained, then tear down, or
    /// give up at `deadline` with the list of what is outstanding. A deadline
    /// in the past checks once without blocking. Waiting again after a
    /// timeout is allowed.
    pub fn wait(&self, deadline: Instant) -> Result<TeardownReport, RetireError> {
        let start = Instant::now();
        let ctx = &*self.ctx;
        let ready = ctx.life.wait_drained(Some(deadline));
        if ready {
            Ok(ctx.finish())
        } else {
            Err(self.outstanding_error(start.elapsed()))
        }
    }

    /// Like [`wait`](Self::wait) with a timeout instead of a deadline.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<TeardownReport, RetireError> {
        self.wait(Instant::now() + timeout)
    }

    /// Tear down if everything has drained; otherwise return at once with
    /// what is outstanding.
    pub fn try_finish(&self) -> Result<TeardownReport, RetireError> {
        if self.ctx.drained() || self.ctx.phase() == Phase::Terminated {
            Ok(self.ctx.finish())
        } else {
            Err(self.outstanding_error(Duration::ZERO))
        }
    }

    /// A future that completes with the report once everything has drained.
    /// Woken by the last retirement, never by polling. Teardown runs on the
    /// thread that polls it to completion.
    pub fn finished(&self) -> Finished<'_, C> {
        Finished {
            handle: self,
            registered: false,
        }
    }

    /// Reclaim instead of waiting: synchronize every stream, revoke the pins
    /// of live buffers and streams (their memory and raw streams die with the
    /// context; later use reports [`GovernorError::Reclaimed`](super::GovernorError::Reclaimed)),
    /// then wait until `deadline` for pending releases and external pins,
    /// which force cannot revoke, and tear down.
    ///
    /// On a lost device nothing is synchronized: pending releases are given up.
    ///
    /// The reclaimed bytes stay charged (to the context's budget and its
    /// shared one) until the backend's teardown has freed them: while force
    /// waits for an external pin the memory is still allocated on the device.
    ///
    /// # Panics
    ///
    /// If the backend's `synchronize` panics, force still revokes what it
    /// reclaims (so the context can tear down) and then re-raises the panic.
    pub fn force(&self, deadline: Instant) -> Result<TeardownReport, RetireError> {
        let ctx = &*self.ctx;
        if ctx.phase() == Phase::Terminated {
            return Ok(ctx.finish());
        }
        ctx.force();
        self.wait(deadline)
    }
}

/// Future returned by [`RetireHandle::finished`].
pub struct Finished<'a, C: DeviceContext> {
    handle: &'a RetireHandle<C>,
    registered: bool,
}

impl<C: DeviceContext> Future for Finished<'_, C> {
    type Output = TeardownReport;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<TeardownReport> {
        let ctx = self.handle.ctx.clone();
        let mut registered = self.registered;
        let ready = ctx.life.poll_drained(cx.waker(), &mut registered);
        self.registered = registered;
        if ready {
            self.forget();
            Poll::Ready(ctx.finish())
        } else {
            Poll::Pending
        }
    }
}

impl<C: DeviceContext> Finished<'_, C> {
    fn forget(&mut self) {
        self.handle.ctx.life.forget_drained(&mut self.registered);
    }
}

impl<C: DeviceContext> Drop for Finished<'_, C> {
    fn drop(&mut self) {
        self.forget();
    }
}
