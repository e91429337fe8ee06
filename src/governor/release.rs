//! The release step, in the order it runs: a buffer's release is ordered
//! after the other streams that used its memory, queued behind its own
//! stream's work (`free_async`), and either settles later (the backend fires
//! or abandons its signal: [`PendingRelease::settle`]) or is refused (the
//! memory goes with a lost device, or into quarantine). The charges move
//! with each step through the [`Ledger`](super::ledger::Ledger); the boxes of
//! pending releases are recycled through one [`Slot`] per shard.
//!
//! # Invariants
//!
//! * Every step of a live buffer's release runs under a gate claim: `force`
//!   reads the shards' live totals only once the gate has drained, so a
//!   buffer is either still counted live (and force revokes its pin) or has
//!   moved on (and released or transferred its pin itself), never both.
//! * The buffer's pin moves into the pending release through the
//!   lifecycle's `Deferral`, taken under the release's gate claim: the
//!   release is counted pending first, so pins + pending never touches zero
//!   in between; the pin leaves with the settlement (`Lifecycle::settle`).
//! * A settlement gives the reuse credit back first, then the charge, then
//!   the statistics: whoever reads "no longer pending" (an admission
//!   deciding whether a wait could help) also sees the bytes back in the
//!   budget.
//! * A cached box holds an `Arc` of the context it is cached in: a reference
//!   cycle, which [`Spares::close`](super::record::pending::Spares::close) breaks. It runs in `begin_retire`, which
//!   precedes every way the record can lose its last outside reference (the
//!   governor's registry holds one until `Governor::drop`, which retires, or
//!   `prune_terminated`, which needs a finished retire), and closes the
//!   slots for good.

use super::ledger::{Entry, Note};
use super::record::pending::PendingRelease;
use super::record::sites::SiteId;
use super::record::stream::StreamShared;
use super::record::{ContextInner, Phase};
use super::role::Role;
use crate::sync::Slot;
use crate::trace::EventKind;
use crate::{BackendError, DeviceContext, Tier};
use memgov_backend::{RetireOutcome, RetireSignal, RetireSink};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// What a release frees, for its context's timeline: a live buffer made at
/// its call site (recorded as [`EventKind::Released`]), or a block the
/// block cache kept, given back for the reason named (recorded as
/// [`EventKind::Trimmed`]: the bytes leave the cache, not the live ones).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Freed {
    Live(SiteId),
    Cached(&'static str),
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
    Quarantined(Box<BackendError>),
}

/// Release `memory` (holding one pin of `ctx`, charged `bytes` live in
/// `tier` under `role` in shard `live_shard`: its own stream's)
/// stream-ordered on `stream`. Every tier's release takes the same steps;
/// only the budget its bytes return to differs.
///
/// `after` lists the other streams the memory was used on (its own stream,
/// when `stream` is another one, and the streams recorded on the buffer):
/// the free is ordered after the work already queued on each of them
/// ([`DeviceContext::order_after`]) before it is queued. The caller leaves
/// `stream` itself out of `after`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn release<C: DeviceContext>(
    ctx: &Arc<ContextInner<C>>,
    live_shard: usize,
    stream: &StreamShared<C>,
    after: &[&StreamShared<C>],
    memory: C::Memory,
    bytes: u64,
    role: Role,
    tier: Tier,
    site: Freed,
) -> Released {
    let Some(backend) = ctx.enter_on(stream.shard) else {
        // Only force closes the gate while buffers live: it already revoked
        // this buffer's pin and holds its charge until teardown frees the
        // memory.
        drop(memory);
        if stream.trace_tag != 0 {
            never_settles(
                ctx,
                stream,
                bytes,
                role,
                Some(site),
                "reclaimed by force".into(),
            );
        }
        return Released::Reclaimed;
    };
    // Everything below runs with the gate claim held (see the module docs).
    if ctx.is_lost() {
        drop(memory);
        if stream.trace_tag != 0 {
            never_settles(
                ctx,
                stream,
                bytes,
                role,
                Some(site),
                "the device is lost".into(),
            );
        }
        settle_live_as_lost(ctx, live_shard, bytes, role, tier);
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
            let released = refused(
                ctx,
                live_shard,
                stream,
                memory,
                bytes,
                role,
                tier,
                Some(site),
                err,
            );
            drop(backend);
            return released;
        }
    }
    // Move the buffer's pin into the pending release: counted pending now,
    // the pin given up once the free is queued (the deferral keeps that
    // order), so the sum of the two counters never touches zero in between.
    let deferral = backend.defer_pin();
    // `release_on` another stream: the buffer leaves its own shard and is
    // queued in the other one (as if allocated there). Stream-ordered reuse
    // credits device memory freed on the stream to the device allocations
    // after it: the ledger says whether this free earned the credit.
    let entry = Entry::new(bytes, role, tier, live_shard);
    let queued = ctx
        .ledger
        .queue(entry, stream.shard, stream.pending_bytes.as_deref());
    let reuse = if queued.credited {
        stream.pending_bytes.clone()
    } else {
        None
    };
    let pending = boxed(ctx, reuse, bytes, role, tier, stream.shard);
    // A stream's trace tag is set only on a traced context.
    let signal = if stream.trace_tag == 0 {
        RetireSignal::from_sink(pending)
    } else {
        traced_signal(ctx, stream.trace_tag, pending, site)
    };
    // The deferral gives the buffer's pin up once the backend has queued the
    // free, and also if `free_async` panics: the signal, dropped or kept by
    // the backend, settles the release on its own, and the pin must not
    // outlive the call.
    match backend.free_async(stream.raw(), memory, signal) {
        Ok(()) => {
            deferral.queued();
            drop(backend);
            Released::Queued
        }
        Err((memory, signal, err)) => {
            // Undo the move without settling: the release never happened.
            // The pin stays here; the paths below release it themselves.
            signal.defuse();
            ctx.ledger
                .unqueue(entry, stream.shard, queued, stream.pending_bytes.as_deref());
            deferral.undo();
            ctx.note_backend_error(&err);
            // The signal put the release on the timeline already: only
            // its abandonment is left to record.
            let released = refused(
                ctx, live_shard, stream, memory, bytes, role, tier, None, err,
            );
            drop(backend);
            released
        }
    }
}

