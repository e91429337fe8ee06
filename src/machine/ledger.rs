//! The ledger's protocol: one word `G` in the header holds the bytes
//! charged on the machine (in [`UNIT`]s); each slot holds its own share `W`
//! and the one operation it has in flight `C`. A charge or a return moves
//! `G` and `W` together, crash-safely, with compare-and-swaps only.
//!
//! # The protocol
//!
//! ```text
//! G = total units (32 bits) | tag slot (8 bits) | tag sequence (24 bits)
//! W = units (40 bits) | applied sequence (24 bits)        one per slot
//! C = sequence (24 bits) | delta in units (40 bits, signed) one per slot
//! ```
//!
//! The total's 32 bits of [`UNIT`]s hold 16 TiB less one unit
//! ([`MAX_TOTAL_BYTES`]): a ledger is never created with a larger limit.
//! A share and a delta are wider than the total, so every change the
//! total can take fits them.
//!
//! An operation of slot `i` with sequence `q` (the slot's last applied
//! sequence plus one, modulo 2^24):
//!
//! 1. writes its claim `C_i = (q, delta)`;
//! 2. *commits*: a compare-and-swap of `G` from `(T, t, p)` to
//!    `(T + delta, i, q)`, after *helping* `(t, p)` (below) and checking
//!    the limits against `T + delta`; a refusal leaves `G` alone;
//! 3. *applies*: a compare-and-swap of `W_i` from `(w, q - 1)` to
//!    `(w + delta, q)`.
//!
//! Helping: whoever is about to replace a tag `(t, p)` in `G` first
//! applies `t`'s claim if it has sequence `p` and is not applied yet (the
//! same compare-and-swap as step 3; one of the two wins, the other sees
//! `W_t` at `p`). So at any moment at most one committed operation is not
//! applied, and `G`'s tag names it.
//!
//! # What a crash leaves, and how it is recovered
//!
//! A process can die between any two instructions. Its slot's share of
//! `G` is then exactly `W_i` once the tag is helped: if its last claim was
//! committed, the tag names it (it is applied by helping) or someone
//! replaced the tag (and applied it first); otherwise `G` never saw it.
//! Reclaiming a dead slot is therefore: take the slot (its lock, then a
//! compare-and-swap of its state word from the dead owner's to
//! "reclaiming by me": two sweepers cannot both win), help `G`'s tag, and
//! run one operation of `-W_i` on the slot's behalf through the same three
//! steps. A reclaimer that dies meanwhile drops the lock and is itself
//! dead to the next sweeper, which takes the slot over and finds the same
//! consistent state.
//!
//! # Who is dead
//!
//! A slot's holder keeps the slot's lock (an open-file-description lock on
//! the slot's byte of the segment file, `segment.rs`) from before it claims
//! the slot until after the slot is free again, and so does a reclaimer.
//! The kernel drops the lock when the process dies, however it dies. A
//! slot whose state word is not free while its lock can be taken has no
//! living holder: that, and nothing about pids, `/proc` or thread states,
//! is what [`sweep`] acts on. See `docs/sharing-a-gpu.md`, "Liveness".
//!
//! # Nothing is clamped
//!
//! An operation's owner checks that its share covers a give-back before it
//! claims it, and the commit checks the total does (and that a charge
//! stays within the total's 32 bits): an impossible change is refused,
//! counted in the audit word, and changes nothing. A share a helper would
//! apply below 0 exists only in a segment written by something else; it is
//! counted too.
//!
//! # The sequence
//!
//! The sequence is 24 bits, counted modulo 2^24 (`seq_next`,
//! `seq_prev`): helping re-reads `G` after reading the claim, so a helper
//! is misled only if `G` returned to the very same value (total and tag)
//! across 16,777,216 operations of one slot between two of its loads, a
//! few instructions apart. At the fastest rate measured for one slot
//! (about 26 ns an operation, `docs/sharing-a-gpu.md`, "The sequence"),
//! that is the helper preempted at exactly that point for 0.43 s or more
//! while the other process does nothing but charge and return without a
//! lease: a bound, measured, not a proof.

use super::segment::{
    futex_wake, Segment, H_AUDIT, H_LEDGER, H_LIMIT, H_NEWS, H_OUTSIDE, H_OUTSIDE_PROCS,
    H_RECLAIMS, H_WAITERS, S_ANSWERED, S_ASK, S_C, S_CACHED, S_CONTEXTS, S_FLOOR, S_GAVE, S_LIMIT,
    S_PRIORITY, S_RING, S_START, S_STATE, S_USED, S_W, S_WAITING, UNIT,
};
use std::sync::atomic::Ordering::{Relaxed, SeqCst};

/// The ledger word.
pub(crate) struct G;

const TOTAL_BITS: u32 = 32;
const TOTAL_MASK: u64 = (1 << TOTAL_BITS) - 1;
/// The most bytes the ledger's total can hold: its 32 bits of units.
pub const MAX_TOTAL_BYTES: u64 = TOTAL_MASK * UNIT;
pub(crate) const NO_TAG: u64 = 0xff;
/// The width of a sequence, in `G`'s tag, `W` and `C` alike.
const SEQ_BITS: u32 = 24;
const SEQ_MASK: u32 = (1 << SEQ_BITS) - 1;
/// Where a sequence starts in `G` (above the total and the tag slot).
const G_SEQ_SHIFT: u32 = TOTAL_BITS + 8;
/// The width of a share in `W` and of a delta in `C`.
const UNITS_BITS: u32 = 64 - SEQ_BITS;

