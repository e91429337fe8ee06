//! Stream-ordered release: moving a buffer's pin into a pending release,
//! settling it when the backend fires (or abandons) its signal, and
//! quarantining releases the backend refuses.

use super::config::Role;
use super::pin_source::ContextPin;
use super::record::{add, sub, ContextInner, Phase};
use super::stream::StreamShared;
use crate::{BackendError, DeviceContext};
use memgov_backend::{RetireOutcome, RetireSignal, RetireSink};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

/// The governor's side of one pending release. Boxed once per release; the
/// box is recycled, *with its `Arc` of the context*, through its shard's
/// `spare` slot, so that in the steady state a release neither allocates nor
/// touches the context's reference count.
///
/// A cached box holds an `Arc` of the context it is cached in: a reference
/// cycle, which [`close_spares`] breaks. It runs in `begin_retire`, which
/// precedes every way the record can lose its last outside reference (the
/// governor's registry holds one until `Governor::drop`, which retires, or
/// `prune_terminated`, which needs a finished retire), and closes the slots
/// for good: a closed slot is never filled again.
struct PendingRelease<C: DeviceContext> {
    ctx: Arc<ContextInner<C>>,
    stream_pending: Option<Arc<AtomicU64>>,
    bytes: u64,
    role: Role,
    /// Shard of the stream the release was queued on: its pending counts.
    /// (`u8`: keeps the box at 32 bytes.)
    shard: u8,
}

/// A `spare` slot of a retiring context: never filled again.
const SPARE_CLOSED: *mut u8 = 1usize as *mut u8;

fn is_box(p: *mut u8) -> bool {
    !p.is_null() && p != SPARE_CLOSED
}

