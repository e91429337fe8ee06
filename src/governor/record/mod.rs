//! The per-context record shared by handles, streams, buffers, pins and
//! pending releases: the backend, its lifecycle ([`Lifecycle`], in
//! `memgov-sync`, where the loom models drive it) and the governor's
//! bookkeeping around them.
//!
//! # Invariants
//!
//! * The lifecycle's own invariants (pins and their leases, pending
//!   releases per shard, the gate, the phase, the background reap) are kept
//!   by [`Lifecycle`]; this record calls its transitions and acts on what
//!   they hand out: a [`Destroyer`] (the one caller that tears the backend
//!   down), a [`Forcing`] (the one forcer, with the gate closed and drained)
//!   and the reaper hook (a retiring, drained context that nobody attends).
//! * The backend value is only reached through a [`BackendGuard`], which
//!   holds a claim of one gate shard; `finish` moves it out only under the
//!   `Destroyer`, when the gate is closed and drained, and `force` reaches it
//!   only under the `Forcing`. That is what makes the `UnsafeCell` below
//!   sound.
//! * Every transition of a buffer's or stream's *live* count, and the pin
//!   release that goes with it, happens while a gate claim is held. `force`
//!   reads those counts only under the `Forcing`, so each live buffer and
//!   stream has its pin either revoked by `force` or released by its own
//!   path, never both and never neither.
//! * Statistics of live and pending buffers live in [`Stats`](super::ledger::Stats) (its own
//!   module, with its own invariants); every change of the admitted, queued
//!   and gone totals happens under a gate claim, so `force` reads stable live
//!   totals once the gate has drained.
//! * A shard's `spare` slot may hold a `PendingRelease` box with an `Arc` of
//!   this record (a cycle): `begin_retire` closes every slot for good, and the
//!   registry keeps the record alive until a retire has begun, so the cycle
//!   never outlives the last outside reference.
//! * Teardown runs once (the `Destroyer`); a panic in any of its steps (the
//!   backend's `teardown`, the accounting, the reporting) is caught, so
//!   Terminated is always reached, and every waiter gets the same outcome
//!   (`RetireError::TeardownPanicked` naming the step).
//! * Charges: `charge` puts an allocation's bytes on the context's budget
//!   (through its stream's lease, see `lease.rs`) and the shared one
//!   together; they come off when an executed free settles
//!   (`uncharge_settled`, back into the stream's lease), or at teardown for every byte whose free never ran
//!   (quarantined, abandoned, reclaimed, released on a lost device), in the
//!   one accounting step every teardown path runs
//!   (`return_charges_at_teardown`).
//! * A retiring context with no `RetireHandle` left is torn down by a
//!   reaper thread, which the lifecycle's reaper hook ([`start_reaper`])
//!   starts on the event that drained it; the reaper holds an `Arc` of the
//!   record.
//! * Every pin and charge taken before a call into a backend or user code is
//!   held in a guard across the call, so a panic there releases it.
//! * No lock in this record is held while calling the backend, a pressure
//!   responder or user code.
//! * The record imports no module that acts on it: the types that hold an
//!   `Arc` of it or that it holds (streams, pin sources, pending releases,
//!   the cache's blocks, reservations, the sleep word) are defined in its
//!   submodules, and the behaviour lives above it. The one call back up,
//!   the cache flush of device loss (`mark_lost`, reached from any backend
//!   error), goes through `flush_cache`, the function the governor hands in
//!   at registration (`cache::flush_all`); no hot path calls it.

pub(crate) mod cache;
pub(crate) mod pending;
pub(crate) mod pin_source;
pub(crate) mod reservations;
pub(crate) mod sites;
pub(crate) mod sleep;
pub(crate) mod stream;

use super::config::{Admission, ContextConfig};
use super::error::{ContextName, GovernorError, RetireError, RetiredBy, TeardownStep};
use super::ledger::{Charges, Entry, Imbalance, Ledger, Note, ReturnedAtTeardown};
use super::pressure::RegisteredResponder;
use super::report::TeardownReport;
use super::role::Role;
use super::shards::{GLOBAL, SHARDS};
use crate::sync::{
    lock, AcquireError, Deferral, Destroyer, Forcing, GateClaim, Lifecycle, Teardown,
};
use crate::trace::{ContextTrace, EventKind};
use crate::{
    BackendError, BackendErrorKind, DeviceContext, DeviceDescription, ProviderContextIdentity,
    ProviderContextPinError, Tier,
};
use pending::Spares;
use pin_source::PinSourceInner;
use sites::SiteId;
use std::cell::UnsafeCell;
use std::ops::Deref;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Instant;
use stream::StreamShared;