/// The sequence after `q`, modulo 2^24.
#[inline]
fn seq_next(q: u32) -> u32 {
    q.wrapping_add(1) & SEQ_MASK
}

/// The sequence before `q`, modulo 2^24.
#[inline]
fn seq_prev(q: u32) -> u32 {
    q.wrapping_sub(1) & SEQ_MASK
}

impl G {
    pub(crate) const EMPTY: u64 = NO_TAG << TOTAL_BITS;

    #[inline]
    pub(crate) fn pack(total: u64, slot: u64, seq: u32) -> u64 {
        debug_assert!(total <= TOTAL_MASK && slot <= NO_TAG && seq <= SEQ_MASK);
        total | (slot << TOTAL_BITS) | (u64::from(seq & SEQ_MASK) << G_SEQ_SHIFT)
    }

    #[inline]
    pub(crate) fn total(g: u64) -> u64 {
        g & TOTAL_MASK
    }

    #[inline]
    fn tag(g: u64) -> (u64, u32) {
        (
            (g >> TOTAL_BITS) & 0xff,
            (g >> G_SEQ_SHIFT) as u32 & SEQ_MASK,
        )
    }
}

const UNITS_MASK: u64 = (1 << UNITS_BITS) - 1;

#[inline]
pub(crate) fn w_units(w: u64) -> u64 {
    w & UNITS_MASK
}

#[inline]
pub(crate) fn w_applied(w: u64) -> u32 {
    (w >> UNITS_BITS) as u32 & SEQ_MASK
}

#[inline]
fn w_pack(units: u64, applied: u32) -> u64 {
    (units & UNITS_MASK) | (u64::from(applied & SEQ_MASK) << UNITS_BITS)
}

#[inline]
fn c_pack(seq: u32, delta: i64) -> u64 {
    ((delta as u64) & UNITS_MASK) | (u64::from(seq & SEQ_MASK) << UNITS_BITS)
}

#[inline]
fn c_seq(c: u64) -> u32 {
    (c >> UNITS_BITS) as u32 & SEQ_MASK
}

#[inline]
fn c_delta(c: u64) -> i64 {
    // Sign-extend the low 40 bits.
    (((c & UNITS_MASK) << SEQ_BITS) as i64) >> SEQ_BITS
}

/// The state word of a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Free,
    Claiming,
    Live,
    Reclaiming,
}

#[inline]
pub(crate) fn st_pack(kind: Kind, epoch: u32, pid: u32) -> u64 {
    let k = match kind {
        Kind::Free => 0u64,
        Kind::Claiming => 1,
        Kind::Live => 2,
        Kind::Reclaiming => 3,
    };
    (k << 62) | (u64::from(epoch & 0x3fff_ffff) << 32) | u64::from(pid)
}

#[inline]
pub(crate) fn st_kind(s: u64) -> Kind {
    match s >> 62 {
        0 => Kind::Free,
        1 => Kind::Claiming,
        2 => Kind::Live,
        _ => Kind::Reclaiming,
    }
}

#[inline]
pub(crate) fn st_epoch(s: u64) -> u32 {
    ((s >> 32) & 0x3fff_ffff) as u32
}

#[inline]
pub(crate) fn st_pid(s: u64) -> u32 {
    s as u32
}

/// Apply slot `t`'s claim of sequence `q` to `W_t` if it is not applied
/// yet. Called only for a claim `G` committed. Its operator checked that
/// the share covers a give-back before claiming it, so a delta that would
/// take the share below 0 (or past its width) is found only in a segment
/// written by something else: it is applied clamped, so that the slot's
/// sequence moves on, and counted as an audit finding
/// ([`H_AUDIT`], reported by `MachineLedger::check`).
fn apply(seg: &Segment, t: usize, q: u32, delta: i64) {
    let w = seg.slot(t, S_W);
    let mut cur = w.load(SeqCst);
    loop {
        if w_applied(cur) != seq_prev(q) {
            // Applied already (by the owner or another helper).
            return;
        }
        let want = i128::from(w_units(cur)) + i128::from(delta);
        let units = want.clamp(0, i128::from(UNITS_MASK)) as u64;
        match w.compare_exchange(cur, w_pack(units, q), SeqCst, SeqCst) {
            Ok(_) => {
                if i128::from(units) != want {
                    seg.word(H_AUDIT).fetch_add(1, Relaxed);
                }
                return;
            }
            Err(now) => cur = now,
        }
    }
}

/// Help the operation `G`'s tag names, as read in `g` (see the module
/// docs).
fn help(seg: &Segment, g: u64) {
    let (t, q) = G::tag(g);
    if t == NO_TAG || t as usize >= seg.slots() {
        return;
    }
    let t = t as usize;
    let c = seg.slot(t, S_C).load(SeqCst);
    if c_seq(c) != q {
        // The owner started another operation: it applied this one first.
        return;
    }
    if w_applied(seg.slot(t, S_W).load(SeqCst)) != seq_prev(q) {
        return;
    }
    // The claim read belongs to the commit `g` names only if `G` still
    // holds `g`.
    if seg.word(H_LEDGER).load(SeqCst) != g {
        return;
    }
    apply(seg, t, q, c_delta(c));
}

