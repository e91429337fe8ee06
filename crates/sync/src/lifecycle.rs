//! The lifecycle of one context, apart from its backend: the phase, the pins
//! and their leases, the pending releases, the backend gate, the waiters for
//! all of them, and the transitions (retire, loss, force, teardown, the
//! background reap) that move it forward.
//!
//! The governor's record holds one [`Lifecycle`] next to its backend and
//! asks it *when*: [`Lifecycle::begin_teardown`] hands exactly one caller a
//! [`Destroyer`], the proof that it alone tears the backend down, with the
//! gate closed and drained; [`Lifecycle::begin_force`] hands one caller a
//! [`Forcing`]; and the reaper hook is called once, when a retiring context
//! that nobody attends has drained. The governor then calls the backend (or
//! starts the reaper) with no lock held.
//!
//! The sequences the governor runs between two transitions live here too,
//! so that the order of their steps is written once: a backend call holds a
//! [`GateClaim`] ([`Lifecycle::enter`]); a buffer's pin moves into a pending
//! release through a [`Deferral`] taken under that claim
//! ([`GateClaim::defer_pin`]: counted pending first, the pin given up
//! second); the release leaves pending by [`Lifecycle::settle`] (on whatever
//! thread fires its signal) or [`Deferral::undo`]. The loom models in
//! `tests/loom.rs` drive these, not a copy of them.
//!
//! ```
//! use memgov_sync::Lifecycle;
//! let life = Lifecycle::<2>::new(8, 0, false, Box::new(|| true));
//! life.acquire_pin_on(1).unwrap(); // a buffer's pin
//! // Its release, queued on a stream of shard 1:
//! let claim = life.enter(1).expect("the gate is open");
//! let deferral = claim.defer_pin(); // counted pending; the pin is still held
//! // ... the backend queues the free here ...
//! deferral.queued(); // the pin goes
//! drop(claim);
//! assert_eq!((life.pin_count(), life.pending_count()), (0, 1));
//! life.settle(1); // the free executed: its signal settles the release
//! assert_eq!(life.pending_count(), 0);
//! ```
//!
//! # Invariants
//!
//! * `pins` counts every holder that must finish before teardown, plus the
//!   idle claims of the pin leases (`pin_leases`: a stream's pins come out
//!   of its shard's lease and go back into a shard's lease). Retire and loss
//!   close the leases before the word ([`close_pins`](Lifecycle::close_pins)),
//!   so that no pin is taken once either has run, and the idle claims are
//!   back on the word by the time it closes. A pin that moves into a pending
//!   release is counted in `pending` *before* it leaves `pins`: one
//!   [`Deferral`] does both, in that order ([`GateClaim::defer_pin`] counts,
//!   the deferral's drop gives the pin up), so the two never read zero
//!   together early. Nothing else counts a release pending.
//! * `pending` is counted per shard (`ShardedCount`): a release is counted on
//!   the shard of the stream it was queued on, and leaves it there. Only
//!   after [`begin_retire`](Lifecycle::begin_retire) closes the shards can
//!   the total reach zero. It carries the drain waiters in its total: a
//!   waiter registers there before its first check, and the settlement's own
//!   read-modify-write tells it whether to wake. A release leaves it by its
//!   settlement ([`Lifecycle::settle`]) or by the undo of a refused queueing
//!   ([`Deferral::undo`], with the pin still held).
//! * `gate` counts backend calls in flight, one claim word per shard. A
//!   [`GateClaim`] holds one, and is the only way to take one; teardown and
//!   force close every shard and wait for all of them to drain, so a
//!   [`Destroyer`] or a [`Forcing`] proves that no call is in flight and
//!   none can start.
//! * The phase only moves forward: Active -> Retiring ([`begin_retire`](Lifecycle::begin_retire)),
//!   Retiring -> Terminating by compare-and-swap ([`begin_teardown`](Lifecycle::begin_teardown),
//!   whose winner alone gets the `Destroyer`), Terminating -> Terminated
//!   ([`Destroyer::terminated`]).
//! * Every event that can make "retiring, drained, nobody attends" true
//!   (last pin, last pending release, loss, last attendant gone) checks it
//!   after its own write, behind a SeqCst fence, so of two racing events the
//!   later one sees both; the reaper hook is called by the one that claims
//!   `reaping` (a swap), once.
//! * Admission waiters register in `settle_epoch` and fence before their
//!   attempt; a settlement fences and bumps the epoch only if it sees one
//!   ([`announce_settlement`](Lifecycle::announce_settlement)).
//! * No lock of this type is held while the reaper hook, a waker or the
//!   caller's code runs.