/// Where a context is in its life (see [`Lifecycle`]).
pub(crate) use crate::sync::Phase;

/// A release the backend refused: the memory stays owned and charged until
/// the context terminates.
struct Quarantined<M> {
    role: Role,
    tier: Tier,
    bytes: u64,
    /// The part of `bytes` that slept: on no level (see `ledger/charges.rs`).
    asleep: u64,
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
    /// Identity and label, as errors name the context.
    pub name: ContextName,
    pub description: DeviceDescription,
    pub admission: Admission,

    /// Phase, pins, pending releases, the gate and their waiters, and the
    /// transitions between them. Its `settled` notifier and `settle_epoch`
    /// are the admission waiters'.
    pub life: Lifecycle<SHARDS>,

    /// The books: charges on every level of the budget tree, statistics,
    /// counters and outside usage, changed one step at a time (see
    /// `ledger/`).
    pub ledger: Ledger,
    /// The live reservations, for snapshots and refusals.
    pub reservations: reservations::Reservations,
    /// Live streams. Changed only under a gate claim (`stream_created`,
    /// `stream_left`), so that `force` reads a stable count once the gate
    /// has drained.
    streams_live: AtomicU64,

    backend: UnsafeCell<Option<C>>,
    pub streams: Mutex<Vec<Weak<StreamShared<C>>>>,
    pub sources: Mutex<Vec<Weak<PinSourceInner<C>>>>,
    quarantine: Mutex<Vec<Quarantined<C::Memory>>>,
    pub responders: Mutex<Vec<RegisteredResponder>>,
    /// The teardown's outcome, once it ran: every waiter gets a clone.
    report: Mutex<Option<Result<TeardownReport, RetireError>>>,
    /// When retiring began, and what began it.
    pub retire_started: Mutex<Option<(Instant, RetiredBy)>>,

    /// The block cache's limits and totals (its bins are the streams').
    pub cache: cache::ContextCache,
    /// The cached `PendingRelease` boxes, one slot per shard (see
    /// `release.rs`).
    pub spares: Spares<C>,
    /// Where this context records its memory timeline, when it was given a
    /// [`Trace`](crate::trace::Trace).
    pub trace: Option<Box<ContextTrace>>,
    /// What each call site holds, with attribution on
    /// ([`ContextConfig::attribution`], `MEMGOV_ATTRIBUTION`).
    pub sites: Option<Box<sites::Sites>>,
    /// Called with the snapshot when a budget refuses an allocation
    /// ([`ContextConfig::on_refusal`]).
    pub on_refusal: Option<super::config::RefusalHook>,
    /// Whether its memory sleeps (see `suspend.rs`).
    pub sleep: sleep::SleepWord,
    /// The reaper thread, joined by `Governor::drop` when it still owns the
    /// record.
    reaper: Mutex<Option<JoinHandle<()>>>,
    /// A bug planted in the teardown's accounting step, for the tests that
    /// show every waiter still gets an answer.
    #[cfg(test)]
    pub planted_accounting_panic: std::sync::atomic::AtomicBool,
    /// Closes every stream's bins and frees their blocks (`cache::flush_all`,
    /// given by the governor at registration): device loss runs it from
    /// here, below the release path that the flush itself runs on. Cold:
    /// no allocation or release calls it.
    flush_cache: fn(&ContextInner<C>) -> u64,
}

// SAFETY: `backend` is only reached through `BackendGuard` (shared `&C`, and
// `C: Sync`), through `with_closed_gate` under the lifecycle's `Forcing`
// (shared `&C`, no guard can exist), or moved out under its `Destroyer`
// (gate closed and drained, when no `&C` exists any more). Every other
// field is Sync on its own.
unsafe impl<C: DeviceContext> Sync for ContextInner<C> {}
// SAFETY: `C: Send`; the cell is moved between threads only as part of the
// whole record.
unsafe impl<C: DeviceContext> Send for ContextInner<C> {}

/// Shared access to the backend for the length of one call. Holds a gate
/// claim, so teardown cannot move the backend out from under it.
pub(crate) struct BackendGuard<'a, C: DeviceContext> {
    ctx: &'a ContextInner<C>,
    /// The claim of one gate shard, given back when the guard drops.
    claim: GateClaim<'a, SHARDS>,
}

