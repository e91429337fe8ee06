//! The books of one context, behind one type: the [`Ledger`].
//!
//! Every byte a context governs is in exactly one place at a time: being
//! allocated (charged, not yet live), live (the block cache's blocks
//! included), pending release, quarantined, awaiting teardown, reserved, or
//! recorded outside memgov. Four sets of books follow it: the charges on
//! each level of the budget tree (`charges.rs`, over `budget.rs` and the
//! leases of `lease.rs`), the per-shard statistics (`stats.rs`), the event
//! counters, and the bytes recorded outside. A step of an allocation's life
//! updates several of them, in an order that readers rely on; the ledger
//! is the one place those steps are written, one method per step, each
//! taking the one [`Entry`] that moves:
//!
//! | step of an allocation                     | method                                   |
//! | ----------------------------------------- | ---------------------------------------- |
//! | charged before the backend call            | [`charge`](Ledger::charge)               |
//! | ... and not made                          | [`uncharge`](Ledger::uncharge)           |
//! | made: live                                | [`admit`](Ledger::admit)                 |
//! | made out of a reservation                 | [`admit_reserved`](Ledger::admit_reserved) |
//! | release queued on a stream                | [`queue`](Ledger::queue)                 |
//! | ... and refused by the backend            | [`unqueue`](Ledger::unqueue)             |
//! | the free retired or was abandoned         | [`settle`](Ledger::settle)               |
//! | release refused, memory quarantined       | [`quarantine`](Ledger::quarantine)       |
//! | live memory gone with a lost device       | [`lose_live`](Ledger::lose_live)         |
//! | every live buffer reclaimed by force      | [`reclaim_live`](Ledger::reclaim_live)   |
//! | a cached block handed out as another role | [`retag`](Ledger::retag)                 |
//! | live memory sleeps / wakes                | [`suspend`](Ledger::suspend) / [`resume`](Ledger::resume) |
//! | sleep's host copies made / freed           | [`charge_sleep_copies`](Ledger::charge_sleep_copies) / [`return_sleep_copies`](Ledger::return_sleep_copies) |
//! | the backend's teardown returned           | [`return_at_teardown`](Ledger::return_at_teardown) |
//!
//! and, outside an allocation's life: [`reserve`](Ledger::reserve) /
//! [`unreserve`](Ledger::unreserve), a reclaim's [`claim`](Ledger::claim),
//! and memory [`record_outside`](Ledger::record_outside) /
//! [`return_outside`](Ledger::return_outside).
//!
//! # The identity
//!
//! For each tier of a quiet context (nothing being allocated, released or
//! settled at that moment), the books balance:
//!
//! ```text
//! charged = live + pending + quarantined + awaiting teardown
//!         + reserved + outside + sleep's host copies - off the books
//! ```
//!
//! where live includes the block cache's blocks, and "off the books" is
//! the device-tier bytes of buffers whose memory sleeps (see
//! `charges.rs`); "sleep's host copies" is the pinned host tier's
//! page-locked memory holding sleeping contents (0 on the device tier,
//! as outside is on the pinned one). [`audit`](Ledger::audit) checks it and names every term
//! when it does not hold. In debug builds teardown runs it inside
//! [`return_at_teardown`](Ledger::return_at_teardown), where the context is
//! quiet by construction (the gate is closed and drained), and the record
//! asserts it once the context is terminated; release builds leave that
//! pass over every shard out of the teardown, and run it on demand
//! (`ContextHandle::check_books`).
//!
//! # Invariants
//!
//! * Only the ledger changes the books: the charges' and statistics'
//!   changing operations are visible to this module alone; the rest of the
//!   governor reads them through [`charges`](Ledger::charges) and
//!   [`stats`](Ledger::stats).
//! * The ledger knows nothing of the backend, the lifecycle or the streams
//!   it is given words of: it is not generic, and imports nothing of the
//!   governor but its vocabulary (roles, shards, pressure requests).
//! * Each step's own order is written at the step. The one every reader
//!   relies on: a settlement gives the stream's reuse credit back first,
//!   then the charge, then the statistics, so that whoever reads "no longer
//!   pending" also sees the bytes back in the budget.

