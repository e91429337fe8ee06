use super::{lock_model, slot_index, AtomicU64, Mutex, Ordering};

/// Units of a [`Pool`] (budget bytes, pin claims) leased to one shard of
/// streams: already taken from the pool, not yet held by anything.
///
/// Each slot sits on its own cache line, so that a stream taking from and
/// giving back to its own lease writes no line another stream writes.
#[derive(Debug)]
#[repr(align(128))]
struct Slot(AtomicU64);

/// The closed bit of [`LeaseSlots`]' state word.
const CLOSED: u64 = 1 << 63;
/// One refusal reclaiming leases now (bits 32..63 count them).
const PRESS: u64 = 1 << 32;
/// One refill leasing a chunk now (bits 0..32 count them).
const REFILL: u64 = 1;
const REFILLS: u64 = PRESS - 1;

/// A fixed set of lease slots, and one word saying whether they are closed
/// for good and whether a refusal is reclaiming them now.
///
/// Invariants, enforced here and nowhere else ("the pool" is what leased the
/// units: a budget, or a pin counter):
/// * every unit in a slot is held from the pool: units enter a slot only
///   through [`fill`](Self::fill) and [`give`](Self::give), whose callers
///   took them from the pool, and leave it only through [`take`](Self::take)
///   (they become a holder's) or [`reclaim`](Self::reclaim) and the excess
///   returned by `give` (the caller puts back exactly what it is handed). No
///   unit is ever counted twice: each of those is one read-modify-write of
///   the slot, and all of them are totally ordered on it.
/// * a `take` that succeeds never drives a slot below zero: it checks and
///   subtracts in one compare-and-swap, so a `reclaim` racing it takes either
///   the units before the take or the rest after it, never both.
/// * once [`close`](Self::close) has run, no unit stays in a slot and no
///   `take` succeeds: a `fill` or `give` that lands after close's sweep of
///   its slot sees the closed flag (SeqCst on both sides, as in `Notifier`)
///   and hands its units back to the caller; a `take` that lands after it
///   sees the flag too ([`Take::Closed`]).
/// * a chunk is leased only between [`begin_refill`](Self::begin_refill)
///   (which fails while a refusal is reclaiming or the slots are closed) and
///   [`end_refill`](Self::end_refill), and the caller takes from the pool and
///   fills the slot (or, while a refusal presses, hands the chunk straight
///   back to the pool) in between. A refusal that saw no refill in flight
///   ([`refilling`](Self::refilling)) after pressing, *then* was refused by
///   the pool, and then swept every slot empty was exact: no refill was in
///   flight when the pool refused (none begins while pressed), and every
///   unit leased then has since been swept, taken by a holder, or handed
///   back by a `give` that is still in progress (which the refusal
///   precedes). Checking for refills only *after* the pool refused is not
///   enough: a refill that ends in between may have handed its chunk back to
///   the pool, where no sweep finds it (the loom model
///   `a_refill_in_flight_is_waited_for_before_a_refusal` finds that
///   interleaving).
/// * while a refusal is reclaiming ([`press`](Self::press) to
///   [`unpress`](Self::unpress)) `give` keeps nothing and no refill begins,
///   so the refusal's loop waits only for refills that began before it.
/// * a `give` hands back to its caller at most the units it gave: units
///   leased before it stay in the slot, where a refusal's sweep finds them.
///   Between its slot operation and the caller's put, a give holds only its
///   own units, which the refusal may count as still held by the giver.
#[derive(Debug)]
pub struct LeaseSlots<const N: usize> {
    slots: [Slot; N],
    /// `CLOSED`, the refusals between `press` and `unpress` (`PRESS` each)
    /// and the refills between `begin_refill` and `end_refill` (`REFILL`
    /// each).
    state: AtomicU64,
}

impl<const N: usize> LeaseSlots<N> {
    /// `N` open slots, none holding a lease.
    pub fn new() -> Self {
        Self {
            slots: std::array::from_fn(|_| Slot(AtomicU64::new(0))),
            state: AtomicU64::new(0),
        }
    }

