//! # memgov-sync
//!
//! Internal to memgov: its crates share these primitives, and the loom
//! models in `tests/loom.rs` check them as shipped. No stability promise.
//!
//! The concurrency primitives the lifecycle rests on, kept small and
//! separate so that the loom model (`--cfg loom`) checks exactly the code that
//! ships:
//!
//! * [`ClaimCounter`]: a count of outstanding claims with a *closed* bit in the
//!   same word. Acquire is one compare-and-swap that fails once the bit is set
//!   or the count is at its maximum (refused, never wrapped); release is one
//!   `fetch_sub` that tells the caller whether it dropped the last claim of a
//!   closed counter. The governor uses one for pins. [`ClaimShards`] is one
//!   per shard of streams, closed together: the gate backend calls pass
//!   through.
//! * [`Notifier`]: a generation-less "check under the lock, wake after the
//!   change" waiter, with a count of waiters so that the signalling side (a
//!   driver thread firing a `RetireSignal`) skips the lock entirely when no one
//!   waits. It never polls: waiters sleep on a condition variable or register
//!   a task waker.
//! * [`CountWord`] and [`EpochWord`]: a count or an epoch with its waiters in
//!   the same word, so that a signaller learns from its own read-modify-write
//!   (or, for the epoch, a fenced load) whether to wake anyone.
//!   [`ShardedCount`] counts per shard (pending releases) and reaches its
//!   `CountWord` total only once closed, so an open shard's count is written
//!   on its own line.
//! * [`Leases`] over a [`Pool`] (a budget's bytes, a counter's claims), on
//!   [`LeaseSlots`]: units leased to shards of streams, one cache line each,
//!   that a refusal elsewhere takes back while their holders are taking from
//!   them, with refusals exact, and that retire or teardown close for good.
//! * [`BudgetWord`]: bytes charged against a limit, one compare-and-swap per
//!   charge that never passes the limit; a [`Pool`] for leases.
//!   [`Allowance`]: a reservation's unused bytes, each handed out once.
//! * [`Slot`]: one cached box handed between threads by compare-and-swap,
//!   closed for good by retire (the governor recycles the boxes of pending
//!   releases through one per shard).
//! * [`Bins`]: blocks kept by size class under one lock, closed for good
//!   by retire (the governor's block cache keeps one per stream).
//! * [`Lifecycle`]: one context's phase, pins, pending releases, gate and
//!   waiters built from the above, the transitions (retire, loss, force,
//!   teardown, the background reap), and the sequences the governor runs
//!   between them (a backend call under a [`GateClaim`], a pin moved into a
//!   pending release by a [`Deferral`], its settlement), all of which the
//!   governor drives and the loom models check.

mod bins;
mod budget;
mod claim;
mod lease;
mod lifecycle;
mod notify;
mod slot;
mod word;

pub use bins::{Bins, PutRefused};
pub use budget::{Allowance, BudgetWord, Refusal};
pub use claim::{AcquireError, ClaimCounter, ClaimShards, Entry, MAX_CLAIMS};
// `LeaseSlots`, `Take` and `CountWord` are named by the loom model
// (`tests/loom.rs`); the governor reaches them through `Leases` and
// `ShardedCount`.
#[allow(unused_imports)]
pub use lease::{LeaseSlots, Leases, Pool, Take};
pub use lifecycle::{Deferral, Destroyer, Forcing, GateClaim, Lifecycle, Phase, Reaper, Teardown};
pub use notify::Notifier;
pub use slot::Slot;
#[allow(unused_imports)]
pub use word::{CountWord, EpochWord, ShardedCount};

// The primitives below switch to loom's under `--cfg loom`; the governor's
// own bookkeeping mutexes stay `std` (they are not part of the model and are
// never held across a wait), which keeps the crate compiling under loom.
#[cfg(loom)]
pub use loom::sync::{
    atomic::{fence, AtomicU64, AtomicUsize, Ordering},
    Condvar, Mutex, MutexGuard,
};
#[cfg(not(loom))]
pub use std::sync::{
    atomic::{fence, AtomicU64, AtomicUsize, Ordering},
    Condvar, Mutex, MutexGuard,
};

/// Index `i` of an array of `N` shards: `i` itself (callers pass indices
/// below `N`, debug-asserted), reduced modulo the constant `N` so that the
/// compiler sees it in bounds and the hot paths carry no bounds check.
#[inline(always)]
pub fn slot_index<const N: usize>(i: usize) -> usize {
    debug_assert!(i < N, "shard {i} of {N}");
    i % N
}

/// One turn of a wait for another thread's few instructions (a refill in
/// flight): a yield under loom, which must see the other thread run.
#[inline]
pub fn spin() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

/// Lock one of the governor's bookkeeping mutexes (always `std`), recovering
/// from poisoning: every structure guarded here is left consistent between
/// statements, and a panic in one user thread must not wedge teardown for
/// everyone else.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lock a mutex of the modelled primitives (loom's under `--cfg loom`).
pub fn lock_model<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    #[cfg(loom)]
    {
        m.lock().unwrap()
    }
    #[cfg(not(loom))]
    {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }
}