/// Apply the operation `G`'s tag names, as read in `g`, if it is still
/// pending (a reader's first step: see `snapshot_of`).
pub(crate) fn help_pending(seg: &Segment, g: u64) {
    help(seg, g);
}

/// Why an operation left the ledger as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// `fits` refused the total the commit would leave (units it saw).
    Limit { total_units: u64 },
    /// The change is impossible: a give-back beyond the slot's share or
    /// the ledger's total, or a total past its width. Counted as an audit
    /// finding; nothing changed.
    Impossible {
        /// The slot's share (units).
        share: u64,
        /// The ledger's total (units).
        total: u64,
        /// The change asked for (units).
        delta: i64,
    },
}

/// Run one operation of `delta` units for slot `i` (steps 1 to 3 of the
/// module docs). The caller is the slot's only operator: its owner (one
/// operation at a time) or the reclaimer that took it. `fits` sees the
/// total the commit would leave, and refuses by returning false; `None`
/// forces the commit (returns, outside records, claims). Nothing is
/// clamped: a give-back beyond the slot's share or the total, or a total
/// past its width, is refused as [`Refused::Impossible`] and counted in
/// [`H_AUDIT`].
pub(crate) fn operate(
    seg: &Segment,
    i: usize,
    delta: i64,
    fits: Option<&dyn Fn(u64) -> bool>,
) -> Result<u64, Refused> {
    let g_word = seg.word(H_LEDGER);
    // Our own previous operation is applied (we applied it, or it was
    // refused and left nothing): the sequence follows it.
    let w = seg.slot(i, S_W).load(SeqCst);
    let q = seq_next(w_applied(w));
    if delta == 0 {
        return Ok(G::total(g_word.load(SeqCst)));
    }
    let impossible = |total: u64| {
        seg.word(H_AUDIT).fetch_add(1, Relaxed);
        Err(Refused::Impossible {
            share: w_units(w),
            total,
            delta,
        })
    };
    // Only this operator changes `W_i` (helpers apply only what it
    // committed, and it committed nothing unapplied): the share read above
    // is the share the claim applies to.
    // A change wider than the total can never be committed (and would
    // not fit the claim's delta): refused before anything is written.
    if (delta < 0 && delta.unsigned_abs() > w_units(w)) || delta.unsigned_abs() > TOTAL_MASK {
        return impossible(G::total(g_word.load(SeqCst)));
    }
    seg.slot(i, S_C).store(c_pack(q, delta), SeqCst);
    let mut g = g_word.load(SeqCst);
    let after = loop {
        help(seg, g);
        let total = G::total(g);
        let after = if delta >= 0 {
            total.checked_add(delta as u64).filter(|&a| a <= TOTAL_MASK)
        } else {
            total.checked_sub(delta.unsigned_abs())
        };
        let Some(after) = after else {
            // Void the claim: nothing committed it.
            seg.slot(i, S_C).store(c_pack(q, 0), SeqCst);
            return impossible(total);
        };
        if delta > 0 {
            if let Some(fits) = fits {
                if !fits(after) {
                    // Void the claim: nothing committed it.
                    seg.slot(i, S_C).store(c_pack(q, 0), SeqCst);
                    return Err(Refused::Limit { total_units: total });
                }
            }
        }
        match g_word.compare_exchange(g, G::pack(after, i as u64, q), SeqCst, SeqCst) {
            Ok(_) => break after,
            Err(now) => g = now,
        }
    };
    apply(seg, i, q, delta);
    if delta < 0 {
        announce(seg);
    }
    Ok(after)
}

/// Tell the processes waiting for room that some may have appeared: bump
/// the news word and wake its waiters, when there are any (the count is
/// read after the change is published, and a waiter counts itself before
/// it looks: one of the two sees the other).
pub(crate) fn announce(seg: &Segment) {
    std::sync::atomic::fence(SeqCst);
    if seg.word32(H_WAITERS).load(SeqCst) > 0 {
        let news = seg.word32(H_NEWS);
        news.fetch_add(1, SeqCst);
        futex_wake(news);
    }
}

/// The total charged on the ledger, in units.
pub(crate) fn total_units(seg: &Segment) -> u64 {
    G::total(seg.word(H_LEDGER).load(SeqCst))
}

/// The state and start time (field 22, clock ticks since boot) of `pid`
/// from `/proc/<pid>/stat`.
pub(crate) fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: the
    // fields after it start after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // Fields 4..=21 come before the start time.
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// A dead process's slot, reclaimed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Reclaimed {
    /// The slot's index.
    pub slot: usize,
    /// The dead process.
    pub pid: u32,
    /// Its name.
    pub name: String,
    /// The bytes it held that came back.
    pub bytes: u64,
}

