use super::{AtomicU64, Ordering};

/// Registered waiters live in the high bits of [`CountWord`]; the count in
/// the low bits.
const COUNT_WAITER: u64 = 1 << 44;
const COUNT_MASK: u64 = COUNT_WAITER - 1;

/// A count (of pending releases) and the number of waiters that wait for it to
/// reach zero, in one atomic word.
///
/// The decrement that takes the count to zero reads the waiter count *in the
/// same read-modify-write*, so it needs no fence to know whether to wake
/// anyone (`Notifier::notify` needs a SeqCst fence for that, because there the
/// condition and the waiter count are different words):
///
/// * if the waiter's registration comes first in the word's modification
///   order, the decrement sees it and the decrementer wakes (under the
///   notifier's lock, so a waiter that checked before going to sleep is
///   asleep by then and one that checks after sees zero);
/// * otherwise the registration reads the decremented word (an RMW reads the
///   latest value), synchronizes with the decrement (both AcqRel) and the
///   waiter's check, made after registering, sees zero.
///
/// Bounds: the count stays below 2^44 (each pending release owns a heap
/// allocation, so 2^44 of them cannot exist) and the waiters below 2^20 (they
/// are threads or tasks blocked on one context); both are debug-asserted.
#[derive(Debug, Default)]
pub(crate) struct CountWord(AtomicU64);

impl CountWord {
    pub(crate) fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// The count now.
    #[inline]
    pub(crate) fn count(&self) -> u64 {
        self.0.load(Ordering::Acquire) & COUNT_MASK
    }

    #[inline]
    pub(crate) fn increment(&self) {
        let prev = self.0.fetch_add(1, Ordering::AcqRel);
        debug_assert!(prev & COUNT_MASK < COUNT_MASK, "count overflow");
    }

    /// Decrement. Returns true when this took the count to zero while a
    /// waiter was registered: the caller must then wake the waiters.
    #[inline]
    #[must_use = "the decrement to zero with a waiter registered must wake it"]
    pub(crate) fn decrement(&self) -> bool {
        let prev = self.0.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & COUNT_MASK != 0, "count decremented below zero");
        prev & COUNT_MASK == 1 && prev >= COUNT_WAITER
    }

    /// Register a waiter. Must come before the waiter's first check of the
    /// condition, and be undone with [`unregister`](Self::unregister).
    pub(crate) fn register(&self) {
        let prev = self.0.fetch_add(COUNT_WAITER, Ordering::AcqRel);
        debug_assert!(prev < u64::MAX - COUNT_WAITER, "too many waiters");
    }

    pub(crate) fn unregister(&self) {
        self.0.fetch_sub(COUNT_WAITER, Ordering::AcqRel);
    }
}

/// Registered waiters live in the low bits of [`EpochWord`]; the epoch in the
/// high bits, where it wraps off the top of the word without touching them.
const EPOCH_ONE: u64 = 1 << 20;
const EPOCH_WAITERS: u64 = EPOCH_ONE - 1;

/// An event epoch (settlements) and the number of waiters for its next
/// change, in one atomic word: bumping it tells the bumper, from the same
/// read-modify-write, whether anyone waits (same argument as [`CountWord`]).
#[derive(Debug, Default)]
pub(crate) struct EpochWord(AtomicU64);

impl EpochWord {
    pub(crate) fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// The epoch now (wraps; compare for equality only).
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.0.load(Ordering::Acquire) >> 20
    }

    /// Advance the epoch. Returns true if a waiter was registered: the caller
    /// must then wake the waiters.
    #[inline]
    #[must_use = "a bump with a waiter registered must wake it"]
    pub(crate) fn bump(&self) -> bool {
        self.0.fetch_add(EPOCH_ONE, Ordering::AcqRel) & EPOCH_WAITERS != 0
    }

    /// Register a waiter; read the epoch to wait past *after* this.
    pub(crate) fn register(&self) {
        let prev = self.0.fetch_add(1, Ordering::AcqRel);
        debug_assert!(prev & EPOCH_WAITERS < EPOCH_WAITERS, "too many waiters");
    }

    pub(crate) fn unregister(&self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn count_word_reports_zero_only_with_a_waiter() {
        let c = CountWord::new();
        c.increment();
        assert!(!c.decrement());
        c.increment();
        c.increment();
        c.register();
        assert_eq!(c.count(), 2);
        assert!(!c.decrement());
        assert!(c.decrement());
        c.unregister();
        assert_eq!(c.count(), 0);
    }

    #[test]
    fn epoch_word_wraps_without_touching_waiters() {
        let e = EpochWord(AtomicU64::new(!EPOCH_WAITERS));
        assert!(!e.bump());
        assert_eq!(e.epoch(), 0);
        e.register();
        assert!(e.bump());
        assert_eq!(e.epoch(), 1);
        e.unregister();
        assert!(!e.bump());
    }
}
