//! [`Gate`]: the exclusion between stream captures and a backend's own
//! "potentially unsafe" driver calls (maps, unmaps, releases, device
//! synchronizes, page-locked host allocations and frees), which a capture
//! in the driver's global mode forbids on every thread and which would
//! invalidate it.
//!
//! * While a capture is under way, a gated call waits until the last
//!   capture ends; a capture waits for gated calls under way to finish
//!   before it begins. Captures are keyed by the driver's capture id, not by
//!   thread; the thread that began one is remembered only so that a call it
//!   makes itself during its own capture is refused rather than waited on
//!   forever.
//! * A trim asked for during a capture is deferred ([`Gate::defer`]): the
//!   end of the last capture runs it, with no lock held.
//! * One gate per driver: a CUDA capture is invalidated by CUDA calls, a HIP
//!   capture by HIP calls, so each backend keeps its own process-wide
//!   instance (the driver's rule is process-wide).

use crate::{lock, BackendError, BackendErrorKind};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::thread::ThreadId;

/// A trim (or other work) to run when the last capture ends.
pub type Deferred = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct GateState {
    /// Captures under way, by capture id: the thread that began them and
    /// the stream they capture.
    active: HashMap<u64, (ThreadId, usize)>,
    /// Captures between their admission and the driver's capture id.
    beginning: usize,
    /// Gated driver calls under way.
    calls: usize,
    /// Gated calls waiting for the last capture to end.
    waiting: usize,
    /// Work deferred to the end of the last capture, by key (one per
    /// arena: a second trim asked for replaces the first).
    deferred: HashMap<u64, Deferred>,
}

impl GateState {
    fn capturing(&self) -> bool {
        !self.active.is_empty() || self.beginning > 0
    }
}

/// The process-wide exclusion between one driver's captures and memgov's
/// potentially unsafe calls into that driver.
pub struct Gate {
    backend: &'static str,
    /// The capture type's name, for the errors' way out (`"HipCapture"`).
    capture: &'static str,
    state: Mutex<GateState>,
    changed: Condvar,
}

/// One gated driver call under way; dropping it lets captures begin.
pub struct GateCall<'a>(&'a Gate);

impl Drop for GateCall<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).calls -= 1;
        self.0.changed.notify_all();
    }
}

impl Gate {
    /// A gate for `backend`'s driver, whose capture type is named `capture`.
    pub fn new(backend: &'static str, capture: &'static str) -> Self {
        Self {
            backend,
            capture,
            state: Mutex::default(),
            changed: Condvar::new(),
        }
    }

    fn err(&self, op: &'static str, msg: String) -> BackendError {
        BackendError::new(self.backend, op, BackendErrorKind::InvalidArgument, msg)
    }

    /// Whether a capture is under way (or beginning) anywhere.
    pub fn capturing(&self) -> bool {
        lock(&self.state).capturing()
    }

