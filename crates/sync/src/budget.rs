//! Byte counts against a limit: a budget's charged total ([`BudgetWord`])
//! and a reservation's unused bytes ([`Allowance`]). Each change is one
//! compare-and-swap or one read-modify-write; nothing here takes a lock.

use crate::{AtomicU64, Ordering};

/// What a refused [`BudgetWord::try_charge`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Bytes charged when the charge was refused.
    pub charged: u64,
    /// The limit it was refused against.
    pub limit: u64,
}

/// Charged bytes against a limit. A charge is admitted by one
/// compare-and-swap that never takes `charged` above `limit` (less the
/// caller's credit); an uncharge is one `fetch_sub`.
///
/// # Invariant
///
/// `charged` is the sum of every admitted charge not yet uncharged: it never
/// wraps (a charge that would overflow is refused) and never goes below zero
/// (debug-asserted on uncharge). A lowered limit refuses new charges and
/// takes nothing back.
#[derive(Debug)]
pub struct BudgetWord {
    limit: AtomicU64,
    charged: AtomicU64,
    peak: AtomicU64,
}

impl BudgetWord {
    /// A budget of `limit` bytes, nothing charged.
    pub fn new(limit: u64) -> Self {
        Self {
            limit: AtomicU64::new(limit),
            charged: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// Charge `bytes` if `charged + bytes - credit <= limit`.
    ///
    /// `credit` is what the caller may reuse at once (in the governor: bytes
    /// pending release on the requesting stream, where the backend reuses
    /// stream-ordered frees); it lowers the bar, but the full size is
    /// charged.
    #[inline]
    pub fn try_charge(&self, bytes: u64, credit: u64) -> Result<(), Refusal> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut cur = self.charged.load(Ordering::Relaxed);
        loop {
            let needed = cur.checked_add(bytes.saturating_sub(credit));
            let Some(new) = cur
                .checked_add(bytes)
                .filter(|_| needed.is_some_and(|n| n <= limit))
            else {
                return Err(Refusal {
                    charged: cur,
                    limit,
                });
            };
            match self
                .charged
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    if new > self.peak.load(Ordering::Relaxed) {
                        self.peak.fetch_max(new, Ordering::Relaxed);
                    }
                    return Ok(());
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Charge `bytes` whatever the limit: memory that already exists (a
    /// runtime's own allocation recorded against the budget) cannot be
    /// refused. The budget may end up over its limit; charges are refused
    /// until enough comes back.
    pub fn force_charge(&self, bytes: u64) {
        let new = self
            .charged
            .fetch_add(bytes, Ordering::AcqRel)
            .saturating_add(bytes);
        self.peak.fetch_max(new, Ordering::Relaxed);
    }

    /// Give back `bytes` charged earlier.
    #[inline]
    pub fn uncharge(&self, bytes: u64) {
        let prev = self.charged.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(
            prev >= bytes,
            "uncharged {bytes} B from a budget holding {prev} B"
        );
    }

    /// Bytes charged now.
    pub fn charged(&self) -> u64 {
        self.charged.load(Ordering::Acquire)
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Change the limit; charges already admitted stay.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// The most ever charged at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

impl crate::Pool for BudgetWord {
    type Refusal = Refusal;

    #[inline]
    fn try_take(&self, n: u64, credit: u64) -> Result<(), Refusal> {
        self.try_charge(n, credit)
    }

    #[inline]
    fn put(&self, n: u64) {
        self.uncharge(n);
    }
}

/// A reservation's unused bytes: charged to a budget when they were added,
/// handed out to allocations one `take` at a time, and given back to the
/// budget by whoever [`shrink`](Self::shrink)s or [`close`](Self::close)s
/// it.
///
/// # Invariant
///
/// Every byte added is, at any moment, in exactly one place: left here,
/// taken by an allocation (and put back if that allocation fails), or
/// returned by `shrink` / `close` to the caller, who gives it back to the
/// budget. `close` leaves zero behind, so a byte is returned at most once
/// even when a snapshot reads the allowance afterwards.
#[derive(Debug)]
pub struct Allowance {
    left: AtomicU64,
}

impl Allowance {
    /// An allowance of `bytes`, already charged by the caller.
    pub fn new(bytes: u64) -> Self {
        Self {
            left: AtomicU64::new(bytes),
        }
    }

    /// Bytes left.
    #[inline]
    pub fn left(&self) -> u64 {
        self.left.load(Ordering::Acquire)
    }

    /// Take `bytes` for an allocation, or say how many are left.
    #[inline]
    pub fn take(&self, bytes: u64) -> Result<(), u64> {
        self.left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                left.checked_sub(bytes)
            })
            .map(drop)
    }

    /// Put back `bytes` taken for an allocation that was not made, or add
    /// bytes the caller has just charged (a grow).
    #[inline]
    pub fn add(&self, bytes: u64) {
        self.left.fetch_add(bytes, Ordering::AcqRel);
    }

    /// Take up to `bytes` of what is left out for good; returns how many,
    /// for the caller to give back to the budget.
    pub fn shrink(&self, bytes: u64) -> u64 {
        let mut given = 0;
        let _ = self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                given = left.min(bytes);
                Some(left - given)
            });
        given
    }

    /// Take everything left out for good; returns how many, for the caller
    /// to give back to the budget.
    pub fn close(&self) -> u64 {
        self.left.swap(0, Ordering::AcqRel)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn charge_respects_limit_and_credit() {
        let b = BudgetWord::new(100);
        b.try_charge(60, 0).unwrap();
        assert_eq!(b.try_charge(50, 0).unwrap_err().charged, 60);
        b.try_charge(50, 10).unwrap();
        assert_eq!((b.charged(), b.peak()), (110, 110));
        b.uncharge(110);
        assert_eq!(b.charged(), 0);
    }

    #[test]
    fn charge_never_overflows() {
        let b = BudgetWord::new(u64::MAX);
        b.try_charge(u64::MAX - 1, 0).unwrap();
        assert!(b.try_charge(2, 0).is_err());
        assert!(b.try_charge(2, 2).is_err(), "credit never wraps the total");
    }

    #[test]
    fn allowance_hands_out_each_byte_once() {
        let a = Allowance::new(10);
        assert_eq!(a.take(11), Err(10));
        a.take(4).unwrap();
        a.add(1);
        assert_eq!(a.shrink(3), 3);
        assert_eq!(a.close(), 4);
        assert_eq!((a.close(), a.left()), (0, 0));
    }
}
