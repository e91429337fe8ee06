//! What a context has charged: its own budget, the budget leases of its
//! shards, the device's [`SharedBudget`] it is charged to and the
//! [`ProcessBudget`] above that (the levels of the
//! budget tree), and the bytes held until teardown. Every change to any of them is one named operation
//! here, one per step of an allocation's bytes:
//!
//! | step                                   | operation                                  |
//! | -------------------------------------- | ------------------------------------------ |
//! | allocation being made                  | [`charge`](Charges::charge)                |
//! | bytes reserved / reservation given back | [`reserve`](Charges::reserve) / [`unreserve`](Charges::unreserve) |
//! | ... in a tier / reserved bytes allocated | [`reserve_in`](Charges::reserve_in) / [`unreserve_in`](Charges::unreserve_in) / [`reserved_taken_in`](Charges::reserved_taken_in) |
//! | ... and not made                       | [`uncharge`](Charges::uncharge)            |
//! | release queued / its free refused      | [`queued`](Charges::queued) / [`unqueued`](Charges::unqueued) |
//! | the free executed and settled          | [`uncharge_settled`](Charges::uncharge_settled) |
//! | the free never ran (abandoned)         | [`abandoned`](Charges::abandoned)          |
//! | live memory that only teardown frees   | [`hold_until_teardown`](Charges::hold_until_teardown) |
//! | release refused, memory quarantined    | [`quarantined`](Charges::quarantined)      |
//! | teardown returned the memory           | [`return_at_teardown`](Charges::return_at_teardown) |
//! | bytes claimed while reclaiming         | [`claim`](Charges::claim) (given back with `uncharge`) |
//! | live bytes whose memory sleeps / wakes | [`suspend`](Charges::suspend) / [`resumed`](Charges::resumed) (after an admission charged them) |
//! | a live buffer leaves live (any way)    | [`leave_live`](Charges::leave_live) first: what of it slept goes on no level |
//! | memory allocated outside memgov        | [`record_outside`](Charges::record_outside) / [`return_outside`](Charges::return_outside), [`record_outside_at`] / [`return_outside_at`] on a level alone |
//!
//! # Tiers
//!
//! Everything above is the device tier. Pinned host memory
//! ([`Tier::PinnedHost`]) has a budget of its own ([`TierCharges`]), and its
//! bytes are never on the context's device budget, its leases or the shared
//! budget: a device's shared budget governs device memory, which pinned
//! host memory does not take. Each step above has its tier form (`*_in`),
//! which is the device operation for [`Tier::Device`] and moves the tier's
//! own amounts (live, pending, quarantined, awaiting teardown) otherwise, so
//! that its budget's charge is always their sum.
//!
//! # Invariants
//!
//! * A charge is on every level of the tree from the context up (context,
//!   shared, process) or on none: [`charge`](Charges::charge) takes them in
//!   that order and gives back those it took when one refuses, and every
//!   operation that gives bytes back gives them to every level. So no level
//!   holds less than the sum of the levels below it.
//! * Each level's `pending`, `quarantined`, `awaiting_teardown` and
//!   `outside` totals move with the steps above, so that an admission
//!   refused there can tell what is on its way back and what is not
//!   memgov's.
//! * Outside records are charged whatever the limit (the memory exists
//!   already) and may take a level over it: allocations are then refused
//!   there until enough comes back. So may a reclaim's claim, for as long
//!   as the allocation holding it asks responders: it is kept only once
//!   every level is back within its limit. Nothing else ever takes a level
//!   over its limit.
//! * A context with no shared budget pays for no level above its own: the
//!   tree costs its charges nothing.
//! * Bytes come off when an executed free settles, or at teardown for
//!   every byte whose free never ran (quarantined, abandoned, reclaimed,
//!   released on a lost device), in the one step every teardown path runs.
//!   Bytes held after that step (a release the backend settles late, a
//!   backend bug) are returned at once: see
//!   [`hold_until_teardown`](Charges::hold_until_teardown).
//! * Suspended bytes (see `suspend.rs`) are device-tier bytes of live
//!   buffers whose memory the backend released while the buffers stay
//!   live: they are on no level. A suspended buffer that leaves live takes
//!   its bytes out of `suspended` as it goes ([`leave_live`](Charges::leave_live):
//!   released, quarantined, lost, reclaimed by force), so that
//!   `suspended <= live` role by role, and carries only the rest onward:
//!   a release queued asleep is pending with its bytes counted
//!   `released_asleep` (taken out again when a release of its role settles
//!   or is abandoned: [`uncharge_settled`](Charges::uncharge_settled),
//!   [`abandoned`](Charges::abandoned)), a quarantined one
//!   `quarantined_asleep` (taken out by teardown), a lost or reclaimed one
//!   nowhere (it is held until teardown without them). No byte is given
//!   back twice and none is left charged: for the device tier of a quiet
//!   context, charged = live + pending + quarantined + awaiting teardown +
//!   reserved + outside + cached - [`off_books`](Charges::off_books)
//!   (suspended + released asleep + quarantined asleep). Teardown ends with
//!   nothing suspended, and, unless the device is lost (a release may never
//!   settle), nothing released or quarantined asleep (asserted in debug
//!   builds).
//! * Leases are off for a context on a shared budget (a refusal there would
//!   have to reclaim the leases of every context on the device), so a
//!   leased byte is only ever on the context's own budget.
//!
//! Imports nothing from its neighbours but the budgets it keeps and the
//! roles it counts suspended bytes by.

use super::budget::{BudgetWord, Level, LevelAmounts, ProcessBudget, Refusal, SharedBudget};
use crate::governor::role::Role;
#[cfg(target_os = "linux")]
pub(crate) use crate::machine::MachineMember as Machine;
#[cfg(target_os = "linux")]
pub(crate) type MachineRefused = Box<crate::machine::MachineRefusal>;
use super::lease::BudgetLeases;
use crate::Tier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Which budget refused a charge, and what it saw.
#[derive(Debug)]
pub(crate) enum RefusedAt {
    /// The context's own budget.
    Context(Refusal),
    /// The shared budget, by label.
    Shared(String, Refusal),
    /// The budget of a tier other than the device's.
    Tier(Tier, Refusal),
    /// The process budget above the shared one, by label.
    Process(String, Refusal),
    /// The machine ledger above the process budget.
    #[cfg(target_os = "linux")]
    Machine(MachineRefused),
}

/// A level of the tree above the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Above {
    /// The device's shared budget.
    Shared,
    /// The process budget above it.
    Process,
}

/// What teardown returned to the budgets.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReturnedAtTeardown {
    pub quarantined: u64,
    pub awaiting_teardown: u64,
}

