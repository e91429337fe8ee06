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
pub struct CountWord(AtomicU64);

impl CountWord {
    /// A count of zero with no waiters.
    #[allow(dead_code)] // the loom model's
    pub fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// The count now.
    #[inline]
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Acquire) & COUNT_MASK
    }

    /// Count one more.
    #[inline]
    pub fn increment(&self) {
        let prev = self.0.fetch_add(1, Ordering::AcqRel);
        debug_assert!(prev & COUNT_MASK < COUNT_MASK, "count overflow");
    }

    /// Decrement. Returns true when this took the count to zero while a
    /// waiter was registered: the caller must then wake the waiters.
    #[inline]
    #[must_use = "the decrement to zero with a waiter registered must wake it"]
    pub fn decrement(&self) -> bool {
        let prev = self.0.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & COUNT_MASK != 0, "count decremented below zero");
        prev & COUNT_MASK == 1 && prev >= COUNT_WAITER
    }

    /// Register a waiter. Must come before the waiter's first check of the
    /// condition, and be undone with [`unregister`](Self::unregister).
    pub fn register(&self) {
        let prev = self.0.fetch_add(COUNT_WAITER, Ordering::AcqRel);
        debug_assert!(prev < u64::MAX - COUNT_WAITER, "too many waiters");
    }

    /// Undo a [`register`](Self::register), once the waiter is done
    /// waiting.
    pub fn unregister(&self) {
        self.0.fetch_sub(COUNT_WAITER, Ordering::AcqRel);
    }
}

/// Registered waiters live in the low bits of [`EpochWord`]; the epoch in the
/// high bits, where it wraps off the top of the word without touching them.
const EPOCH_ONE: u64 = 1 << 20;
const EPOCH_WAITERS: u64 = EPOCH_ONE - 1;

/// An event epoch (settlements) and the number of waiters for its next
/// change, in one atomic word: bumping it tells the bumper, from the same
/// read-modify-write, whether anyone waits (same argument as [`CountWord`]);
/// a signaller that would rather not write the word at all checks
/// [`has_waiters`](Self::has_waiters) after a fence, and bumps only then.
#[derive(Debug, Default)]
pub struct EpochWord(AtomicU64);

impl EpochWord {
    /// Epoch zero with no waiters.
    pub fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// The epoch now (wraps; compare for equality only).
    #[inline]
    pub fn epoch(&self) -> u64 {
        self.0.load(Ordering::Acquire) >> 20
    }

    /// Advance the epoch. Returns true if a waiter was registered: the caller
    /// must then wake the waiters.
    #[inline]
    #[must_use = "a bump with a waiter registered must wake it"]
    pub fn bump(&self) -> bool {
        self.0.fetch_add(EPOCH_ONE, Ordering::AcqRel) & EPOCH_WAITERS != 0
    }

    /// Whether a waiter is registered. For a signaller that skips the bump
    /// when nobody waits: it must issue a SeqCst fence between its change
    /// and this load, as the waiter does between registering and its check
    /// (see [`Notifier`](super::Notifier)).
    #[inline]
    pub fn has_waiters(&self) -> bool {
        self.0.load(Ordering::SeqCst) & EPOCH_WAITERS != 0
    }

    /// Register a waiter; read the epoch to wait past *after* this.
    pub fn register(&self) {
        let prev = self.0.fetch_add(1, Ordering::SeqCst);
        debug_assert!(prev & EPOCH_WAITERS < EPOCH_WAITERS, "too many waiters");
    }