/// A live buffer whose release the backend refused (the free, or the
/// ordering in front of it): on a lost device it goes with the device,
/// otherwise it is quarantined. Either way its pin is released. Call under
/// a gate claim.
#[allow(clippy::too_many_arguments)]
fn refused<C: DeviceContext>(
    ctx: &ContextInner<C>,
    live_shard: usize,
    stream: &StreamShared<C>,
    memory: C::Memory,
    bytes: u64,
    role: Role,
    tier: Tier,
    site: Option<Freed>,
    err: BackendError,
) -> Released {
    if stream.trace_tag != 0 {
        never_settles(
            ctx,
            stream,
            bytes,
            role,
            site,
            format!("release refused: {err}"),
        );
    }
    if err.is_device_lost() {
        drop(memory);
        settle_live_as_lost(ctx, live_shard, bytes, role, tier);
        Released::SettledLost
    } else {
        ctx.quarantine(live_shard, memory, bytes, role, tier, &err);
        Released::Quarantined(Box::new(err))
    }
}

/// On a traced context, the timeline of a live buffer released without a
/// free that will retire (refused, on a lost device, reclaimed by force):
/// released (at `site`; a cached block: trimmed; `None` when the release is
/// on the timeline already: a refused free's signal recorded it), then
/// abandoned, `why` noted.
#[cold]
#[inline(never)]
fn never_settles<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
    site: Option<Freed>,
    why: String,
) {
    let tag = stream.trace_tag;
    if let Some(freed) = site {
        freed_event(ctx, tag, role, bytes, freed);
    }
    ctx.trace_event(tag, Some(role), EventKind::Abandoned, bytes, Some(why));
}

/// A live buffer of a lost context goes away with the device.
fn settle_live_as_lost<C: DeviceContext>(
    ctx: &ContextInner<C>,
    live_shard: usize,
    bytes: u64,
    role: Role,
    tier: Tier,
) {
    // The device does not get the memory back before the context is
    // destroyed (a lost context's allocations are freed by its teardown).
    ctx.ledger
        .lose_live(Entry::new(bytes, role, tier, live_shard));
    ctx.announce_settlement();
    ctx.release_pin();
}