    /// Admit a map, unmap, release, device synchronize, page-locked host
    /// allocation or free: waits while a capture is under way. `refuse_own`: refuse (rather than wait
    /// forever) when the calling thread began a capture still under way;
    /// otherwise such a call goes ahead and the driver decides.
    pub fn call(&self, op: &'static str, refuse_own: bool) -> Result<GateCall<'_>, BackendError> {
        let me = std::thread::current().id();
        let mut st = lock(&self.state);
        loop {
            let own = st.active.values().any(|(t, _)| *t == me);
            if own && refuse_own {
                return Err(self.own_error(op));
            }
            if own || !st.capturing() {
                st.calls += 1;
                return Ok(GateCall(self));
            }
            st.waiting += 1;
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiting -= 1;
        }
    }

    /// Refuse when the calling thread began a capture still under way
    /// (the error [`call`](Self::call) returns with `refuse_own`); never
    /// waits, admits nothing.
    pub fn refuse_own(&self, op: &'static str) -> Result<(), BackendError> {
        let me = std::thread::current().id();
        if lock(&self.state).active.values().any(|(t, _)| *t == me) {
            return Err(self.own_error(op));
        }
        Ok(())
    }

    fn own_error(&self, op: &'static str) -> BackendError {
        let t = self.capture;
        self.err(
            op,
            format!(
                "this thread's own stream capture is under way, and {op} would map, unmap or \
                 synchronize outside the stream, which invalidates it: allocate from the \
                 capture's pool ({t}::allocate), or end the capture first ({t}::end)"
            ),
        )
    }

    /// How many gated calls are waiting for a capture to end (for a test
    /// or a tool that wants to see a call held back, not run).
    pub fn waiting(&self) -> usize {
        lock(&self.state).waiting
    }

    /// Before synchronizing `stream` (which would invalidate its capture):
    /// waits while another thread captures it; refused when the calling
    /// thread does.
    pub fn before_sync(&self, op: &'static str, stream: usize) -> Result<(), BackendError> {
        let me = std::thread::current().id();
        let mut st = lock(&self.state);
        loop {
            let Some((t, _)) = st.active.values().find(|(_, s)| *s == stream) else {
                return Ok(());
            };
            if *t == me {
                return Err(self.err(
                    op,
                    format!(
                        "the stream is being captured by this thread, and synchronizing it \
                         would invalidate the capture: end the capture first ({}::end)",
                        self.capture
                    ),
                ));
            }
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Refuse to destroy a stream being captured (the capture must end on
    /// it first).
    pub fn before_destroy(&self, op: &'static str, stream: usize) -> Result<(), BackendError> {
        let st = lock(&self.state);
        if st.active.values().any(|(_, s)| *s == stream) {
            return Err(self.err(
                op,
                format!(
                    "the stream is being captured: end the capture ({}::end) before destroying it",
                    self.capture
                ),
            ));
        }
        Ok(())
    }

    /// Defer `work` under `key` to the end of the last capture; `Some(work)`
    /// back when no capture is under way (the caller runs it now).
    pub fn defer(&self, key: u64, work: Deferred) -> Option<Deferred> {
        let mut st = lock(&self.state);
        if !st.capturing() {
            return Some(work);
        }
        st.deferred.insert(key, work);
        None
    }

    /// Defer a trim of `arena` (a backend's arena, trimmed by `trim` with
    /// its shared context state) to the end of the last capture, keyed by
    /// `key` (the arena's base: one per arena); `false` when no capture is
    /// under way (the caller trims now). The deferred trim holds neither
    /// alive: it runs only when both still exist, and a trim that fails
    /// leaves its granules quarantined and listed in the arena's snapshot,
    /// with nobody waiting on it.
    pub fn defer_trim<A, S>(
        &self,
        key: u64,
        arena: &std::sync::Arc<A>,
        shared: &std::sync::Arc<S>,
        trim: fn(&A, &S),
    ) -> bool
    where
        A: Send + Sync + 'static,
        S: Send + Sync + 'static,
    {
        let (a, s) = (
            std::sync::Arc::downgrade(arena),
            std::sync::Arc::downgrade(shared),
        );
        let work: Deferred = Box::new(move || {
            if let (Some(a), Some(s)) = (a.upgrade(), s.upgrade()) {
                trim(&a, &s);
            }
        });
        self.defer(key, work).is_none()
    }

    /// Admit a capture: waits for gated calls under way to finish. Follow
    /// with [`begun`](Self::begun) in every case.
    pub fn begin(&self) {
        let mut st = lock(&self.state);
        while st.calls > 0 {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.beginning += 1;
    }

    /// The capture admitted by [`begin`](Self::begin) on `stream` has id
    /// `id` (or failed to begin: `None`).
    pub fn begun(&self, id: Option<u64>, stream: usize) {
        let mut st = lock(&self.state);
        st.beginning -= 1;
        if let Some(id) = id {
            st.active.insert(id, (std::thread::current().id(), stream));
        }
        let idle = !st.capturing();
        let deferred = if idle {
            st.deferred.drain().map(|(_, v)| v).collect()
        } else {
            Vec::new()
        };
        drop(st);
        self.changed.notify_all();
        deferred.into_iter().for_each(|f| f());
    }

    /// Capture `id` ended; when it was the last, run the deferred work (no
    /// lock held).
    pub fn end(&self, id: u64) {
        let deferred: Vec<Deferred> = {
            let mut st = lock(&self.state);
            st.active.remove(&id);
            if st.capturing() {
                Vec::new()
            } else {
                st.deferred.drain().map(|(_, v)| v).collect()
            }
        };
        self.changed.notify_all();
        deferred.into_iter().for_each(|f| f());
    }
}

/// The exclusion between a context's sleeps and the work that checks its
/// arena is awake and then queues on its memory (a copy, a graph launch):
/// between that check and the enqueue, a sleep could wait for the streams
/// (finding nothing queued yet) and unmap under the work about to be queued.
///
/// A use ([`enter`](Self::enter)) is held from before the awake check until
/// the work is queued; a sleep ([`sleep`](Self::sleep)) is held from before
/// it marks anything asleep until it returns. A sleep waits for the uses
/// under way; a use waits while a sleep runs or waits (a stream of uses
/// cannot starve a sleep), then makes its check, which refuses what the
/// sleep left asleep. No lock is held while either runs, only while it is
/// admitted; nothing here calls a driver.
#[derive(Default)]
pub struct SleepGate {
    state: Mutex<SleepGateState>,
    changed: Condvar,
}

#[derive(Default)]
struct SleepGateState {
    /// Uses between their awake check and their enqueue.
    uses: usize,
    /// A sleep runs.
    sleeping: bool,
    /// Sleeps waiting for the uses under way (uses wait behind them).
    sleeps_waiting: usize,
    /// Uses waiting for a sleep.
    uses_waiting: usize,
}

/// A use under way ([`SleepGate::enter`]); dropping it lets a sleep begin.
pub struct SleepGateUse<'a>(&'a SleepGate);

impl Drop for SleepGateUse<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).uses -= 1;
        self.0.changed.notify_all();
    }
}

/// A sleep under way ([`SleepGate::sleep`]); dropping it lets uses go on.
pub struct SleepGateSleep<'a>(&'a SleepGate);