/// Reclaim slot `i`, seen in state `seen`, whose holder is dead (`dead`;
/// otherwise its owner leaving). The caller holds the slot's lock (see
/// `segment.rs`): a sweeper took it from the dead holder, a leaving owner
/// has held it since it joined; so no one else operates on the slot until
/// it is free and the lock dropped. `None` when the state word is no
/// longer `seen`.
///
/// What comes back is the slot's share once `G`'s tag is helped, and no
/// more than the total holds: a share the total does not cover (a segment
/// written by something else) is dropped from the slot and counted as an
/// audit finding, never taken from the others' bytes.
pub(crate) fn reclaim(
    seg: &Segment,
    i: usize,
    seen: u64,
    me: u32,
    dead: bool,
) -> Option<Reclaimed> {
    let state = seg.slot(i, S_STATE);
    let mine = st_pack(Kind::Reclaiming, st_epoch(seen), me);
    state.compare_exchange(seen, mine, SeqCst, SeqCst).ok()?;
    let pid = match st_kind(seen) {
        // A reclaimer died: the owner's pid is gone from the word, its
        // name is still in the slot.
        Kind::Reclaiming => 0,
        _ => st_pid(seen),
    };
    let name = seg.slot_name(i);
    help(seg, seg.word(H_LEDGER).load(SeqCst));
    let units = w_units(seg.slot(i, S_W).load(SeqCst));
    // Any claim not applied now was never committed: the next operation
    // reuses its sequence.
    let mut back = 0;
    if units > 0 {
        match operate(seg, i, -(units as i64), None) {
            Ok(_) => back = units,
            Err(_) => {
                // Counted by `operate`. The share is not the ledger's:
                // drop it from the slot alone.
                let w = seg.slot(i, S_W);
                let cur = w.load(SeqCst);
                let _ = w.compare_exchange(cur, w_pack(0, w_applied(cur)), SeqCst, SeqCst);
            }
        }
    }
    for off in [
        S_START, S_USED, S_CACHED, S_CONTEXTS, S_ASK, S_GAVE, S_LIMIT, S_FLOOR,
    ] {
        seg.slot(i, off).store(0, Relaxed);
    }
    seg.slot(i, S_PRIORITY).store(0, Relaxed);
    // A holder that died waiting for room left its waiters counted: take
    // them off, so that returns stop waking nobody.
    let waiting = seg.slot32(i, S_WAITING).swap(0, SeqCst);
    if waiting > 0 {
        seg.word32(H_WAITERS).fetch_sub(waiting, SeqCst);
    }
    seg.slot(i, S_ANSWERED)
        .store(u64::from(seg.slot32(i, S_RING).load(Relaxed)), Relaxed);
    seg.set_slot_name(i, "");
    seg.set_slot_sites(i, &[]);
    let _ = state.compare_exchange(mine, st_pack(Kind::Free, st_epoch(seen), 0), SeqCst, SeqCst);
    if dead {
        seg.word(H_RECLAIMS).fetch_add(1, Relaxed);
    }
    announce(seg);
    Some(Reclaimed {
        slot: i,
        pid,
        name,
        bytes: back * UNIT,
    })
}

/// Whether slot `i` has a living holder, as the kernel says: its lock is
/// held. A slot whose lock the kernel cannot report on counts as held (it
/// is never reclaimed on a guess).
pub(crate) fn held(seg: &Segment, i: usize) -> bool {
    seg.slot_held(i).unwrap_or(true)
}

/// Reclaim every slot whose holder is dead: whose lock can be taken (see
/// `segment.rs`). Cheap when nothing died: one load per slot and one
/// `fcntl(F_OFD_GETLK)` per occupied slot. Pids, `/proc` and thread
/// states play no part: a holder in another pid namespace, or one whose
/// main thread has exited, holds its lock as long as its process lives.
pub(crate) fn sweep(seg: &Segment) -> Vec<Reclaimed> {
    let me = std::process::id();
    let mut out = Vec::new();
    for i in 0..seg.slots() {
        let s = seg.slot(i, S_STATE).load(SeqCst);
        if st_kind(s) == Kind::Free || held(seg, i) {
            continue;
        }
        // Take the lock: from here no one else operates on the slot. A
        // holder that appeared since (a claimer of a slot that went free)
        // keeps it, and the state word is no longer `s`.
        let Ok(Some(lock)) = seg.lock_slot(i) else {
            continue;
        };
        out.extend(reclaim(seg, i, s, me, true));
        drop(lock);
    }
    out
}

/// Claim a free slot for process `pid` started at `start`: its lock
/// first, then a compare-and-swap of its state word from free to
/// claiming. Returns its index, epoch and lock, or `None` when the table
/// is full. The caller writes the slot's fields and then marks it live
/// (a compare-and-swap from claiming), holding the lock for as long as it
/// holds the slot.
pub(crate) fn claim_slot(
    seg: &Segment,
    pid: u32,
    start: u64,
) -> Option<(usize, u32, super::segment::SlotLock)> {
    for i in 0..seg.slots() {
        let state = seg.slot(i, S_STATE);
        if st_kind(state.load(SeqCst)) != Kind::Free {
            continue;
        }
        let Ok(Some(lock)) = seg.lock_slot(i) else {
            continue;
        };
        // Read again under the lock: the slot's last holder let its lock
        // go only after freeing it.
        let s = state.load(SeqCst);
        if st_kind(s) != Kind::Free || w_units(seg.slot(i, S_W).load(SeqCst)) != 0 {
            continue;
        }
        let epoch = st_epoch(s).wrapping_add(1) & 0x3fff_ffff;
        if state
            .compare_exchange(s, st_pack(Kind::Claiming, epoch, pid), SeqCst, SeqCst)
            .is_ok()
        {
            seg.slot(i, S_START).store(start, SeqCst);
            return Some((i, epoch, lock));
        }
    }
    None
}

