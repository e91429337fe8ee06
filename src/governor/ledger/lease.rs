//! Budget leases: each shard of streams holds a chunk of the context's budget
//! and charges allocations out of it, so that the allocate → release → settle
//! cycle of one stream writes its own lease line, not the budget's. The
//! protocol (refill, reclaim before refusal, close) is `sync::Leases`, shared
//! with the pin leases of `record/mod.rs`; this module holds what is the
//! budget's own: what a snapshot reports as charged.
//!
//! # Invariants
//!
//! * The budget's `charged` counts every allocation's bytes plus every byte
//!   leased and idle. What the context reports as charged (snapshots,
//!   refusals) is `charged - idle`: bytes charged to allocations.
//! * The protocol's own invariants (refill before lease, refusals exact
//!   after every idle lease was taken back, at most two chunks kept, closed
//!   for good at teardown) are written where they are enforced: `sync::Leases`
//!   and `sync::LeaseSlots`. For the budget they mean: a lease never causes
//!   a refusal the budget without leases would not make; an allocation is
//!   refused only if the bytes charged to allocations leave no room for it;
//!   no byte stays leased after teardown, even from a release the backend
//!   settles late.
//! * Leases are off (`chunk == 0`) for a context on a
//!   [`SharedBudget`](crate::SharedBudget): a refusal there would have to reclaim the
//!   leases of every context on the device.
//!
//! # How far a snapshot lags
//!
//! `charged` sums the slots and the budget in separate reads: a refill or a
//! settlement running at the same moment may be half-seen, so the figure is
//! off by at most one chunk per shard refilling or settling at that instant,
//! and exact when the context is quiet. No peak is taken here: the budget's
//! own peak counts idle leases (a snapshot reports it as what the budget
//! held), and the peak of live bytes is kept exactly by the statistics
//! (`stats.rs`), which see every allocation, leased or not.

use super::budget::{BudgetWord, Refusal};
use crate::governor::shards::SHARDS;
use crate::sync::Leases;

/// The budget leases of one context: the shared lease protocol
/// (`sync::Leases`) over the context's [`BudgetWord`].
#[derive(Debug)]
pub(crate) struct BudgetLeases {
    slots: Leases<SHARDS>,
}

impl BudgetLeases {
    pub(crate) fn new(chunk: u64) -> Self {
        Self {
            slots: Leases::new(chunk),
        }
    }

    /// Whether allocations charge through leases.
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.slots.enabled()
    }

    /// Charge an allocation of `bytes` on `shard`: out of its lease, else by
    /// a refill, else by reclaiming every idle lease and asking the budget
    /// again. The refusal reports the bytes charged to allocations.
    #[inline]
    pub(crate) fn charge(
        &self,
        budget: &BudgetWord,
        shard: usize,
        bytes: u64,
        credit: u64,
    ) -> Result<(), Refusal> {
        if self.slots.take_leased(budget, shard, bytes) {
            return Ok(());
        }
        match self.slots.take_from_pool(budget, shard, bytes, credit) {
            Ok(()) => Ok(()),
            Err(r) => Err(Refusal {
                charged: self.charged(budget).min(r.charged),
                limit: r.limit,
            }),
        }
    }

    /// Take back every idle lease and uncharge it from `budget`; returns the
    /// bytes taken.
    pub(crate) fn reclaim(&self, budget: &BudgetWord) -> u64 {
        self.slots.reclaim(budget)
    }

    /// A release of `bytes` on `shard` settled: keep up to two chunks leased,
    /// uncharge the rest from `budget`.
    #[inline]
    pub(crate) fn settled(&self, budget: &BudgetWord, shard: usize, bytes: u64) {
        self.slots.give(budget, shard, bytes);
    }

    /// Teardown: close the leases for good and uncharge what they held.
    pub(crate) fn close(&self, budget: &BudgetWord) {
        self.slots.close(budget);
    }

    /// Bytes charged to allocations (and pending, quarantined or awaiting
    /// teardown): the budget's charge less the idle leases.
    pub(crate) fn charged(&self, budget: &BudgetWord) -> u64 {
        budget.charged().saturating_sub(self.slots.idle())
    }
}
