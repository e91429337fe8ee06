//! The per-context record shared by handles, streams, buffers, pins and
//! pending releases, and the lifecycle transitions that act on it.
//!
//! # Invariants
//!
//! * `pins` counts every holder that must finish before teardown: streams,
//!   live buffers, external pins and in-flight allocations, plus the idle
//!   claims of the pin leases (`pin_leases`: a buffer's pin comes out of its
//!   stream shard's lease and goes back into a shard's lease; see
//!   [`PinPool`]). Retire and loss close the leases before the word
//!   (`close_pins`), so that no pin is taken once either has run, and the
//!   idle claims are back on the word by the time it closes. A buffer's pin
//!   is *moved* into `pending` when its release is queued (`pending` is
//!   incremented before the pin is released, so the sum never reaches zero
//!   early) and leaves `pending` when the release retires or is abandoned.
//! * `pending` is counted per shard of streams (`ShardedCount`): a release
//!   is counted on the shard of the stream it was queued on, and leaves it
//!   there. Only after `begin_retire` closes the shards can the total reach
//!   zero.
//! * `gate` counts backend calls in flight, one claim word per shard. The
//!   backend value is only reached through a [`BackendGuard`], which holds a
//!   claim of one shard; `finish` closes every shard and waits for all of
//!   them to drain before it moves the backend out to call `teardown`. That
//!   is what makes the `UnsafeCell` below sound.
//! * Every transition of a buffer's or stream's *live* count, and the pin
//!   release that goes with it, happens while a gate claim is held. `force`
//!   reads those counts only after closing the gate and seeing it drain, so
//!   each live buffer and stream has its pin either revoked by `force` or
//!   released by its own path, never both and never neither.
//! * Statistics of live and pending buffers live in [`Stats`] (its own
//!   module, with its own invariants); every change of the admitted, queued
//!   and gone totals happens under a gate claim, so `force` reads stable live
//!   totals once the gate has drained.
//! * `pending` carries its waiters in its total (`CountWord`): a waiter
//!   registers there before its first check, and the settlement's own RMW
//!   tells it whether to wake. Admission waiters register in
//!   `settle_epoch` and fence before their attempt; a settlement fences and
//!   bumps the epoch only if it sees one ([`announce_settlement`](ContextInner::announce_settlement)).
//! * A shard's `spare` slot may hold a `PendingRelease` box with an `Arc` of
//!   this record (a cycle): `begin_retire` closes every slot for good, and the
//!   registry keeps the record alive until a retire has begun, so the cycle
//!   never outlives the last outside reference.
//! * The phase ([`Phase`]) only moves forward, by the transitions in this
//!   file. Teardown runs once: the phase moves Retiring -> Terminating by
//!   compare-and-swap and only the winner calls the backend; a panicking
//!   `teardown` is caught, so Terminated is always reached.
//! * Charges: `charge` puts an allocation's bytes on the context's budget
//!   (through its stream's lease, see `lease.rs`) and the shared one
//!   together; they come off when an executed free settles
//!   (`uncharge_settled`, back into the stream's lease), or at teardown for every byte whose free never ran
//!   (quarantined, abandoned, reclaimed, released on a lost device), in the
//!   one accounting step every teardown path runs
//!   (`return_charges_at_teardown`).
//! * A retiring context with no `RetireHandle` left is torn down by a
//!   reaper thread, started by whichever of the last pin, the last pending
//!   release and the last handle goes last (`reap_if_unattended`, modelled
//!   in `tests/loom.rs`); the reaper holds an `Arc` of the record.
//! * Every pin and charge taken before a call into a backend or user code is
//!   held in a guard across the call, so a panic there releases it.
//! * No lock in this record is held while calling the backend, a pressure
//!   responder or user code.

use super::charges::{Charges, ReturnedAtTeardown};
use super::config::{Admission, ContextConfig, PressureResponder, Role};
use super::error::GovernorError;
use super::pin_source::PinSourceInner;
use super::release::Spares;
use super::report::TeardownReport;
use super::shards::{GLOBAL, SHARDS};
use super::stats::Stats;
use super::stream::StreamShared;
use crate::sync::{
    fence, lock, AcquireError, ClaimCounter, ClaimShards, Entry, EpochWord, Leases as PinLeases,
    Notifier, Pool, ShardedCount,
};
use crate::{
    BackendError, BackendErrorKind, DeviceContext, DeviceDescription, ProviderContextIdentity,
    ProviderContextPinError,
};
use std::cell::UnsafeCell;
use std::ops::Deref;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

/// Where a context is in its life: the record's phase word. It only moves
/// forward, by the transitions in this file (`begin_retire`: Active ->
/// Retiring; `finish`: Retiring -> Terminating by compare-and-swap, then
/// Terminated once the report is stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Phase {
    Active = 0,
    Retiring = 1,
    Terminating = 2,
    Terminated = 3,
}

impl Phase {
    fn from_word(v: u8) -> Self {
        match v {
            0 => Self::Active,
            1 => Self::Retiring,
            2 => Self::Terminating,
            _ => Self::Terminated,
        }
    }
}

