use super::{fence, AtomicU64, Ordering};

/// The closed bit. Below it: the number of outstanding claims.
const CLOSED: u64 = 1 << 63;

/// The largest count a counter can be configured for.
pub const MAX_CLAIMS: u64 = CLOSED - 1;

/// Why [`ClaimCounter::try_acquire`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireError {
    /// The counter is closed: no new claims.
    Closed,
    /// The count is at its configured maximum.
    Overflow,
}

/// A count of outstanding claims and a closed bit, in one atomic word.
///
/// Invariants, enforced here and nowhere else:
/// * once [`close`](Self::close) has been ordered before a `try_acquire` in the
///   word's modification order, that acquire fails (both are read-modify-writes
///   of the same word, so "after close" is well defined);
/// * the count never exceeds `max` and never wraps: acquire checks before it
///   increments, in the same compare-and-swap;
/// * exactly one `release` observes the transition to "closed and zero", and
///   it is told so, so that exactly one party wakes the waiter.
#[derive(Debug)]
pub struct ClaimCounter {
    state: AtomicU64,
    max: u64,
}

impl ClaimCounter {
    /// An open counter with no claims that admits at most `max` at once.
    ///
    /// # Panics
    ///
    /// If `max` is zero or above 2^63 - 1 (the top bit is the closed bit).
    pub fn new(max: u64) -> Self {
        assert!(
            (1..=MAX_CLAIMS).contains(&max),
            "claim maximum must be in 1..=2^63-1, got {max}"
        );
        Self {
            state: AtomicU64::new(0),
            max,
        }
    }

    /// Take a new claim, unless the counter is closed or full.
    #[inline]
    pub fn try_acquire(&self) -> Result<(), AcquireError> {
        self.try_acquire_n(1)
    }

    /// Take `n` claims at once (a lease of claims), unless the counter is
    /// closed or would exceed its maximum.
    #[inline]
    pub fn try_acquire_n(&self, n: u64) -> Result<(), AcquireError> {
        let mut cur = self.state.load(Ordering::Relaxed);
        loop {
            if cur & CLOSED != 0 {
                return Err(AcquireError::Closed);
            }
            if n > self.max - cur {
                return Err(AcquireError::Overflow);
            }
            match self.state.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Drop a claim. Returns true when this was the last claim of a closed
    /// counter: the caller must then wake whoever waits for zero.
    #[inline]
    #[must_use = "the last release of a closed counter must wake the waiter"]
    pub fn release(&self) -> bool {
        self.release_n(1)
    }

    /// Drop `n` claims at once (a lease of claims put back). Returns true
    /// when they were the last claims of a closed counter.
    #[inline]
    #[must_use = "the last release of a closed counter must wake the waiter"]
    pub fn release_n(&self, n: u64) -> bool {
        let prev = self.state.fetch_sub(n, Ordering::Release);
        debug_assert!(
            prev & !CLOSED >= n,
            "claim released more often than acquired"
        );
        if prev == CLOSED | n {
            // Pair with every other releaser's Release so that the woken side
            // sees everything they did before dropping their claims.
            fence(Ordering::Acquire);
            true
        } else {
            false
        }
    }

    /// Forget `n` claims at once (force-retire revokes the claims of live
    /// buffers and streams whose holders can no longer release them). Returns
    /// true if the counter is closed and now at zero.
    pub fn revoke(&self, n: u64) -> bool {
        if n == 0 {
            return self.is_drained();
        }
        self.release_n(n)
    }

    /// Refuse new claims from now on. Returns true if no claims are
    /// outstanding at the moment of closing.
    pub fn close(&self) -> bool {
        self.state.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED == 0
    }

    /// Whether the counter has been closed.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Closed and at zero: the condition teardown waits for.
    #[inline]
    pub fn is_drained(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED
    }

    /// Outstanding claims now.
    #[inline]
    pub fn count(&self) -> u64 {
        self.state.load(Ordering::Acquire) & !CLOSED
    }

    /// The configured maximum.
    pub fn max(&self) -> u64 {
        self.max
    }
}

/// What [`ClaimShards::enter`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// The caller holds a claim of the shard.
    Entered,
    /// The shards are closed: no claim.
    Closed,
    /// The shards are closed, and giving back the claim taken on the way
    /// drained the shard: the caller must wake the waiter.
    ClosedDrained,
}

/// A [`ClaimCounter`] alone on its cache line(s).
#[derive(Debug)]
#[repr(align(128))]
struct PaddedCounter(ClaimCounter);

/// One [`ClaimCounter`] per shard of streams, each on its own cache line,
/// opened and closed together: a gate that calls from different streams
/// pass through without writing a common line.
///
/// Invariants, enforced here:
/// * [`close`](Self::close) closes every shard; once it has returned, every
///   `try_acquire` on any shard fails (each shard is a `ClaimCounter`).
/// * [`is_drained`](Self::is_drained) holds only when every shard is closed
///   and at zero. Once it has held, no claim is taken again: a refused
///   [`enter`](Self::enter) adds one for an instant (it may read false
///   again meanwhile) but gives it back without making a call, so whoever
///   saw it drained may go on as if it still were.
/// * the release that drains a closed shard is told so (per shard): the
///   caller wakes the waiter, which re-checks every shard. The waiter's
///   condition is the conjunction, and the last shard to drain is drained by
///   a release that is told so, so no wake-up is lost.
#[derive(Debug)]
pub struct ClaimShards<const N: usize> {
    shards: [PaddedCounter; N],
}

impl<const N: usize> ClaimShards<N> {
    /// `N` open shards with no claims, each admitting at most `max` at once.
    ///
    /// # Panics
    ///
    /// As [`ClaimCounter::new`].
    pub fn new(max: u64) -> Self {
        Self {
            shards: std::array::from_fn(|_| PaddedCounter(ClaimCounter::new(max))),
        }
    }

