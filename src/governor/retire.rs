//! Retiring a context: refuse new work, wait (without polling) for every
//! outstanding pin, and tear the backend down exactly once.

use super::cache::flush_all;
use super::error::{RetireError, RetiredBy};
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
    pub(crate) fn begin_retire(&self, by: RetiredBy) {
        // Break the reference cycle of cached PendingRelease boxes before the
        // record can lose its last outside reference (before any reaper can
        // start, too).
        self.spares.close();
        // The first retire names itself: later ones find the context retired.
        lock(&self.retire_started).get_or_insert_with(|| (Instant::now(), by));
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
        ctx.begin_retire(RetiredBy::Retire);
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
    ///
    /// # Errors
    ///
    /// [`RetireError::Outstanding`] at the deadline;
    /// [`RetireError::TeardownPanicked`] when a step of the teardown (the
    /// backend's, the governor's accounting, the reporting) panicked: the
    /// context is terminated all the same, and every waiter (this method,
    /// [`try_finish`](Self::try_finish), [`finished`](Self::finished),
    /// [`force`](Self::force), on any handle) gets the same error.
    pub fn wait(&self, deadline: Instant) -> Result<TeardownReport, RetireError> {
        let start = Instant::now();
        let ctx = &*self.ctx;
        let ready = ctx.life.wait_drained(Some(deadline));
        if ready {
            ctx.finish()
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
            self.ctx.finish()
        } else {
            Err(self.outstanding_error(Duration::ZERO))
        }
    }

    /// A future that completes with the report once everything has drained
    /// (or with [`RetireError::TeardownPanicked`], as [`wait`](Self::wait)).
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
            return ctx.finish();
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
    type Output = Result<TeardownReport, RetireError>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<TeardownReport, RetireError>> {
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

#[cfg(test)]
mod tests {
    //! A panic planted in the governor's own teardown accounting (which no
    //! backend can reach): every waiter still gets an answer naming it.
    use super::*;
    use crate::null::NullContext;
    use crate::{ContextConfig, ContextHandle, ContextState, Governor, TeardownStep};
    use std::sync::atomic::Ordering;
    use std::sync::{mpsc, Barrier};
    use std::task::{Wake, Waker};

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut f = std::pin::pin!(f);
        loop {
            if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
                return out;
            }
            std::thread::park();
        }
    }

    /// A context whose teardown accounting panics. Its governor is leaked:
    /// dropped while a failing test unwinds, it would wait for that
    /// teardown too.
    fn planted(label: &str) -> ContextHandle<NullContext> {
        let gov = Governor::new();
        let ctx = gov.register(NullContext::new(), ContextConfig::new().label(label));
        std::mem::forget(gov);
        ctx.inner
            .planted_accounting_panic
            .store(true, Ordering::SeqCst);
        ctx
    }

    fn check(how: &str, answer: Option<Result<TeardownReport, RetireError>>) -> RetireError {
        let answer = answer.unwrap_or_else(|| panic!("{how} never answered (hung or panicked)"));
        let err = answer.expect_err("a panicking teardown is an error");
        let RetireError::TeardownPanicked {
            step,
            message,
            report,
            ..
        } = &err
        else {
            panic!("{how}: {err}");
        };
        assert_eq!(*step, TeardownStep::Accounting, "{how}: {err}");
        assert!(
            message.contains("planted in the teardown accounting"),
            "{how}: {err}"
        );
        assert!(report.is_none(), "{how}: the accounting did not finish");
        let text = err.to_string();
        assert!(
            text.contains("the governor's teardown accounting") && text.contains("bug in memgov"),
            "{how}: {text}"
        );
        err
    }

    #[test]
    // Not under Miri: the governor is leaked on purpose (see `planted`),
    // which Miri's leak check reports; the path is safe code.
    #[cfg_attr(miri, ignore)]
    fn a_panic_in_the_teardown_accounting_fails_every_racing_waiter_alike() {
        type Wait = fn(&RetireHandle<NullContext>) -> Result<TeardownReport, RetireError>;
        let waits: [(&str, Wait); 6] = [
            ("wait(deadline)", |h| h.wait(soon())),
            ("wait(past deadline)", |h| h.wait(Instant::now())),
            ("wait_timeout", |h| h.wait_timeout(Duration::from_secs(20))),
            ("try_finish", |h| h.try_finish()),
            ("finished().await", |h| block_on(h.finished())),
            ("force", |h| h.force(soon())),
        ];
        for round in 0..25 {
            let ctx = planted("acct");
            drop(ctx.create_stream("s").unwrap());
            let barrier = Arc::new(Barrier::new(waits.len()));
            let mut answers = Vec::new();
            for (how, wait) in waits {
                let (handle, barrier) = (ctx.retire(), barrier.clone());
                let (tx, rx) = mpsc::channel();
                std::thread::spawn(move || {
                    barrier.wait();
                    let answer =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wait(&handle)));
                    let _ = tx.send(answer.ok());
                });
                answers.push((how, rx));
            }
            let mut seen = None;
            for (how, rx) in answers {
                let answer = rx.recv_timeout(Duration::from_secs(10)).ok().flatten();
                let err = check(&format!("round {round}: {how}"), answer);
                assert_eq!(seen.get_or_insert_with(|| err.clone()), &err, "{how}");
            }
            assert_eq!(ctx.lifecycle(), ContextState::Terminated);
            assert!(ctx.teardown_report().is_none());
            assert_eq!(ctx.retire().try_finish(), Err(seen.unwrap()));
        }
    }

    #[test]
    // Not under Miri: the governor is leaked on purpose (see `planted`),
    // which Miri's leak check reports; the path is safe code.
    #[cfg_attr(miri, ignore)]
    fn a_panic_in_a_background_teardown_accounting_is_kept_for_later_waiters() {
        let ctx = planted("bg-acct");
        let s = ctx.create_stream("s").unwrap();
        drop(ctx.retire()); // nobody attends: the last holder's drop reaps it
        drop(s);
        let deadline = Instant::now() + Duration::from_secs(10);
        while ctx.lifecycle() != ContextState::Terminated {
            assert!(Instant::now() < deadline, "the reaper never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (tx, rx) = mpsc::channel();
        let late = ctx.retire();
        std::thread::spawn(move || {
            let _ = tx.send(Some(late.wait(soon())));
        });
        check(
            "a later wait",
            rx.recv_timeout(Duration::from_secs(10)).ok().flatten(),
        );
    }
}