mod budget;
mod charges;
mod counters;
mod lease;
mod stats;

pub(crate) use budget::{DeviceMember, Refusal};
pub use budget::{ProcessBudget, SharedBudget};
#[cfg(target_os = "linux")]
pub(crate) use charges::MachineRefused;
pub(crate) use charges::{
    record_outside_at, return_outside_at, Above, Charges, RefusedAt, ReturnedAtTeardown,
};
pub(crate) use counters::{Counters, Note};
pub(crate) use stats::{Amount, Stats};

use crate::governor::role::Role;
use crate::Tier;
use charges::Left;
use memgov_backend::RetireOutcome;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// The bytes that move in one step: how many, of which role and tier, and
/// the shard of streams whose statistics count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub bytes: u64,
    pub role: Role,
    pub tier: Tier,
    pub shard: usize,
}

impl Entry {
    /// `bytes` of `role` in `tier`, counted in `shard`.
    #[inline(always)]
    pub(crate) fn new(bytes: u64, role: Role, tier: Tier, shard: usize) -> Self {
        Self {
            bytes,
            role,
            tier,
            shard,
        }
    }
}

/// What [`Ledger::queue`] did, for [`Ledger::unqueue`] to undo and
/// [`Ledger::settle`] to finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub(crate) struct Queued {
    /// The part of the bytes whose memory slept: pending in the statistics,
    /// on no level of the budget tree.
    pub asleep: u64,
    /// Whether the stream's reuse credit was raised by the bytes.
    pub credited: bool,
}

/// The books of a context that do not balance (see the module docs): every
/// term of the identity, for the tier that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the {tier} books of context {context} do not balance: {charged} B charged, but live \
     {live} + pending {pending} + quarantined {quarantined} + awaiting teardown \
     {awaiting_teardown} + reserved {reserved} + outside {outside} + sleep's host copies \
     {sleep_copies} - off the books {off_books} = {accounted} B; audit a quiet context (nothing being allocated, released \
     or settled), and if it was quiet, report this as a memgov bug"
)]
pub struct Imbalance {
    /// The context, as errors name it.
    pub context: String,
    /// The tier whose books failed.
    pub tier: Tier,
    /// Bytes charged to the tier's budget (leased and idle bytes excluded).
    pub charged: u64,
    /// Live bytes, cached blocks included.
    pub live: u64,
    /// Bytes of releases queued and not settled.
    pub pending: u64,
    /// Bytes of quarantined releases.
    pub quarantined: u64,
    /// Bytes whose free never ran, held until teardown.
    pub awaiting_teardown: u64,
    /// Reserved bytes no allocation took yet.
    pub reserved: u64,
    /// Bytes recorded as allocated outside memgov (device tier only).
    pub outside: u64,
    /// Page-locked host memory holding the contents of sleeping device
    /// memory (pinned host tier only).
    pub sleep_copies: u64,
    /// Bytes of live, pending or quarantined buffers whose memory slept:
    /// on no level (device tier only).
    pub off_books: u64,
    /// The right-hand side: what the parts add up to.
    pub accounted: u64,
}

impl Imbalance {
    /// The same imbalance, naming `context`.
    pub(crate) fn of(mut self, context: String) -> Self {
        self.context = context;
        self
    }
}

/// The books of one context (see the module docs).
pub(crate) struct Ledger {
    charges: Charges,
    stats: Stats,
    counters: Counters,
    /// The sum of the live outside records.
    outside: AtomicU64,
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("charged", &self.charges.charged())
            .field("outside", &self.outside_bytes())
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// Empty books over `charges`, with statistics that total live bytes
    /// context-wide when `exact_peak`.
    pub(crate) fn new(charges: Charges, exact_peak: bool) -> Self {
        Self {
            charges,
            stats: Stats::new(exact_peak),
            counters: Counters::default(),
            outside: AtomicU64::new(0),
        }
    }

