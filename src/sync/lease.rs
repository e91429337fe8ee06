use super::{AtomicU64, Ordering};

/// Budget bytes leased to one shard of streams: already charged to the
/// budget, not yet charged to any allocation.
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
/// Invariants, enforced here and nowhere else:
/// * every byte in a slot is charged to the budget that leased it: bytes enter
///   a slot only through [`fill`](Self::fill) and [`give`](Self::give), whose
///   callers charged them, and leave it only through [`take`](Self::take)
///   (they become an allocation's charge) or [`reclaim`](Self::reclaim) and
///   the excess returned by `give` (the caller uncharges exactly what it is
///   handed). No byte is ever counted twice: each of those is one
///   read-modify-write of the slot, and all of them are totally ordered on it.
/// * a `take` that succeeds never drives a slot below zero: it checks and
///   subtracts in one compare-and-swap, so a `reclaim` racing it takes either
///   the bytes before the take or the rest after it, never both.
/// * once [`close`](Self::close) has run, no byte stays in a slot: a `fill` or
///   `give` that lands after close's sweep of its slot sees the closed flag
///   (SeqCst on both sides, as in `Notifier`) and hands its bytes back to the
///   caller to uncharge.
/// * a chunk is leased only between [`begin_refill`](Self::begin_refill)
///   (which fails while a refusal is reclaiming or the slots are closed) and
///   [`end_refill`](Self::end_refill), and the caller charges the budget and
///   fills the slot in between. A refusal that, after the budget refused it,
///   sees no refill in flight ([`refilling`](Self::refilling)) and then
///   sweeps every slot empty was exact: every chunk the budget counted when it
///   refused was either swept or had already become an allocation's charge
///   (both are read-modify-writes of the state word, so a refill whose chunk
///   the budget counted ended before the check, and its fill before that).
/// * while a refusal is reclaiming ([`press`](Self::press) to
///   [`unpress`](Self::unpress)) `give` keeps nothing and no refill begins,
///   so the refusal's loop waits only for refills that began before it.
#[derive(Debug)]
pub(crate) struct LeaseSlots<const N: usize> {
    slots: [Slot; N],
    /// `CLOSED`, the refusals between `press` and `unpress` (`PRESS` each)
    /// and the refills between `begin_refill` and `end_refill` (`REFILL`
    /// each).
    state: AtomicU64,
}

impl<const N: usize> LeaseSlots<N> {
    pub(crate) fn new() -> Self {
        Self {
            slots: std::array::from_fn(|_| Slot(AtomicU64::new(0))),
            state: AtomicU64::new(0),
        }
    }

    /// Charge `bytes` to an allocation out of slot `i`'s lease, if it holds
    /// that many.
    #[inline]
    pub(crate) fn take(&self, i: usize, bytes: u64) -> bool {
        let slot = &self.slots[i].0;
        let mut cur = slot.load(Ordering::Relaxed);
        loop {
            if cur < bytes {
                return false;
            }
            match slot.compare_exchange_weak(cur, cur - bytes, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Put `bytes` the caller has just charged to the budget into slot `i`.
    /// Returns what the caller must uncharge again: zero, or all of it when
    /// the slots are closed.
    #[inline]
    pub(crate) fn fill(&self, i: usize, bytes: u64) -> u64 {
        self.give(i, bytes, u64::MAX)
    }

    /// Give `bytes` (still charged to the budget) back to slot `i`, keeping
    /// at most `keep` bytes there. Returns what the caller must uncharge: the
    /// part above `keep`, or everything once the slots are closed.
    #[inline]
    pub(crate) fn give(&self, i: usize, bytes: u64, keep: u64) -> u64 {
        let slot = &self.slots[i].0;
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
            self.shrink(i, keep)
        } else {
            0
        }
    }

    /// Lower slot `i` to at most `keep` bytes; returns what was removed.
    fn shrink(&self, i: usize, keep: u64) -> u64 {
        let slot = &self.slots[i].0;
        let mut cur = slot.load(Ordering::Relaxed);
        loop {
            if cur <= keep {
                return 0;
            }
            match slot.compare_exchange_weak(cur, keep, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => return cur - keep,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Empty every slot, whoever holds it and whatever it is doing; returns
    /// the bytes taken, which the caller uncharges. A holder taking from its
    /// slot at the same moment either took first (its bytes are an
    /// allocation's now) or finds the slot empty and charges the budget.
    pub(crate) fn reclaim(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.0.swap(0, Ordering::SeqCst))
            .sum()
    }

    /// Close the slots for good and empty them; returns the bytes taken.
    pub(crate) fn close(&self) -> u64 {
        self.state.fetch_or(CLOSED, Ordering::SeqCst);
        self.reclaim()
    }

    /// A refusal starts reclaiming: until [`unpress`](Self::unpress), no
    /// refill begins and no settlement keeps its bytes leased.
    pub(crate) fn press(&self) {
        self.state.fetch_add(PRESS, Ordering::SeqCst);
    }

    /// Undo [`press`](Self::press).
    pub(crate) fn unpress(&self) {
        self.state.fetch_sub(PRESS, Ordering::SeqCst);
    }

    /// Start leasing a chunk, unless a refusal is reclaiming or the slots
    /// are closed (then the caller charges its allocation alone). On `true`
    /// the caller charges the chunk, fills its slot, and calls
    /// [`end_refill`](Self::end_refill).
    pub(crate) fn begin_refill(&self) -> bool {
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
    pub(crate) fn end_refill(&self) {
        self.state.fetch_sub(REFILL, Ordering::SeqCst);
    }

    /// Whether a refill is leasing a chunk now.
    pub(crate) fn refilling(&self) -> bool {
        self.state.load(Ordering::SeqCst) & REFILLS != 0
    }

    /// Bytes leased and idle now, summed over the slots (not one atomic
    /// read: a concurrent fill or take may be half-seen).
    pub(crate) fn idle(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0u64, u64::saturating_add)
    }
}