    /// Take a claim of `shard` for one call, unless the shards are closed.
    ///
    /// One `fetch_add`, not a compare-and-swap loop: a gate counts calls in
    /// flight, which cannot approach the 2^63 the word holds, so there is no
    /// maximum to check first. A claim taken on a closed shard is given back
    /// at once; if that drains the shard, [`Entry::ClosedDrained`] tells the
    /// caller to wake the waiter (whose check may have seen the claim).
    #[inline]
    pub fn enter(&self, shard: usize) -> Entry {
        let word = &self.shards[super::slot_index::<N>(shard)].0.state;
        let prev = word.fetch_add(1, Ordering::Acquire);
        if prev & CLOSED == 0 {
            return Entry::Entered;
        }
        if self.release(shard) {
            Entry::ClosedDrained
        } else {
            Entry::Closed
        }
    }

    /// Drop a claim of `shard`; true when it drained that closed shard.
    #[inline]
    #[must_use = "the last release of a closed shard must wake the waiter"]
    pub fn release(&self, shard: usize) -> bool {
        self.shards[super::slot_index::<N>(shard)].0.release()
    }

    /// Close every shard. Returns true if all of them were at zero.
    pub fn close(&self) -> bool {
        self.shards
            .iter()
            .fold(true, |drained, s| s.0.close() & drained)
    }

    /// Whether closing has begun (the first shard is closed first).
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.shards[0].0.is_closed()
    }

    /// Every shard closed and at zero.
    pub fn is_drained(&self) -> bool {
        self.shards.iter().all(|s| s.0.is_drained())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn close_refuses_and_last_release_reports_zero() {
        let c = ClaimCounter::new(10);
        c.try_acquire().unwrap();
        c.try_acquire().unwrap();
        assert!(!c.close());
        assert_eq!(c.try_acquire(), Err(AcquireError::Closed));
        assert!(!c.release());
        assert!(c.release());
        assert!(c.is_drained());
    }

    #[test]
    fn overflow_is_refused_not_wrapped() {
        let c = ClaimCounter::new(2);
        c.try_acquire().unwrap();
        c.try_acquire().unwrap();
        assert_eq!(c.try_acquire(), Err(AcquireError::Overflow));
        assert_eq!(c.count(), 2);
        let big = ClaimCounter::new(MAX_CLAIMS);
        assert_eq!(big.max(), MAX_CLAIMS);
    }

    #[test]
    fn close_on_empty_reports_drained() {
        let c = ClaimCounter::new(1);
        assert!(c.close());
        assert!(c.is_drained());
        assert!(c.is_closed());
    }

    #[test]
    fn claims_taken_and_put_back_in_bulk_stay_exact() {
        let c = ClaimCounter::new(10);
        c.try_acquire_n(8).unwrap();
        assert_eq!(c.try_acquire_n(3), Err(AcquireError::Overflow));
        c.try_acquire_n(2).unwrap();
        assert_eq!(c.try_acquire(), Err(AcquireError::Overflow));
        assert!(!c.release_n(7));
        c.close();
        assert_eq!(c.try_acquire_n(1), Err(AcquireError::Closed));
        assert!(!c.release_n(1));
        assert!(c.release_n(2));
    }

    #[test]
    fn shards_close_together_and_drain_as_one() {
        let g = ClaimShards::<4>::new(MAX_CLAIMS);
        assert_eq!(g.enter(1), Entry::Entered);
        assert_eq!(g.enter(3), Entry::Entered);
        assert!(!g.close());
        assert!(g.is_closed());
        assert_eq!(g.enter(0), Entry::ClosedDrained);
        assert_eq!(g.enter(2), Entry::ClosedDrained);
        assert_eq!(g.enter(1), Entry::Closed);
        assert!(g.release(1));
        assert!(!g.is_drained());
        assert!(g.release(3));
        assert!(g.is_drained());
    }

    #[test]
    fn revoke_reports_zero() {
        let c = ClaimCounter::new(10);
        for _ in 0..3 {
            c.try_acquire().unwrap();
        }
        c.close();
        assert!(!c.revoke(2));
        assert!(c.release());
    }
}