    /// The charges, to read (limits, amounts, the levels above).
    #[inline]
    pub(crate) fn charges(&self) -> &Charges {
        &self.charges
    }

    /// The statistics, to read.
    #[inline]
    pub(crate) fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The event counters, to read.
    #[inline]
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Count an event that moves no bytes (a refusal, a wait, a call to the
    /// responders, a backend error).
    #[inline]
    pub(crate) fn note(&self, note: Note) {
        self.counters.note(note);
    }

    // --- An allocation, step by step. ---

    /// Charge `e` for an allocation about to be made, to its tier's budget
    /// (and, for the device tier, to every level above): all or none.
    /// `credit` is the stream's reuse credit (device tier only).
    #[inline(always)]
    pub(crate) fn charge(&self, e: Entry, credit: u64) -> Result<(), RefusedAt> {
        match e.tier {
            Tier::Device => self.charges.charge(e.shard, e.bytes, credit),
            tier => self
                .charges
                .charge_in(tier, e.shard, e.role, e.bytes, credit),
        }
    }

    /// The allocation [`charge`](Self::charge)d for was not made.
    #[inline(always)]
    pub(crate) fn uncharge(&self, e: Entry) {
        match e.tier {
            Tier::Device => self.charges.uncharge(e.bytes),
            tier => self.charges.uncharge_in(tier, e.role, e.bytes),
        }
    }

    /// The allocation [`charge`](Self::charge)d for was made: live.
    #[inline(always)]
    pub(crate) fn admit(&self, e: Entry) {
        self.stats.admit(e.shard, e.role, e.bytes);
    }

    /// An allocation was made out of reserved bytes
    /// ([`reserve`](Self::reserve)): live, no longer reserved. (The bytes a
    /// reservation has left are its own books: the ledger reads them only
    /// to audit, so that this path takes no atomic of its own.)
    #[inline(always)]
    pub(crate) fn admit_reserved(&self, e: Entry) {
        self.stats.admit(e.shard, e.role, e.bytes);
        self.charges.reserved_taken_in(e.tier, e.role, e.bytes);
    }

    /// A live buffer's release was queued on a stream of `to_shard` (its
    /// own, or another one: it moves there as if allocated there). `credit`
    /// is that stream's reuse credit, raised when the free gives device
    /// memory back (not a pinned buffer's, nor a sleeping one's).
    ///
    /// Statistics first, then the credit, then the levels' pending bytes.
    #[inline(always)]
    pub(crate) fn queue(&self, e: Entry, to_shard: usize, credit: Option<&AtomicU64>) -> Queued {
        self.stats.transfer(e.shard, to_shard, e.role, e.bytes);
        self.stats.queue(to_shard, e.role, e.bytes);
        // What of the buffer slept is on no level: only the rest is pending
        // there (see `charges.rs`).
        let asleep = self.leave_live(e, Left::Queued);
        let credited = match credit {
            Some(c) if asleep == 0 && e.tier == Tier::Device => {
                c.fetch_add(e.bytes, Ordering::Relaxed);
                true
            }
            _ => false,
        };
        self.charges.queued_in(e.tier, e.role, e.bytes - asleep);
        Queued { asleep, credited }
    }

    /// The backend refused the free [`queue`](Self::queue) (`q`) was for:
    /// the buffer is live in `e.shard` again, the release never happened.
    pub(crate) fn unqueue(&self, e: Entry, to_shard: usize, q: Queued, credit: Option<&AtomicU64>) {
        self.stats.unqueue(e.shard, to_shard, e.role, e.bytes);
        if let Some(c) = credit.filter(|_| q.credited) {
            c.fetch_sub(e.bytes, Ordering::Relaxed);
        }
        self.charges.unqueued_in(e.tier, e.role, e.bytes - q.asleep);
        self.charges.rejoin_live(e.role, q.asleep);
    }

    /// A release queued on a stream of `e.shard` settled with `outcome`:
    /// retired (the device has the bytes back) or abandoned (the free never
    /// ran: charged until teardown). `credit` is the reuse credit
    /// [`queue`](Self::queue) raised, if it did. A settlement after the
    /// context terminated (a backend bug) is counted by the caller, which
    /// knows the phase, with [`Note::LateSettlement`].
    ///
    /// Credit, charge, statistics: in that order (see the module docs);
    /// the levels above are woken last.
    #[inline(always)]
    pub(crate) fn settle(&self, e: Entry, outcome: RetireOutcome, credit: Option<&AtomicU64>) {
        if let Some(c) = credit {
            c.fetch_sub(e.bytes, Ordering::Relaxed);
        }
        match outcome {
            RetireOutcome::Retired => self
                .charges
                .uncharge_settled_in(e.tier, e.shard, e.role, e.bytes),
            RetireOutcome::Abandoned => {
                self.counters.abandoned.fetch_add(1, Ordering::Release);
                self.charges.abandoned_in(e.tier, e.role, e.bytes);
            }
        }
        self.stats.settle(e.shard, e.role, e.bytes);
        self.charges.announce_settled();
    }

    /// A live buffer leaves live, `to` where its bytes go: returns the part
    /// of them that slept (only device-tier memory sleeps), which the caller
    /// moves on no level.
    #[inline(always)]
    fn leave_live(&self, e: Entry, to: Left) -> u64 {
        match e.tier {
            Tier::Device => self.charges.leave_live(e.role, e.bytes, to),
            _ => 0,
        }
    }

    /// A live buffer's release was refused and its memory quarantined:
    /// charged until teardown returns it. Returns the part of it that
    /// slept, which teardown returns to no level.
    pub(crate) fn quarantine(&self, e: Entry) -> u64 {
        self.stats.leave(e.shard, e.role, e.bytes);
        self.stats.quarantine(e.role, e.bytes);
        // What of it slept is on no level: only the rest is quarantined there.
        let asleep = self.leave_live(e, Left::Quarantined);
        self.charges
            .quarantined_in(e.tier, e.role, e.bytes - asleep);
        self.counters.note(Note::Quarantined);
        asleep
    }

    /// A live buffer went with its lost device: the device does not get the
    /// memory back before the context is destroyed, so it is charged until
    /// teardown (what of it slept is on no level).
    pub(crate) fn lose_live(&self, e: Entry) {
        self.stats.leave(e.shard, e.role, e.bytes);
        let asleep = self.leave_live(e, Left::Gone);
        self.charges
            .hold_live_until_teardown_in(e.tier, e.role, e.bytes - asleep);
        self.counters.note(Note::SettledLost);
    }

    /// `force` reclaimed every live buffer (precondition: the gate is
    /// closed and drained, so the live totals are stable): they are charged
    /// until teardown frees their memory, each tier on its own budget, and
    /// nothing sleeps any more. Returns what left.
    pub(crate) fn reclaim_live(&self) -> Amount {
        let reclaimed = self.stats.reclaim_live();
        self.counters
            .reclaimed
            .fetch_add(reclaimed.count, Ordering::Relaxed);
        let other_tiers = self.charges.reclaim_tiers_live();
        // Bytes that slept are on no level: held without them.
        let asleep = self.charges.reclaim_suspended();
        self.charges.hold_until_teardown(
            reclaimed
                .bytes
                .saturating_sub(other_tiers)
                .saturating_sub(asleep),
        );
        reclaimed
    }

    /// A block cached as `from` (live in the books) is handed out as
    /// `e.role`: the statistics and whatever of it sleeps follow it.
    pub(crate) fn retag(&self, e: Entry, from: Role) {
        self.stats.leave(e.shard, from, e.bytes);
        self.stats.admit(e.shard, e.role, e.bytes);
        self.charges.retag_suspended(from, e.role, e.bytes);
    }

    /// Teardown's accounting, once the backend's teardown has returned
    /// (the device has every byte back): every quarantined entry (its bytes
    /// and the part of them that slept) leaves the statistics, and every
    /// charge an executed free did not return goes back (see
    /// [`Charges::return_at_teardown`]).
    ///
    /// In debug builds the books are audited first, while the context is
    /// quiet and before anything moves: the result is returned for the
    /// record to assert once the context is terminated (a panic here would
    /// leave the teardown's waiters waiting). Release builds skip the
    /// audit, which would add a pass over every shard to each teardown;
    /// [`ContextHandle::check_books`](crate::ContextHandle::check_books)
    /// runs it on demand there.
    /// `reserved` says what the live reservations have left in a tier (see
    /// [`audit`](Self::audit)).
    pub(crate) fn return_at_teardown(
        &self,
        quarantined: impl Iterator<Item = (Entry, u64)>,
        reserved: impl Fn(Tier) -> u64,
    ) -> (ReturnedAtTeardown, Result<(), Imbalance>) {
        let audit = if cfg!(debug_assertions) {
            self.audit(reserved)
        } else {
            Ok(())
        };
        let (mut device, mut pinned, mut asleep) = (0u64, 0u64, 0u64);
        for (e, slept) in quarantined {
            self.stats.unquarantine(e.role, e.bytes);
            match e.tier {
                Tier::Device => device += e.bytes - slept,
                _ => pinned += e.bytes,
            }
            asleep += slept;
        }
        (
            self.charges.return_at_teardown(device, pinned, asleep),
            audit,
        )
    }

    /// Device-tier bytes the context's teardown will give back to the levels
    /// above: pending, awaiting teardown, quarantined and suspended, less
    /// what of them is on no level. Pending first, then awaiting teardown:
    /// an abandoned release adds its bytes to the latter before it leaves
    /// the former, so it is counted in one or both.
    pub(crate) fn returned_by_teardown(&self) -> u64 {
        // The shared budget holds device bytes only: other tiers' pending
        // and quarantined bytes return nothing to it.
        let other = self
            .charges
            .tier_amounts(Tier::PinnedHost)
            .unwrap_or_default();
        self.stats
            .usage_all()
            .pending
            .bytes
            .saturating_sub(other.pending)
            .saturating_add(self.charges.awaiting_teardown())
            .saturating_add(
                self.stats
                    .quarantined_bytes()
                    .saturating_sub(other.quarantined),
            )
            // Bytes released or quarantined asleep are on no level: their
            // return gives nothing back.
            .saturating_sub(self.charges.off_books())
            .saturating_add(self.charges.suspended_bytes())
    }

    // --- Sleep and wake (see `suspend.rs`). ---

    /// `bytes` of live device-tier buffers of `role` lost their memory to a
    /// sleep: off every level.
    pub(crate) fn suspend(&self, role: Role, bytes: u64) {
        self.charges.suspend(role, bytes);
    }

    /// A wake admitted `admitted` bytes for the suspended bytes of `role`;
    /// returns those no longer suspended.
    pub(crate) fn resume(&self, role: Role, admitted: u64) -> u64 {
        self.charges.resumed(role, admitted)
    }

    /// Charge `bytes` of the pinned host tier for the page-locked host
    /// copies a sleep is about to make of device memory.
    pub(crate) fn charge_sleep_copies(&self, bytes: u64) -> Result<(), RefusedAt> {
        self.charges.charge_sleep_copies(bytes)
    }

    /// Host copies of sleeping memory freed: up to `bytes` of their charge
    /// back to the pinned host tier; returns the bytes given back.
    pub(crate) fn return_sleep_copies(&self, bytes: u64) -> u64 {
        self.charges.return_sleep_copies(bytes)
    }

    // --- Outside an allocation's life. ---

    /// Reserve `bytes` of `tier` ahead of need.
    pub(crate) fn reserve(&self, tier: Tier, bytes: u64) -> Result<(), RefusedAt> {
        self.charges.reserve_in(tier, bytes)
    }

    /// Reserved bytes of `tier` no allocation took, given back.
    pub(crate) fn unreserve(&self, tier: Tier, bytes: u64) {
        self.charges.unreserve_in(tier, bytes);
    }

    /// Claim `bytes` for an allocation about to ask responders on a level
    /// above (see [`Charges::claim`]).
    pub(crate) fn claim(&self, bytes: u64) {
        self.charges.claim(bytes);
    }

    /// Whether every level is within its limit, so that a claim holds only
    /// admissible bytes.
    pub(crate) fn claim_fits(&self) -> bool {
        self.charges.claim_fits()
    }

    /// A claim (or any device charge being made) given back: every level
    /// has the bytes again, and the admissions waiting above are woken.
    pub(crate) fn give_back(&self, bytes: u64) {
        self.charges.uncharge(bytes);
        self.charges.announce_returned();
    }

    /// Memory a runtime allocated outside memgov: charged to every level
    /// whatever the limits, until [`return_outside`](Self::return_outside).
    pub(crate) fn record_outside(&self, bytes: u64) {
        self.outside.fetch_add(bytes, Ordering::Relaxed);
        self.charges.record_outside(bytes);
    }

    /// The runtime freed memory [`record_outside`](Self::record_outside)
    /// charged.
    pub(crate) fn return_outside(&self, bytes: u64) {
        self.outside.fetch_sub(bytes, Ordering::Relaxed);
        self.charges.return_outside(bytes);
    }

    /// Bytes recorded outside memgov now.
    pub(crate) fn outside_bytes(&self) -> u64 {
        self.outside.load(Ordering::Relaxed)
    }

    // --- The identity. ---

    /// Check the identity of the module docs for every tier. Exact only on a
    /// quiet context: a step running meanwhile may be half-seen. The error's
    /// `context` is left empty for the caller, which knows the name, to
    /// fill in ([`Imbalance::of`]).
    ///
    /// `reserved` says how many bytes the context's live reservations have
    /// left in a tier: charged to its budget and allocated to nothing yet.
    /// The reservations keep that figure themselves; the ledger reads it here
    /// rather than counting it on every allocation out of a reservation.
    pub(crate) fn audit(&self, reserved: impl Fn(Tier) -> u64) -> Result<(), Imbalance> {
        let pinned = self
            .charges
            .tier_amounts(Tier::PinnedHost)
            .unwrap_or_default();
        let all = self.stats.usage_all();
        let quarantined = self.stats.quarantined_bytes();
        let device = Imbalance {
            context: String::new(),
            tier: Tier::Device,
            charged: self.charges.charged(),
            live: all.live.bytes.saturating_sub(pinned.live),
            pending: all.pending.bytes.saturating_sub(pinned.pending),
            quarantined: quarantined.saturating_sub(pinned.quarantined),
            awaiting_teardown: self.charges.awaiting_teardown(),
            reserved: reserved(Tier::Device),
            outside: self.outside_bytes(),
            sleep_copies: 0,
            off_books: self.charges.off_books(),
            accounted: 0,
        };
        let pinned = Imbalance {
            context: String::new(),
            tier: Tier::PinnedHost,
            charged: pinned.charged,
            live: pinned.live,
            pending: pinned.pending,
            quarantined: pinned.quarantined,
            awaiting_teardown: pinned.awaiting_teardown,
            reserved: reserved(Tier::PinnedHost),
            outside: 0,
            sleep_copies: pinned.sleep_copies,
            off_books: 0,
            accounted: 0,
        };
        for mut books in [device, pinned] {
            books.accounted = (books.live as i128
                + books.pending as i128
                + books.quarantined as i128
                + books.awaiting_teardown as i128
                + books.reserved as i128
                + books.outside as i128
                + books.sleep_copies as i128
                - books.off_books as i128)
                .clamp(0, u64::MAX as i128) as u64;
            if books.accounted != books.charged {
                return Err(books);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger() -> Ledger {
        Ledger::new(Charges::new(1 << 20, 0, None, 1 << 20), false)
    }

    fn e(bytes: u64) -> Entry {
        Entry::new(bytes, Role::Weights, Tier::Device, 0)
    }

    #[test]
    fn sleep_copies_are_charged_to_the_pinned_tier_and_returned() {
        let l = ledger();
        let pinned = || l.charges.tier_amounts(Tier::PinnedHost).unwrap();
        // The tier holds 1 MiB: 2 MiB of copies are refused, nothing charged.
        let refused = l.charge_sleep_copies(2 << 20);
        assert!(
            matches!(refused, Err(RefusedAt::Tier(Tier::PinnedHost, r)) if r.limit == 1 << 20),
            "{refused:?}"
        );
        assert_eq!((pinned().charged, pinned().sleep_copies), (0, 0));
        l.charge_sleep_copies(768 << 10).unwrap();
        assert_eq!(
            (pinned().charged, pinned().sleep_copies),
            (768 << 10, 768 << 10)
        );
        assert_eq!(l.audit(|_| 0), Ok(()));
        // A wake frees half; more than was charged gives back only that.
        assert_eq!(l.return_sleep_copies(384 << 10), 384 << 10);
        assert_eq!(l.return_sleep_copies(1 << 20), 384 << 10);
        assert_eq!((pinned().charged, pinned().sleep_copies), (0, 0));
        assert_eq!(l.audit(|_| 0), Ok(()));
        // Teardown returns what a sleep still held.
        l.charge_sleep_copies(512 << 10).unwrap();
        let (_, audit) = l.return_at_teardown(std::iter::empty(), |_| 0);
        audit.unwrap();
        assert_eq!((pinned().charged, pinned().sleep_copies), (0, 0));
    }

    #[test]
    fn every_step_keeps_the_books_balanced() {
        let l = ledger();
        let credit = AtomicU64::new(0);
        l.charge(e(100), 0).unwrap();
        l.admit(e(100));
        l.audit(|_| 0).unwrap();
        let q = l.queue(e(100), 1, Some(&credit));
        assert!(q.credited);
        l.audit(|_| 0).unwrap();
        let settled = Entry { shard: 1, ..e(100) };
        l.settle(settled, RetireOutcome::Retired, Some(&credit));
        assert_eq!(credit.load(Ordering::Relaxed), 0);
        l.audit(|_| 0).unwrap();
        l.reserve(Tier::PinnedHost, 64).unwrap();
        l.admit_reserved(Entry::new(32, Role::Other, Tier::PinnedHost, 0));
        let left = |t: Tier| if t == Tier::PinnedHost { 32 } else { 0 };
        l.audit(left).unwrap();
        // The reservation's bytes are charged: left out, the books are short.
        assert_eq!(l.audit(|_| 0).unwrap_err().tier, Tier::PinnedHost);
        l.record_outside(7);
        l.audit(left).unwrap();
        l.return_outside(7);
        l.charge(e(10), 0).unwrap();
        l.admit(e(10));
        let slept = l.quarantine(e(10));
        assert_eq!(slept, 0);
        l.audit(left).unwrap();
    }

    #[test]
    fn a_step_that_skips_a_book_fails_the_audit() {
        let l = ledger();
        l.charge(e(100), 0).unwrap();
        // Live in the statistics, never charged: the audit names both.
        l.admit(e(100));
        l.admit(e(5));
        let err = l.audit(|_| 0).unwrap_err();
        assert_eq!((err.tier, err.charged, err.live), (Tier::Device, 100, 105));
        let err = err.of("ctx".into());
        assert!(err.to_string().contains("context ctx"), "{err}");
        assert!(err.to_string().contains("100 B charged"), "{err}");
    }
}
