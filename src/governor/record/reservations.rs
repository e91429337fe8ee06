//! The live reservations of a context, as its record lists them for
//! snapshots and refusals. What a reservation does (its charges, its
//! allocations) is `reservation.rs`'s.

use crate::governor::snapshot::ReservationUsage;
use crate::sync::{lock, Allowance};
use crate::Tier;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What the context's record sees of one reservation: its label and the
/// bytes it has left.
pub(crate) struct Reserved {
    pub label: Box<str>,
    pub tier: Tier,
    /// Bytes reserved and not yet allocated: charged to the budgets.
    pub left: Allowance,
}

/// The live reservations of one context, keyed by the order they were made.
#[derive(Default)]
pub(crate) struct Reservations(Mutex<RegistryInner>);

#[derive(Default)]
struct RegistryInner {
    next: u64,
    live: HashMap<u64, Arc<Reserved>>,
}

impl Reservations {
    pub(crate) fn insert(&self, reserved: Arc<Reserved>) -> u64 {
        let mut inner = lock(&self.0);
        let key = inner.next;
        inner.next += 1;
        inner.live.insert(key, reserved);
        key
    }

    pub(crate) fn remove(&self, key: u64) {
        lock(&self.0).live.remove(&key);
    }

    /// Bytes the live reservations of `tier` have left: charged, allocated
    /// to nothing yet (what the ledger's audit counts as reserved).
    pub(crate) fn left_in(&self, tier: Tier) -> u64 {
        lock(&self.0)
            .live
            .values()
            .filter(|r| r.tier == tier)
            .map(|r| r.left.left())
            .sum()
    }

    /// The live reservations with bytes left, largest first (ties by
    /// label).
    pub(crate) fn usage(&self) -> Vec<ReservationUsage> {
        let mut list: Vec<ReservationUsage> = lock(&self.0)
            .live
            .values()
            .map(|r| ReservationUsage {
                label: r.label.to_string(),
                tier: r.tier,
                left: r.left.left(),
            })
            .filter(|r| r.left > 0)
            .collect();
        list.sort_by(|a, b| b.left.cmp(&a.left).then_with(|| a.label.cmp(&b.label)));
        list
    }
}
