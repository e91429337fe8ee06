//! Budget leases: each shard of streams holds a chunk of the context's budget
//! and charges allocations out of it, so that the allocate → release → settle
//! cycle of one stream writes its own lease line, not the budget's.
//!
//! # Invariants
//!
//! * The budget's `charged` counts every allocation's bytes plus every byte
//!   leased and idle. What the context reports as charged (snapshots,
//!   refusals) is `charged - idle`: bytes charged to allocations.
//! * A lease is refilled only by charging the budget first, `bytes + chunk`
//!   when that fits and `bytes` alone otherwise, so a lease never causes a
//!   refusal the budget without leases would not make.
//! * A refusal is reported only after the budget refused an allocation and
//!   a sweep of every slot that came *before* that refusal found nothing
//!   leased (`Leases::reclaim_then_charge`; holders may be taking from their
//!   slots at that moment: see `LeaseSlots`). Refusals therefore stay exact:
//!   an allocation is refused only if the bytes charged to allocations leave
//!   no room for it.
//! * A settled release gives its bytes back to its shard's lease, which keeps
//!   at most two chunks; the rest goes back to the budget at once.
//! * Teardown closes the slots for good (`Leases::close`): no byte stays
//!   leased after it, even from a release the backend settles late.
//! * Leases are off (`chunk == 0`) for a context on a [`SharedBudget`]
//!   (`super::SharedBudget`): a refusal there would have to reclaim the
//!   leases of every context on the device.
//!
//! # How far a snapshot lags
//!
//! `charged` sums the slots and the budget in separate reads: a refill or a
//! settlement running at the same moment may be half-seen, so the figure is
//! off by at most one chunk per shard refilling or settling at that instant,
//! and exact when the context is quiet. `peak` is raised at every refill,
//! reclaim and snapshot: it misses a peak reached and left between two of
//! them by at most one chunk per shard.

use super::budget::{Budget, Refusal};
use super::stats::SHARDS;
use crate::sync::LeaseSlots;
use std::sync::atomic::{AtomicU64, Ordering};

/// The default lease chunk: 2 MiB, the size of the smallest large-page
/// allocation most GPU drivers make.
pub(crate) const DEFAULT_CHUNK: u64 = 2 << 20;

/// The leases of one context.
#[derive(Debug)]
pub(crate) struct Leases {
    slots: LeaseSlots<SHARDS>,
    /// Bytes a refill leases beyond the allocation; zero: leases are off.
    chunk: u64,
    /// The most bytes ever charged to allocations, as far as refills,
    /// reclaims and snapshots saw (see the module docs).
    peak: AtomicU64,
}

impl Leases {
    pub(crate) fn new(chunk: u64) -> Self {
        Self {
            slots: LeaseSlots::new(),
            chunk,
            peak: AtomicU64::new(0),
        }
    }

    /// Whether allocations charge through leases.
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.chunk > 0
    }

    /// Charge an allocation of `bytes` on `shard` out of its lease.
    #[inline]
    pub(crate) fn take(&self, shard: usize, bytes: u64) -> bool {
        self.slots.take(shard, bytes)
    }

    /// Charge `bytes` to `budget` for an allocation on `shard`, leasing a
    /// chunk more when it fits. Returns the budget's refusal otherwise.
    pub(crate) fn refill(
        &self,
        budget: &Budget,
        shard: usize,
        bytes: u64,
        credit: u64,
    ) -> Result<(), Refusal> {
        if let Some(with_chunk) = bytes.checked_add(self.chunk) {
            if self.slots.begin_refill() {
                let leased = budget.try_charge(with_chunk, credit).is_ok();
                if leased {
                    let back = self.slots.fill(shard, self.chunk);
                    if back > 0 {
                        budget.uncharge(back);
                    }
                }
                self.slots.end_refill();
                if leased {
                    self.raise_peak(budget);
                    return Ok(());
                }
            }
        }
        budget.try_charge(bytes, credit)?;
        self.raise_peak(budget);
        Ok(())
    }

    /// Take back every idle lease and uncharge it from `budget`; returns the
    /// bytes taken.
    pub(crate) fn reclaim(&self, budget: &Budget) -> u64 {
        let taken = self.slots.reclaim();
        if taken > 0 {
            budget.uncharge(taken);
        }
        taken
    }

    /// The last word on an allocation the lease and a refill could not
    /// charge: take back every idle lease and ask the budget again, until it
    /// admits the allocation, or refuses it and then no refill is in flight
    /// and a sweep finds nothing leased (see `LeaseSlots` for why that is
    /// exact). Holders keep allocating meanwhile; no refill begins and no
    /// settlement keeps its bytes until this returns, so the loop waits only
    /// for refills that began before it (a charge and a store each). The
    /// refusal reports the bytes charged to allocations.
    pub(crate) fn reclaim_then_charge(
        &self,
        budget: &Budget,
        bytes: u64,
        credit: u64,
    ) -> Result<(), Refusal> {
        self.slots.press();
        self.reclaim(budget);
        let result = loop {
            match budget.try_charge(bytes, credit) {
                Ok(()) => break Ok(()),
                Err(r) => {
                    if self.slots.refilling() {
                        // Began before `press`: a charge and a store away.
                        crate::sync::spin();
                        continue;
                    }
                    if self.reclaim(budget) == 0 {
                        // No refill in flight and nothing leased: every
                        // byte the budget counted is an allocation's.
                        break Err(Refusal {
                            charged: self.charged(budget).min(r.charged),
                            limit: r.limit,
                        });
                    }
                }
            }
        };
        self.slots.unpress();
        result
    }

    /// A release of `bytes` on `shard` settled: keep up to two chunks leased,
    /// uncharge the rest from `budget`.
    #[inline]
    pub(crate) fn settled(&self, budget: &Budget, shard: usize, bytes: u64) {
        let back = self.slots.give(shard, bytes, self.chunk.saturating_mul(2));
        if back > 0 {
            budget.uncharge(back);
        }
    }

    /// Teardown: close the leases for good and uncharge what they held.
    pub(crate) fn close(&self, budget: &Budget) {
        let taken = self.slots.close();
        if taken > 0 {
            budget.uncharge(taken);
        }
    }

    /// Bytes charged to allocations (and pending, quarantined or awaiting
    /// teardown): the budget's charge less the idle leases.
    pub(crate) fn charged(&self, budget: &Budget) -> u64 {
        budget.charged().saturating_sub(self.slots.idle())
    }

    /// Raise the recorded peak to what is charged to allocations now, and
    /// return it.
    pub(crate) fn raise_peak(&self, budget: &Budget) -> u64 {
        let now = self.charged(budget);
        self.peak.fetch_max(now, Ordering::Relaxed).max(now)
    }
}
