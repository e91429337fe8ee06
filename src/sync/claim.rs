use super::{fence, AtomicU64, Ordering};

/// The closed bit. Below it: the number of outstanding claims.
const CLOSED: u64 = 1 << 63;

/// The largest count a counter can be configured for.
pub(crate) const MAX_CLAIMS: u64 = CLOSED - 1;

/// Why [`ClaimCounter::try_acquire`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcquireError {
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
pub(crate) struct ClaimCounter {
    state: AtomicU64,
    max: u64,
}

impl ClaimCounter {
    pub(crate) fn new(max: u64) -> Self {
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
    pub(crate) fn try_acquire(&self) -> Result<(), AcquireError> {
        let mut cur = self.state.load(Ordering::Relaxed);
        loop {
            if cur & CLOSED != 0 {
                return Err(AcquireError::Closed);
            }
            if cur >= self.max {
                return Err(AcquireError::Overflow);
            }
            match self.state.compare_exchange_weak(
                cur,
                cur + 1,
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
    pub(crate) fn release(&self) -> bool {
        let prev = self.state.fetch_sub(1, Ordering::Release);
        debug_assert!(
            prev & !CLOSED != 0,
            "claim released more often than acquired"
        );
        if prev == CLOSED | 1 {
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
    pub(crate) fn revoke(&self, n: u64) -> bool {
        if n == 0 {
            return self.is_drained();
        }
        let prev = self.state.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(prev & !CLOSED >= n, "revoked more claims than outstanding");
        prev == CLOSED | n
    }

    /// Refuse new claims from now on. Returns true if no claims are
    /// outstanding at the moment of closing.
    pub(crate) fn close(&self) -> bool {
        self.state.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED == 0
    }

    /// Whether the counter has been closed.
    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Closed and at zero: the condition teardown waits for.
    #[inline]
    pub(crate) fn is_drained(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED
    }

    /// Outstanding claims now.
    #[inline]
    pub(crate) fn count(&self) -> u64 {
        self.state.load(Ordering::Acquire) & !CLOSED
    }

    /// The configured maximum.
    #[cfg(test)]
    pub(crate) fn max(&self) -> u64 {
        self.max
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