/// Where a live buffer's bytes go when it leaves live
/// ([`Charges::leave_live`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Left {
    /// Into a pending release.
    Queued,
    /// Into quarantine.
    Quarantined,
    /// Nowhere the books follow (lost with the device, reclaimed by force,
    /// handed out under another role).
    Gone,
}

/// Take up to `bytes` out of `word`; returns how many were there. One load
/// when it holds nothing (the hot paths while nothing sleeps).
#[inline(always)]
fn take_some(word: &AtomicU64, bytes: u64) -> u64 {
    if word.load(Ordering::Acquire) == 0 {
        return 0;
    }
    take_some_slow(word, bytes)
}

#[cold]
#[inline(never)]
fn take_some_slow(word: &AtomicU64, bytes: u64) -> u64 {
    let mut now = word.load(Ordering::Acquire);
    loop {
        let take = now.min(bytes);
        if take == 0 {
            return 0;
        }
        match word.compare_exchange_weak(now, now - take, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return take,
            Err(seen) => now = seen,
        }
    }
}

/// A tier's amounts, as snapshots and refusals report them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TierAmounts {
    pub limit: u64,
    pub charged: u64,
    pub live: u64,
    pub pending: u64,
    pub quarantined: u64,
    pub awaiting_teardown: u64,
    /// Page-locked host memory holding the contents of sleeping device
    /// memory (see [`Charges::charge_sleep_copies`]).
    pub sleep_copies: u64,
    pub peak: u64,
}

/// The charges of a tier other than the device's (see the module docs): a
/// budget of its own, no leases, no shared budget, and the amounts in each
/// step. The budget's charge is live + pending + quarantined + awaiting
/// teardown, plus an allocation being made.
pub(crate) struct TierCharges {
    budget: BudgetWord,
    live: AtomicU64,
    /// `live` by role: what a sleep of some roles leaves on the device tier.
    live_by_role: [AtomicU64; 5],
    pending: AtomicU64,
    quarantined: AtomicU64,
    awaiting_teardown: AtomicU64,
    /// Page-locked host copies of sleeping device memory: charged to the
    /// budget, no buffer's.
    sleep_copies: AtomicU64,
}

impl TierCharges {
    fn new(limit: u64) -> Self {
        Self {
            budget: BudgetWord::new(limit),
            live: AtomicU64::new(0),
            live_by_role: Default::default(),
            pending: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            awaiting_teardown: AtomicU64::new(0),
            sleep_copies: AtomicU64::new(0),
        }
    }

    /// Move `bytes` from one amount to another (`None`: the budget).
    fn shift(&self, from: Option<&AtomicU64>, to: Option<&AtomicU64>, bytes: u64) {
        // Into the new amount first: a reader never sees the bytes nowhere.
        if let Some(to) = to {
            to.fetch_add(bytes, Ordering::AcqRel);
        }
        if let Some(from) = from {
            from.fetch_sub(bytes, Ordering::AcqRel);
        }
    }

    /// `role`'s live bytes rise or fall with `live` (called beside each
    /// shift into or out of `live`).
    #[inline]
    fn live_role(&self, role: Role, up: bool, bytes: u64) {
        let r = &self.live_by_role[role.index()];
        if up {
            r.fetch_add(bytes, Ordering::AcqRel);
        } else {
            r.fetch_sub(bytes, Ordering::AcqRel);
        }
    }

    fn amounts(&self) -> TierAmounts {
        TierAmounts {
            limit: self.budget.limit(),
            charged: self.budget.charged(),
            live: self.live.load(Ordering::Acquire),
            pending: self.pending.load(Ordering::Acquire),
            quarantined: self.quarantined.load(Ordering::Acquire),
            awaiting_teardown: self.awaiting_teardown.load(Ordering::Acquire),
            sleep_copies: self.sleep_copies.load(Ordering::Acquire),
            peak: self.budget.peak(),
        }
    }
}

/// The charges of one context (see the module docs).
pub(crate) struct Charges {
    /// The context's own budget.
    budget: BudgetWord,
    /// Chunks of `budget` leased to shards of streams (see `lease.rs`).
    leases: BudgetLeases,
    /// The device's budget, when the context is charged to one.
    shared: Option<SharedBudget>,
    /// Bytes whose free never ran on the device (abandoned releases, buffers
    /// reclaimed by force or released on a lost device): charged until
    /// teardown returns them.
    awaiting_teardown: AtomicU64,
    /// Set once teardown has returned the charges: bytes that become
    /// "awaiting teardown" later are returned at once.
    returned: AtomicBool,
    /// The pinned host tier.
    pinned: TierCharges,
    /// Device-tier bytes of live buffers whose memory sleeps, by role: on
    /// no level (see the module docs).
    suspended: [AtomicU64; 5],
    /// Bytes of releases queued while their buffer slept, by role: pending
    /// in the statistics, on no level.
    released_asleep: [AtomicU64; 5],
    /// Bytes of quarantined buffers that slept: quarantined in the
    /// statistics, on no level.
    quarantined_asleep: AtomicU64,
}

/// The machine ledger membership above the process level, if any.
#[cfg(target_os = "linux")]
#[inline]
fn machine_of(shared: Option<&SharedBudget>) -> Option<&Machine> {
    shared?.0.parent.as_ref()?.0.machine.as_ref()
}

/// Apply `f` to the machine ledger membership above the process level, if
/// there is one (never, off Linux).
#[inline]
#[allow(unused_variables)]
fn on_machine(shared: Option<&SharedBudget>, f: impl FnOnce(&MachineOps)) {
    #[cfg(target_os = "linux")]
    if let Some(m) = machine_of(shared) {
        f(m.inner());
    }
}

#[cfg(target_os = "linux")]
type MachineOps = crate::machine::MemberOps;
/// Off Linux there is no machine ledger: no value of this type exists.
#[cfg(not(target_os = "linux"))]
enum MachineOps {}

#[cfg(not(target_os = "linux"))]
impl MachineOps {
    fn uncharge(&self, _: u64) {
        match *self {}
    }
    fn force_charge(&self, _: u64) {
        match *self {}
    }
    fn fits(&self) -> bool {
        match *self {}
    }
    fn over(&self) -> u64 {
        match *self {}
    }
}

/// Apply `f` to every level above the context: the shared one, then the
/// process one.
#[inline]
fn each_above(shared: Option<&SharedBudget>, mut f: impl FnMut(&Level)) {
    if let Some(s) = shared {
        f(&s.0.level);
        if let Some(p) = &s.0.parent {
            f(&p.0.level);
        }
    }
}