/// Monotonic event counters. `allocations`, `releases_queued` and `retired`
/// are derived from the statistics (see [`ContextInner::allocations`]).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub abandoned: AtomicU64,
    pub settled_lost: AtomicU64,
    pub quarantined: AtomicU64,
    pub reclaimed: AtomicU64,
    pub admission_refusals: AtomicU64,
    pub admission_waits: AtomicU64,
    pub pressure_calls: AtomicU64,
    pub backend_errors: AtomicU64,
    /// Releases that settled after teardown: must stay zero (a backend bug).
    pub late_settlements: AtomicU64,
}

/// A release the backend refused: the memory stays owned and charged until
/// the context terminates.
struct Quarantined<M> {
    role: Role,
    bytes: u64,
    reason: String,
    _memory: M,
}

#[inline]
pub(crate) fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}
#[inline]
pub(crate) fn sub(a: &AtomicU64, n: u64) {
    a.fetch_sub(n, Ordering::Relaxed);
}

pub(crate) struct ContextInner<C: DeviceContext> {
    pub id: ProviderContextIdentity,
    pub label: String,
    pub description: DeviceDescription,
    pub admission: Admission,
    /// Whether the admission policy ever waits for a settlement: with
    /// `FailFast` no admission waiter exists, and a settlement skips even
    /// the fence of [`announce_settlement`](Self::announce_settlement).
    waits_for_settlements: bool,

    pins: ClaimCounter,
    /// Chunks of `pins` leased to shards of streams: a stream takes its
    /// buffers' pins out of its shard's lease (see [`PinPool`]).
    pin_leases: PinLeases<SHARDS>,
    /// Pending releases per shard, and the lifecycle waiters that wait for
    /// `drained()` (see [`ShardedCount`]).
    pending: ShardedCount<SHARDS>,
    /// Backend calls in flight, per shard (see [`ClaimShards`]).
    gate: ClaimShards<SHARDS>,
    phase: AtomicU8,
    lost: AtomicBool,
    forced: AtomicBool,
    /// Woken when `pins`, `pending` or `gate` reach zero, and at termination.
    pub lifecycle: Notifier,

    /// The context's budget, its leases, its shared budget and the bytes
    /// held until teardown (see `charges.rs`).
    pub charges: Charges,
    /// Woken when a release of this context settles (admission waiters), and
    /// on device loss and termination.
    pub settled: Notifier,
    /// Bumped by a settlement while an admission waiter is registered in it
    /// (see [`announce_settlement`](Self::announce_settlement)).
    pub settle_epoch: EpochWord,

    /// Live, pending and quarantined amounts (see `stats.rs`).
    pub stats: Stats,
    pub counters: Counters,
    /// Bytes reported as used outside memgov's allocations (see `outside.rs`).
    pub outside: super::outside::Outside,
    /// Live streams. Changed only under a gate claim (`stream_created`,
    /// `stream_left`), so that `force` reads a stable count once the gate
    /// has drained.
    streams_live: AtomicU64,

    backend: UnsafeCell<Option<C>>,
    pub streams: Mutex<Vec<Weak<StreamShared<C>>>>,
    pub sources: Mutex<Vec<Weak<PinSourceInner<C>>>>,
    quarantine: Mutex<Vec<Quarantined<C::Memory>>>,
    pub responders: Mutex<Vec<PressureResponder>>,
    lost_reason: Mutex<Option<String>>,
    report: Mutex<Option<TeardownReport>>,
    retire_started: Mutex<Option<Instant>>,

    /// The cached `PendingRelease` boxes, one slot per shard (see
    /// `release.rs`).
    pub spares: Spares<C>,
    /// This record, for the reaper thread a background teardown starts.
    this: Weak<ContextInner<C>>,
    /// Live [`RetireHandle`](super::RetireHandle)s: while there is one, its
    /// owner finishes the teardown; with none, the last holder's exit starts
    /// a reaper (see [`reap_if_unattended`](Self::reap_if_unattended)).
    attended: AtomicUsize,
    /// Whether a reaper was started (once).
    reaping: AtomicBool,
    /// The reaper thread, joined by `Governor::drop` when it still owns the
    /// record.
    reaper: Mutex<Option<JoinHandle<()>>>,
}

// SAFETY: `backend` is only reached through `BackendGuard` (shared `&C`, and
// `C: Sync`) or moved out by the single winner of the TERMINATING transition
// after the gate is closed and drained, when no `&C` exists any more. Every
// other field is Sync on its own.
unsafe impl<C: DeviceContext> Sync for ContextInner<C> {}
// SAFETY: `C: Send`; the cell is moved between threads only as part of the
// whole record.
unsafe impl<C: DeviceContext> Send for ContextInner<C> {}

/// Shared access to the backend for the length of one call. Holds a gate
/// claim, so teardown cannot move the backend out from under it.
pub(crate) struct BackendGuard<'a, C: DeviceContext> {
    ctx: &'a ContextInner<C>,
    shard: usize,
}