impl<'a, C: DeviceContext> BackendGuard<'a, C> {
    /// Move a live buffer's pin into a release queued on this guard's
    /// shard (see [`GateClaim::defer_pin`]): counted pending now, the pin
    /// given up when the returned deferral drops.
    #[inline]
    pub(crate) fn defer_pin(&self) -> Deferral<'a, SHARDS> {
        self.claim.defer_pin()
    }
}

impl<C: DeviceContext> Deref for BackendGuard<'_, C> {
    type Target = C;
    #[inline]
    fn deref(&self) -> &C {
        // SAFETY: this guard holds a gate claim; `finish` moves the backend
        // out only under the lifecycle's `Destroyer`, which is handed out
        // once the gate is closed and drained of claims, so the Option is
        // Some and stays in place for the guard's lifetime.
        unsafe {
            (*self.ctx.backend.get())
                .as_ref()
                .expect("backend present while the gate is open")
        }
    }
}

/// Start the background teardown of `this` on a thread of its own: the
/// lifecycle's reaper hook. Never tears down on the calling thread, which
/// may be a driver callback thread (a `RetireSignal` fired), where calling
/// back into the driver is forbidden. The thread holds the record, so the
/// report stays readable through any handle and the governor's snapshot.
/// `Governor::drop` joins it if it still owns the record; one started after
/// the governor is gone runs detached and touches only the record and the
/// backend it tears down.
///
/// Returns false when no thread could be started: the context stays
/// retiring (drained) until a `retire().wait(..)` finishes it.
fn start_reaper<C: DeviceContext>(this: &Weak<ContextInner<C>>) -> bool {
    // Every event that calls the hook holds an Arc of the record (a
    // buffer's stream, a pending release, a pin source, a handle), so this
    // succeeds, and the Arc dropped here is never the last.
    let Some(this) = this.upgrade() else {
        return true;
    };
    let record = this.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("memgov-reaper-{}", this.id))
        .spawn(move || {
            // Nobody waits: the outcome stays on the record (and a failure
            // went to the tracing subscriber, if there is one).
            let _ = record.finish();
        });
    match spawned {
        Ok(handle) => {
            *lock(&this.reaper) = Some(handle);
            true
        }
        Err(_e) => {
            #[cfg(feature = "tracing")]
            tracing::error!(context = %this.id, error = %_e, "memgov: could not start the reaper; the context stays retiring until retire().wait() finishes it");
            false
        }
    }
}