use super::{
    fence, AcquireError, ClaimCounter, ClaimShards, Entry, EpochWord, Leases, Notifier, Ordering,
    Pool, ShardedCount, MAX_CLAIMS,
};
#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize};
use std::fmt;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize};
use std::task::Waker;
use std::time::Instant;

/// Where a context is in its life. It only moves forward (see the module
/// invariants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Accepting work.
    Active = 0,
    /// New pins are refused; teardown waits for what is outstanding.
    Retiring = 1,
    /// One caller is tearing the backend down.
    Terminating = 2,
    /// Torn down.
    Terminated = 3,
}

impl Phase {
    #[inline]
    fn from_word(v: u8) -> Self {
        match v {
            0 => Self::Active,
            1 => Self::Retiring,
            2 => Self::Terminating,
            _ => Self::Terminated,
        }
    }
}

/// Starts the background teardown of a retiring, drained context that
/// nobody attends; called at most once at a time, with no lock held, on the
/// thread of the event that drained it (which may be a driver callback
/// thread: the hook must not tear down there). Returns false if it could
/// not start one: the claim is undone, and the next such event (or a
/// waiting retirer) finishes the context instead.
pub type Reaper = Box<dyn Fn() -> bool + Send + Sync>;

/// The lifecycle of one context (its invariants head `lifecycle.rs`), with `N`
/// shards of streams for the pin leases, the pending count and the gate.
pub struct Lifecycle<const N: usize> {
    pins: ClaimCounter,
    /// Chunks of `pins` leased to shards of streams.
    pin_leases: Leases<N>,
    /// Pending releases per shard, and the drain waiters.
    pending: ShardedCount<N>,
    /// Backend calls in flight, per shard.
    gate: ClaimShards<N>,
    phase: AtomicU8,
    lost: AtomicBool,
    forced: AtomicBool,
    /// Live attendants (the governor's `RetireHandle`s): while there is
    /// one, its owner finishes the teardown; with none, the event that
    /// drains the context calls the reaper hook.
    attended: AtomicUsize,
    /// Whether the reaper hook was called (and did not give up).
    reaping: AtomicBool,
    /// Whether any admission waiter can exist: without, a settlement skips
    /// even the fence of `announce_settlement`.
    waits_for_settlements: bool,
    /// Woken when `pins`, `pending` or `gate` reach zero, and at termination.
    waiters: Notifier,
    /// Woken when a release settles while an admission waiter is registered
    /// in `settle_epoch`, and on retire, loss and termination.
    pub settled: Notifier,
    /// Bumped by a settlement while an admission waiter is registered in it.
    pub settle_epoch: EpochWord,
    /// Why the device was declared lost. A bookkeeping mutex (always `std`),
    /// held only to copy the string.
    lost_reason: std::sync::Mutex<Option<String>>,
    reaper: Reaper,
}

impl<const N: usize> fmt::Debug for Lifecycle<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lifecycle")
            .field("phase", &self.phase())
            .field("lost", &self.is_lost())
            .field("forced", &self.is_forced())
            .field("pins", &self.pin_count())
            .field("pending", &self.pending_count())
            .finish_non_exhaustive()
    }
}

/// One backend call in flight: a claim of one gate shard, given back when
/// dropped. Teardown and force wait for every claim to be given back.
#[must_use = "the gate claim is given back when dropped"]
pub struct GateClaim<'a, const N: usize> {
    life: &'a Lifecycle<N>,
    shard: usize,
}