impl<C: DeviceContext> Deref for BackendGuard<'_, C> {
    type Target = C;
    fn deref(&self) -> &C {
        // SAFETY: this guard holds a gate claim; `finish` moves the backend
        // out only after closing the gate and observing zero claims, so the
        // Option is Some and stays in place for the guard's lifetime.
        unsafe {
            (*self.ctx.backend.get())
                .as_ref()
                .expect("backend present while the gate is open")
        }
    }
}

impl<C: DeviceContext> Drop for BackendGuard<'_, C> {
    fn drop(&mut self) {
        if self.ctx.gate.release(self.shard) {
            self.ctx.lifecycle.notify();
        }
    }
}

impl<C: DeviceContext> ContextInner<C> {
    pub(crate) fn new(
        id: ProviderContextIdentity,
        backend: C,
        config: ContextConfig,
        this: Weak<Self>,
    ) -> Self {
        let description = backend.describe();
        let limit = config.budget.unwrap_or(u64::MAX);
        Self {
            id,
            label: if config.label.is_empty() {
                format!("{}:{}", description.backend, description.ordinal)
            } else {
                config.label
            },
            description,
            admission: config.admission,
            waits_for_settlements: matches!(config.admission, Admission::WaitForPending { .. }),
            pins: ClaimCounter::new(config.max_pins),
            pin_leases: PinLeases::new(config.pin_lease_chunk),
            pending: ShardedCount::new(),
            gate: ClaimShards::new(crate::sync::MAX_CLAIMS),
            phase: AtomicU8::new(Phase::Active as u8),
            lost: AtomicBool::new(false),
            forced: AtomicBool::new(false),
            lifecycle: Notifier::new(),
            charges: Charges::new(limit, config.lease_chunk, config.shared),
            settled: Notifier::new(),
            settle_epoch: EpochWord::new(),
            stats: Stats::new(config.exact_peak),
            counters: Counters::default(),
            outside: Default::default(),
            streams_live: AtomicU64::new(0),
            backend: UnsafeCell::new(Some(backend)),
            streams: Mutex::new(Vec::new()),
            sources: Mutex::new(Vec::new()),
            quarantine: Mutex::new(Vec::new()),
            responders: Mutex::new(Vec::new()),
            lost_reason: Mutex::new(None),
            report: Mutex::new(None),
            retire_started: Mutex::new(None),
            spares: Spares::new(),
            this,
            attended: AtomicUsize::new(0),
            reaping: AtomicBool::new(false),
            reaper: Mutex::new(None),
        }
    }