impl<C: DeviceContext> ContextInner<C> {
    pub(crate) fn new(
        id: ProviderContextIdentity,
        backend: C,
        config: ContextConfig,
        this: Weak<Self>,
        flush_cache: fn(&Self) -> u64,
    ) -> Self {
        let description = backend.describe();
        let limit = config.budget.unwrap_or(u64::MAX);
        let label = if config.label.is_empty() {
            format!("{}:{}", description.backend, description.ordinal)
        } else {
            config.label
        };
        let sites = config
            .attribution
            .unwrap_or_else(sites::from_env)
            .then(|| Box::new(sites::Sites::new()));
        Self {
            id,
            sites,
            on_refusal: config.on_refusal,
            trace: config
                .trace
                .map(|t| Box::new(ContextTrace::new(t, label.clone()))),
            name: ContextName::new(id, label),
            description,
            admission: config.admission,
            // With `FailFast` no admission waiter exists, and a settlement
            // skips even the fence of `announce_settlement`.
            life: Lifecycle::new(
                config.max_pins,
                config.tuning.pin_lease_chunk,
                matches!(config.admission, Admission::WaitForPending { .. }),
                Box::new(move || start_reaper(&this)),
            ),
            ledger: Ledger::new(
                Charges::new(
                    limit,
                    config.tuning.lease_chunk,
                    config.shared,
                    config.pinned_budget.unwrap_or(u64::MAX),
                ),
                config.tuning.exact_peak,
            ),
            cache: cache::ContextCache::new(config.cache),
            reservations: Default::default(),
            streams_live: AtomicU64::new(0),
            backend: UnsafeCell::new(Some(backend)),
            streams: Mutex::new(Vec::new()),
            sources: Mutex::new(Vec::new()),
            quarantine: Mutex::new(Vec::new()),
            responders: Mutex::new(Vec::new()),
            report: Mutex::new(None),
            retire_started: Mutex::new(None),
            spares: Spares::new(),
            sleep: Default::default(),
            reaper: Mutex::new(None),
            #[cfg(test)]
            planted_accounting_panic: Default::default(),
            flush_cache,
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
        let claim = self.life.enter(shard)?;
        Some(BackendGuard { ctx: self, claim })
    }

    /// Reach the backend while the gate is closed, for `force` only: the
    /// `Forcing` proves that the gate is closed and drained and that the
    /// caller is the only forcer. The caller also holds at least one stream
    /// pin still outstanding, so `finish` cannot have started (it needs
    /// `drained()`).
    fn with_closed_gate<R>(
        &self,
        _forcing: &Forcing<'_, SHARDS>,
        f: impl FnOnce(&C) -> R,
    ) -> Option<R> {
        // (The gate may read undrained again for an instant: a call refused
        // at the closed gate takes and gives back a claim. It never makes a
        // guard.)
        // SAFETY: under the `Forcing` no BackendGuard exists or can be made,
        // and the backend is moved out only by `finish`, which cannot run
        // while the stream pin the caller is synchronizing is outstanding.
        unsafe { (*self.backend.get()).as_ref() }.map(f)
    }

    /// Acquire a pin from the context's pin word, with the error the pin
    /// contract names. At the maximum, idle pin leases are taken back first,
    /// so that `PinCountOverflow` is exact.
    #[inline]
    pub(crate) fn acquire_pin(&self) -> Result<(), ProviderContextPinError> {
        self.life.acquire_pin().map_err(|e| self.pin_refusal(e))
    }

    /// Acquire a pin for an allocation on a stream of `shard`: out of the
    /// shard's pin lease, refilled from the pin word when short.
    #[inline]
    pub(crate) fn acquire_pin_on(&self, shard: usize) -> Result<(), ProviderContextPinError> {
        self.life
            .acquire_pin_on(shard)
            .map_err(|e| self.pin_refusal(e))
    }

    #[cold]
    fn pin_refusal(&self, e: AcquireError) -> ProviderContextPinError {
        match e {
            AcquireError::Closed => ProviderContextPinError::ContextUnavailable(self.id),
            AcquireError::Overflow => ProviderContextPinError::PinCountOverflow(self.id),
        }
    }

    /// Outstanding pins now: held by something, not leased and idle.
    #[inline]
    pub(crate) fn pin_count(&self) -> u64 {
        self.life.pin_count()
    }

    /// Pending releases now.
    #[inline]
    pub(crate) fn pending_count(&self) -> u64 {
        self.life.pending_count()
    }

    /// Whether the backend gate is closed: by `force` (live buffers and
    /// streams were reclaimed) or by teardown.
    #[inline]
    pub(crate) fn gate_closed(&self) -> bool {
        self.life.gate_closed()
    }

    /// A pending release queued on a stream of `shard` settled: wake the
    /// admission waiters, then take it out of pending (see
    /// [`Lifecycle::settle`]).
    #[inline]
    pub(crate) fn settle_pending(&self, shard: usize) {
        self.life.settle(shard);
    }

    /// A release settled (or a live buffer went with a lost device): wake
    /// the admission waiters, if one is registered (see
    /// [`Lifecycle::announce_settlement`]).
    #[inline]
    pub(crate) fn announce_settlement(&self) {
        self.life.announce_settlement();
    }

    /// Drop a pin, waking the teardown waiter if it was the last (and
    /// starting the background teardown if nobody waits).
    #[inline]
    pub(crate) fn release_pin(&self) {
        self.life.release_pin();
    }

    /// Drop a pin taken by a stream of `shard` (or by anything, when
    /// `shard` is [`GLOBAL`]): back into the shard's pin lease, which keeps
    /// two chunks and puts the rest back on the pin word.
    #[inline]
    pub(crate) fn release_pin_on(&self, shard: usize) {
        if shard == GLOBAL {
            self.life.release_pin();
        } else {
            self.life.release_pin_on(shard);
        }
    }

    #[inline]
    pub(crate) fn phase(&self) -> Phase {
        self.life.phase()
    }

    #[inline]
    pub(crate) fn is_lost(&self) -> bool {
        self.life.is_lost()
    }

    pub(crate) fn lost_reason(&self) -> String {
        self.life
            .lost_reason()
            .unwrap_or_else(|| "device lost".into())
    }

    /// Why the device was declared lost, if it was.
    pub(crate) fn lost_reason_if_lost(&self) -> Option<String> {
        self.life.lost_reason()
    }

    /// The stored teardown report, once the context terminated (also when
    /// a step other than the accounting panicked).
    pub(crate) fn teardown_report(&self) -> Option<TeardownReport> {
        match lock(&self.report).as_ref()? {
            Ok(report) => Some(report.clone()),
            Err(RetireError::TeardownPanicked { report, .. }) => report.as_deref().cloned(),
            Err(_) => None,
        }
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
        tier: Tier,
        err: &BackendError,
    ) {
        let asleep = self
            .ledger
            .quarantine(Entry::new(bytes, role, tier, live_shard));
        #[cfg(feature = "tracing")]
        tracing::warn!(context = %self.id, label = %self.label(), bytes, role = %role, error = %err, "memgov: release refused; memory quarantined");
        lock(&self.quarantine).push(Quarantined {
            role,
            tier,
            bytes,
            asleep,
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

    /// The context as errors name it.
    #[inline]
    pub(crate) fn name(&self) -> ContextName {
        self.name.clone()
    }

    /// The label it was registered with.
    #[inline]
    pub(crate) fn label(&self) -> &str {
        self.name.label()
    }

    /// A pin refusal as the governor reports it, naming device loss when
    /// that is why the context stopped accepting work.
    #[cold]
    pub(crate) fn pin_error(&self, refusal: ProviderContextPinError) -> GovernorError {
        match refusal {
            ProviderContextPinError::ContextUnavailable(_) if self.is_lost() => self.lost_error(),
            refusal => GovernorError::Pin {
                context: self.name(),
                refusal,
                retired_by: match refusal {
                    ProviderContextPinError::ContextUnavailable(_) => self.retired_by(),
                    _ => None,
                },
            },
        }
    }

    /// What retired the context, once something did.
    pub(crate) fn retired_by(&self) -> Option<RetiredBy> {
        lock(&self.retire_started).map(|(_, by)| by)
    }

    /// The error every operation on a lost context returns.
    #[cold]
    pub(crate) fn lost_error(&self) -> GovernorError {
        GovernorError::DeviceLost {
            context: self.name(),
            reason: self.lost_reason(),
        }
    }

    /// Whether new work is still admitted: not retiring, lost or torn down.
    /// (A pin taken before retire keeps its holder going; an allocation that
    /// has to wait for room gives up once this is false.)
    #[inline]
    pub(crate) fn accepting(&self) -> bool {
        self.life.accepting()
    }

    /// The error an allocation refused for that reason returns.
    pub(crate) fn unavailable_error(&self) -> GovernorError {
        if self.is_lost() {
            self.lost_error()
        } else {
            self.pin_error(ProviderContextPinError::ContextUnavailable(self.id))
        }
    }

    /// Records one event of this context's timeline, when it is traced.
    /// Out of line and cold: the hot paths call it only for a stream whose
    /// trace tag is set, which they read from a line they already hold.
    #[cold]
    #[inline(never)]
    pub(crate) fn trace_event(
        &self,
        stream: u32,
        role: Option<Role>,
        kind: EventKind,
        bytes: u64,
        note: Option<String>,
    ) {
        if let Some(t) = &self.trace {
            t.event(stream, role, kind, bytes, note);
        }
    }

    /// [`trace_event`](Self::trace_event) of an allocation counted as
    /// `site` in the context's table of sites (0: none, or attribution
    /// off): the event names the site and its label.
    #[cold]
    #[inline(never)]
    pub(crate) fn trace_event_at(
        &self,
        stream: u32,
        role: Option<Role>,
        kind: EventKind,
        bytes: u64,
        note: Option<String>,
        site: SiteId,
    ) {
        if let Some(t) = &self.trace {
            let names = t.site_names(site, || self.sites.as_ref()?.name(site));
            t.event_at(stream, role, kind, bytes, note, names);
        }
    }

    /// `err`, after recording the refusal of `bytes` of `role` made at
    /// `site` on the stream tagged `stream` (0: not traced) in the
    /// context's timeline.
    #[cold]
    #[inline(never)]
    pub(crate) fn trace_refused(
        &self,
        stream: u32,
        role: Role,
        bytes: u64,
        err: GovernorError,
        site: SiteId,
    ) -> GovernorError {
        if stream != 0 {
            let note = Some(err.to_string());
            self.trace_event_at(stream, Some(role), EventKind::Refused, bytes, note, site);
        }
        err
    }

    /// Everything teardown waits for has finished: no pins, and no pending
    /// release (a lost device's pending releases are given up by its teardown).
    #[inline]
    pub(crate) fn drained(&self) -> bool {
        self.life.drained()
    }

    /// A [`RetireHandle`](super::RetireHandle) begins: its owner finishes
    /// the teardown (see [`Lifecycle::attend`]).
    #[inline]
    pub(crate) fn attend(&self) {
        self.life.attend();
    }

    /// A `RetireHandle` ends; with none left, a drained context is torn down
    /// in the background.
    #[inline]
    pub(crate) fn unattend(&self) {
        self.life.unattend();
    }

    /// Declare the device lost. Returns false if it already was.
    pub(crate) fn mark_lost(&self, reason: &str) -> bool {
        // Pins are refused, a drained retiring context may be reaped, and
        // the lifecycle and admission waiters are woken before the
        // backend's hook runs: if it panics, waiters still see the loss (a
        // teardown they start waits at the gate for the hook's claim).
        if !self.life.mark_lost(reason) {
            return false;
        }
        #[cfg(feature = "tracing")]
        tracing::error!(context = %self.id, label = %self.label(), reason, pending = self.life.pending_count(), "memgov: device lost");
        self.ledger.charges().wake_shared_waiters();
        if let Some(backend) = self.enter() {
            backend.device_lost();
        }
        // Cached blocks go with the device, like live buffers.
        (self.flush_cache)(self);
        // Pending releases no longer hold a lost context.
        self.life.reap_if_unattended();
        true
    }

    /// Record a backend error; a lost device marks the context lost.
    pub(crate) fn note_backend_error(&self, err: &BackendError) {
        self.ledger.note(Note::BackendError);
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
                context: self.name(),
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
    #[inline]
    pub(crate) fn is_forced(&self) -> bool {
        self.life.is_forced()
    }

    /// Force, once (a second caller returns at once): the lifecycle closes
    /// the gate and waits for calls in flight; then every stream is
    /// synchronized (unless the device is lost), and the pins of live
    /// buffers and streams, whose memory and raw streams die with the
    /// context, are revoked. The reclaimed bytes stay charged until teardown
    /// frees them. Precondition: retire has begun.
    ///
    /// A `synchronize` that panics does not stop the revocation (a closed
    /// gate with unrevoked pins would wedge the context); the panic is
    /// re-raised once it is done.
    pub(crate) fn force(&self) {
        let Some(forcing) = self.life.begin_force() else {
            return;
        };
        let mut panicked = None;
        // From here on live buffers and streams can no longer release their
        // pins (their paths go through the gate), so the counts are stable.
        if !self.is_lost() {
            let streams: Vec<_> = lock(&self.streams)
                .iter()
                .filter_map(|w| w.upgrade())
                .collect();
            for s in &streams {
                match catch_unwind(AssertUnwindSafe(|| {
                    self.with_closed_gate(&forcing, |b| b.synchronize(s.raw()))
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
        // Still allocated on the device until teardown frees it: charged
        // until then, so that no other context is admitted into it.
        let reclaimed = self.ledger.reclaim_live();
        let streams = self.streams_live.swap(0, Ordering::AcqRel);
        forcing.revoke(reclaimed.count + streams);
        #[cfg(feature = "tracing")]
        tracing::warn!(context = %self.id, label = %self.label(), buffers = reclaimed.count, bytes = reclaimed.bytes, streams, "memgov: force-retire reclaimed live buffers and streams");
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }

    /// Tear down, once. Precondition: `drained()` was observed, or the caller
    /// is `force` after revoking what it reclaimed. Returns the report, or
    /// the error of a step that panicked; a second caller waits for the
    /// first and gets the same outcome. Never panics before every waiter
    /// has been given that outcome.
    pub(crate) fn finish(&self) -> Result<TeardownReport, RetireError> {
        let destroyer = match self.life.begin_teardown() {
            Teardown::Destroy(destroyer) => destroyer,
            Teardown::Done => {
                return lock(&self.report)
                    .clone()
                    .expect("outcome stored before TERMINATED");
            }
        };
        let (outcome, balanced) = self.tear_down(&destroyer);
        *lock(&self.report) = Some(outcome.clone());
        destroyer.terminated();
        #[cfg(feature = "tracing")]
        if let Err(e) = &outcome {
            tracing::error!(context = %self.id, label = %self.label(), error = %e, "memgov: teardown failed");
        }
        // After Terminated: a failed check fails the caller, not every waiter.
        // A lost device may settle a release at any time, teardown included:
        // its books are not quiet. An accounting step that panicked left
        // them half done, and its error says so.
        let accounted = !matches!(
            &outcome,
            Err(RetireError::TeardownPanicked {
                step: TeardownStep::Accounting,
                ..
            })
        );
        if !self.is_lost() && accounted {
            if let Err(imbalance) = balanced {
                debug_assert!(false, "{}", imbalance.of(self.name().to_string()));
            }
        }
        let closed = self.ledger.charges().closed(self.is_lost());
        debug_assert!(
            closed.is_ok() || !accounted,
            "context {}: {}",
            self.name(),
            closed.clone().unwrap_err()
        );
        // Admissions on the shared budget may be waiting for what this
        // teardown gave back (see `DeviceMember::returning_at_teardown`):
        // after the Terminated store, so that a waiter that reads the new
        // epoch also reads Terminated and sees every byte back.
        self.ledger.charges().announce_returned();
        outcome
    }

    /// The backend's teardown, under the lifecycle's `Destroyer`, the
    /// accounting, and the report of it: each step's panic caught, so that
    /// the caller always reaches `terminated` with an outcome for every
    /// waiter.
    fn tear_down(
        &self,
        _destroyer: &Destroyer<'_, SHARDS>,
    ) -> (Result<TeardownReport, RetireError>, Result<(), Imbalance>) {
        // SAFETY: the `Destroyer` is handed out once (the winner of
        // Retiring -> Terminating), with the gate closed and drained: no
        // BackendGuard (and no `&C`) exists and none can be created, and no
        // one else moves the backend out.
        let backend = unsafe { (*self.backend.get()).take() };
        let lost = self.is_lost();
        let started = lock(&self.retire_started).map_or_else(Instant::now, |(at, _)| at);
        // The step that panicked last, and what every panic said.
        let mut panicked: Option<(TeardownStep, String)> = None;
        let mut caught = |step: TeardownStep, p: Box<dyn std::any::Any + Send>| {
            let message = match panicked.take() {
                None => panic_message(&*p),
                Some((earlier, said)) => {
                    format!("{} (after {earlier} panicked: {said})", panic_message(&*p))
                }
            };
            panicked = Some((step, message));
        };
        let result = match backend {
            // A panicking teardown must still end in TERMINATED, with every
            // waiter woken: the panic is also the report's backend result.
            Some(b) => catch_unwind(AssertUnwindSafe(|| b.teardown(lost))).unwrap_or_else(|p| {
                let e = BackendError::new(
                    self.description.backend,
                    "teardown",
                    BackendErrorKind::Other,
                    format!("teardown panicked: {}", panic_message(&*p)),
                );
                caught(TeardownStep::Backend, p);
                Err(e)
            }),
            None => Ok(()),
        };
        // A device the governor thought healthy may answer the teardown's
        // own calls with a device-lost error: the report says it was lost.
        let lost_in_teardown = !lost && matches!(&result, Err(e) if e.is_device_lost());
        let lost = lost || lost_in_teardown;
        let accounting = catch_unwind(AssertUnwindSafe(|| {
            #[cfg(test)]
            if self.planted_accounting_panic.swap(false, Ordering::SeqCst) {
                panic!("planted in the teardown accounting");
            }
            self.return_charges_at_teardown()
        }));
        let (returned, balanced) = match accounting {
            Ok(done) => done,
            Err(p) => {
                caught(TeardownStep::Accounting, p);
                let nothing = ReturnedAtTeardown {
                    quarantined: 0,
                    awaiting_teardown: 0,
                };
                (nothing, Ok(()))
            }
        };
        let counters = self.ledger.counters();
        let report = TeardownReport {
            context: self.id,
            label: self.label().to_owned(),
            lost,
            lost_in_teardown,
            forced: self.is_forced(),
            retired_releases: self.retired(),
            abandoned_releases: counters.abandoned.load(Ordering::Relaxed),
            settled_lost: counters.settled_lost.load(Ordering::Relaxed),
            reclaimed_buffers: counters.reclaimed.load(Ordering::Relaxed),
            quarantined_bytes: returned.quarantined,
            awaiting_teardown_bytes: returned.awaiting_teardown,
            unsettled_releases: if lost { self.life.pending_count() } else { 0 },
            elapsed: started.elapsed(),
            backend_result: result,
        };
        // The trace and a tracing subscriber are the last steps; a
        // subscriber is user code, and may panic too.
        let reporting = catch_unwind(AssertUnwindSafe(|| self.report_teardown(&report, returned)));
        if let Err(p) = reporting {
            caught(TeardownStep::Reporting, p);
        }
        let outcome = match panicked {
            None => Ok(report),
            Some((step, message)) => Err(RetireError::TeardownPanicked {
                context: self.name(),
                step,
                message,
                report: (step != TeardownStep::Accounting).then(|| Box::new(report)),
            }),
        };
        (outcome, balanced)
    }

    /// Record a teardown in the context's trace and as a `tracing` event.
    fn report_teardown(&self, report: &TeardownReport, returned: ReturnedAtTeardown) {
        let lost = report.lost;
        if let Some(t) = &self.trace {
            let note = match &report.backend_result {
                Ok(()) if lost => "lost".to_owned(),
                Ok(()) => "clean".to_owned(),
                Err(e) => format!("the backend's teardown failed: {e}"),
            };
            let held = returned.quarantined + returned.awaiting_teardown;
            t.event(0, None, EventKind::TornDown, held, Some(note));
        }
        #[cfg(feature = "tracing")]
        match &report.backend_result {
            Ok(()) => {
                tracing::info!(context = %self.id, label = %self.label(), lost, forced = report.forced, quarantined_bytes = returned.quarantined, awaiting_teardown_bytes = returned.awaiting_teardown, elapsed = ?report.elapsed, "memgov: context torn down")
            }
            Err(e) => {
                tracing::error!(context = %self.id, label = %self.label(), lost, forced = report.forced, quarantined_bytes = returned.quarantined, awaiting_teardown_bytes = returned.awaiting_teardown, elapsed = ?report.elapsed, error = %e, "memgov: context torn down; the backend's teardown failed")
            }
        }
        #[cfg(not(feature = "tracing"))]
        let _ = returned;
    }

    /// The accounting of every teardown path (waited, background, forced,
    /// lost), in this one place. Runs once the backend's teardown has
    /// returned: the device has every byte of the context back, so every
    /// charge that an executed free did not return is returned now, to the
    /// context's budget and the shared one: quarantined memory, and bytes
    /// awaiting teardown (abandoned releases, buffers reclaimed by force or
    /// released on a lost device). See [`Charges::return_at_teardown`].
    fn return_charges_at_teardown(&self) -> (ReturnedAtTeardown, Result<(), Imbalance>) {
        let quarantined: Vec<_> = std::mem::take(&mut *lock(&self.quarantine));
        let returned = self.ledger.return_at_teardown(
            quarantined
                .iter()
                .map(|q| (Entry::new(q.bytes, q.role, q.tier, GLOBAL), q.asleep)),
            |tier| self.reservations.left_in(tier),
        );
        drop(quarantined);
        returned
    }

    /// Live bytes of every role.
    pub(crate) fn live_bytes(&self) -> u64 {
        self.ledger.stats().usage_all().live.bytes
    }

    /// Pending-release bytes of every role.
    pub(crate) fn pending_bytes(&self) -> u64 {
        self.ledger.stats().usage_all().pending.bytes
    }

    /// Releases whose free executed: settled ones that were not abandoned.
    pub(crate) fn retired(&self) -> u64 {
        let abandoned = self.ledger.counters().abandoned.load(Ordering::Acquire);
        self.ledger
            .stats()
            .settled_count()
            .saturating_sub(abandoned)
    }

    /// Releases queued on a stream (and not undone because the backend
    /// refused them). Derived rather than counted, so the cycle does not pay
    /// for it.
    pub(crate) fn releases_queued(&self) -> u64 {
        self.ledger.stats().queued_count()
    }

    /// Allocations admitted: each is live, queued (see `releases_queued`),
    /// settled because the device was lost, quarantined or reclaimed by
    /// force. Derived rather than counted.
    pub(crate) fn allocations(&self) -> u64 {
        let c = self.ledger.counters();
        self.ledger
            .stats()
            .usage_all()
            .live
            .count
            .wrapping_add(self.releases_queued())
            .wrapping_add(c.settled_lost.load(Ordering::Relaxed))
            .wrapping_add(c.quarantined.load(Ordering::Relaxed))
            .wrapping_add(c.reclaimed.load(Ordering::Relaxed))
    }
}

impl<C: DeviceContext> Drop for ContextInner<C> {
    fn drop(&mut self) {
        // No `spare` slot can hold a cached PendingRelease here: it would hold
        // an Arc of this record (see `Spares::close`).
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