impl<'a, const N: usize> GateClaim<'a, N> {
    /// The holder of a pin releases it into a pending release queued on a
    /// stream of this claim's shard: count the release pending now, and
    /// keep the pin in the returned [`Deferral`] until the backend has
    /// queued the free. Pending first, pin second: in between, the pin
    /// keeps `pins` + `pending` above zero (which is also what
    /// `ShardedCount` needs of an increment on a closed shard). Under a gate
    /// claim, so that `force`, which reads the live counts once the gate has
    /// drained, sees the buffer either live or released.
    #[inline]
    pub fn defer_pin(&self) -> Deferral<'a, N> {
        self.life.pending.increment(self.shard);
        Deferral {
            life: self.life,
            shard: self.shard,
        }
    }
}

impl<const N: usize> Drop for GateClaim<'_, N> {
    #[inline]
    fn drop(&mut self) {
        self.life.leave_gate(self.shard);
    }
}

/// A pin on its way into a pending release, from [`GateClaim::defer_pin`]:
/// the release is counted pending, and the pin is still held. Dropped (or
/// [`queued`](Self::queued)), it gives the pin up into its shard's lease,
/// also when the call that queues the free unwinds: the signal, fired or
/// dropped, settles the release on its own ([`Lifecycle::settle`]), and the
/// pin must not outlive the call. [`undo`](Self::undo) takes the release
/// back instead, and leaves the pin with the caller.
#[must_use = "the pin is given up when the deferral drops"]
pub struct Deferral<'a, const N: usize> {
    life: &'a Lifecycle<N>,
    shard: usize,
}

impl<const N: usize> Deferral<'_, N> {
    /// The backend queued the free, whose signal will settle the release:
    /// the pin goes now.
    #[inline]
    pub fn queued(self) {
        drop(self);
    }

    /// The backend refused the free, so no signal will settle the release:
    /// it leaves pending again (waking the drain waiters if it was the last
    /// one), and the pin stays with the caller, who gives it back (or moves
    /// it on) itself. The pin is still held while the release leaves, so
    /// the two never read zero together here either.
    #[inline]
    pub fn undo(self) {
        let this = std::mem::ManuallyDrop::new(self);
        this.life.pending_left(this.shard);
    }
}

impl<const N: usize> Drop for Deferral<'_, N> {
    #[inline]
    fn drop(&mut self) {
        self.life.release_pin_on(self.shard);
    }
}

/// What [`Lifecycle::begin_teardown`] decided.
#[must_use = "the winner must tear down and then call `Destroyer::terminated`"]
pub enum Teardown<'a, const N: usize> {
    /// This caller won Retiring -> Terminating and the gate is closed and
    /// drained: it tears the backend down now, then calls
    /// [`Destroyer::terminated`].
    Destroy(Destroyer<'a, N>),
    /// Another caller tore down; the phase is Terminated.
    Done,
}

/// The one caller that tears the backend down: no backend call is in
/// flight and none can start, and nothing else holds a `Destroyer`.
#[must_use = "the phase stays Terminating until `terminated` is called"]
pub struct Destroyer<'a, const N: usize> {
    life: &'a Lifecycle<N>,
}

impl<const N: usize> Destroyer<'_, N> {
    /// The backend is torn down and the caller's report is stored: move to
    /// Terminated and wake every waiter (teardown waiters, and admission
    /// waiters, which give up).
    pub fn terminated(self) {
        self.life
            .phase
            .store(Phase::Terminated as u8, Ordering::Release);
        self.life.waiters.notify();
        self.life.settled.notify();
    }
}

/// The one caller that forces a retiring context: the gate is closed and
/// drained, so no backend call is in flight and none can start, and the
/// live counts that only change under a gate claim are stable.
#[must_use = "the revoked pins must be given back with `revoke`"]
pub struct Forcing<'a, const N: usize> {
    life: &'a Lifecycle<N>,
}

impl<const N: usize> Forcing<'_, N> {
    /// Revoke `pins` claims whose holders (live buffers and streams, which
    /// reach the context only through the closed gate) can no longer give
    /// them back.
    pub fn revoke(self, pins: u64) {
        if self.life.pins.revoke(pins) {
            self.life.waiters.notify();
        }
    }
}

/// The pin word as the [`Pool`] of the pin leases: a lease of claims is
/// claims taken on `pins`, counted against the maximum like any other; a
/// refusal for the maximum takes back every idle lease first, so `Overflow`
/// stays exact, and a closed word refuses at once. Claims put back may drain
/// the closed word: then its waiters wake.
///
/// Teardown observes every pin taken from a lease: the claim stays on the
/// pin word from the refill that leased it until it is put back, which is
/// after its holder gave it back to the lease (and the lease's close, a
/// refusal's reclaim or the excess of a give put it back).
struct PinPool<'a, const N: usize>(&'a Lifecycle<N>);