    /// Undo a [`register`](Self::register), once the waiter is done
    /// waiting.
    pub fn unregister(&self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The closed bit of a [`ShardedCount`] shard.
const SHARD_CLOSED: u64 = 1 << 63;

/// One shard's count, alone on its cache line(s).
#[derive(Debug)]
#[repr(align(128))]
struct ShardWord(AtomicU64);

/// A count (of pending releases) kept per shard of streams, and a
/// [`CountWord`] that reaches zero only once every shard is closed and at
/// zero, with the waiters for that in it.
///
/// While a shard is open it holds one unit of `total` for good, so its count
/// goes up and down on its own line and the total stays above zero: nobody
/// can be waiting for zero then (teardown waits only after retire closed the
/// shards). [`close`](Self::close) closes every shard; from then on a shard
/// holds its unit only while its count is above zero.
///
/// Invariants, enforced here:
/// * `total` = (open shards) + (closed shards whose count is above zero) +
///   the transient unit of an `increment` between its two steps: the
///   transition of a closed shard from zero to one takes a unit
///   ([`increment`](Self::increment) sees `prev == CLOSED`), the one from one
///   to zero gives it back ([`decrement`](Self::decrement) sees
///   `prev == CLOSED | 1`), and `close` gives back the unit of a shard it
///   finds at zero. Each is told by its own read-modify-write of the shard
///   word, so exactly one party takes or gives each unit.
/// * `total` reaches zero only when every shard is closed and at zero, and a
///   decrement that takes it there with a waiter registered is told so (see
///   [`CountWord`]).
/// * An `increment` of a closed shard at zero gives `total` its unit back
///   *after* the shard word says one: between the two, `total` may read
///   zero with a release being queued. The caller must hold something else
///   that keeps the waiter's condition false meanwhile (the governor: the
///   buffer's pin, which moves into the pending release only after
///   `increment` returns).
#[derive(Debug)]
pub struct ShardedCount<const N: usize> {
    shards: [ShardWord; N],
    total: CountWord,
}

impl<const N: usize> ShardedCount<N> {
    /// `N` open shards at zero; each open shard holds its unit of the total.
    pub fn new() -> Self {
        Self {
            shards: std::array::from_fn(|_| ShardWord(AtomicU64::new(0))),
            total: CountWord(AtomicU64::new(N as u64)),
        }
    }

    /// Count one more on `shard`; a closed shard at zero takes its unit of
    /// the total back (see the invariants above for the instant between).
    #[inline]
    pub fn increment(&self, shard: usize) {
        let prev = self.shards[super::slot_index::<N>(shard)]
            .0
            .fetch_add(1, Ordering::AcqRel);
        debug_assert!(prev & !SHARD_CLOSED < COUNT_MASK, "count overflow");
        if prev == SHARD_CLOSED {
            self.total.increment();
        }
    }

    /// Decrement. Returns true when this took the total to zero while a
    /// waiter was registered: the caller must then wake the waiters.
    #[inline]
    #[must_use = "the decrement to zero with a waiter registered must wake it"]
    pub fn decrement(&self, shard: usize) -> bool {
        let prev = self.shards[super::slot_index::<N>(shard)]
            .0
            .fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & !SHARD_CLOSED != 0, "count decremented below zero");
        prev == SHARD_CLOSED | 1 && self.total.decrement()
    }

    /// Close every shard (once; later calls do nothing). Returns true when
    /// this took the total to zero while a waiter was registered.
    #[must_use = "the close that takes the total to zero with a waiter registered must wake it"]
    pub fn close(&self) -> bool {
        let mut wake = false;
        for s in &self.shards {
            let prev = s.0.fetch_or(SHARD_CLOSED, Ordering::AcqRel);
            if prev == 0 {
                wake |= self.total.decrement();
            }
        }
        wake
    }

    /// The sum of the shards' counts now (each read on its own: a
    /// concurrent increment and decrement on two shards may be half-seen).
    pub fn count(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0.load(Ordering::Acquire) & !SHARD_CLOSED)
            .fold(0, u64::wrapping_add)
    }

    /// Whether every shard is closed and at zero.
    #[inline]
    pub fn is_zero(&self) -> bool {
        self.total.count() == 0
    }

    /// Register a waiter for zero (see [`CountWord::register`]).
    pub fn register(&self) {
        self.total.register();
    }

    /// Undo a [`register`](Self::register), once the waiter is done
    /// waiting.
    pub fn unregister(&self) {
        self.total.unregister();
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
    fn sharded_count_reaches_zero_only_when_closed_and_says_so_once() {
        let c = ShardedCount::<3>::new();
        c.increment(0);
        c.increment(1);
        assert!(!c.decrement(0));
        assert!(!c.is_zero());
        c.register();
        assert!(!c.close());
        assert_eq!(c.count(), 1);
        assert!(!c.is_zero());
        // A closed shard at zero takes its unit back for a new release...
        c.increment(2);
        assert!(!c.decrement(1));
        // ...and gives it back with the last one: zero, and the waiter is told.
        assert!(c.decrement(2));
        assert!(c.is_zero());
        assert_eq!(c.count(), 0);
        c.unregister();
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

impl<const N: usize> Default for ShardedCount<N> {
    fn default() -> Self {
        Self::new()
    }
}