    /// Enter the gate for one backend call; `None` once teardown or force has
    /// closed it. For calls not made for a stream (handle-level queries,
    /// stream creation, device loss): they pass through shard 0.
    #[inline]
    pub(crate) fn enter(&self) -> Option<BackendGuard<'_, C>> {
        self.enter_on(0)
    }

    /// Enter the gate through `shard`'s claim word: the hot paths of a
    /// stream pass through their own shard.
    #[inline]
    pub(crate) fn enter_on(&self, shard: usize) -> Option<BackendGuard<'_, C>> {
        match self.gate.enter(shard) {
            Entry::Entered => Some(BackendGuard { ctx: self, shard }),
            Entry::Closed => None,
            Entry::ClosedDrained => {
                self.lifecycle.notify();
                None
            }
        }
    }

    /// Reach the backend while the gate is closed, for `force` only.
    ///
    /// Precondition: the caller closed the gate, observed it drained, and
    /// holds the context's `forced` flag (so it is the only forcer), and at
    /// least one stream pin is still outstanding (so `finish` cannot have
    /// started, as it needs `drained()`).
    fn with_closed_gate<R>(&self, f: impl FnOnce(&C) -> R) -> Option<R> {
        // (The gate may read undrained again for an instant: a call refused
        // at the closed gate takes and gives back a claim. It never makes a
        // guard.)
        debug_assert!(self.gate.is_closed() && self.forced.load(Ordering::Acquire));
        // SAFETY: per the precondition no BackendGuard exists or can be made,
        // and the backend is moved out only by `finish`, which cannot run
        // while the stream pin the caller is synchronizing is outstanding.
        unsafe { (*self.backend.get()).as_ref() }.map(f)
    }

    /// Acquire a pin from the context's pin word, with the error the pin
    /// contract names. At the maximum, idle pin leases are taken back first
    /// (see [`PinPool`]), so that `PinCountOverflow` is exact.
    #[inline]
    pub(crate) fn acquire_pin(&self) -> Result<(), ProviderContextPinError> {
        match self.pins.try_acquire() {
            Ok(()) => Ok(()),
            Err(AcquireError::Overflow) if self.pin_leases.enabled() => self
                .pin_leases
                .reclaim_then_take(&PinPool(self), 1, 0)
                .map_err(|e| self.pin_refusal(e)),
            Err(e) => Err(self.pin_refusal(e)),
        }
    }

    /// Acquire a pin for an allocation on a stream of `shard`: out of the
    /// shard's pin lease, refilled from the pin word when short.
    #[inline]
    pub(crate) fn acquire_pin_on(&self, shard: usize) -> Result<(), ProviderContextPinError> {
        if !self.pin_leases.enabled() {
            return self.acquire_pin();
        }
        if self.pin_leases.take_leased(&PinPool(self), shard, 1) {
            return Ok(());
        }
        self.pin_leases
            .take_from_pool(&PinPool(self), shard, 1, 0)
            .map_err(|e| self.pin_refusal(e))
    }

    #[cold]
    fn pin_refusal(&self, e: AcquireError) -> ProviderContextPinError {
        match e {
            AcquireError::Closed => ProviderContextPinError::ContextUnavailable(self.id),
            AcquireError::Overflow => ProviderContextPinError::PinCountOverflow(self.id),
        }
    }

    /// Outstanding pins now: held by something, not leased and idle (the
    /// two are read apart, so a pin moving between them may be half-seen).
    pub(crate) fn pin_count(&self) -> u64 {
        self.pins.count().saturating_sub(self.pin_leases.idle())
    }

    /// Pending releases now.
    pub(crate) fn pending_count(&self) -> u64 {
        self.pending.count()
    }

    /// Whether the backend gate is closed: by `force` (live buffers and
    /// streams were reclaimed) or by teardown.
    #[inline]
    pub(crate) fn gate_closed(&self) -> bool {
        self.gate.is_closed()
    }

    /// A live buffer's pin is about to move into a pending release queued
    /// on a stream of `shard`: count the release first, so that pins +
    /// pending never touches zero in between (which is also what
    /// [`ShardedCount`] needs of its caller). Call under a gate claim, before
    /// the buffer's pin goes.
    #[inline]
    pub(crate) fn pending_queued(&self, shard: usize) {
        self.pending.increment(shard);
    }

    /// A pending release queued on a stream of `shard` left: settled, or its
    /// free refused (undone). Wakes the teardown waiters if it was the last
    /// one they waited for, and starts the background teardown if nobody
    /// waits.
    #[inline]
    pub(crate) fn pending_left(&self, shard: usize) {
        if self.pending.decrement(shard) {
            self.lifecycle.wake_all();
            self.reap_if_unattended();
        }
    }

    /// A release settled (or a live buffer went with a lost device): wake
    /// the admission waiters, if one is registered. Nobody waiting, this
    /// writes nothing: a SeqCst fence and a load of a line only waiters
    /// write. The waiter registers (SeqCst) and fences before its attempt
    /// (`admission.rs`); of the two fences, whichever comes first in their
    /// total order, either the waiter's attempt sees what this settlement
    /// gave back, or this load sees the registration and bumps the epoch the
    /// waiter waits past.
    ///
    /// Under `FailFast` nothing ever registers, so there is nothing to
    /// announce (the admission policy is fixed at registration).
    #[inline]
    pub(crate) fn announce_settlement(&self) {
        if !self.waits_for_settlements {
            return;
        }
        fence(Ordering::SeqCst);
        if self.settle_epoch.has_waiters() {
            let _ = self.settle_epoch.bump();
            self.settled.wake_all();
        }
    }

    /// A waiter for `drained()` registers in `pending` before its first
    /// check (see `CountWord`): the settlement taking it to zero wakes it.
    pub(crate) fn register_drain_waiter(&self) {
        self.pending.register();
    }

    /// Undo [`register_drain_waiter`](Self::register_drain_waiter).
    pub(crate) fn unregister_drain_waiter(&self) {
        self.pending.unregister();
    }

    /// Drop a pin, waking the teardown waiter if it was the last (and
    /// starting the background teardown if nobody waits).
    #[inline]
    pub(crate) fn release_pin(&self) {
        if self.pins.release() {
            self.pins_drained();
        }
    }

    /// Drop a pin taken by a stream of `shard` (or by anything, when
    /// `shard` is [`GLOBAL`]): back into the shard's pin lease, which keeps
    /// two chunks and puts the rest back on the pin word.
    #[inline]
    pub(crate) fn release_pin_on(&self, shard: usize) {
        if shard == GLOBAL || !self.pin_leases.enabled() {
            self.release_pin();
        } else {
            self.pin_leases.give(&PinPool(self), shard, 1);
        }
    }

    /// The last claim of the closed pin word is gone.
    #[cold]
    fn pins_drained(&self) {
        self.lifecycle.notify();
        self.reap_if_unattended();
    }

    pub(crate) fn phase(&self) -> Phase {
        Phase::from_word(self.phase.load(Ordering::Acquire))
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    pub(crate) fn lost_reason(&self) -> String {
        lock(&self.lost_reason)
            .clone()
            .unwrap_or_else(|| "device lost".into())
    }

    /// Why the device was declared lost, if it was.
    pub(crate) fn lost_reason_if_lost(&self) -> Option<String> {
        lock(&self.lost_reason).clone()
    }

    /// The stored teardown report, once the context terminated.
    pub(crate) fn teardown_report(&self) -> Option<TeardownReport> {
        lock(&self.report).clone()
    }

    /// Join the reaper thread, if one was started (`Governor::drop`).
    pub(crate) fn join_reaper(&self) {
        let reaper = lock(&self.reaper).take();
        if let Some(reaper) = reaper {
            // It runs `finish`, which catches a panicking teardown.
            let _ = reaper.join();
        }
    }

    /// Keep memory whose free the backend refused owned and charged, visible
    /// with its reason, until the context terminates. It holds no pin: the
    /// live buffer's pin is released here, and teardown frees the memory
    /// with the context. Call under a gate claim (the buffer leaves live).
    pub(crate) fn quarantine(
        &self,
        live_shard: usize,
        memory: C::Memory,
        bytes: u64,
        role: Role,
        err: &BackendError,
    ) {
        self.stats.leave(live_shard, role, bytes);
        self.stats.quarantine(role, bytes);
        self.charges.quarantined(bytes);
        add(&self.counters.quarantined, 1);
        #[cfg(feature = "tracing")]
        tracing::warn!(context = %self.id, label = %self.label, bytes, role = %role, error = %err, "memgov: release refused; memory quarantined");
        lock(&self.quarantine).push(Quarantined {
            role,
            bytes,
            reason: err.to_string(),
            _memory: memory,
        });
        self.release_pin();
    }

    /// The quarantined releases now: role, bytes and the backend's reason.
    pub(crate) fn quarantine_entries(&self) -> Vec<(Role, u64, String)> {
        lock(&self.quarantine)
            .iter()
            .map(|q| (q.role, q.bytes, q.reason.clone()))
            .collect()
    }

    /// The error every operation on a lost context returns.
    pub(crate) fn lost_error(&self) -> GovernorError {
        GovernorError::DeviceLost {
            context: self.id,
            reason: self.lost_reason(),
        }
    }

    /// Whether new work is still admitted: not retiring, lost or torn down.
    /// (A pin taken before retire keeps its holder going; an allocation that
    /// has to wait for room gives up once this is false.)
    pub(crate) fn accepting(&self) -> bool {
        self.phase() == Phase::Active && !self.is_lost()
    }

    /// The error an allocation refused for that reason returns.
    pub(crate) fn unavailable_error(&self) -> GovernorError {
        if self.is_lost() {
            self.lost_error()
        } else {
            GovernorError::Pin(ProviderContextPinError::ContextUnavailable(self.id))
        }
    }

    /// Everything teardown waits for has finished: no pins, and no pending
    /// release (a lost device's pending releases are given up by its teardown).
    pub(crate) fn drained(&self) -> bool {
        self.pins.is_drained() && (self.is_lost() || self.pending.is_zero())
    }

    /// Stop accepting work: new pins fail from now on, and allocations
    /// waiting for room give up.
    pub(crate) fn begin_retire(&self) {
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
                self.lifecycle.wake_all();
            }
        }
        // Break the reference cycle of cached PendingRelease boxes before the
        // record can lose its last outside reference.
        super::release::close_spares(self);
        lock(&self.retire_started).get_or_insert_with(Instant::now);
        self.close_pins();
        // Nothing can be admitted any more: drop the pressure responders and
        // whatever they captured (a responder that holds a stream or buffers
        // of this context would otherwise keep it from ever draining). Their
        // destructors are user code: they run after the lock is released.
        let responders = std::mem::take(&mut *lock(&self.responders));
        drop(responders);
        // Admission waiters check `accepting()`: wake them to give up.
        self.settled.notify();
        self.charges.wake_shared_waiters();
        #[cfg(feature = "tracing")]
        tracing::info!(context = %self.id, label = %self.label, pins = self.pins.count(), pending = self.pending.count(), "memgov: retiring context");
    }

    /// A [`RetireHandle`](super::RetireHandle) begins: its owner finishes
    /// the teardown. Counted before `begin_retire`, so that a context drained
    /// already is torn down by the caller, not by a reaper.
    pub(crate) fn attend(&self) {
        self.attended.fetch_add(1, Ordering::SeqCst);
    }

    /// A `RetireHandle` ends; with none left, a drained context is torn down
    /// in the background.
    pub(crate) fn unattend(&self) {
        self.attended.fetch_sub(1, Ordering::SeqCst);
        self.reap_if_unattended();
    }

    /// Start the background teardown if the context is retiring, drained,
    /// and no `RetireHandle` is left to finish it. Called after every event
    /// that can make that true (last pin, last pending release, loss, last
    /// handle gone), each after its own write, so that of two racing events
    /// the later one sees both (the SeqCst fence below pairs with the fence
    /// of the other event's check).
    ///
    /// The teardown runs on a new thread, never on this one: this may be a
    /// driver callback thread (a `RetireSignal` fired), where calling back
    /// into the driver is forbidden. The thread holds the record, so the
    /// report stays readable through any handle and the governor's snapshot.
    /// `Governor::drop` joins it if it still owns the record; one started
    /// after the governor is gone runs detached and touches only the record
    /// and the backend it tears down.
    pub(crate) fn reap_if_unattended(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.phase() != Phase::Retiring
            || self.attended.load(Ordering::SeqCst) != 0
            || !self.drained()
            || self.reaping.swap(true, Ordering::AcqRel)
        {
            return;
        }
        // Every caller holds an Arc of the record (a buffer's stream, a
        // pending release, a pin source, a handle), so this succeeds.
        let Some(this) = self.this.upgrade() else {
            return;
        };
        let id = self.id;
        let spawned = std::thread::Builder::new()
            .name(format!("memgov-reaper-{id}"))
            .spawn(move || {
                this.finish();
            });
        match spawned {
            Ok(handle) => *lock(&self.reaper) = Some(handle),
            Err(_e) => {
                // No thread to be had: the context stays retiring (drained)
                // until a `retire().wait(..)` finishes it. Tearing down here
                // could run the driver under its own callback.
                self.reaping.store(false, Ordering::Release);
                #[cfg(feature = "tracing")]
                tracing::error!(context = %id, error = %_e, "memgov: could not start the reaper; the context stays retiring until retire().wait() finishes it");
            }
        }
    }

    /// No pin is acquired from now on: the pin leases close (their idle
    /// claims go back to the pin word, and no take from a lease succeeds
    /// after this), then the pin word closes. Returns true if nothing held
    /// the context then; its waiters are woken.
    fn close_pins(&self) -> bool {
        self.pin_leases.close(&PinPool(self));
        let drained = self.pins.close();
        if drained {
            self.lifecycle.notify();
        }
        drained
    }

    /// Declare the device lost. Returns false if it already was.
    pub(crate) fn mark_lost(&self, reason: &str) -> bool {
        if self.lost.swap(true, Ordering::AcqRel) {
            return false;
        }
        *lock(&self.lost_reason) = Some(reason.to_owned());
        if self.close_pins() {
            // Nothing held the context: a retiring one may be reaped now.
            self.reap_if_unattended();
        }
        #[cfg(feature = "tracing")]
        tracing::error!(context = %self.id, label = %self.label, reason, pending = self.pending.count(), "memgov: device lost");
        // Wake before the backend's hook runs: if it panics, waiters still
        // see the loss (a teardown they start waits at the gate for the
        // hook's claim).
        self.lifecycle.notify();
        self.settled.notify();
        self.charges.wake_shared_waiters();
        if let Some(backend) = self.enter() {
            backend.device_lost();
        }
        // Pending releases no longer hold a lost context.
        self.reap_if_unattended();
        true
    }

    /// Record a backend error; a lost device marks the context lost.
    pub(crate) fn note_backend_error(&self, err: &BackendError) {
        add(&self.counters.backend_errors, 1);
        if err.is_device_lost() {
            self.mark_lost(&err.to_string());
        }
    }

    /// Record a backend error and turn it into the caller's error:
    /// [`GovernorError::DeviceLost`] when the device is lost,
    /// [`GovernorError::Backend`] otherwise. Call with no gate claim held
    /// where convenient; marking the context lost takes one of its own.
    pub(crate) fn backend_failure(&self, err: BackendError) -> GovernorError {
        self.note_backend_error(&err);
        if err.is_device_lost() {
            self.lost_error()
        } else {
            GovernorError::Backend {
                context: self.id,
                source: err,
            }
        }
    }

    /// A stream was created. Call under the gate claim of `create_stream`.
    #[inline]
    pub(crate) fn stream_created(&self) {
        add(&self.streams_live, 1);
    }

    /// A stream was dropped: its live count and its pin leave together.
    /// Call under a gate claim.
    #[inline]
    pub(crate) fn stream_left(&self) {
        sub(&self.streams_live, 1);
        self.release_pin();
    }

    /// Live streams now.
    pub(crate) fn streams_live(&self) -> u64 {
        self.streams_live.load(Ordering::Relaxed)
    }

    /// Whether `force` has revoked (or is revoking) live buffers and streams.
    pub(crate) fn is_forced(&self) -> bool {
        self.forced.load(Ordering::Acquire)
    }

    /// Force's transition, once (a second caller returns at once): close the
    /// gate, wait for calls in flight, synchronize every stream (unless the
    /// device is lost), and revoke the pins of live buffers and streams,
    /// whose memory and raw streams die with the context. The reclaimed
    /// bytes stay charged until teardown frees them. Precondition: retire
    /// has begun.
    ///
    /// A `synchronize` that panics does not stop the revocation (a closed
    /// gate with unrevoked pins would wedge the context); the panic is
    /// re-raised once it is done.
    pub(crate) fn force(&self) {
        if self.forced.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut panicked = None;
        // Stop every backend call from starting and wait for those in flight.
        self.gate.close();
        self.lifecycle.wait_until(|| self.gate.is_drained(), None);
        // From here on live buffers and streams can no longer release their
        // pins (their paths go through the gate), so the counts are stable.
        if !self.is_lost() {
            let streams: Vec<_> = lock(&self.streams)
                .iter()
                .filter_map(|w| w.upgrade())
                .collect();
            for s in &streams {
                match catch_unwind(AssertUnwindSafe(|| {
                    self.with_closed_gate(|b| b.synchronize(s.raw()))
                })) {
                    Ok(Some(Err(e))) => self.note_backend_error(&e),
                    Ok(_) => {}
                    Err(p) => {
                        panicked.get_or_insert(p);
                    }
                }
            }
        }
        // Every live transition happens under a gate claim, and the gate is
        // closed and drained: the live totals of every shard are stable.
        let reclaimed = self.stats.reclaim_live();
        add(&self.counters.reclaimed, reclaimed.count);
        // Still allocated on the device until teardown frees it: charged
        // until then, so that no other context is admitted into it.
        self.charges.hold_until_teardown(reclaimed.bytes);
        let streams = self.streams_live.swap(0, Ordering::AcqRel);
        if self.pins.revoke(reclaimed.count + streams) {
            self.lifecycle.notify();
        }
        #[cfg(feature = "tracing")]
        tracing::warn!(context = %self.id, label = %self.label, buffers = reclaimed.count, bytes = reclaimed.bytes, streams, "memgov: force-retire reclaimed live buffers and streams");
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }

    /// Tear down, once. Precondition: `drained()` was observed, or the caller
    /// is `force` after revoking what it reclaimed. Returns the report; a
    /// second caller waits for the first and gets the same report.
    pub(crate) fn finish(&self) -> TeardownReport {
        match self.phase.compare_exchange(
            Phase::Retiring as u8,
            Phase::Terminating as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {}
            Err(_) => {
                self.lifecycle
                    .wait_until(|| self.phase() == Phase::Terminated, None);
                return lock(&self.report)
                    .clone()
                    .expect("report stored before TERMINATED");
            }
        }
        // Close the gate and wait for backend calls in flight (handle-level
        // queries such as memory_info hold no pin) to return.
        self.gate.close();
        self.lifecycle.wait_until(|| self.gate.is_drained(), None);
        // SAFETY: we won RETIRING -> TERMINATING, so no one else moves the
        // backend out; the gate is closed and drained, so no BackendGuard (and
        // no `&C`) exists and none can be created.
        let backend = unsafe { (*self.backend.get()).take() };
        let lost = self.is_lost();
        let started = lock(&self.retire_started).unwrap_or_else(Instant::now);
        let result = match backend {
            // A panicking teardown must still end in TERMINATED, with every
            // waiter woken: the panic becomes the report's backend result.
            Some(b) => catch_unwind(AssertUnwindSafe(|| b.teardown(lost))).unwrap_or_else(|p| {
                Err(BackendError::new(
                    self.description.backend,
                    "teardown",
                    BackendErrorKind::Other,
                    format!("teardown panicked: {}", panic_message(&*p)),
                ))
            }),
            None => Ok(()),
        };
        let returned = self.return_charges_at_teardown();
        let report = TeardownReport {
            context: self.id,
            label: self.label.clone(),
            lost,
            forced: self.forced.load(Ordering::Acquire),
            retired_releases: self.retired(),
            abandoned_releases: self.counters.abandoned.load(Ordering::Relaxed),
            settled_lost: self.counters.settled_lost.load(Ordering::Relaxed),
            reclaimed_buffers: self.counters.reclaimed.load(Ordering::Relaxed),
            quarantined_bytes: returned.quarantined,
            awaiting_teardown_bytes: returned.awaiting_teardown,
            unsettled_releases: if lost { self.pending.count() } else { 0 },
            elapsed: started.elapsed(),
            backend_result: result,
        };
        #[cfg(feature = "tracing")]
        match &report.backend_result {
            Ok(()) => {
                tracing::info!(context = %self.id, label = %self.label, lost, forced = report.forced, quarantined_bytes = returned.quarantined, awaiting_teardown_bytes = returned.awaiting_teardown, elapsed = ?report.elapsed, "memgov: context torn down")
            }
            Err(e) => {
                tracing::error!(context = %self.id, label = %self.label, lost, forced = report.forced, quarantined_bytes = returned.quarantined, awaiting_teardown_bytes = returned.awaiting_teardown, elapsed = ?report.elapsed, error = %e, "memgov: context torn down; the backend's teardown failed")
            }
        }
        *lock(&self.report) = Some(report.clone());
        self.phase.store(Phase::Terminated as u8, Ordering::Release);
        self.lifecycle.notify();
        self.settled.notify();
        // Admissions on the shared budget may be waiting for what this
        // teardown gave back (see `DeviceMember::returning_at_teardown`):
        // after the Terminated store, so that a waiter that reads the new
        // epoch also reads Terminated and sees every byte back.
        self.charges.announce_returned();
        report
    }

    /// The accounting of every teardown path (waited, background, forced,
    /// lost), in this one place. Runs once the backend's teardown has
    /// returned: the device has every byte of the context back, so every
    /// charge that an executed free did not return is returned now, to the
    /// context's budget and the shared one: quarantined memory, and bytes
    /// awaiting teardown (abandoned releases, buffers reclaimed by force or
    /// released on a lost device). See [`Charges::return_at_teardown`].
    fn return_charges_at_teardown(&self) -> ReturnedAtTeardown {
        let quarantined: Vec<_> = std::mem::take(&mut *lock(&self.quarantine));
        let quarantined_bytes: u64 = quarantined.iter().map(|q| q.bytes).sum();
        for q in &quarantined {
            self.stats.unquarantine(q.role, q.bytes);
        }
        let returned = self.charges.return_at_teardown(quarantined_bytes);
        drop(quarantined);
        returned
    }

    /// Live bytes of every role.
    pub(crate) fn live_bytes(&self) -> u64 {
        self.stats.usage_all().live.bytes
    }

    /// Pending-release bytes of every role.
    pub(crate) fn pending_bytes(&self) -> u64 {
        self.stats.usage_all().pending.bytes
    }

    /// Releases whose free executed: settled ones that were not abandoned.
    pub(crate) fn retired(&self) -> u64 {
        let abandoned = self.counters.abandoned.load(Ordering::Acquire);
        self.stats.settled_count().saturating_sub(abandoned)
    }

    /// Releases queued on a stream (and not undone because the backend
    /// refused them). Derived rather than counted, so the cycle does not pay
    /// for it.
    pub(crate) fn releases_queued(&self) -> u64 {
        self.stats.queued_count()
    }

    /// Allocations admitted: each is live, queued (see `releases_queued`),
    /// settled because the device was lost, quarantined or reclaimed by
    /// force. Derived rather than counted.
    pub(crate) fn allocations(&self) -> u64 {
        let c = &self.counters;
        self.stats
            .usage_all()
            .live
            .count
            .wrapping_add(self.releases_queued())
            .wrapping_add(c.settled_lost.load(Ordering::Relaxed))
            .wrapping_add(c.quarantined.load(Ordering::Relaxed))
            .wrapping_add(c.reclaimed.load(Ordering::Relaxed))
    }
}