impl Charges {
    /// Charges against a budget of `limit` bytes, leased to shards in chunks
    /// of `lease_chunk` (0: no leases; leases are off on a shared budget).
    pub(crate) fn new(
        limit: u64,
        lease_chunk: u64,
        shared: Option<SharedBudget>,
        pinned_limit: u64,
    ) -> Self {
        Self {
            pinned: TierCharges::new(pinned_limit),
            budget: BudgetWord::new(limit),
            leases: BudgetLeases::new(if shared.is_some() { 0 } else { lease_chunk }),
            shared,
            awaiting_teardown: AtomicU64::new(0),
            returned: AtomicBool::new(false),
            suspended: Default::default(),
            released_asleep: Default::default(),
            quarantined_asleep: AtomicU64::new(0),
        }
    }

    /// The shared budget the context is charged to, if any.
    #[inline]
    pub(crate) fn shared(&self) -> Option<&SharedBudget> {
        self.shared.as_ref()
    }

    /// The process budget above the shared one, if any.
    #[inline]
    pub(crate) fn process(&self) -> Option<&ProcessBudget> {
        self.shared.as_ref().and_then(|s| s.0.parent.as_ref())
    }

    /// The machine ledger membership above the process budget, if any.
    #[cfg(target_os = "linux")]
    #[inline]
    pub(crate) fn machine(&self) -> Option<&Machine> {
        machine_of(self.shared.as_ref())
    }

    fn level(&self, which: Above) -> Option<&Level> {
        match which {
            Above::Shared => self.shared.as_ref().map(|s| &s.0.level),
            Above::Process => self.process().map(|p| &p.0.level),
        }
    }

    // --- An allocation's bytes, step by step. ---

    /// Charge `bytes` for an allocation on a stream of `shard` to the
    /// context's budget and to every level above it: all, or none. `credit`
    /// lowers the bar (see [`BudgetWord::try_charge`]).
    ///
    /// With leases on, the charge comes out of the shard's lease, refilled
    /// from the budget when short; the budget's refusal is final only after
    /// every idle lease was taken back and the budget refused again.
    #[inline]
    pub(super) fn charge(&self, shard: usize, bytes: u64, credit: u64) -> Result<(), RefusedAt> {
        if self.leases.enabled() {
            return self
                .leases
                .charge(&self.budget, shard, bytes, credit)
                .map_err(RefusedAt::Context);
        }
        self.budget
            .try_charge(bytes, credit)
            .map_err(RefusedAt::Context)?;
        if let Some(s) = &self.shared {
            if let Err(r) = s.0.level.budget.try_charge(bytes, credit) {
                self.budget.uncharge(bytes);
                return Err(RefusedAt::Shared(s.0.level.label.clone(), r));
            }
            if let Some(p) = &s.0.parent {
                if let Err(r) = p.0.level.budget.try_charge(bytes, credit) {
                    s.0.level.budget.uncharge(bytes);
                    self.budget.uncharge(bytes);
                    return Err(RefusedAt::Process(p.0.level.label.clone(), r));
                }
                // The machine ledger last: the levels below are process
                // memory, cheap to give back; the ledger is shared.
                #[cfg(target_os = "linux")]
                if let Some(m) = &p.0.machine {
                    if let Err(r) = m.inner().charge(bytes) {
                        p.0.level.budget.uncharge(bytes);
                        s.0.level.budget.uncharge(bytes);
                        self.budget.uncharge(bytes);
                        return Err(RefusedAt::Machine(r));
                    }
                }
            }
        }
        Ok(())
    }

    /// The allocation [`charge`](Self::charge)d for was not made: give the
    /// bytes back to every level.
    #[inline]
    pub(super) fn uncharge(&self, bytes: u64) {
        self.budget.uncharge(bytes);
        each_above(self.shared.as_ref(), |l| l.budget.uncharge(bytes));
        on_machine(self.shared.as_ref(), |m| m.uncharge(bytes));
    }

    /// A release of `bytes` was queued: pending on the levels above.
    #[inline]
    pub(super) fn queued(&self, bytes: u64) {
        each_above(self.shared.as_ref(), |l| {
            l.pending.fetch_add(bytes, Ordering::Relaxed);
        });
    }

    /// The backend refused the free just [`queued`](Self::queued): no
    /// longer pending (the caller quarantines the memory or settles it as
    /// lost).
    #[inline]
    pub(super) fn unqueued(&self, bytes: u64) {
        each_above(self.shared.as_ref(), |l| {
            l.pending.fetch_sub(bytes, Ordering::Relaxed);
        });
    }

    /// An executed free of `bytes`, queued on a stream of `shard`, settled:
    /// the device has the bytes back. They go back to that shard's lease
    /// (the rest to the budget), or to every level when leases are off.
    ///
    /// Bytes of `role` released asleep are taken first: they are on no
    /// level, so only the rest is given back.
    #[inline]
    pub(super) fn uncharge_settled(&self, shard: usize, role: Role, bytes: u64) {
        let charged = bytes - take_some(&self.released_asleep[role.index()], bytes);
        if self.leases.enabled() {
            // Leases are off on a shared budget: only the context's own
            // budget holds these bytes.
            self.leases.settled(&self.budget, shard, charged);
        } else {
            self.budget.uncharge(charged);
            each_above(self.shared.as_ref(), |l| {
                l.budget.uncharge(charged);
                l.pending.fetch_sub(charged, Ordering::Relaxed);
            });
            on_machine(self.shared.as_ref(), |m| m.uncharge(charged));
        }
    }

    /// A queued free of `bytes` was abandoned: it never ran, so the memory
    /// is the backend's to free at teardown, and charged until then.
    /// Bytes of `role` released asleep are taken first, as in
    /// [`uncharge_settled`](Self::uncharge_settled).
    #[inline]
    pub(super) fn abandoned(&self, role: Role, bytes: u64) {
        let charged = bytes - take_some(&self.released_asleep[role.index()], bytes);
        self.unqueued(charged);
        self.hold_until_teardown(charged);
    }

    /// Keep `bytes` charged until teardown: their free never ran, so the
    /// device does not have them back before the context is destroyed.
    /// After teardown returned the charges (a release the backend settled
    /// late) they are returned at once.
    pub(super) fn hold_until_teardown(&self, bytes: u64) {
        self.awaiting_teardown.fetch_add(bytes, Ordering::SeqCst);
        each_above(self.shared.as_ref(), |l| {
            l.awaiting_teardown.fetch_add(bytes, Ordering::Relaxed);
        });
        // SeqCst on both sides: either teardown's swap sees our add, or we
        // see its flag (or both, and the swaps split the bytes).
        if self.returned.load(Ordering::SeqCst) && self.return_awaiting_teardown() > 0 {
            self.announce_returned();
        }
    }