impl<const N: usize> Pool for PinPool<'_, N> {
    type Refusal = AcquireError;

    #[inline]
    fn try_take(&self, n: u64, _credit: u64) -> Result<(), AcquireError> {
        self.0.pins.try_acquire_n(n)
    }

    #[inline]
    fn put(&self, n: u64) {
        if self.0.pins.release_n(n) {
            self.0.pins_drained();
        }
    }

    fn is_final(refusal: &AcquireError) -> bool {
        *refusal == AcquireError::Closed
    }
}

impl<const N: usize> Lifecycle<N> {
    /// An active context: at most `max_pins` pins, leased to shards in
    /// chunks of `pin_lease_chunk` (0: no leases), and `reaper` to start the
    /// background teardown. `waits_for_settlements`: whether an admission
    /// waiter can ever register in [`settle_epoch`](Self::settle_epoch).
    pub fn new(
        max_pins: u64,
        pin_lease_chunk: u64,
        waits_for_settlements: bool,
        reaper: Reaper,
    ) -> Self {
        Self {
            pins: ClaimCounter::new(max_pins),
            pin_leases: Leases::new(pin_lease_chunk),
            pending: ShardedCount::new(),
            gate: ClaimShards::new(MAX_CLAIMS),
            phase: AtomicU8::new(Phase::Active as u8),
            lost: AtomicBool::new(false),
            forced: AtomicBool::new(false),
            attended: AtomicUsize::new(0),
            reaping: AtomicBool::new(false),
            waits_for_settlements,
            waiters: Notifier::new(),
            settled: Notifier::new(),
            settle_epoch: EpochWord::new(),
            lost_reason: std::sync::Mutex::new(None),
            reaper,
        }
    }

    // ---- the gate -------------------------------------------------------