impl<C: DeviceContext> RetireSink for PendingRelease<C> {
    /// The settlement. Runs on whatever thread fires the signal (possibly a
    /// driver thread): atomics and wake-ups only.
    fn settle(mut self: Box<Self>, outcome: RetireOutcome) {
        let this = &mut *self;
        let ctx = &*this.ctx;
        let shard = usize::from(this.shard);
        // Credit, charge, statistics: in that order (see the module docs).
        // Retired: the device has the bytes back (`retired` is derived:
        // settled minus abandoned). Abandoned: the free never ran, the
        // memory is the backend's to free at teardown, charged until then.
        ctx.ledger.settle(
            Entry::new(this.bytes, this.role, this.tier, shard),
            outcome,
            this.stream_pending.as_deref(),
        );
        // A settlement after teardown is a backend bug: counted, after the
        // books moved (a reader that sees it counted sees them moved).
        if ctx.phase() == Phase::Terminated {
            ctx.ledger.note(Note::LateSettlement);
        }
        // The context's own admission waiters (woken only if one is
        // registered), then the pin this release carried leaves with it.
        // Lifecycle waiters wait for `drained()` (or the gate, or
        // termination); a settlement can only make that true by taking
        // `pending` to zero, so only that one wakes them, and only if one
        // registered in `pending`: a teardown waiter is not woken once per
        // release. Last of the wake-ups: a task waker registered by
        // `finished()` runs executor code, which must not keep the others
        // from happening.
        ctx.settle_pending(shard);
        // Last: offer the box, with its Arc of the context, to the shard.
        // After a successful offer this thread touches nothing: the box (and
        // the Arc that keeps the record alive) belongs to the slot.
        this.stream_pending = None;
        let slot: *const Slot<PendingRelease<C>> = ctx.spares.of(shard);
        // SAFETY: `slot` points into the context record, which the Arc inside
        // `self` keeps alive until the offer has either stored the box (and
        // with it the Arc; nothing is touched afterwards) or handed it back.
        if let Err(refused) = unsafe { &*slot }.offer(self) {
            // Slot full or closed: drop the box (and its Arc) normally.
            drop(refused);
        }
    }
}

/// Box a pending release, reusing the shard's cached box if it has one.
#[inline]
fn boxed<C: DeviceContext>(
    ctx: &Arc<ContextInner<C>>,
    stream_pending: Option<Arc<AtomicU64>>,
    bytes: u64,
    role: Role,
    tier: Tier,
    shard: usize,
) -> Box<PendingRelease<C>> {
    if let Some(mut b) = ctx.spares.of(shard).take() {
        // Every box in a context's slots holds an Arc of that context.
        debug_assert!(Arc::ptr_eq(&b.ctx, ctx));
        b.stream_pending = stream_pending;
        b.bytes = bytes;
        b.role = role;
        b.tier = tier;
        b.shard = shard as u8;
        return b;
    }
    Box::new(PendingRelease {
        ctx: ctx.clone(),
        stream_pending,
        bytes,
        role,
        tier,
        shard: shard as u8,
    })
}

/// The signal of a release on a traced context: records the release now
/// (before the free is queued: a backend may settle it inside the call) and
/// its settlement when it comes, around the release's own settlement. Kept
/// apart so that an untraced release and its settlement carry no trace code.
#[cold]
#[inline(never)]
fn traced_signal<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: u32,
    pending: Box<PendingRelease<C>>,
    site: Freed,
) -> RetireSignal {
    let (role, bytes) = (pending.role, pending.bytes);
    freed_event(ctx, stream, role, bytes, site);
    RetireSignal::from_sink(Box::new(TracedRelease { pending, stream }))
}

/// The event of bytes going pending: a live buffer's release at its site,
/// or a cached block's trim with its reason as the note.
fn freed_event<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: u32,
    role: Role,
    bytes: u64,
    freed: Freed,
) {
    match freed {
        Freed::Live(site) => {
            ctx.trace_event_at(stream, Some(role), EventKind::Released, bytes, None, site);
        }
        Freed::Cached(why) => {
            let note = Some(why.to_string());
            ctx.trace_event(stream, Some(role), EventKind::Trimmed, bytes, note);
        }
    }
}

/// A pending release whose settlement is recorded in its context's trace.
struct TracedRelease<C: DeviceContext> {
    pending: Box<PendingRelease<C>>,
    stream: u32,
}

impl<C: DeviceContext> RetireSink for TracedRelease<C> {
    fn settle(self: Box<Self>, outcome: RetireOutcome) {
        let Self { pending, stream } = *self;
        let (ctx, role, bytes) = (pending.ctx.clone(), pending.role, pending.bytes);
        // The release settles first: the trace shows what the books show.
        pending.settle(outcome);
        let kind = match outcome {
            RetireOutcome::Retired => EventKind::Retired,
            RetireOutcome::Abandoned => EventKind::Abandoned,
        };
        ctx.trace_event(stream, Some(role), kind, bytes, None);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_pending_release_box_stays_32_bytes() {
        // The heap-bytes row's budget per pending release.
        assert_eq!(
            std::mem::size_of::<
                crate::governor::record::pending::PendingRelease<crate::null::NullContext>,
            >(),
            32
        );
    }
}