    /// A release of `bytes` was refused and its memory quarantined: charged
    /// until teardown returns it.
    pub(super) fn quarantined(&self, bytes: u64) {
        each_above(self.shared.as_ref(), |l| {
            l.quarantined.fetch_add(bytes, Ordering::Relaxed);
        });
    }

    /// Teardown's accounting, once the backend's teardown has returned: the
    /// device has every byte of the context back. The leases close for good
    /// (what they held goes back), the `quarantined` bytes come off, and so
    /// does every byte awaiting teardown, now and (see
    /// [`hold_until_teardown`](Self::hold_until_teardown)) later.
    /// `pinned_quarantined` is the pinned tier's part of the quarantine,
    /// returned to its own budget with its bytes awaiting teardown; the
    /// report counts both tiers. Bytes recorded outside memgov stay charged
    /// until their record is dropped: the runtime that allocated them frees
    /// them, not the teardown.
    /// `quarantined_asleep` is the part of the device quarantine that slept
    /// (on no level: see the module docs), not in `quarantined`. Afterwards
    /// the books are [`closed`](Self::closed).
    pub(super) fn return_at_teardown(
        &self,
        quarantined: u64,
        pinned_quarantined: u64,
        quarantined_asleep: u64,
    ) -> ReturnedAtTeardown {
        self.leases.close(&self.budget);
        if quarantined > 0 {
            self.uncharge(quarantined);
            each_above(self.shared.as_ref(), |l| {
                l.quarantined.fetch_sub(quarantined, Ordering::Relaxed);
            });
        }
        self.quarantined_asleep
            .fetch_sub(quarantined_asleep, Ordering::AcqRel);
        // Pairs with `hold_until_teardown`: see there.
        self.returned.store(true, Ordering::SeqCst);
        let pinned_awaiting = Self::return_tier(&self.pinned, pinned_quarantined);
        // The backend's teardown freed whatever host copies still held
        // sleeping contents.
        let copies = self.pinned.sleep_copies.swap(0, Ordering::AcqRel);
        if copies > 0 {
            self.pinned.budget.uncharge(copies);
        }
        ReturnedAtTeardown {
            quarantined: quarantined + quarantined_asleep + pinned_quarantined,
            awaiting_teardown: self.return_awaiting_teardown() + pinned_awaiting,
        }
    }

    /// Whether the books closed after teardown returned the charges: every
    /// live buffer is gone (each took its suspended bytes out), and unless
    /// the device is lost (a release may never settle) every release
    /// settled and every quarantined byte was returned, so nothing is off
    /// the books. `Err` says what is left. Checked in debug builds once the
    /// context is terminated (never inside the teardown, whose waiters a
    /// panic there would leave waiting).
    pub(crate) fn closed(&self, lost: bool) -> Result<(), String> {
        let suspended = self.suspended_bytes();
        let off = self.off_books();
        if suspended > 0 || (!lost && off > 0) {
            return Err(format!(
                "{suspended} B suspended and {off} B off the books after teardown: the books \
                 gave back fewer bytes than they took off"
            ));
        }
        Ok(())
    }

    fn return_awaiting_teardown(&self) -> u64 {
        let bytes = self.awaiting_teardown.swap(0, Ordering::SeqCst);
        if bytes > 0 {
            self.budget.uncharge(bytes);
            each_above(self.shared.as_ref(), |l| {
                l.budget.uncharge(bytes);
                l.awaiting_teardown.fetch_sub(bytes, Ordering::Relaxed);
            });
            on_machine(self.shared.as_ref(), |m| m.uncharge(bytes));
        }
        bytes
    }

    // --- Suspended bytes: live buffers whose memory sleeps. ---

    /// `bytes` of live device-tier buffers of `role` lost their memory to
    /// a sleep (the buffers stay live): off every level, counted as
    /// suspended, and the admissions waiting above are woken (there is
    /// room now).
    pub(super) fn suspend(&self, role: Role, bytes: u64) {
        if bytes == 0 {
            return;
        }
        // Suspended first: a reader never sees the bytes on no amount.
        self.suspended[role.index()].fetch_add(bytes, Ordering::SeqCst);
        self.uncharge(bytes);
        self.announce_returned();
    }

    /// A wake admitted (charged, through the admission an allocation takes)
    /// `admitted` bytes for the suspended bytes of `role`: they are no
    /// longer suspended. Any of them whose buffer left live meanwhile (and
    /// took them out of `suspended`) are given back here. Returns the bytes
    /// no longer suspended.
    pub(super) fn resumed(&self, role: Role, admitted: u64) -> u64 {
        let taken = take_some(&self.suspended[role.index()], admitted);
        if taken < admitted {
            self.uncharge(admitted - taken);
            self.announce_returned();
        }
        taken
    }

    /// A live device-tier buffer of `role` and `bytes` leaves live, `to`
    /// where its bytes go: the part of them that was suspended is taken out
    /// of `suspended` (and counted where they go, until given back) and
    /// returned; the caller carries only the rest onward, as charged bytes.
    /// One load when nothing of `role` sleeps.
    #[inline]
    pub(super) fn leave_live(&self, role: Role, bytes: u64, to: Left) -> u64 {
        let s = &self.suspended[role.index()];
        if s.load(Ordering::Acquire) == 0 {
            return 0;
        }
        self.leave_live_slow(role, bytes, to)
    }

    #[cold]
    #[inline(never)]
    fn leave_live_slow(&self, role: Role, bytes: u64, to: Left) -> u64 {
        let asleep = take_some_slow(&self.suspended[role.index()], bytes);
        match to {
            Left::Queued => self.released_asleep[role.index()].fetch_add(asleep, Ordering::AcqRel),
            Left::Quarantined => self.quarantined_asleep.fetch_add(asleep, Ordering::AcqRel),
            Left::Gone => 0,
        };
        asleep
    }

    /// Undo [`leave_live`](Self::leave_live)`(.., Left::Queued)`, which
    /// returned `asleep`: the backend refused the free, the buffer is live
    /// again.
    pub(super) fn rejoin_live(&self, role: Role, asleep: u64) {
        if asleep > 0 {
            let back = take_some(&self.released_asleep[role.index()], asleep);
            self.suspended[role.index()].fetch_add(back, Ordering::AcqRel);
        }
    }