    /// Enter the gate for one backend call through `shard`'s claim word;
    /// `None` once teardown or force has closed it. The call runs while the
    /// returned claim lives.
    #[inline]
    pub fn enter(&self, shard: usize) -> Option<GateClaim<'_, N>> {
        if self.enter_gate(shard) {
            Some(GateClaim { life: self, shard })
        } else {
            None
        }
    }

    /// True if the caller now holds a claim of `shard`, which the
    /// [`GateClaim`] made of it gives back with exactly one
    /// [`leave_gate`](Self::leave_gate).
    #[inline]
    fn enter_gate(&self, shard: usize) -> bool {
        match self.gate.enter(shard) {
            Entry::Entered => true,
            Entry::Closed => false,
            Entry::ClosedDrained => {
                self.waiters.notify();
                false
            }
        }
    }

    /// Give back a claim of `shard` taken by [`enter_gate`](Self::enter_gate);
    /// the last one of a closed gate wakes teardown or force.
    #[inline]
    fn leave_gate(&self, shard: usize) {
        if self.gate.release(shard) {
            self.waiters.notify();
        }
    }

    /// Whether the gate is closed: by force or by teardown.
    #[inline]
    pub fn gate_closed(&self) -> bool {
        self.gate.is_closed()
    }

    // ---- pins -----------------------------------------------------------

    /// Take a pin from the pin word. At the maximum, idle pin leases are
    /// taken back first, so that `Overflow` is exact.
    #[inline]
    pub fn acquire_pin(&self) -> Result<(), AcquireError> {
        match self.pins.try_acquire() {
            Ok(()) => Ok(()),
            Err(e) => self.pin_refused(e),
        }
    }

    /// The pin word refused: at the maximum, with leases on, take back
    /// every idle lease and try again. Out of line, so that the hot path
    /// above carries nothing of it.
    #[cold]
    #[inline(never)]
    fn pin_refused(&self, e: AcquireError) -> Result<(), AcquireError> {
        match e {
            AcquireError::Overflow if self.pin_leases.enabled() => {
                self.pin_leases.reclaim_then_take(&PinPool(self), 1, 0)
            }
            e => Err(e),
        }
    }

    /// Take a pin for work on a stream of `shard` (below `N`): out of the
    /// shard's pin lease, refilled from the pin word when short.
    #[inline]
    pub fn acquire_pin_on(&self, shard: usize) -> Result<(), AcquireError> {
        if !self.pin_leases.enabled() {
            return self.acquire_pin();
        }
        if self.pin_leases.take_leased(&PinPool(self), shard, 1) {
            return Ok(());
        }
        self.refill_pin_lease(shard)
    }

    /// The shard's pin lease is empty: refill it from the pin word (once
    /// per chunk), else take back every idle lease and try again. Out of
    /// line, so that the take from the lease inlines alone.
    #[inline(never)]
    fn refill_pin_lease(&self, shard: usize) -> Result<(), AcquireError> {
        self.pin_leases.take_from_pool(&PinPool(self), shard, 1, 0)
    }

    /// Give back a pin taken with [`acquire_pin`](Self::acquire_pin) (or
    /// any pin, to the word): the last of a closed word wakes the teardown
    /// waiters and may start the background teardown.
    #[inline]
    pub fn release_pin(&self) {
        if self.pins.release() {
            self.pins_drained();
        }
    }

    /// Give back a pin taken for a stream of `shard` (below `N`): into the
    /// shard's pin lease, which keeps two chunks and puts the rest back on
    /// the pin word.
    #[inline]
    pub fn release_pin_on(&self, shard: usize) {
        if self.pin_leases.enabled() {
            self.pin_leases.give(&PinPool(self), shard, 1);
        } else {
            self.release_pin();
        }
    }

    /// The last claim of the closed pin word is gone.
    #[cold]
    fn pins_drained(&self) {
        self.waiters.notify();
        self.reap_if_unattended();
    }

    /// Pins held now: claims on the word less the idle leased ones (the two
    /// are read apart, so a pin moving between them may be half-seen).
    pub fn pin_count(&self) -> u64 {
        self.pins.count().saturating_sub(self.pin_leases.idle())
    }

    /// Claims on the pin word now: held pins and idle leased ones.
    pub fn pin_claims(&self) -> u64 {
        self.pins.count()
    }

    /// Pins leased to shards and idle now.
    pub fn leased_pins(&self) -> u64 {
        self.pin_leases.idle()
    }

    /// The most pins the context admits.
    pub fn max_pins(&self) -> u64 {
        self.pins.max()
    }

    /// No pin is acquired from now on: the pin leases close (their idle
    /// claims go back to the pin word, and no take from a lease succeeds
    /// after this), then the pin word closes. Returns true if nothing held
    /// the context then; its waiters are woken.
    fn close_pins(&self) -> bool {
        self.pin_leases.close(&PinPool(self));
        let drained = self.pins.close();
        if drained {
            self.waiters.notify();
        }
        drained
    }

    // ---- pending releases and settlements -------------------------------

    /// A release queued on a stream of `shard` (by a [`Deferral`]) settled:
    /// its free executed, or will never run. Call once the books of the
    /// release are settled: wakes the admission waiters, if one is
    /// registered ([`announce_settlement`](Self::announce_settlement)), then
    /// takes the release out of pending, which wakes the drain waiters if it
    /// was the last one and may start the background teardown. That step
    /// is last: from there the context may be torn down, and a drain waiter
    /// woken there may be a task's waker, running executor code.
    #[inline]
    pub fn settle(&self, shard: usize) {
        self.announce_settlement();
        self.pending_left(shard);
    }

    /// A release queued on a stream of `shard` left: settled, or undone.
    /// Wakes the drain waiters if it was the last one they waited for, and
    /// may start the background teardown.
    #[inline]
    fn pending_left(&self, shard: usize) {
        if self.pending.decrement(shard) {
            self.waiters.wake_all();
            self.reap_if_unattended();
        }
    }

    /// Pending releases now.
    pub fn pending_count(&self) -> u64 {
        self.pending.count()
    }

    /// A release settled (or a live buffer went with a lost device): wake
    /// the admission waiters, if one is registered. Nobody waiting, this
    /// writes nothing: a SeqCst fence and a load of a line only waiters
    /// write. The waiter registers (SeqCst) and fences before its attempt;
    /// of the two fences, whichever comes first in their total order, either
    /// the waiter's attempt sees what this settlement gave back, or this
    /// load sees the registration and bumps the epoch the waiter waits past.
    #[inline]
    pub fn announce_settlement(&self) {
        if !self.waits_for_settlements {
            return;
        }
        fence(Ordering::SeqCst);
        if self.settle_epoch.has_waiters() {
            let _ = self.settle_epoch.bump();
            self.settled.wake_all();
        }
    }

    // ---- state ----------------------------------------------------------

    /// The phase now.
    #[inline]
    pub fn phase(&self) -> Phase {
        Phase::from_word(self.phase.load(Ordering::Acquire))
    }

    /// Whether the device has been declared lost.
    #[inline]
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Whether force has revoked (or is revoking) live holders.
    pub fn is_forced(&self) -> bool {
        self.forced.load(Ordering::Acquire)
    }

    /// Why the device was declared lost, if it was (the flag is set an
    /// instant before the reason).
    pub fn lost_reason(&self) -> Option<String> {
        super::lock(&self.lost_reason).clone()
    }

    /// Whether new work is still admitted: not retiring, lost or torn down.
    #[inline]
    pub fn accepting(&self) -> bool {
        self.phase() == Phase::Active && !self.is_lost()
    }

    /// Everything teardown waits for has finished: no pins, and no pending
    /// release (a lost device's pending releases are given up by its
    /// teardown).
    pub fn drained(&self) -> bool {
        self.pins.is_drained() && (self.is_lost() || self.pending.is_zero())
    }

    // ---- transitions ----------------------------------------------------

    /// Stop accepting work: the phase moves to Retiring (returns true for
    /// the caller that moved it), pins are refused from now on, and
    /// admission waiters are woken to give up. Idempotent.
    pub fn begin_retire(&self) -> bool {
        let first = self
            .phase
            .compare_exchange(
                Phase::Active as u8,
                Phase::Retiring as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if first {
            // A permanent waiter in `pending`: from now on the settlement
            // that takes it to zero reports it (see `ShardedCount`), so that
            // a background teardown can start there. Then the shards close:
            // from now on each holds the total above zero only while it has
            // releases pending.
            self.pending.register();
            if self.pending.close() {
                self.waiters.wake_all();
            }
        }
        self.close_pins();
        // Admission waiters check `accepting()`: wake them to give up.
        self.settled.notify();
        first
    }

    /// Declare the device lost: pins are refused from now on, pending
    /// releases no longer hold the context, and every waiter wakes. Returns
    /// false if it already was.
    pub fn mark_lost(&self, reason: &str) -> bool {
        if self.lost.swap(true, Ordering::AcqRel) {
            return false;
        }
        *super::lock(&self.lost_reason) = Some(reason.to_owned());
        if self.close_pins() {
            // Nothing held the context: a retiring one may be reaped now.
            self.reap_if_unattended();
        }
        self.waiters.notify();
        self.settled.notify();
        true
    }

    /// An attendant (a `RetireHandle`) begins: its owner finishes the
    /// teardown. Counted before `begin_retire`, so that a context drained
    /// already is torn down by the attendant, not by a reaper.
    pub fn attend(&self) {
        self.attended.fetch_add(1, Ordering::SeqCst);
    }

    /// An attendant ends; with none left, a drained context is reaped.
    pub fn unattend(&self) {
        self.attended.fetch_sub(1, Ordering::SeqCst);
        self.reap_if_unattended();
    }

    /// Call the reaper hook if the context is retiring, drained, and nobody
    /// attends it. Runs after every event that can make that true, each
    /// after its own write, so that of two racing events the later one sees
    /// both (the SeqCst fence below pairs with the fence of the other
    /// event's check); the swap of `reaping` lets one of them through.
    pub fn reap_if_unattended(&self) {
        fence(Ordering::SeqCst);
        if self.phase() != Phase::Retiring
            || self.attended.load(Ordering::SeqCst) != 0
            || !self.drained()
            || self.reaping.swap(true, Ordering::AcqRel)
        {
            return;
        }
        if !(self.reaper)() {
            self.reaping.store(false, Ordering::Release);
        }
    }

    /// Block until [`drained`](Self::drained) holds (or the context is
    /// terminated) or `deadline` passes; returns whether it held. Registered
    /// in `pending` around the wait: the settlement that takes it to zero
    /// wakes us from there; everything else that drains the context wakes
    /// the waiters itself.
    pub fn wait_drained(&self, deadline: Option<Instant>) -> bool {
        self.pending.register();
        let ready = self.waiters.wait_until(
            || self.drained() || self.phase() == Phase::Terminated,
            deadline,
        );
        self.pending.unregister();
        ready
    }

    /// [`wait_drained`](Self::wait_drained) for a task: true if drained (or
    /// terminated); otherwise `waker` is woken when that may have changed.
    /// `registered` starts false and is undone by
    /// [`forget_drained`](Self::forget_drained), which must run once the
    /// task stops polling.
    pub fn poll_drained(&self, waker: &Waker, registered: &mut bool) -> bool {
        if !*registered {
            self.pending.register();
        }
        self.waiters.register_task(waker, registered, || {
            self.drained() || self.phase() == Phase::Terminated
        })
    }

    /// Undo the registration of [`poll_drained`](Self::poll_drained).
    pub fn forget_drained(&self, registered: &mut bool) {
        if *registered {
            self.pending.unregister();
        }
        self.waiters.forget_task(registered);
    }

    /// Force's transition, once: `None` for every caller after the first.
    /// Closes the gate and waits for the calls in flight, then hands the
    /// caller a [`Forcing`], under which it may reach the backend (the gate
    /// being closed, nobody else can) and revoke the pins of live holders.
    /// Precondition: retire has begun.
    pub fn begin_force(&self) -> Option<Forcing<'_, N>> {
        if self.forced.swap(true, Ordering::AcqRel) {
            return None;
        }
        self.gate.close();
        self.waiters.wait_until(|| self.gate.is_drained(), None);
        Some(Forcing { life: self })
    }

    /// Teardown, once: the caller that moves Retiring -> Terminating closes
    /// the gate, waits for the calls in flight and gets the [`Destroyer`];
    /// every other caller waits for Terminated. Precondition:
    /// [`drained`](Self::drained) was observed, or the caller forced and
    /// revoked what it reclaimed.
    pub fn begin_teardown(&self) -> Teardown<'_, N> {
        if self
            .phase
            .compare_exchange(
                Phase::Retiring as u8,
                Phase::Terminating as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            self.waiters
                .wait_until(|| self.phase() == Phase::Terminated, None);
            return Teardown::Done;
        }
        // Close the gate and wait for backend calls in flight (queries that
        // hold no pin) to return.
        self.gate.close();
        self.waiters.wait_until(|| self.gate.is_drained(), None);
        Teardown::Destroy(Destroyer { life: self })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize as StdUsize;
    use std::sync::Arc;

    fn counting(reaps: &Arc<StdUsize>) -> Reaper {
        let reaps = reaps.clone();
        Box::new(move || {
            reaps.fetch_add(1, Ordering::SeqCst);
            true
        })
    }

    #[test]
    fn teardown_is_handed_out_once_after_the_last_pin() {
        let reaps = Arc::new(StdUsize::new(0));
        let life = Lifecycle::<2>::new(4, 1, false, counting(&reaps));
        life.acquire_pin_on(1).unwrap();
        life.attend();
        assert!(life.begin_retire());
        assert!(!life.begin_retire());
        assert_eq!(life.acquire_pin(), Err(AcquireError::Closed));
        assert_eq!(life.acquire_pin_on(0), Err(AcquireError::Closed));
        assert!(!life.drained());
        life.release_pin_on(1);
        assert!(life.drained());
        assert_eq!(reaps.load(Ordering::SeqCst), 0, "attended: not reaped");
        let Teardown::Destroy(d) = life.begin_teardown() else {
            panic!("the first teardown lost");
        };
        assert!(life.enter(0).is_none(), "the gate is closed");
        d.terminated();
        assert!(matches!(life.begin_teardown(), Teardown::Done));
        assert_eq!(life.phase(), Phase::Terminated);
    }

    #[test]
    fn the_last_event_of_an_unattended_context_reaps_it_once() {
        let reaps = Arc::new(StdUsize::new(0));
        let life = Lifecycle::<2>::new(4, 0, false, counting(&reaps));
        life.acquire_pin_on(0).unwrap();
        let claim = life.enter(0).unwrap();
        claim.defer_pin().queued();
        drop(claim);
        life.attend();
        life.begin_retire();
        life.unattend();
        assert_eq!(reaps.load(Ordering::SeqCst), 0, "a release is pending");
        life.settle(0);
        assert_eq!(reaps.load(Ordering::SeqCst), 1);
        life.reap_if_unattended();
        assert_eq!(reaps.load(Ordering::SeqCst), 1, "reaped twice");
    }

    #[test]
    fn a_reaper_that_gives_up_leaves_the_claim_open() {
        let calls = Arc::new(StdUsize::new(0));
        let c = calls.clone();
        let life = Lifecycle::<1>::new(
            4,
            0,
            false,
            Box::new(move || {
                c.fetch_add(1, Ordering::SeqCst);
                false
            }),
        );
        life.begin_retire();
        life.reap_if_unattended();
        life.reap_if_unattended();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn loss_refuses_pins_and_drains_without_pending() {
        let life = Lifecycle::<2>::new(4, 0, false, Box::new(|| true));
        life.acquire_pin_on(1).unwrap();
        life.enter(1).unwrap().defer_pin().queued();
        assert!(life.mark_lost("gone"));
        assert!(!life.mark_lost("again"));
        assert_eq!(life.lost_reason().as_deref(), Some("gone"));
        assert!(!life.accepting());
        assert_eq!(life.acquire_pin(), Err(AcquireError::Closed));
        assert!(
            life.drained(),
            "a lost device's pending releases are given up"
        );
        assert_eq!(life.pending_count(), 1);
    }

    #[test]
    fn a_deferral_counts_pending_before_the_pin_goes() {
        let life = Lifecycle::<2>::new(4, 1, true, Box::new(|| true));
        life.acquire_pin_on(1).unwrap();
        let claim = life.enter(1).unwrap();
        let deferral = claim.defer_pin();
        assert_eq!(
            (life.pin_count(), life.pending_count()),
            (1, 1),
            "counted pending while the pin is still held"
        );
        deferral.queued();
        drop(claim);
        assert_eq!((life.pin_count(), life.pending_count()), (0, 1));
        assert_eq!(life.leased_pins(), 2, "the pin went into the shard's lease");
        life.settle(1);
        assert_eq!(life.pending_count(), 0);
    }

    #[test]
    fn an_undone_deferral_leaves_the_pin_with_its_holder() {
        let life = Lifecycle::<2>::new(4, 0, false, Box::new(|| true));
        life.acquire_pin_on(0).unwrap();
        let claim = life.enter(0).unwrap();
        claim.defer_pin().undo();
        drop(claim);
        assert_eq!((life.pin_count(), life.pending_count()), (1, 0));
        life.begin_retire();
        assert!(!life.drained(), "the holder still has its pin");
        life.release_pin_on(0);
        assert!(life.drained());
    }

    #[test]
    fn a_deferral_dropped_by_an_unwinding_call_gives_the_pin_up() {
        let life = Lifecycle::<2>::new(4, 0, false, Box::new(|| true));
        life.acquire_pin_on(0).unwrap();
        let claim = life.enter(0).unwrap();
        let deferral = claim.defer_pin();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = deferral;
            panic!("the backend's free unwound");
        }));
        assert!(unwound.is_err());
        drop(claim);
        assert_eq!(
            (life.pin_count(), life.pending_count()),
            (0, 1),
            "the pin went; the dropped signal settles the release"
        );
        life.settle(0);
        life.begin_retire();
        assert!(life.drained());
    }

    #[test]
    fn force_is_handed_out_once_and_revokes() {
        let life = Lifecycle::<2>::new(4, 0, false, Box::new(|| true));
        life.acquire_pin().unwrap();
        life.acquire_pin().unwrap();
        life.begin_retire();
        let forcing = life.begin_force().expect("the first force");
        assert!(life.begin_force().is_none());
        assert!(life.gate_closed() && life.is_forced());
        forcing.revoke(2);
        assert!(life.drained());
    }
}
