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
    hold: AtomicBool,
    held: Mutex<Vec<RetireSignal>>,
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
        self.hold.store(hold, Ordering::SeqCst);
    }

    /// How many governor signals are parked.
    pub fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Fire every parked governor signal. Returns how many.
    pub fn release_held(&self) -> usize {
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
        let n = held.len();
        for s in held {
            s.retire();
        }
        n
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
                RetireOutcome::Retired => match original {
                    // Park first, count second: whoever sees `retired` reach
                    // n must find all n signals parked, or a `release_held`
                    // right after the count can miss the last one.
                    Some(o) if log.hold.load(Ordering::SeqCst) => {
                        log.held.lock().unwrap_or_else(|e| e.into_inner()).push(o);
                        log.retired.fetch_add(1, Ordering::SeqCst);
                    }
                    // Count first, settle second: the governor may tear down
                    // inside `retire()`, and teardown must not find this
                    // signal in flight.
                    original => {
                        log.retired.fetch_add(1, Ordering::SeqCst);
                        if let Some(o) = original {
                            o.retire();
                        }
                    }
                },
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
        if lost {
            drop(std::mem::take(
                &mut *log.held.lock().unwrap_or_else(|e| e.into_inner()),
            ));
        }
        r
    }
}