    /// `force` reclaimed every live buffer: nothing is suspended any more.
    /// Returns the bytes that were (the caller holds only the rest until
    /// teardown).
    pub(super) fn reclaim_suspended(&self) -> u64 {
        self.suspended
            .iter()
            .map(|s| s.swap(0, Ordering::AcqRel))
            .sum()
    }

    /// A block cached as `from` was handed out as `to` (the cache keeps
    /// blocks live in the books): whatever of it was suspended follows it,
    /// so that `suspended <= live` stays true role by role.
    pub(super) fn retag_suspended(&self, from: Role, to: Role, bytes: u64) {
        let moved = self.leave_live(from, bytes, Left::Gone);
        if moved > 0 {
            self.suspended[to.index()].fetch_add(moved, Ordering::AcqRel);
        }
    }

    // --- Sleep's page-locked host copies, on the pinned host tier. ---

    /// Charge `bytes` to the pinned host tier for the page-locked host
    /// memory a sleep is about to fill with device contents; refused, with
    /// nothing charged, when the tier cannot hold them.
    pub(super) fn charge_sleep_copies(&self, bytes: u64) -> Result<(), RefusedAt> {
        let t = &self.pinned;
        t.budget
            .try_charge(bytes, 0)
            .map_err(|r| RefusedAt::Tier(Tier::PinnedHost, r))?;
        t.sleep_copies.fetch_add(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Host copies of sleeping contents freed (woken, or not made after
    /// all): up to `bytes` of what
    /// [`charge_sleep_copies`](Self::charge_sleep_copies) charged goes back
    /// to the tier. Returns how many were charged (a copy made outside a
    /// governed sleep was never charged).
    pub(super) fn return_sleep_copies(&self, bytes: u64) -> u64 {
        let t = &self.pinned;
        let taken = take_some(&t.sleep_copies, bytes);
        if taken > 0 {
            t.budget.uncharge(taken);
        }
        taken
    }

    /// Suspended bytes of `role` now.
    #[inline]
    pub(crate) fn suspended(&self, role: Role) -> u64 {
        self.suspended[role.index()].load(Ordering::Acquire)
    }

    /// Suspended bytes of every role now.
    pub(crate) fn suspended_bytes(&self) -> u64 {
        Role::ALL.iter().map(|&r| self.suspended(r)).sum()
    }

    /// Device-tier bytes of the statistics on no level: suspended, released
    /// asleep and quarantined asleep (see the module docs).
    pub(crate) fn off_books(&self) -> u64 {
        let released: u64 = self
            .released_asleep
            .iter()
            .map(|r| r.load(Ordering::Acquire))
            .sum();
        self.suspended_bytes() + released + self.quarantined_asleep.load(Ordering::Acquire)
    }

    /// Claim `bytes` for an allocation about to ask pressure responders on
    /// a level above: charged to every level whatever the limits, so that
    /// what a responder frees pays the claim off before anything else can
    /// be admitted there (an allocation racing it sees the level over its
    /// limit by what the claim still lacks). The claim is the allocation's
    /// once [`claim_fits`](Self::claim_fits); given back with
    /// [`uncharge`](Self::uncharge) otherwise.
    pub(super) fn claim(&self, bytes: u64) {
        self.budget.force_charge(bytes);
        each_above(self.shared.as_ref(), |l| l.budget.force_charge(bytes));
        on_machine(self.shared.as_ref(), |m| m.force_charge(bytes));
    }

    /// Whether every level is within its limit, so that a
    /// [`claim`](Self::claim) holds only admissible bytes.
    pub(crate) fn claim_fits(&self) -> bool {
        let mut fits = self.budget.charged() <= self.budget.limit();
        each_above(self.shared.as_ref(), |l| {
            fits &= l.budget.charged() <= l.budget.limit();
        });
        on_machine(self.shared.as_ref(), |m| fits &= m.fits());
        fits
    }

    /// How far the most overdrawn level is over its limit: what responders
    /// still have to free for a [`claim`](Self::claim) to fit.
    pub(crate) fn claim_shortfall(&self) -> u64 {
        let mut over = self.budget.charged().saturating_sub(self.budget.limit());
        each_above(self.shared.as_ref(), |l| {
            over = over.max(l.budget.charged().saturating_sub(l.budget.limit()));
        });
        on_machine(self.shared.as_ref(), |m| over = over.max(m.over()));
        over
    }

    /// Memory a runtime allocated outside memgov for this context: charged
    /// to every level, whatever the limits (it exists already), and counted
    /// as outside at every level above. Given back by
    /// [`return_outside`](Self::return_outside).
    pub(super) fn record_outside(&self, bytes: u64) {
        self.budget.force_charge(bytes);
        // Idle leased bytes were admitted without these: take them back, so
        // that allocations from now on are held to the budget with them
        // (as `set_limit` does).
        self.leases.reclaim(&self.budget);
        each_above(self.shared.as_ref(), |l| {
            l.budget.force_charge(bytes);
            l.outside.fetch_add(bytes, Ordering::Relaxed);
        });
        on_machine(self.shared.as_ref(), |m| m.force_charge(bytes));
    }

    /// The runtime freed memory [`record_outside`](Self::record_outside)
    /// charged: give it back to every level and wake the admissions waiting
    /// above.
    pub(super) fn return_outside(&self, bytes: u64) {
        self.budget.uncharge(bytes);
        each_above(self.shared.as_ref(), |l| {
            l.budget.uncharge(bytes);
            l.outside.fetch_sub(bytes, Ordering::Relaxed);
        });
        on_machine(self.shared.as_ref(), |m| m.uncharge(bytes));
        self.announce_returned();
    }

    // --- Wake-ups of the admissions waiting on the levels above. ---

    /// A release charged here settled: wake the admission waiters of the
    /// levels above (the context's own are woken by the record).
    #[inline]
    pub(crate) fn announce_settled(&self) {
        each_above(self.shared.as_ref(), |l| {
            l.epoch.fetch_add(1, Ordering::SeqCst);
            l.retired.notify();
        });
    }

    /// Teardown gave charges back outside a settlement: wake the admission
    /// waiters of the levels above.
    #[inline]
    pub(crate) fn announce_returned(&self) {
        if let Some(s) = &self.shared {
            s.0.announce_returned();
        }
    }

    /// The context stopped accepting work (retire, loss): the admission
    /// waiters of the levels above look again and those of this context
    /// give up.
    #[inline]
    pub(crate) fn wake_shared_waiters(&self) {
        each_above(self.shared.as_ref(), |l| l.retired.notify());
    }

    /// The settlement epoch of a level above, for an admission about to
    /// wait past it; `None` without that level.
    pub(crate) fn epoch(&self, which: Above) -> Option<u64> {
        self.level(which).map(|l| l.epoch.load(Ordering::SeqCst))
    }

    /// Sleep until the epoch of a level above moves past `seen`, `give_up`
    /// holds, or the deadline passes. Never polls.
    pub(crate) fn wait_above(
        &self,
        which: Above,
        seen: u64,
        deadline: Instant,
        give_up: impl Fn() -> bool,
    ) {
        if let Some(l) = self.level(which) {
            l.retired.wait_until(
                || l.epoch.load(Ordering::SeqCst) != seen || give_up(),
                Some(deadline),
            );
        }
    }

    /// Charge `bytes` for a reservation (see `reservation.rs`): to every
    /// level, or to none. An allocation out of the reservation is not
    /// charged again; its release gives its bytes back as usual.
    pub(super) fn reserve(&self, bytes: u64) -> Result<(), RefusedAt> {
        // Any shard's lease may carry the charge: it comes off the budget
        // through `unreserve`, or through the buffers' settled releases.
        self.charge(0, bytes, 0)
    }

    /// Unused reserved bytes given back (shrink, or the reservation dropped).
    pub(super) fn unreserve(&self, bytes: u64) {
        if bytes > 0 {
            self.uncharge(bytes);
        }
    }

    /// [`reserve`](Self::reserve) in `tier`: charged to the tier's budget,
    /// counted in none of its amounts until an allocation takes the bytes
    /// ([`reserved_taken_in`](Self::reserved_taken_in)).
    pub(super) fn reserve_in(&self, tier: Tier, bytes: u64) -> Result<(), RefusedAt> {
        let Some(t) = self.tier(tier) else {
            return self.reserve(bytes);
        };
        t.budget
            .try_charge(bytes, 0)
            .map_err(|r| RefusedAt::Tier(tier, r))
    }

    /// [`unreserve`](Self::unreserve) in `tier`.
    pub(super) fn unreserve_in(&self, tier: Tier, bytes: u64) {
        match self.tier(tier) {
            None => self.unreserve(bytes),
            Some(t) if bytes > 0 => t.budget.uncharge(bytes),
            Some(_) => {}
        }
    }

    /// Reserved bytes of `tier` became a live allocation: already charged,
    /// now counted live (the device tier counts live bytes in the context's
    /// statistics instead).
    #[inline]
    pub(super) fn reserved_taken_in(&self, tier: Tier, role: Role, bytes: u64) {
        if let Some(t) = self.tier(tier) {
            t.shift(None, Some(&t.live), bytes);
            t.live_role(role, true, bytes);
        }
    }

    // --- The same steps in any tier. ---

    /// The tier's charges; `None` for the device tier.
    #[inline]
    fn tier(&self, tier: Tier) -> Option<&TierCharges> {
        match tier {
            Tier::Device => None,
            _ => Some(&self.pinned),
        }
    }

    /// [`charge`](Self::charge) in `tier`: to its own budget, counted live.
    pub(super) fn charge_in(
        &self,
        tier: Tier,
        shard: usize,
        role: Role,
        bytes: u64,
        credit: u64,
    ) -> Result<(), RefusedAt> {
        let Some(t) = self.tier(tier) else {
            return self.charge(shard, bytes, credit);
        };
        // Stream-ordered reuse is a device pool's: no credit.
        t.budget
            .try_charge(bytes, 0)
            .map_err(|r| RefusedAt::Tier(tier, r))?;
        t.shift(None, Some(&t.live), bytes);
        t.live_role(role, true, bytes);
        Ok(())
    }

    /// [`uncharge`](Self::uncharge) in `tier`.
    pub(super) fn uncharge_in(&self, tier: Tier, role: Role, bytes: u64) {
        let Some(t) = self.tier(tier) else {
            return self.uncharge(bytes);
        };
        t.live_role(role, false, bytes);
        t.shift(Some(&t.live), None, bytes);
        t.budget.uncharge(bytes);
    }

    /// [`queued`](Self::queued) in `tier`.
    #[inline]
    pub(super) fn queued_in(&self, tier: Tier, role: Role, bytes: u64) {
        match self.tier(tier) {
            None => self.queued(bytes),
            Some(t) => {
                t.live_role(role, false, bytes);
                t.shift(Some(&t.live), Some(&t.pending), bytes)
            }
        }
    }

    /// [`unqueued`](Self::unqueued) in `tier`.
    pub(super) fn unqueued_in(&self, tier: Tier, role: Role, bytes: u64) {
        match self.tier(tier) {
            None => self.unqueued(bytes),
            Some(t) => {
                t.shift(Some(&t.pending), Some(&t.live), bytes);
                t.live_role(role, true, bytes);
            }
        }
    }

    /// [`uncharge_settled`](Self::uncharge_settled) in `tier`.
    #[inline]
    pub(super) fn uncharge_settled_in(&self, tier: Tier, shard: usize, role: Role, bytes: u64) {
        match self.tier(tier) {
            None => self.uncharge_settled(shard, role, bytes),
            Some(t) => {
                t.shift(Some(&t.pending), None, bytes);
                t.budget.uncharge(bytes);
            }
        }
    }

    /// [`abandoned`](Self::abandoned) in `tier`.
    pub(super) fn abandoned_in(&self, tier: Tier, role: Role, bytes: u64) {
        match self.tier(tier) {
            None => self.abandoned(role, bytes),
            Some(t) => self.hold_in(t, Some(&t.pending), bytes),
        }
    }

    /// Live bytes in `tier` whose free will never run (released on a lost
    /// device): charged until teardown, as
    /// [`hold_until_teardown`](Self::hold_until_teardown).
    pub(super) fn hold_live_until_teardown_in(&self, tier: Tier, role: Role, bytes: u64) {
        match self.tier(tier) {
            None => self.hold_until_teardown(bytes),
            Some(t) => {
                t.live_role(role, false, bytes);
                self.hold_in(t, Some(&t.live), bytes)
            }
        }
    }

    /// [`quarantined`](Self::quarantined) in `tier`.
    pub(super) fn quarantined_in(&self, tier: Tier, role: Role, bytes: u64) {
        match self.tier(tier) {
            None => self.quarantined(bytes),
            Some(t) => {
                t.live_role(role, false, bytes);
                t.shift(Some(&t.live), Some(&t.quarantined), bytes)
            }
        }
    }

    /// Live bytes of `role` in the tiers other than the device's: what a
    /// sleep leaves out of the role's live total.
    pub(crate) fn other_tiers_live(&self, role: Role) -> u64 {
        self.pinned.live_by_role[role.index()].load(Ordering::Acquire)
    }

    /// Force reclaimed every live buffer: the live bytes of the tiers other
    /// than the device's are held until teardown. Returns them, so that the
    /// caller holds the rest on the device tier. Called with the gate closed
    /// and drained: nothing moves the live amounts meanwhile.
    pub(super) fn reclaim_tiers_live(&self) -> u64 {
        let t = &self.pinned;
        let live = t.live.load(Ordering::Acquire);
        for r in &t.live_by_role {
            r.store(0, Ordering::Release);
        }
        if live > 0 {
            self.hold_in(t, Some(&t.live), live);
        }
        live
    }

    /// Move `bytes` of `t` from `from` to awaiting teardown, or give them
    /// back at once after teardown (see
    /// [`hold_until_teardown`](Self::hold_until_teardown)).
    fn hold_in(&self, t: &TierCharges, from: Option<&AtomicU64>, bytes: u64) {
        t.shift(from, Some(&t.awaiting_teardown), bytes);
        // SeqCst on both sides, as in `hold_until_teardown`.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.returned.load(Ordering::SeqCst) {
            Self::return_tier(t, 0);
        }
    }

    /// Teardown's accounting of a tier: its `quarantined` bytes and every
    /// byte awaiting teardown go back to its budget. Returns them.
    fn return_tier(t: &TierCharges, quarantined: u64) -> u64 {
        let awaiting = t.awaiting_teardown.swap(0, Ordering::SeqCst);
        t.shift(Some(&t.quarantined), None, quarantined);
        t.budget.uncharge(awaiting + quarantined);
        awaiting
    }

    /// A tier's amounts now.
    pub(crate) fn tier_amounts(&self, tier: Tier) -> Option<TierAmounts> {
        self.tier(tier).map(TierCharges::amounts)
    }

    /// Change the limit of `tier` (the device tier's is the context budget).
    pub(crate) fn set_tier_limit(&self, tier: Tier, bytes: u64) {
        match self.tier(tier) {
            None => self.set_limit(bytes),
            Some(t) => t.budget.set_limit(bytes),
        }
    }

    // --- What is charged. ---

    /// The context's budget limit.
    #[inline]
    pub(crate) fn limit(&self) -> u64 {
        self.budget.limit()
    }

    /// Change the context's budget limit.
    pub(crate) fn set_limit(&self, bytes: u64) {
        self.budget.set_limit(bytes);
        // Leased bytes were admitted under the old limit: take them back, so
        // that allocations from now on are held to the new one.
        self.leases.reclaim(&self.budget);
    }

    /// Bytes charged to allocations on the context's budget now (leased,
    /// idle bytes are not; see `lease.rs` for how far this can lag while
    /// streams allocate), outside records included.
    pub(crate) fn charged(&self) -> u64 {
        if self.leases.enabled() {
            self.leases.charged(&self.budget)
        } else {
            self.budget.charged()
        }
    }

    /// The most the context's budget ever held: bytes charged to
    /// allocations (being made included) plus, with leases on, bytes leased
    /// to streams and idle. Exact: raised by every successful charge.
    pub(crate) fn peak_held(&self) -> u64 {
        self.budget.peak()
    }

    /// Bytes awaiting teardown now.
    #[inline]
    pub(crate) fn awaiting_teardown(&self) -> u64 {
        self.awaiting_teardown.load(Ordering::Acquire)
    }

    /// A level's pending, quarantined, awaiting-teardown and outside totals;
    /// `None` without that level.
    pub(crate) fn amounts(&self, which: Above) -> Option<LevelAmounts> {
        self.level(which).map(Level::amounts)
    }

    /// Bytes on a level above on their way back: pending releases of every
    /// context under it, and what retiring contexts under it will give back
    /// at teardown (see `DeviceMember::returning_at_teardown`). The slow path
    /// of a refused admission only: it takes the budgets' members locks.
    pub(crate) fn on_the_way(&self, which: Above) -> u64 {
        let Some(l) = self.level(which) else {
            return 0;
        };
        let pending = l.pending.load(Ordering::Acquire);
        let returning = match which {
            Above::Shared => self
                .shared
                .as_ref()
                .map_or(0, |s| s.0.returning_at_teardown()),
            Above::Process => self.process().map_or(0, |p| {
                p.devices()
                    .iter()
                    .map(|d| d.returning_at_teardown())
                    .fold(0, u64::saturating_add)
            }),
        };
        pending.saturating_add(returning)
    }
}

/// Memory a runtime allocated outside memgov, recorded on a level alone (a
/// device's shared budget, which charges its process level too, or a
/// process budget): charged whatever the limits, counted as outside.
pub(crate) fn record_outside_at(
    shared: Option<&SharedBudget>,
    process: Option<&ProcessBudget>,
    bytes: u64,
) {
    let mut f = |l: &Level| {
        l.budget.force_charge(bytes);
        l.outside.fetch_add(bytes, Ordering::Relaxed);
    };
    match shared {
        Some(s) => each_above(Some(s), &mut f),
        None => process.into_iter().for_each(|p| f(&p.0.level)),
    }
    #[cfg(target_os = "linux")]
    if let Some(m) = process_of(shared, process).and_then(|p| p.0.machine.as_ref()) {
        m.inner().force_charge(bytes);
    }
}

/// The process level of an outside record: above `shared`, or `process`.
#[cfg(target_os = "linux")]
fn process_of<'a>(
    shared: Option<&'a SharedBudget>,
    process: Option<&'a ProcessBudget>,
) -> Option<&'a ProcessBudget> {
    match shared {
        Some(s) => s.0.parent.as_ref(),
        None => process,
    }
}

