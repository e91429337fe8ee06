//! `Watched<C>`: a transparent wrapper that observes what the governor asks of
//! a backend and what the backend's signals do, without changing either.
//!
//! It can also *hold* retirements: the backend still executes each free and
//! fires its signal, but the wrapper parks the governor's signal until the
//! test lets it go. That makes "pending" real on any backend, including fast
//! ones, without lying to the backend about anything.

use memgov::{
    BackendError, DeviceContext, DeviceDescription, MemoryInfo, RetireOutcome, RetireSignal, Tier,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a [`Watched`] backend saw. Shared, and readable after teardown.
#[derive(Debug, Default)]
pub struct WatchLog {
    /// `allocate` and `allocate_in` calls that returned memory.
    pub allocations: AtomicU64,
    /// `free_async` calls accepted by the backend.
    pub frees_queued: AtomicU64,
    /// Signals the backend fired as retired. While retirements are held, a
    /// signal is counted only once it is parked, so a reader that sees the
    /// count also finds the signal in [`held`](WatchLog::held).
    pub retired: AtomicU64,
    /// Signals the backend dropped unfired.
    pub abandoned: AtomicU64,
    /// Signals that settled after teardown had returned.
    pub settled_after_teardown: AtomicU64,
    /// Signals not yet settled by the backend when teardown began.
    pub unsettled_at_teardown: AtomicU64,
    /// `teardown` calls.
    pub teardowns: AtomicU64,
    /// The `lost` argument of the last teardown.
    pub teardown_lost: AtomicBool,
    /// Calls that reach the device after `device_lost()` (frees, writes,
    /// reads, allocations, synchronizations).
    pub device_calls_after_loss: AtomicU64,
    /// Whether `device_lost()` was called.
    pub device_lost_called: AtomicBool,
    /// `order_after` calls: a release ordered after another stream's work.
    pub orderings: AtomicU64,
    /// Backend calls of any kind.
    pub calls: AtomicU64,
    torn_down: AtomicBool,
    parked: Mutex<Parked>,
}

/// Whether retirements are held, and the signals parked while they are:
/// one lock, so that a signal firing while the test lets go is either
/// parked before the let-go (and fired by `release_held`) or passed
/// through after it, never parked after `release_held` has looked.
#[derive(Debug, Default)]
struct Parked {
    hold: bool,
    signals: Vec<RetireSignal>,
}

fn ld(a: &AtomicU64) -> u64 {
    a.load(Ordering::SeqCst)
}

impl WatchLog {
    /// Signals queued and not yet settled by the backend.
    pub fn in_flight(&self) -> u64 {
        ld(&self.frees_queued) - ld(&self.retired) - ld(&self.abandoned)
    }

    /// Park governor signals from now on (the backend's firing is recorded,
    /// the governor is told later, by [`release_held`](Self::release_held)).
    pub fn hold_retirements(&self, hold: bool) {
        self.parked().hold = hold;
    }

    /// How many governor signals are parked.
    pub fn held(&self) -> usize {
        self.parked().signals.len()
    }

    /// Fire every parked governor signal. Returns how many. (Fired with no
    /// lock held: a signal runs the governor's settlement.)
    pub fn release_held(&self) -> usize {
        let held = std::mem::take(&mut self.parked().signals);
        let n = held.len();
        for s in held {
            s.retire();
        }
        n
    }

    fn parked(&self) -> std::sync::MutexGuard<'_, Parked> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Park `signal` if retirements are held (the decision and the parking
    /// under one lock, see [`Parked`]); hands it back otherwise.
    fn park_if_held(&self, signal: RetireSignal) -> Option<RetireSignal> {
        let mut parked = self.parked();
        if parked.hold {
            #[cfg(test)]
            tests::PARKING.with(|f| (f.borrow())());
            parked.signals.push(signal);
            None
        } else {
            Some(signal)
        }
    }

    /// A one-line summary for failure messages.
    pub fn summary(&self) -> String {
        format!(
            "frees queued {}, retired {}, abandoned {}, held {}, settled after teardown {}, unsettled at teardown {}, teardowns {}, device calls after loss {}",
            ld(&self.frees_queued),
            ld(&self.retired),
            ld(&self.abandoned),
            self.held(),
            ld(&self.settled_after_teardown),
            ld(&self.unsettled_at_teardown),
            ld(&self.teardowns),
            ld(&self.device_calls_after_loss),
        )
    }

    fn call(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    fn device_call(&self) {
        self.call();
        if self.device_lost_called.load(Ordering::SeqCst) {
            self.device_calls_after_loss.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A backend wrapped for observation. Behaves exactly like `C`.
pub struct Watched<C: DeviceContext> {
    inner: C,
    log: Arc<WatchLog>,
}

impl<C: DeviceContext> Watched<C> {
    /// Wrap `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            log: Arc::new(WatchLog::default()),
        }
    }

    /// The shared log.
    pub fn log(&self) -> Arc<WatchLog> {
        self.log.clone()
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: DeviceContext> DeviceContext for Watched<C> {
    type Stream = C::Stream;
    type Memory = C::Memory;

    fn describe(&self) -> DeviceDescription {
        self.inner.describe()
    }
    fn identity(&self) -> memgov::DeviceIdentity {
        self.inner.identity()
    }
    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.log.call();
        self.inner.memory_info()
    }
    fn create_stream(&self) -> Result<C::Stream, BackendError> {
        self.log.device_call();
        self.inner.create_stream()
    }
    fn destroy_stream(&self, s: C::Stream) -> Result<(), BackendError> {
        self.log.call();
        self.inner.destroy_stream(s)
    }
    fn allocate(&self, s: &C::Stream, bytes: u64) -> Result<C::Memory, BackendError> {
        self.log.device_call();
        let m = self.inner.allocate(s, bytes)?;
        self.log.allocations.fetch_add(1, Ordering::SeqCst);
        Ok(m)
    }
    fn allocate_in(
        &self,
        s: &C::Stream,
        bytes: u64,
        tier: Tier,
    ) -> Result<C::Memory, BackendError> {
        self.log.device_call();
        let m = self.inner.allocate_in(s, bytes, tier)?;
        self.log.allocations.fetch_add(1, Ordering::SeqCst);
        Ok(m)
    }
    fn free_async(
        &self,
        s: &C::Stream,
        m: C::Memory,
        retired: RetireSignal,
    ) -> Result<(), (C::Memory, RetireSignal, BackendError)> {
        self.log.device_call();
        let log = self.log.clone();
        // The original travels inside the wrapper's signal; if the backend
        // refuses, it comes back out unfired.
        let slot = Arc::new(Mutex::new(Some(retired)));
        let inner_slot = slot.clone();
        let wrapped = RetireSignal::from_fn(move |outcome| {
            if log.torn_down.load(Ordering::SeqCst) {
                log.settled_after_teardown.fetch_add(1, Ordering::SeqCst);
            }
            let original = inner_slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            match outcome {
                RetireOutcome::Retired => {
                    // Park first, count second: whoever sees `retired` reach
                    // n must find all n signals parked, or a `release_held`
                    // right after the count can miss the last one.
                    let passed = original.and_then(|o| log.park_if_held(o));
                    // Count first, settle second: the governor may tear down
                    // inside `retire()`, and teardown must not find this
                    // signal in flight.
                    log.retired.fetch_add(1, Ordering::SeqCst);
                    if let Some(o) = passed {
                        o.retire();
                    }
                }
                RetireOutcome::Abandoned => {
                    log.abandoned.fetch_add(1, Ordering::SeqCst);
                    drop(original);
                }
            }
        });
        match self.inner.free_async(s, m, wrapped) {
            Ok(()) => {
                self.log.frees_queued.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
            Err((m, wrapped_back, e)) => {
                let original = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
                // Dropping the wrapper now finds its slot empty: it settles nothing.
                drop(wrapped_back);
                // Undo the abandonment count the drop just made.
                self.log.abandoned.fetch_sub(1, Ordering::SeqCst);
                Err((m, original.expect("original signal present on refusal"), e))
            }
        }
    }
    fn write(
        &self,
        s: &C::Stream,
        m: &C::Memory,
        off: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.log.device_call();
        self.inner.write(s, m, off, src)
    }
    fn read(
        &self,
        s: &C::Stream,
        m: &C::Memory,
        off: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.log.device_call();
        self.inner.read(s, m, off, dst)
    }
    fn synchronize(&self, s: &C::Stream) -> Result<(), BackendError> {
        self.log.device_call();
        self.inner.synchronize(s)
    }
    fn order_after(&self, s: &C::Stream, after: &C::Stream) -> Result<(), BackendError> {
        self.log.device_call();
        self.log.orderings.fetch_add(1, Ordering::SeqCst);
        self.inner.order_after(s, after)
    }
    fn device_lost(&self) {
        self.log.device_lost_called.store(true, Ordering::SeqCst);
        self.inner.device_lost()
    }
    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        let log = self.log.clone();
        log.teardowns.fetch_add(1, Ordering::SeqCst);
        log.teardown_lost.store(lost, Ordering::SeqCst);
        log.unsettled_at_teardown
            .store(log.in_flight(), Ordering::SeqCst);
        let r = self.inner.teardown(lost);
        log.torn_down.store(true, Ordering::SeqCst);
        // Parked governor signals of a lost device will never be retired.
        // (Dropped with no lock held: a dropped signal runs the governor's
        // settlement as abandoned.)
        if lost {
            let parked = std::mem::take(&mut log.parked().signals);
            drop(parked);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memgov::null::NullContext;
    use memgov::{Alloc, ContextConfig, Governor, Role};
    use std::cell::RefCell;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    thread_local! {
        /// Runs on the firing thread when it parks a signal (under the
        /// parking lock): lets a test stop a signal half-way.
        pub(super) static PARKING: RefCell<Box<dyn Fn()>> = RefCell::new(Box::new(|| {}));
    }

    /// A signal fired by a backend thread just as the test lets the holds
    /// go (`hold_retirements(false)`, then `release_held`) is either parked
    /// before `release_held` looks, and fired by it, or passed through:
    /// never parked after it, to be stranded with the release pending
    /// forever. The firing thread is stopped while parking; the let-go runs
    /// on another thread meanwhile (given up to 200 ms to finish first,
    /// which a let-go that does not wait for the parking does).
    #[test]
    fn a_signal_firing_while_the_holds_are_let_go_is_never_stranded() {
        let null = NullContext::deferred(8);
        let controls = null.controls();
        let watched = Watched::new(null);
        let log = watched.log();
        let gov = Governor::new();
        let ctx = gov.register(watched, ContextConfig::new().label("watched"));
        let stream = ctx.create_stream("s").unwrap();
        log.hold_retirements(true);
        drop(
            ctx.allocate(&stream, Alloc::new(4096, Role::Weights))
                .unwrap(),
        );
        assert_eq!(
            controls.parked_count(),
            1,
            "the null backend parks the free"
        );

        let (stopped_tx, stopped) = mpsc::channel::<()>();
        let (go, go_rx) = mpsc::channel::<()>();
        let firing = std::thread::spawn(move || {
            PARKING.with(|f| {
                *f.borrow_mut() = Box::new(move || {
                    stopped_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                })
            });
            controls.retire_parked()
        });
        stopped.recv().unwrap();
        let letting_go = {
            let log = log.clone();
            std::thread::spawn(move || {
                log.hold_retirements(false);
                log.release_held()
            })
        };
        let deadline = Instant::now() + Duration::from_millis(200);
        while !letting_go.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        go.send(()).unwrap();
        assert_eq!(firing.join().unwrap(), 1);
        let released = letting_go.join().unwrap();
        assert_eq!(
            (released, log.held()),
            (1, 0),
            "the signal was parked after the let-go looked (released {released})"
        );
        drop(stream);
        let report = ctx
            .retire()
            .wait(Instant::now() + Duration::from_secs(5))
            .expect("the release settled");
        assert_eq!(report.retired_releases, 1);
    }
}