/// Units the device uses that no slot charged, as last observed: the
/// larger of the driver's view (used less charged) and the management
/// library's (what it attributes to processes without a slot).
pub(crate) fn outside_units(seg: &Segment) -> u64 {
    seg.word(H_OUTSIDE)
        .load(Relaxed)
        .max(seg.word(H_OUTSIDE_PROCS).load(Relaxed))
}

/// [`outside_units`] in bytes.
pub(crate) fn outside_bytes(seg: &Segment) -> u64 {
    outside_units(seg).saturating_mul(UNIT)
}

/// The ledger's limit in bytes.
pub(crate) fn limit(seg: &Segment) -> u64 {
    seg.word(H_LIMIT).load(Relaxed)
}

/// Rebuild the ledger word from the slots: after helping its tag, the
/// total must be the sum of the slots' shares. Lock-free: a commit racing
/// it changes `G` and the repair tries again. Returns (before, after) in
/// units.
pub(crate) fn repair(seg: &Segment) -> (u64, u64) {
    let g_word = seg.word(H_LEDGER);
    // A free slot holds nothing: bytes written there were never charged.
    for i in 0..seg.slots() {
        if st_kind(seg.slot(i, S_STATE).load(SeqCst)) != Kind::Free {
            continue;
        }
        let w = seg.slot(i, S_W);
        let cur = w.load(SeqCst);
        if w_units(cur) != 0 {
            let _ = w.compare_exchange(cur, w_pack(0, w_applied(cur)), SeqCst, SeqCst);
        }
    }
    loop {
        let g = g_word.load(SeqCst);
        help(seg, g);
        let sum: u64 = (0..seg.slots())
            .map(|i| w_units(seg.slot(i, S_W).load(SeqCst)))
            .sum();
        let before = G::total(g);
        if before == sum {
            return (before, sum);
        }
        let (t, q) = G::tag(g);
        if g_word
            .compare_exchange(g, G::pack(sum.min(TOTAL_MASK), t, q), SeqCst, SeqCst)
            .is_ok()
        {
            return (before, sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_pack_and_unpack() {
        let whole = TOTAL_MASK as i64;
        for d in [0i64, 1, -1, 12345, whole, -whole, -(1 << 39), (1 << 39) - 1] {
            for q in [0, 1, 0xffff, 0x1_0000, SEQ_MASK] {
                let c = c_pack(q, d);
                assert_eq!((c_seq(c), c_delta(c)), (q, d));
            }
        }
        for (total, slot, q) in [(TOTAL_MASK, 17, 9), (0, NO_TAG, SEQ_MASK), (1, 0, 0x1_0000)] {
            let g = G::pack(total, slot, q);
            assert_eq!((G::total(g), G::tag(g)), (total, (slot, q)));
        }
        let w = w_pack(UNITS_MASK, SEQ_MASK);
        assert_eq!((w_units(w), w_applied(w)), (UNITS_MASK, SEQ_MASK));
        assert_eq!(
            UNITS_MASK >> TOTAL_BITS,
            0xff,
            "a share is wider than the total"
        );
        assert_eq!(MAX_TOTAL_BYTES, (16 << 40) - UNIT, "16 TiB less one unit");
        assert_eq!((seq_next(SEQ_MASK), seq_prev(0)), (0, SEQ_MASK));
        let s = st_pack(Kind::Reclaiming, 0x3fff_ffff, u32::MAX);
        assert_eq!(
            (st_kind(s), st_epoch(s), st_pid(s)),
            (Kind::Reclaiming, 0x3fff_ffff, u32::MAX)
        );
    }

    /// Room coming back is announced on the news word to waiters, and
    /// only when someone waits (the hot path pays one load otherwise); a
    /// charge announces nothing.
    #[test]
    // Maps a file: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn returns_and_reclaims_announce_to_waiters() {
        let path =
            std::env::temp_dir().join(format!("memgov-ledger-unit-news-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let seg = Segment::open_or_create(&path, "unit", 4, 1 << 30, 0o600).unwrap();
        let news = || seg.word32(H_NEWS).load(SeqCst);
        operate(&seg, 0, 4, None).unwrap();
        operate(&seg, 0, -1, None).unwrap();
        assert_eq!(news(), 0, "nobody waits: no announcement");
        seg.word32(H_WAITERS).fetch_add(1, SeqCst);
        operate(&seg, 0, 2, None).unwrap();
        assert_eq!(news(), 0, "a charge makes no room");
        operate(&seg, 0, -2, None).unwrap();
        assert_eq!(news(), 1, "a return is announced");
        seg.slot(0, S_STATE)
            .store(st_pack(Kind::Live, 1, std::process::id()), SeqCst);
        let live = seg.slot(0, S_STATE).load(SeqCst);
        let r = reclaim(&seg, 0, live, std::process::id(), false).unwrap();
        assert_eq!(r.bytes, 3 * UNIT);
        assert!(news() >= 2, "a reclaim is announced");
        drop(seg);
        let _ = std::fs::remove_file(&path);
    }

    /// A ledger in a temporary file, slot 0 held by a process that has
    /// exited, slot 1 by this one; `set` writes the words a crash left.
    /// Slot 1's lock is held for the test's length (the returned file).
    fn crashed(
        name: &str,
        set: impl FnOnce(&Segment),
    ) -> (
        Segment,
        std::path::PathBuf,
        crate::machine::segment::SlotLock,
    ) {
        let path =
            std::env::temp_dir().join(format!("memgov-ledger-unit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let seg = Segment::open_or_create(&path, "unit", 4, 1 << 30, 0o600).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        seg.slot(0, S_STATE)
            .store(st_pack(Kind::Live, 1, dead), SeqCst);
        let lock = seg.lock_slot(1).unwrap().unwrap();
        seg.slot(1, S_STATE)
            .store(st_pack(Kind::Live, 1, std::process::id()), SeqCst);
        set(&seg);
        (seg, path, lock)
    }

    fn after_sweep(seg: &Segment) -> (u64, u64, Kind) {
        sweep(seg);
        (
            total_units(seg),
            w_units(seg.slot(0, S_W).load(SeqCst)),
            st_kind(seg.slot(0, S_STATE).load(SeqCst)),
        )
    }

    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_crash_at_each_step_of_an_operation_is_recovered_exactly() {
        // Died after committing, before applying: helping applies it, the
        // reclaim returns it.
        let (seg, p, _lock) = crashed("committed", |seg| {
            seg.slot(0, S_C).store(c_pack(1, 10), SeqCst);
            seg.word(H_LEDGER).store(G::pack(10, 0, 1), SeqCst);
        });
        assert_eq!(after_sweep(&seg), (0, 0, Kind::Free));
        let _ = std::fs::remove_file(p);
        // Died after writing its claim, before committing: nothing to undo.
        let (seg, p, _lock) = crashed("claimed", |seg| {
            seg.slot(0, S_C).store(c_pack(1, 10), SeqCst);
        });
        assert_eq!(after_sweep(&seg), (0, 0, Kind::Free));
        let _ = std::fs::remove_file(p);
        // Committed and applied, another slot committed since: its share
        // alone comes off.
        let (seg, p, _lock) = crashed("applied", |seg| {
            seg.slot(0, S_C).store(c_pack(1, 10), SeqCst);
            seg.slot(0, S_W).store(w_pack(10, 1), SeqCst);
            seg.slot(1, S_C).store(c_pack(1, 5), SeqCst);
            seg.slot(1, S_W).store(w_pack(5, 1), SeqCst);
            seg.word(H_LEDGER).store(G::pack(15, 1, 1), SeqCst);
        });
        assert_eq!(after_sweep(&seg), (5, 0, Kind::Free));
        assert_eq!(
            w_units(seg.slot(1, S_W).load(SeqCst)),
            5,
            "the live slot is untouched"
        );
        let _ = std::fs::remove_file(p);
        // A reclaimer died after writing the return of slot 0's 10 units:
        // the ledger word it left is `total` units tagged with `seq`.
        let reclaimer_died = |name: &str, total: u64, seq: u32| {
            crashed(name, |seg| {
                let dead = st_pid(seg.slot(0, S_STATE).load(SeqCst));
                seg.slot(0, S_STATE)
                    .store(st_pack(Kind::Reclaiming, 1, dead), SeqCst);
                seg.slot(0, S_W).store(w_pack(10, 1), SeqCst);
                seg.slot(0, S_C).store(c_pack(2, -10), SeqCst);
                seg.word(H_LEDGER).store(G::pack(total, 0, seq), SeqCst);
            })
        };
        // Before committing it: the next sweeper takes the slot over and
        // finishes ...
        let (seg, p, _lock) = reclaimer_died("reclaimer", 10, 1);
        assert_eq!(after_sweep(&seg), (0, 0, Kind::Free));
        let _ = std::fs::remove_file(p);
        // ... and after committing it, before applying.
        let (seg, p, _lock) = reclaimer_died("reclaimer-committed", 0, 2);
        assert_eq!(after_sweep(&seg), (0, 0, Kind::Free));
        let _ = std::fs::remove_file(p);
    }

    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_refused_commit_changes_nothing_and_the_next_reuses_its_sequence() {
        let (seg, p, _lock) = crashed("refused", |_| {});
        let fits = |after: u64| after <= 8;
        assert_eq!(operate(&seg, 1, 6, Some(&fits)).unwrap(), 6);
        assert!(operate(&seg, 1, 3, Some(&fits)).is_err());
        assert_eq!(
            (total_units(&seg), w_units(seg.slot(1, S_W).load(SeqCst))),
            (6, 6)
        );
        assert_eq!(operate(&seg, 1, 2, Some(&fits)).unwrap(), 8);
        assert_eq!(w_applied(seg.slot(1, S_W).load(SeqCst)), 2);
        assert_eq!(operate(&seg, 1, -8, None).unwrap(), 0);
        let _ = std::fs::remove_file(p);
    }

    /// A helper that read `G` is misled only if `G` comes back to the very
    /// same value (total and tag) before it looks again: a slot's
    /// operations that leave the total where it was must not bring the
    /// tag back within 65,536 of them (all a 16-bit sequence could tell
    /// apart), only after 2^24.
    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn the_ledger_word_does_not_repeat_within_65536_operations_of_a_slot() {
        let (seg, p, _lock) = crashed("no-repeat", |_| {});
        operate(&seg, 1, 1, None).unwrap();
        let before = seg.word(H_LEDGER).load(SeqCst);
        for k in 0..(1u32 << 16) {
            let delta = if k % 2 == 0 { -1 } else { 1 };
            operate(&seg, 1, delta, None).unwrap();
        }
        let after = seg.word(H_LEDGER).load(SeqCst);
        assert_eq!(G::total(after), G::total(before), "the total is back");
        assert_ne!(
            after, before,
            "G repeated after 65,536 operations: a preempted helper could apply a stale claim"
        );
        assert_eq!(G::tag(after), (1, 1 + (1 << 16)));
        let _ = std::fs::remove_file(p);
    }

    /// The sequence wraps from 2^24 - 1 to 0: operations across it commit
    /// and apply, and a claim of sequence 0 committed but not applied by a
    /// process that died (its share still at 2^24 - 1) is applied by
    /// helping and reclaimed exactly.
    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_sequence_crossing_its_width_wraps_to_0_and_applies() {
        let (seg, p, _lock) = crashed("wrap", |seg| {
            // Slot 1 (live) has run 2^24 - 2 operations and holds 5 units.
            seg.slot(1, S_W).store(w_pack(5, SEQ_MASK - 1), SeqCst);
            seg.word(H_LEDGER)
                .store(G::pack(5, 1, SEQ_MASK - 1), SeqCst);
        });
        assert_eq!(operate(&seg, 1, 3, None).unwrap(), 8);
        assert_eq!(w_applied(seg.slot(1, S_W).load(SeqCst)), SEQ_MASK);
        assert_eq!(operate(&seg, 1, -2, None).unwrap(), 6);
        let w = seg.slot(1, S_W).load(SeqCst);
        assert_eq!((w_units(w), w_applied(w)), (6, 0), "wrapped to 0");
        assert_eq!(G::tag(seg.word(H_LEDGER).load(SeqCst)), (1, 0));
        assert_eq!(operate(&seg, 1, 4, None).unwrap(), 10);
        assert_eq!(w_applied(seg.slot(1, S_W).load(SeqCst)), 1);
        let _ = std::fs::remove_file(p);

        // Slot 0 died after committing its operation of sequence 0 (7
        // units), before applying it; its share was 2 units at 2^24 - 1.
        let (seg, p, _lock) = crashed("wrap-crash", |seg| {
            seg.slot(0, S_W).store(w_pack(2, SEQ_MASK), SeqCst);
            seg.slot(0, S_C).store(c_pack(0, 7), SeqCst);
            seg.word(H_LEDGER).store(G::pack(9, 0, 0), SeqCst);
        });
        help_pending(&seg, seg.word(H_LEDGER).load(SeqCst));
        let w = seg.slot(0, S_W).load(SeqCst);
        assert_eq!((w_units(w), w_applied(w)), (9, 0), "helping applies it");
        assert_eq!(after_sweep(&seg), (0, 0, Kind::Free));
        assert_eq!(seg.word(H_AUDIT).load(SeqCst), 0);
        let _ = std::fs::remove_file(p);
    }

    /// A change wider than the total is refused before its claim is
    /// written, whatever the delta's sign: it could never be committed.
    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_change_wider_than_the_total_is_refused() {
        let (seg, p, _lock) = crashed("wide", |_| {});
        operate(&seg, 1, 1, None).unwrap();
        let too_wide = (TOTAL_MASK + 1) as i64;
        for delta in [too_wide, TOTAL_MASK as i64, 1 << 40, i64::MAX] {
            assert!(
                matches!(
                    operate(&seg, 1, delta, None),
                    Err(Refused::Impossible { .. })
                ),
                "{delta}"
            );
        }
        assert_eq!(total_units(&seg), 1);
        assert_eq!(c_delta(seg.slot(1, S_C).load(SeqCst)), 0, "claim voided");
        operate(&seg, 1, -1, None).unwrap();
        assert_eq!(total_units(&seg), 0);
        let _ = std::fs::remove_file(p);
    }

    #[test]
    // Reads /proc: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn this_process_start_time_is_read() {
        let (state, start) = proc_stat(std::process::id()).unwrap();
        assert!(state == 'R' || state == 'S', "{state}");
        assert!(start > 0);
    }

    /// A slot is held exactly while a description holds its lock, even one
    /// of this very process (the probe's description never locks), and a
    /// second holder cannot take it.
    #[test]
    // Maps a file and takes file locks: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_slot_is_held_exactly_while_its_lock_is() {
        let path =
            std::env::temp_dir().join(format!("memgov-ledger-unit-locks-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let seg = Segment::open_or_create(&path, "unit", 4, 1 << 30, 0o600).unwrap();
        assert_eq!(seg.slot_held(2), Some(false));
        let lock = seg.lock_slot(2).unwrap().expect("a free slot's lock");
        assert_eq!(seg.slot_held(2), Some(true));
        assert_eq!(seg.slot_held(1), Some(false), "one byte per slot");
        assert!(
            seg.lock_slot(2).unwrap().is_none(),
            "held by another description"
        );
        drop(lock);
        assert_eq!(seg.slot_held(2), Some(false));
        drop(seg);
        let _ = std::fs::remove_file(&path);
    }

    /// A give-back beyond the slot's share is refused and counted, never
    /// clamped into the total (which holds other slots' bytes).
    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn an_impossible_give_back_is_refused_and_audited() {
        let (seg, p, _lock) = crashed("impossible", |_| {});
        operate(&seg, 1, 17, None).unwrap();
        let r = operate(&seg, 2, -10, None);
        assert_eq!(
            r,
            Err(Refused::Impossible {
                share: 0,
                total: 17,
                delta: -10
            })
        );
        assert_eq!(total_units(&seg), 17, "the total is unchanged");
        assert_eq!(seg.word(H_AUDIT).load(SeqCst), 1);
        // The next operation of that slot is not disturbed.
        operate(&seg, 2, 3, None).unwrap();
        operate(&seg, 2, -3, None).unwrap();
        assert_eq!(total_units(&seg), 17);
        let _ = std::fs::remove_file(p);
    }

    /// A holder killed while it waited for room left the ledger's waiter
    /// count up (every return would then pay a futex wake): the sweep that
    /// reclaims its slot takes its waiters off.
    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_dead_waiters_count_is_repaired_by_the_sweep() {
        let (seg, p, _lock) = crashed("waiter", |seg| {
            // Slot 0 died inside make_room; slot 1 waits too.
            seg.word32(H_WAITERS).store(2, SeqCst);
            seg.slot32(0, S_WAITING).store(1, SeqCst);
            seg.slot32(1, S_WAITING).store(1, SeqCst);
        });
        sweep(&seg);
        assert_eq!(seg.word32(H_WAITERS).load(SeqCst), 1, "slot 1 still waits");
        assert_eq!(seg.slot32(0, S_WAITING).load(SeqCst), 0);
        let _ = std::fs::remove_file(p);
    }

    /// A dead slot whose share the total never counted gives nothing back
    /// from the total: the other slots' bytes stay charged.
    #[test]
    // Maps a file and spawns a process: outside what Miri's isolation allows.
    #[cfg_attr(miri, ignore)]
    fn a_reclaim_moves_only_what_the_total_holds() {
        let (seg, p, _lock) = crashed("unbacked", |seg| {
            // Slot 0 (dead) claims 10 units it never committed.
            seg.slot(0, S_W).store(w_pack(10, 0), SeqCst);
        });
        operate(&seg, 1, 5, None).unwrap();
        let r = sweep(&seg);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].bytes, 0, "{r:?}");
        assert_eq!(total_units(&seg), 5, "slot 1's 5 units are still charged");
        assert_eq!(w_units(seg.slot(0, S_W).load(SeqCst)), 0);
        assert_eq!(st_kind(seg.slot(0, S_STATE).load(SeqCst)), Kind::Free);
        assert!(seg.word(H_AUDIT).load(SeqCst) >= 1);
        let _ = std::fs::remove_file(p);
    }

    /// A reader of a slot's top sites sees one whole table a writer
    /// published, never parts of two: a writer alternates two tables whose
    /// every entry says which table it belongs to, and a reader on another
    /// thread checks each table it reads is all of one (or empty, before
    /// the first).
    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_slots_sites_are_read_whole() {
        use super::super::segment::SITE_ENTRIES;
        let path =
            std::env::temp_dir().join(format!("memgov-ledger-unit-sites-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let seg =
            std::sync::Arc::new(Segment::open_or_create(&path, "unit", 4, 1 << 30, 0o600).unwrap());
        let table = |t: u64| -> Vec<(String, u64)> {
            (0..SITE_ENTRIES as u64)
                .map(|k| (format!("table {t} entry {k}"), t))
                .collect()
        };
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (seg, stop) = (seg.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(SeqCst) {
                    seg.set_slot_sites(1, &table(1 + n % 2));
                    n += 1;
                }
                n
            })
        };
        let mut whole = 0;
        for _ in 0..20_000 {
            let read = seg.slot_sites(1);
            if read.is_empty() {
                continue;
            }
            let t = read[0].1;
            assert_eq!(read, table(t), "a table read half rewritten");
            whole += 1;
        }
        stop.store(true, SeqCst);
        let written = writer.join().unwrap();
        assert!(written > 0 && whole > 0, "{written} written, {whole} read");
        seg.set_slot_sites(1, &[]);
        assert!(seg.slot_sites(1).is_empty());
        drop(seg);
        let _ = std::fs::remove_file(&path);
    }
}