/// The pin word as a [`Pool`] of the pin leases: a lease of claims is
/// claims taken on `pins`, counted against `max_pins` like any other; a
/// refusal for `max_pins` takes back every idle lease first, so
/// `PinCountOverflow` stays exact, and a closed word refuses at once.
/// Claims put back may drain the closed word: then its waiters wake.
///
/// Teardown observes every pin taken from a lease: the claim stays on the
/// pin word from the refill that leased it until it is put back, which is
/// after its holder gave it back to the lease (and the lease's close, a
/// refusal's reclaim or the excess of a give put it back).
struct PinPool<'a, C: DeviceContext>(&'a ContextInner<C>);

impl<C: DeviceContext> Pool for PinPool<'_, C> {
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

impl<C: DeviceContext> Drop for ContextInner<C> {
    fn drop(&mut self) {
        // No `spare` slot can hold a cached PendingRelease here: it would hold
        // an Arc of this record (see `release::close_spares`).
        debug_assert!(!self.spares.any_filled());
        // Every teardown runs while something holds the record: a
        // `RetireHandle`, `Governor::drop`, or the reaper the last holder's
        // exit starts (it holds an Arc). A backend still here means that
        // reaper could not be started: leak the context rather than tear it
        // down on this thread, which may be a driver callback thread.
        if let Some(backend) = self.backend.get_mut().take() {
            std::mem::forget(backend);
        }
        // The reaper held an Arc until its teardown was done: if this drop
        // runs on another thread, the reaper has nothing left to do but exit.
        // Join it, so that no thread outlives the record it served. (When
        // the reaper's own Arc is the last, the drop runs on the reaper and
        // the thread ends right after it.)
        let reaper = self
            .reaper
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(reaper) = reaper {
            if reaper.thread().id() != std::thread::current().id() {
                let _ = reaper.join();
            }
        }
    }
}

/// The message of a caught panic.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".into())
}

impl<C: DeviceContext> super::budget::DeviceMember for ContextInner<C> {
    fn device_lost(&self, reason: &str) {
        self.mark_lost(reason);
    }

    /// The amounts first, the phase last. Pending first, then awaiting
    /// teardown: an abandoned release adds its bytes to the latter before it
    /// leaves the former, so it is counted in one or both. Teardown changes
    /// the amounts only after its Retiring -> Terminating step, with Release
    /// writes that these Acquire reads pair with: amounts that show anything
    /// teardown did come with a phase of Terminating or later. A phase of
    /// Terminating counts at least 1: the bytes may be half given back, and
    /// the epoch bump at Terminated ([`finish`](ContextInner::finish)) is
    /// what ends the wait; a phase of Terminated means every byte is back.
    fn returning_at_teardown(&self) -> u64 {
        let held = self
            .pending_bytes()
            .saturating_add(self.charges.awaiting_teardown())
            .saturating_add(self.stats.quarantined_bytes());
        match self.phase() {
            Phase::Retiring => held,
            Phase::Terminating => held.max(1),
            Phase::Active | Phase::Terminated => 0,
        }
    }
}