/// Give back what [`record_outside_at`] charged, and wake the admissions
/// waiting on those levels.
pub(crate) fn return_outside_at(
    shared: Option<&SharedBudget>,
    process: Option<&ProcessBudget>,
    bytes: u64,
) {
    #[cfg(target_os = "linux")]
    if let Some(m) = process_of(shared, process).and_then(|p| p.0.machine.as_ref()) {
        m.inner().uncharge(bytes);
    }
    let mut f = |l: &Level| {
        l.budget.uncharge(bytes);
        l.outside.fetch_sub(bytes, Ordering::Relaxed);
        l.announce_returned();
    };
    match shared {
        Some(s) => each_above(Some(s), &mut f),
        None => process.into_iter().for_each(|p| f(&p.0.level)),
    }
}

#[cfg(test)]
mod tests {
    use super::{Charges, RefusedAt};
    use crate::Role;
    use crate::{ProcessBudget, SharedBudget};

    #[test]
    fn a_charge_is_on_both_budgets_or_neither() {
        let device = SharedBudget::new("gpu0", 100);
        let c = Charges::new(1000, 0, Some(device.clone()), u64::MAX);
        c.charge(0, 80, 0).unwrap();
        assert_eq!((c.charged(), device.charged()), (80, 80));
        match c.charge(0, 30, 0) {
            Err(RefusedAt::Shared(label, r)) => {
                assert_eq!((label.as_str(), r.charged, r.limit), ("gpu0", 80, 100))
            }
            other => panic!("expected the shared budget to refuse: {other:?}"),
        }
        assert_eq!(c.charged(), 80, "the context's charge was rolled back");
        c.uncharge(80);
        assert_eq!((c.charged(), device.charged()), (0, 0));
    }