/// Box a pending release, reusing the shard's cached box if it has one.
#[inline]
fn boxed<C: DeviceContext>(
    ctx: &Arc<ContextInner<C>>,
    stream_pending: Option<Arc<AtomicU64>>,
    bytes: u64,
    role: Role,
    shard: usize,
) -> Box<PendingRelease<C>> {
    let slot = ctx.stats.spare(shard);
    let p = slot.load(Ordering::Relaxed);
    // Take it with a compare-and-swap, not a swap: a swap could reopen a
    // closed slot. (ABA is harmless: whoever holds the pointer in the slot
    // owns the box it points to.)
    if is_box(p)
        && slot
            .compare_exchange(
                p,
                std::ptr::null_mut(),
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_ok()
    {
        // SAFETY: `spare` of a `ContextInner<C>` holds only pointers from
        // `Box::into_raw` of a complete `Box<PendingRelease<C>>` (see
        // `settle`), whose `ctx` is this context; the CAS gave us sole
        // ownership (Acquire pairs with the Release that stored it).
        let mut b = unsafe { Box::from_raw(p as *mut PendingRelease<C>) };
        debug_assert!(Arc::ptr_eq(&b.ctx, ctx));
        b.stream_pending = stream_pending;
        b.bytes = bytes;
        b.role = role;
        b.shard = shard as u8;
        return b;
    }
    Box::new(PendingRelease {
        ctx: ctx.clone(),
        stream_pending,
        bytes,
        role,
        shard: shard as u8,
    })
}

/// Close every `spare` slot of `ctx` for good and drop the boxes cached there
/// (and their `Arc`s of `ctx`). Called by `begin_retire`; the caller holds its
/// own `Arc` of `ctx`, so none of these is the last.
pub(crate) fn close_spares<C: DeviceContext>(ctx: &ContextInner<C>) {
    for spare in ctx.stats.spares() {
        let p = spare.swap(SPARE_CLOSED, Ordering::AcqRel);
        if is_box(p) {
            // SAFETY: as in `boxed`; the swap took ownership.
            drop(unsafe { Box::from_raw(p as *mut PendingRelease<C>) });
        }
    }
}

/// Whether a slot still holds a box (for `ContextInner`'s drop, where none
/// can: it would hold an `Arc` of the record being dropped).
pub(crate) fn holds_box(p: *mut u8) -> bool {
    is_box(p)
}

impl<C: DeviceContext> RetireSink for PendingRelease<C> {
    /// Runs on whatever thread fires the signal (possibly a driver thread):
    /// atomics and wake-ups only.
    fn settle(mut self: Box<Self>, outcome: RetireOutcome) {
        let this = &mut *self;
        let ctx = &*this.ctx;
        let shard = usize::from(this.shard);
        // The order matters to admission: the reuse credit goes first (so
        // that these bytes are never both credited and uncharged), then the
        // charge, and the statistics last, so that whoever reads "no longer
        // pending" (an allocation deciding whether a wait could help) also
        // sees the bytes back in the budget.
        if let Some(p) = &this.stream_pending {
            sub(p, this.bytes);
        }
        match outcome {
            // The free executed: the device has the bytes back. (`retired`
            // is derived: settled minus abandoned.)
            RetireOutcome::Retired => ctx.uncharge_settled(shard, this.bytes),
            // The free never ran: the memory is the backend's to free at
            // teardown, and charged until then.
            RetireOutcome::Abandoned => {
                ctx.counters.abandoned.fetch_add(1, Ordering::Release);
                if let Some(s) = &ctx.shared {
                    sub(&s.0.pending, this.bytes);
                }
                ctx.hold_until_teardown(this.bytes);
            }
        }
        ctx.stats.settle(shard, this.role, this.bytes);
        if ctx.phase() == Phase::Terminated {
            add(&ctx.counters.late_settlements, 1);
        }
        // Admission waiters: woken only if one is registered.
        ctx.announce_settlement();
        // The pin this release carried leaves with it. Lifecycle waiters wait
        // for `drained()` (or the gate, or termination); a settlement can
        // only make that true by taking `pending` to zero, so only that one
        // wakes them, and only if one registered in `pending`: a teardown
        // waiter is not woken once per release.
        if let Some(s) = &ctx.shared {
            s.0.epoch.fetch_add(1, Ordering::SeqCst);
            s.0.retired.notify();
        }
        // Last of the wake-ups: a task waker registered by `finished()` runs
        // executor code, which must not keep the others from happening.
        ctx.pending_left(shard);
        // Last: offer the box, with its Arc of the context, to the shard.
        // After a successful store this thread touches nothing: the box (and
        // the Arc that keeps the record alive) belongs to the slot.
        this.stream_pending = None;
        let slot: *const AtomicPtr<u8> = ctx.stats.spare(shard);
        let raw = Box::into_raw(self);
        // SAFETY: `slot` points into the context record, which the Arc inside
        // `raw` (still ours until the exchange succeeds) keeps alive.
        let stored = unsafe { &*slot }.compare_exchange(
            std::ptr::null_mut(),
            raw as *mut u8,
            Ordering::Release,
            Ordering::Relaxed,
        );
        if stored.is_err() {
            // Slot full or closed: drop the box (and its Arc) normally.
            // SAFETY: `raw` came from `Box::into_raw` above and is still ours.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

/// How a release ended, for the caller that asked for it explicitly.
#[derive(Debug)]
pub(crate) enum Released {
    /// Queued behind the stream's work; retires later.
    Queued,
    /// The device is lost: settled at once, nothing was called.
    SettledLost,
    /// The context was force-retired: teardown reclaims the memory.
    Reclaimed,
    /// The backend refused: the memory is quarantined.
    Quarantined(BackendError),
}

/// Release `memory` (holding one pin of `ctx`, charged `bytes` live under
/// `role` in shard `live_shard`: its own stream's) stream-ordered on `stream`.
///
/// `after` lists the other streams the memory was used on (its own stream,
/// when `stream` is another one, and the streams recorded on the buffer):
/// the free is ordered after the work already queued on each of them
/// ([`DeviceContext::order_after`]) before it is queued. The caller leaves
/// `stream` itself out of `after`.
pub(crate) fn release<C: DeviceContext>(
    ctx: &Arc<ContextInner<C>>,
    live_shard: usize,
    stream: &StreamShared<C>,
    after: &[&StreamShared<C>],
    memory: C::Memory,
    bytes: u64,
    role: Role,
) -> Released {
    let Some(backend) = ctx.enter_on(stream.shard) else {
        // Only force closes the gate while buffers live: it already revoked
        // this buffer's pin and holds its charge until teardown frees the
        // memory.
        drop(memory);
        return Released::Reclaimed;
    };
    // Everything below runs with the gate claim held: `force` reads
    // the shards' live totals only once the gate has drained, so a buffer is either
    // still counted live (and force revokes its pin) or has moved on (and
    // released or transferred its pin itself) -- never both.
    if ctx.is_lost() {
        drop(memory);
        settle_live_as_lost(ctx, live_shard, bytes, role);
        drop(backend);
        return Released::SettledLost;
    }
    // A free is ordered only within its own stream: make it (and, with
    // stream-ordered reuse, the allocations queued after it) wait for the
    // work still queued on every other stream that used the memory. Nothing
    // has moved yet, so a refusal here ends like a refused free.
    for other in after {
        debug_assert!(!std::ptr::eq(*other, stream));
        if let Err(err) = backend.order_after(stream.raw(), other.raw()) {
            ctx.note_backend_error(&err);
            let released = refused(ctx, live_shard, memory, bytes, role, err);
            drop(backend);
            return released;
        }
    }
    // Move the buffer's pin into the pending release: pending first, so the
    // sum of the two counters never touches zero in between.
    ctx.pending_queued(stream.shard);
    // `release_on` another stream: the buffer leaves its own shard and is
    // queued in the other one (as if allocated there).
    ctx.stats.transfer(live_shard, stream.shard, role, bytes);
    ctx.stats.queue(stream.shard, role, bytes);
    if let Some(p) = &stream.pending_bytes {
        add(p, bytes);
    }
    if let Some(s) = &ctx.shared {
        add(&s.0.pending, bytes);
    }
    let signal = RetireSignal::from_sink(boxed(
        ctx,
        stream.pending_bytes.clone(),
        bytes,
        role,
        stream.shard,
    ));
    // The buffer's pin now belongs to the pending release. The guard drops it
    // once the backend has queued the free, and also if `free_async` panics:
    // the signal, dropped or kept by the backend, settles the release on its
    // own, and the pin must not outlive the call.
    let pin = ContextPin::adopt(ctx, stream.shard);
    match backend.free_async(stream.raw(), memory, signal) {
        Ok(()) => {
            drop(pin);
            drop(backend);
            Released::Queued
        }
        Err((memory, signal, err)) => {
            // The paths below release the pin themselves.
            pin.transfer();
            // Undo the move without settling: the release never happened.
            signal.defuse();
            undo_pending(ctx, live_shard, stream, bytes, role);
            ctx.pending_left(stream.shard);
            ctx.note_backend_error(&err);
            let released = refused(ctx, live_shard, memory, bytes, role, err);
            drop(backend);
            released
        }
    }
}

/// A live buffer whose release the backend refused (the free, or the
/// ordering in front of it): on a lost device it goes with the device,
/// otherwise it is quarantined. Either way its pin is released. Call under
/// a gate claim.
fn refused<C: DeviceContext>(
    ctx: &ContextInner<C>,
    live_shard: usize,
    memory: C::Memory,
    bytes: u64,
    role: Role,
    err: BackendError,
) -> Released {
    if err.is_device_lost() {
        drop(memory);
        settle_live_as_lost(ctx, live_shard, bytes, role);
        Released::SettledLost
    } else {
        ctx.quarantine(live_shard, memory, bytes, role, &err);
        Released::Quarantined(err)
    }
}

fn undo_pending<C: DeviceContext>(
    ctx: &ContextInner<C>,
    live_shard: usize,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
) {
    ctx.stats.unqueue(live_shard, stream.shard, role, bytes);
    if let Some(p) = &stream.pending_bytes {
        sub(p, bytes);
    }
    if let Some(s) = &ctx.shared {
        sub(&s.0.pending, bytes);
    }
}

/// A live buffer of a lost context goes away with the device.
fn settle_live_as_lost<C: DeviceContext>(
    ctx: &ContextInner<C>,
    live_shard: usize,
    bytes: u64,
    role: Role,
) {
    ctx.stats.leave(live_shard, role, bytes);
    // The device does not get the memory back before the context is
    // destroyed (a lost context's allocations are freed by its teardown).
    ctx.hold_until_teardown(bytes);
    add(&ctx.counters.settled_lost, 1);
    ctx.announce_settlement();
    ctx.release_pin();
}
