//! Frees queued per stream whose signal has not settled, for
//! `synchronize`.
//!
//! `DeviceContext::synchronize` returns once every free queued on the
//! stream has retired. A driver's own stream synchronize is not enough when
//! the signal settles off the stream: on the backend's [free
//! thread](crate::FreeThread) after the stream has passed the free, or in a
//! callback the runtime may run after its synchronize returned. So a backend
//! counts each such free on its stream when it queues it
//! ([`Unsettled::add`]) and uncounts it when its signal fired or was dropped
//! ([`Unsettled::settle`]); `synchronize` then waits for its stream's count
//! to reach zero ([`Unsettled::wait`]).
//!
//! ```
//! use memgov_backend::Unsettled;
//! use std::sync::Arc;
//!
//! let unsettled = Arc::new(Unsettled::default());
//! unsettled.add(7);
//! let settler = {
//!     let unsettled = unsettled.clone();
//!     std::thread::spawn(move || unsettled.settle(7))
//! };
//! // Returns once stream 7's free has settled (or `lost` says to stop).
//! unsettled.wait(7, || false, None);
//! settler.join().unwrap();
//! assert_eq!(unsettled.count(7), 0);
//! ```

use memgov_sync::lock;
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Unsettled frees per stream id, with a condition variable that wakes
/// every waiter whenever one settles.
#[derive(Debug, Default)]
pub struct Unsettled {
    per_stream: Mutex<HashMap<u64, u64>>,
    settled: Condvar,
}

impl Unsettled {
    /// A free was queued on `stream`; it counts until settled. Count it
    /// before the side that settles it can run.
    pub fn add(&self, stream: u64) {
        *lock(&self.per_stream).entry(stream).or_default() += 1;
    }

    /// [`add`](Self::add), settled when the returned guard drops unless it
    /// is [handed on](Settling::hand_on): for a free whose queuing can still
    /// fail and settle it on the caller's thread.
    pub fn add_guarded(&self, stream: u64) -> Settling<'_> {
        self.add(stream);
        Settling {
            unsettled: self,
            stream,
        }
    }

    /// One free of `stream` settled (its signal fired or was dropped).
    pub fn settle(&self, stream: u64) {
        let mut m = lock(&self.per_stream);
        if let Some(n) = m.get_mut(&stream) {
            *n -= 1;
            if *n == 0 {
                m.remove(&stream);
            }
        }
        drop(m);
        self.settled.notify_all();
    }

    /// Forget every count (their signals were abandoned together, on device
    /// loss) and wake the waiters.
    pub fn clear(&self) {
        lock(&self.per_stream).clear();
        self.settled.notify_all();
    }

    /// Wake every waiter to look at its `lost` condition again.
    pub fn wake(&self) {
        let _m = lock(&self.per_stream);
        self.settled.notify_all();
    }

    /// How many frees of `stream` have not settled.
    pub fn count(&self, stream: u64) -> u64 {
        lock(&self.per_stream).get(&stream).copied().unwrap_or(0)
    }

    /// Block until every free queued on `stream` so far has settled, or
    /// `lost` holds (then nothing more settles on its own: device loss
    /// abandons them). `lost` is looked at whenever a free settles or
    /// [`wake`](Self::wake) is called, and with `recheck` at least that
    /// often too (for a loss that is declared without a wake).
    pub fn wait(&self, stream: u64, lost: impl Fn() -> bool, recheck: Option<Duration>) {
        let mut m = lock(&self.per_stream);
        while m.contains_key(&stream) && !lost() {
            m = match recheck {
                Some(every) => self
                    .settled
                    .wait_timeout(m, every)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0),
                None => self.settled.wait(m).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }
}

/// A free counted on its stream by [`Unsettled::add_guarded`]: settled when
/// this drops, unless handed on to the side that settles it.
#[derive(Debug)]
#[must_use = "dropping it settles the free at once"]
pub struct Settling<'a> {
    unsettled: &'a Unsettled,
    stream: u64,
}

impl Settling<'_> {
    /// The free was handed on (to a callback or the free thread), which
    /// settles it: do not settle it here.
    pub fn hand_on(self) {
        std::mem::forget(self);
    }
}

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        self.unsettled.settle(self.stream);
    }
}