    #[test]
    fn a_charge_is_on_every_level_of_the_tree_or_none() {
        let process = ProcessBudget::new("proc", 150);
        let device = SharedBudget::with_parent("gpu0", 100, &process);
        let other = SharedBudget::with_parent("gpu1", 100, &process);
        let c = Charges::new(1000, 0, Some(device.clone()), u64::MAX);
        let d = Charges::new(1000, 0, Some(other.clone()), u64::MAX);
        c.charge(0, 80, 0).unwrap();
        assert_eq!(
            (c.charged(), device.charged(), process.charged()),
            (80, 80, 80)
        );
        match d.charge(0, 90, 0) {
            Err(RefusedAt::Process(label, r)) => {
                assert_eq!((label.as_str(), r.charged, r.limit), ("proc", 80, 150))
            }
            other => panic!("expected the process budget to refuse: {other:?}"),
        }
        assert_eq!((d.charged(), other.charged()), (0, 0), "rolled back");
        // Outside memory: charged whatever the limits, counted at each level.
        d.record_outside(200);
        assert_eq!(
            (d.charged(), other.charged(), process.charged()),
            (200, 200, 280)
        );
        assert_eq!((other.outside(), process.outside()), (200, 200));
        assert!(c.charge(0, 1, 0).is_err(), "the process is over its limit");
        d.return_outside(200);
        c.uncharge(80);
        assert_eq!(
            (
                c.charged(),
                device.charged(),
                other.charged(),
                process.charged()
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(process.outside(), 0);
    }

    #[test]
    fn every_step_keeps_the_shared_totals_in_step() {
        let device = SharedBudget::new("gpu0", 1000);
        let c = Charges::new(1000, 0, Some(device.clone()), u64::MAX);
        for _ in 0..3 {
            c.charge(0, 100, 0).unwrap();
        }
        // One release settles, one is abandoned, one is refused and
        // quarantined.
        c.queued(100);
        c.queued(100);
        c.queued(100);
        assert_eq!(device.pending(), 300);
        c.uncharge_settled(0, Role::Other, 100);
        c.abandoned(Role::Other, 100);
        c.unqueued(100);
        c.quarantined(100);
        assert_eq!(device.pending(), 0);
        assert_eq!(device.awaiting_teardown(), 100);
        assert_eq!(device.quarantined(), 100);
        assert_eq!((c.charged(), device.charged()), (200, 200));
        let returned = c.return_at_teardown(100, 0, 0);
        assert_eq!(
            (returned.quarantined, returned.awaiting_teardown),
            (100, 100)
        );
        assert_eq!((c.charged(), device.charged()), (0, 0));
        assert_eq!((device.quarantined(), device.awaiting_teardown()), (0, 0));
    }

    #[test]
    fn bytes_held_after_teardown_are_returned_at_once() {
        let device = SharedBudget::new("gpu0", 1000);
        let c = Charges::new(1000, 0, Some(device.clone()), u64::MAX);
        c.charge(0, 64, 0).unwrap();
        c.queued(64);
        c.return_at_teardown(0, 0, 0);
        // A release the backend abandons after teardown (a backend bug).
        c.abandoned(Role::Other, 64);
        assert_eq!(c.awaiting_teardown(), 0);
        assert_eq!((c.charged(), device.charged()), (0, 0));
        assert_eq!((device.pending(), device.awaiting_teardown()), (0, 0));
    }

    #[test]
    fn pinned_bytes_stay_off_the_device_budgets() {
        use crate::Tier::PinnedHost;
        let device = SharedBudget::new("gpu0", 100);
        let c = Charges::new(100, 0, Some(device.clone()), 300);
        c.charge_in(PinnedHost, 0, Role::Other, 200, 0).unwrap();
        assert_eq!((c.charged(), device.charged()), (0, 0));
        match c.charge_in(PinnedHost, 0, Role::Other, 101, 0) {
            Err(RefusedAt::Tier(PinnedHost, r)) => assert_eq!((r.charged, r.limit), (200, 300)),
            other => panic!("expected the pinned tier to refuse: {other:?}"),
        }
        // The device tier still has all its room.
        c.charge_in(crate::Tier::Device, 0, Role::Other, 100, 0)
            .unwrap();
        // Every step of the tier keeps its budget the sum of its amounts.
        c.queued_in(PinnedHost, Role::Other, 120);
        c.uncharge_settled_in(PinnedHost, 0, Role::Other, 100);
        c.abandoned_in(PinnedHost, Role::Other, 20);
        c.quarantined_in(PinnedHost, Role::Other, 30);
        let a = c.tier_amounts(PinnedHost).unwrap();
        assert_eq!(
            (
                a.charged,
                a.live,
                a.pending,
                a.quarantined,
                a.awaiting_teardown
            ),
            (100, 50, 0, 30, 20)
        );
        assert_eq!(c.reclaim_tiers_live(), 50);
        let returned = c.return_at_teardown(0, 30, 0);
        assert_eq!((returned.quarantined, returned.awaiting_teardown), (30, 70));
        assert_eq!(c.tier_amounts(PinnedHost).unwrap().charged, 0);
        assert_eq!(device.charged(), 100, "only the device bytes are on it");
    }

    #[test]
    fn settled_bytes_go_back_into_the_lease() {
        let c = Charges::new(10 << 20, 1 << 20, None, u64::MAX);
        c.charge(3, 4096, 0).unwrap();
        assert_eq!(c.charged(), 4096, "leased, idle bytes are not charged");
        let held = c.peak_held();
        assert!(held >= 4096 + (1 << 20), "the lease was refilled: {held}");
        c.uncharge_settled(3, Role::Other, 4096);
        assert_eq!(c.charged(), 0);
        c.set_limit(4096);
        c.charge(3, 4096, 0).unwrap();
        assert!(c.charge(3, 1, 0).is_err(), "held to the new limit");
    }
}