impl Drop for SleepGateSleep<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).sleeping = false;
        self.0.changed.notify_all();
    }
}

impl SleepGate {
    /// Admit a use: waits while a sleep runs or waits to run.
    pub fn enter(&self) -> SleepGateUse<'_> {
        let mut st = lock(&self.state);
        while st.sleeping || st.sleeps_waiting > 0 {
            st.uses_waiting += 1;
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            st.uses_waiting -= 1;
        }
        st.uses += 1;
        SleepGateUse(self)
    }

    /// Admit a sleep: waits for the uses under way and for another sleep.
    pub fn sleep(&self) -> SleepGateSleep<'_> {
        let mut st = lock(&self.state);
        st.sleeps_waiting += 1;
        while st.sleeping || st.uses > 0 {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.sleeps_waiting -= 1;
        st.sleeping = true;
        SleepGateSleep(self)
    }

    /// Uses under way, sleeps waiting for them, uses waiting for a sleep
    /// (for tests that force an interleaving).
    pub fn counts(&self) -> (usize, usize, usize) {
        let st = lock(&self.state);
        (st.uses, st.sleeps_waiting, st.uses_waiting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::sync::Mutex;

    #[test]
    fn a_deferred_trim_runs_at_the_end_of_the_last_capture() {
        let gate = Gate::new("test", "TestCapture");
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        let work: Deferred = Box::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        // No capture: handed back to run now.
        let work = gate.defer(1, work).expect("not capturing");
        gate.begin();
        gate.begun(Some(7), 0x10);
        gate.begin();
        gate.begun(Some(8), 0x20);
        assert!(gate.defer(1, work).is_none(), "deferred");
        drop(
            gate.call("unmap", false)
                .expect("own capture, not refused: goes ahead"),
        );
        gate.end(7);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "capture 8 still under way");
        assert!(gate.before_destroy("destroy_stream", 0x20).is_err());
        gate.end(8);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "ran once, at the last end");
        assert!(gate.before_destroy("destroy_stream", 0x20).is_ok());
    }

    /// A sleep asked for while a use is between its check and its enqueue
    /// waits for the use; a use asked for while the sleep waits or runs
    /// waits for the sleep's end. Interleaving forced by the counts.
    #[test]
    fn a_sleep_waits_for_uses_under_way_and_uses_wait_for_the_sleep() {
        let gate = Arc::new(SleepGate::default());
        let order = Arc::new(Mutex::new(Vec::new()));
        let used = gate.enter();
        let sleeper = {
            let (gate, order) = (gate.clone(), order.clone());
            std::thread::spawn(move || {
                let _s = gate.sleep();
                order.lock().unwrap().push("sleep");
                // The late use below is waiting by now (forced before the
                // first use ends): it runs after this sleep.
                while gate.counts().2 == 0 {
                    std::thread::yield_now();
                }
                order.lock().unwrap().push("sleep done");
            })
        };
        while gate.counts().1 == 0 {
            std::thread::yield_now();
        }
        let late = {
            let (gate, order) = (gate.clone(), order.clone());
            std::thread::spawn(move || {
                let _u = gate.enter();
                order.lock().unwrap().push("late use");
            })
        };
        // The sleep still waits for the first use, and the late use waits
        // behind the sleep.
        while gate.counts().2 == 0 {
            std::thread::yield_now();
        }
        assert_eq!(gate.counts(), (1, 1, 1));
        order.lock().unwrap().push("use done");
        drop(used);
        sleeper.join().unwrap();
        late.join().unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["use done", "sleep", "sleep done", "late use"]
        );
        assert_eq!(gate.counts(), (0, 0, 0));
    }

    #[test]
    fn the_capturing_thread_is_refused_what_would_invalidate_its_capture() {
        let gate = Gate::new("test", "TestCapture");
        gate.begin();
        gate.begun(Some(1), 0x10);
        let e = gate.call("allocate", true).err().expect("refused");
        assert!(e.message.contains("TestCapture::allocate"), "{e}");
        let e = gate.before_sync("synchronize", 0x10).expect_err("refused");
        assert!(e.message.contains("end the capture first"), "{e}");
        gate.end(1);
        assert!(gate.call("allocate", true).is_ok());
    }
}