    /// Take `n` units for a holder out of slot `i`'s lease, if it holds that
    /// many and the slots are open.
    ///
    /// The check for "closed" comes *after* the compare-and-swap (both
    /// SeqCst, like `close`): a take that finds the slots open is ordered
    /// before `close`, so that a holder never gains a unit once `close` has
    /// run, not even one a late `give` put into the slot an instant before it
    /// saw the flag. A take that finds them closed has the units in its hands
    /// and must hand them back to the pool ([`Take::Closed`]).
    #[inline]
    pub fn take(&self, i: usize, n: u64) -> Take {
        let slot = &self.slots[slot_index::<N>(i)].0;
        let mut cur = slot.load(Ordering::Relaxed);
        loop {
            if cur < n {
                return Take::Short;
            }
            match slot.compare_exchange_weak(cur, cur - n, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        if self.state.load(Ordering::SeqCst) & CLOSED != 0 {
            Take::Closed
        } else {
            Take::Taken
        }
    }

    /// Put `bytes` units the caller has just taken from the pool into slot `i`.
    /// Returns what the caller must uncharge again: zero, or all of it when
    /// the slots are closed.
    #[inline]
    pub fn fill(&self, i: usize, bytes: u64) -> u64 {
        self.give(i, bytes, u64::MAX)
    }

    /// Give `bytes` units (still held from the pool) back to slot `i`, keeping
    /// at most `keep` bytes there. Returns what the caller must uncharge: the
    /// part above `keep`, or everything once the slots are closed.
    #[inline]
    pub fn give(&self, i: usize, bytes: u64, keep: u64) -> u64 {
        let slot = &self.slots[slot_index::<N>(i)].0;
        let held = slot.fetch_add(bytes, Ordering::SeqCst) + bytes;
        // Pairs with `close` (and `press`): either its sweep of this slot saw
        // our add, or we see its flag here (or both, and the swaps split the
        // bytes).
        let state = self.state.load(Ordering::SeqCst);
        if state & CLOSED != 0 {
            return slot.swap(0, Ordering::SeqCst);
        }
        let keep = if state >= PRESS { 0 } else { keep };
        if held > keep {
            self.shrink(i, keep, bytes)
        } else {
            0
        }
    }

    /// Lower slot `i` towards `keep`, removing at most `most` (what the
    /// caller gave: a give never carries off more than its own units, so
    /// that units leased before it stay in the slot for a refusal's sweep
    /// instead of travelling in a giver's hands where no sweep sees them).
    /// Returns what was removed.
    fn shrink(&self, i: usize, keep: u64, most: u64) -> u64 {
        let slot = &self.slots[slot_index::<N>(i)].0;
        let mut cur = slot.load(Ordering::Relaxed);
        loop {
            if cur <= keep {
                return 0;
            }
            let new = cur.saturating_sub(most).max(keep);
            match slot.compare_exchange_weak(cur, new, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => return cur - new,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Empty every slot, whoever holds it and whatever it is doing; returns
    /// the units taken, which the caller puts back. A holder taking from its
    /// slot at the same moment either took first (its units are its own now)
    /// or finds the slot empty and goes to the pool.
    pub fn reclaim(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.0.swap(0, Ordering::SeqCst))
            .sum()
    }

    /// Close the slots for good and empty them; returns the bytes taken.
    pub fn close(&self) -> u64 {
        self.state.fetch_or(CLOSED, Ordering::SeqCst);
        self.reclaim()
    }

    /// A refusal starts reclaiming: until [`unpress`](Self::unpress), no
    /// refill begins and no settlement keeps its bytes leased.
    pub fn press(&self) {
        self.state.fetch_add(PRESS, Ordering::SeqCst);
    }

    /// Undo [`press`](Self::press).
    pub fn unpress(&self) {
        self.state.fetch_sub(PRESS, Ordering::SeqCst);
    }

    /// Start leasing a chunk, unless a refusal is reclaiming or the slots
    /// are closed (then the caller charges its allocation alone). On `true`
    /// the caller charges the chunk, fills its slot, and calls
    /// [`end_refill`](Self::end_refill).
    pub fn begin_refill(&self) -> bool {
        let mut cur = self.state.load(Ordering::Relaxed);
        loop {
            if cur >= PRESS || cur & REFILLS == REFILLS {
                return false;
            }
            match self.state.compare_exchange_weak(
                cur,
                cur + REFILL,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The refill begun by [`begin_refill`](Self::begin_refill) has filled
    /// its slot (or given up).
    pub fn end_refill(&self) {
        self.state.fetch_sub(REFILL, Ordering::SeqCst);
    }

    /// Whether a refill is leasing a chunk now.
    pub fn refilling(&self) -> bool {
        self.state.load(Ordering::SeqCst) & REFILLS != 0
    }

    /// Bytes leased and idle now, summed over the slots (not one atomic
    /// read: a concurrent fill or take may be half-seen).
    pub fn idle(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0u64, u64::saturating_add)
    }
}

/// What [`LeaseSlots::take`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// The units are the holder's.
    Taken,
    /// The slot holds fewer: go to the pool.
    Short,
    /// The slots are closed: the caller holds the units it took and must put
    /// them back into the pool, then go to the pool (which refuses, if it is
    /// closed with the slots).
    Closed,
}

/// What leases are leased from: a budget's bytes, or a counter's claims.
pub trait Pool {
    /// What a refused [`try_take`](Self::try_take) reports.
    type Refusal;

    /// Take `n` units; `credit` lowers the bar where the pool has one (see
    /// the budget's `try_charge`).
    fn try_take(&self, n: u64, credit: u64) -> Result<(), Self::Refusal>;

    /// Put back `n` units taken with [`try_take`](Self::try_take).
    fn put(&self, n: u64);

    /// Whether no reclaim could turn this refusal into an admission (a
    /// closed counter): the refusal is then reported at once.
    fn is_final(_refusal: &Self::Refusal) -> bool {
        false
    }
}

/// The lease protocol over [`LeaseSlots`]: each of `N` shards holds up to a
/// few chunks of a [`Pool`] and hands units out of them with no write to
/// the pool; a refusal takes back every idle chunk before it is final.
///
/// Invariants (on top of those of [`LeaseSlots`]):
/// * A lease is refilled only by taking from the pool first, `n + chunk`
///   when that fits and `n` alone otherwise, so a lease never causes a
///   refusal the pool without leases would not make.
/// * A refusal is reported only after the pool refused and a sweep of every
///   slot that came *before* that refusal found nothing leased
///   ([`reclaim_then_take`](Self::reclaim_then_take)); holders may be taking
///   from their slots at that moment. Refusals therefore stay exact: a take
///   is refused only if the units held by holders leave no room for it.
/// * Units given back keep at most two chunks in their shard's slot; the
///   rest go back to the pool at once.
/// * [`close`](Self::close) empties the slots for good: no unit stays leased
///   after it, and no take succeeds from a slot.
#[derive(Debug)]
pub struct Leases<const N: usize> {
    slots: LeaseSlots<N>,
    /// Units a refill leases beyond the take; zero: leases are off.
    chunk: u64,
    /// Held by whoever takes idle leases back (a refusal's reclaim loop, a
    /// `reclaim`): the units a sweep has taken are in its hands until it
    /// puts them back, where neither the pool nor another refusal's sweep
    /// sees them. One sweeper at a time means a refusal never counts
    /// another's. Only the slow paths take it; no backend, driver or user
    /// code runs under it.
    sweeping: Mutex<()>,
}

impl<const N: usize> Leases<N> {
    /// Leases of `chunk` units beyond each take that runs short; zero turns
    /// leasing off (every take goes to the pool).
    pub fn new(chunk: u64) -> Self {
        Self {
            slots: LeaseSlots::new(),
            chunk,
            sweeping: Mutex::new(()),
        }
    }

    /// Whether takes go through leases at all.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.chunk > 0
    }

    /// Take `n` units for a holder on `shard` out of its lease (the fast
    /// path); on `false`, [`take_from_pool`](Self::take_from_pool).
    #[inline]
    pub fn take_leased<P: Pool>(&self, pool: &P, shard: usize, n: u64) -> bool {
        match self.slots.take(shard, n) {
            Take::Taken => true,
            Take::Short => false,
            Take::Closed => {
                pool.put(n);
                false
            }
        }
    }

    /// Take `n` units for a holder on `shard` that its lease could not
    /// serve: by a refill, else by reclaiming every idle lease first. The
    /// pool's refusal is final only then.
    #[cold]
    pub fn take_from_pool<P: Pool>(
        &self,
        pool: &P,
        shard: usize,
        n: u64,
        credit: u64,
    ) -> Result<(), P::Refusal> {
        match self.refill(pool, shard, n, credit) {
            Ok(()) => Ok(()),
            Err(r) if P::is_final(&r) => Err(r),
            Err(_) => self.reclaim_then_take(pool, n, credit),
        }
    }

    /// Take `n` units from the pool for a holder on `shard`, leasing a chunk
    /// more when it fits.
    fn refill<P: Pool>(
        &self,
        pool: &P,
        shard: usize,
        n: u64,
        credit: u64,
    ) -> Result<(), P::Refusal> {
        if let Some(with_chunk) = n.checked_add(self.chunk) {
            if self.chunk > 0 && self.slots.begin_refill() {
                let leased = pool.try_take(with_chunk, credit).is_ok();
                if leased {
                    let back = self.slots.fill(shard, self.chunk);
                    if back > 0 {
                        pool.put(back);
                    }
                }
                self.slots.end_refill();
                if leased {
                    return Ok(());
                }
            }
        }
        pool.try_take(n, credit)
    }

    /// Take back every idle lease into the pool; returns the units taken.
    pub fn reclaim<P: Pool>(&self, pool: &P) -> u64 {
        let _one = lock_model(&self.sweeping);
        self.sweep(pool)
    }

    /// [`reclaim`](Self::reclaim) with `sweeping` held by the caller.
    fn sweep<P: Pool>(&self, pool: &P) -> u64 {
        let taken = self.slots.reclaim();
        if taken > 0 {
            pool.put(taken);
        }
        taken
    }

    /// The last word on a take that the lease and a refill could not serve:
    /// take back every idle lease and ask the pool again, until it admits
    /// the take, or refuses it and then no refill is in flight and a sweep
    /// finds nothing leased (see [`LeaseSlots`] for why that is exact).
    /// Holders keep taking meanwhile; no refill begins and no give keeps its
    /// units until this returns, so the loop waits only for refills that
    /// began before it (a take from the pool and a store each).
    pub fn reclaim_then_take<P: Pool>(
        &self,
        pool: &P,
        n: u64,
        credit: u64,
    ) -> Result<(), P::Refusal> {
        let one = lock_model(&self.sweeping);
        self.slots.press();
        self.sweep(pool);
        let result = loop {
            // A refill that began before `press` holds units the pool
            // counts and no slot shows (and may hand them back to the pool
            // rather than to its slot, as `press` makes `fill` keep
            // nothing): wait it out *before* asking the pool, so that a
            // refusal never counts a chunk in flight.
            if self.slots.refilling() {
                super::spin();
                continue;
            }
            match pool.try_take(n, credit) {
                Ok(()) => break Ok(()),
                Err(r) if P::is_final(&r) => break Err(r),
                Err(r) => {
                    if self.sweep(pool) == 0 {
                        // No refill in flight when the pool refused, and
                        // nothing leased since: every unit the pool counted
                        // was a holder's (or a give's in progress, which
                        // the refusal precedes).
                        break Err(r);
                    }
                }
            }
        };
        self.slots.unpress();
        drop(one);
        result
    }

    /// A holder on `shard` gives `n` units back: into the shard's lease,
    /// which keeps at most two chunks; the rest goes back to the pool.
    #[inline]
    pub fn give<P: Pool>(&self, pool: &P, shard: usize, n: u64) {
        let back = self.slots.give(shard, n, self.chunk.saturating_mul(2));
        if back > 0 {
            pool.put(back);
        }
    }

    /// Close the leases for good and put back what they held.
    pub fn close<P: Pool>(&self, pool: &P) {
        let taken = self.slots.close();
        if taken > 0 {
            pool.put(taken);
        }
    }

    /// Units leased and idle now (see [`LeaseSlots::idle`]).
    pub fn idle(&self) -> u64 {
        self.slots.idle()
    }
}

impl<const N: usize> Default for LeaseSlots<N> {
    fn default() -> Self {
        Self::new()
    }
}
