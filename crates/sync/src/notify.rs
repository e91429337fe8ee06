use super::{fence, lock_model as lock, AtomicUsize, Condvar, Mutex, Ordering};
use std::task::Waker;
use std::time::Instant;

/// Wakes threads and tasks that wait for a condition expressed over atomics.
///
/// Protocol (no lost wake-up):
/// * the waiter registers itself in `waiters` (SeqCst), takes the lock and
///   checks its condition *under the lock* before every sleep;
/// * the signaller first changes the atomics the condition reads, then issues
///   a SeqCst fence, then, if `waiters` is non-zero, takes the lock and
///   notifies; the waiter issues a SeqCst fence between registering and its
///   first check.
///
/// Either the waiter's check sees the change, or the waiter was registered
/// before the signaller read `waiters` and is asleep in (or about to enter)
/// the condition variable while the signaller waits for the lock. With no
/// waiter registered the signal costs one atomic load.
#[derive(Debug, Default)]
pub struct Notifier {
    waiters: AtomicUsize,
    wakers: Mutex<Vec<Waker>>,
    cv: Condvar,
}

impl Notifier {
    /// A notifier with no one waiting.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wake everyone waiting, if anyone is. Call after changing the state the
    /// waiters' conditions read.
    #[inline]
    pub fn notify(&self) {
        // Store-buffering with the waiter (its `waiters` increment, then its
        // read of the condition): a SeqCst fence on each side between the
        // write and the read guarantees that at least one of them sees the
        // other's write. SeqCst *accesses* alone do not: the condition's
        // atomics are changed with Release/AcqRel and read with Acquire, so
        // both reads could see stale values and the wake-up would be lost
        // (the loom model in tests/loom.rs finds that interleaving).
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) != 0 {
            self.wake_all();
        }
    }

    /// The slow path of [`notify`](Self::notify), out of line so that the
    /// fast path (nobody waits: a fence and a load) inlines into every
    /// signaller without the slow path's stack frame.
    ///
    /// Also called directly by a signaller that knows from a
    /// [`CountWord`](super::CountWord) or [`EpochWord`](super::EpochWord) that
    /// a waiter is registered.
    #[cold]
    #[inline(never)]
    pub fn wake_all(&self) {
        let wakers = std::mem::take(&mut *lock(&self.wakers));
        self.cv.notify_all();
        // Wakers run executor code: never under our lock.
        for w in wakers {
            w.wake();
        }
    }

    /// Block until `ready()` holds or `deadline` passes. Returns whether
    /// `ready()` held. `ready` must only read atomics.
    pub fn wait_until(&self, mut ready: impl FnMut() -> bool, deadline: Option<Instant>) -> bool {
        if ready() {
            return true;
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in `notify` (see there).
        fence(Ordering::SeqCst);
        let mut guard = lock(&self.wakers);
        let ok = loop {
            if ready() {
                break true;
            }
            match deadline {
                None => {
                    guard = self.cv.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break ready();
                    }
                    #[cfg(not(loom))]
                    {
                        guard = self
                            .cv
                            .wait_timeout(guard, d - now)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                    #[cfg(loom)]
                    {
                        let _ = d;
                        guard = self.cv.wait(guard).unwrap();
                    }
                }
            }
        };
        drop(guard);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        ok
    }

    /// For futures: if `ready()` does not hold, register `waker` to be woken by
    /// the next [`notify`](Self::notify) and return false. The registration
    /// counts as a waiter until [`forget_task`](Self::forget_task).
    pub fn register_task(
        &self,
        waker: &Waker,
        registered: &mut bool,
        mut ready: impl FnMut() -> bool,
    ) -> bool {
        if !*registered {
            self.waiters.fetch_add(1, Ordering::SeqCst);
            *registered = true;
        }
        // Pairs with the fence in `notify` (see there).
        fence(Ordering::SeqCst);
        let mut wakers = lock(&self.wakers);
        if ready() {
            return true;
        }
        if !wakers.iter().any(|w| w.will_wake(waker)) {
            wakers.push(waker.clone());
        }
        false
    }

    /// Undo a task registration (future completed or dropped).
    pub fn forget_task(&self, registered: &mut bool) {
        if std::mem::take(registered) {
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}
