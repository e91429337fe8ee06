//! Stream-ordered release: moving a buffer's pin into a pending release,
//! settling it when the backend fires (or abandons) its signal, and
//! quarantining releases the backend refuses.

use super::config::Role;
use super::record::{add, bump, sub, ContextInner, Quarantined, TERMINATED};
use super::stream::StreamShared;
use crate::context::{RetireOutcome, RetireSignal, RetireSink};
use crate::sync::lock;
use crate::{BackendError, DeviceContext};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The governor's side of one pending release. Boxed once per release; the
/// box is recycled through its shard's `spare` slot, so that in the steady
/// state a release makes no heap allocation at all.
struct PendingRelease<C: DeviceContext> {
    ctx: Arc<ContextInner<C>>,
    stream_pending: Option<Arc<AtomicU64>>,
    bytes: u64,
    role: Role,
    /// Shard of the stream the release was queued on: its pending counts.
    shard: usize,
}

/// Box a pending release, reusing the shard's cached allocation if it has one.
#[inline]
fn boxed<C: DeviceContext>(pr: PendingRelease<C>) -> Box<PendingRelease<C>> {
    let slot = &pr.ctx.shards[pr.shard].spare;
    // A load first: the swap is skipped (no RMW) when the slot is empty.
    if slot.load(Ordering::Relaxed).is_null() {
        return Box::new(pr);
    }
    let p = slot.swap(std::ptr::null_mut(), Ordering::Acquire) as *mut PendingRelease<C>;
    if p.is_null() {
        return Box::new(pr);
    }
    // SAFETY: `spare` of a `ContextInner<C>` holds only pointers produced by
    // `Box::into_raw` of a `Box<PendingRelease<C>>` whose contents were moved
    // out (see `settle`); the swap gave us sole ownership of the allocation
    // (Acquire pairs with the Release of the CAS that stored it). Writing a
    // value makes it a valid `Box<PendingRelease<C>>` again.
    unsafe {
        p.write(pr);
        Box::from_raw(p)
    }
}

/// Free a cached allocation without dropping contents (it has none).
///
/// # Safety
///
/// `p` came from `spare` of a `ContextInner<C>` and is owned by the caller.
pub(crate) unsafe fn free_spare<C: DeviceContext>(p: *mut u8) {
    // SAFETY: per the contract, `p` is a `Box<PendingRelease<C>>` allocation
    // with moved-out contents; `MaybeUninit` has the same layout and drops
    // nothing.
    drop(unsafe { Box::from_raw(p as *mut std::mem::MaybeUninit<PendingRelease<C>>) });
}

impl<C: DeviceContext> RetireSink for PendingRelease<C> {
    /// Runs on whatever thread fires the signal (possibly a driver thread):
    /// atomics and wake-ups only.
    fn settle(self: Box<Self>, outcome: RetireOutcome) {
        // Move the contents out and offer the allocation to the shard for the
        // next release. `this` (and its Arc of the context) stays alive until
        // the end of this function, so the shard outlives the store.
        let raw = Box::into_raw(self);
        // SAFETY: `raw` is a valid, uniquely owned `PendingRelease<C>`; after
        // the read the allocation is treated as uninitialised.
        let this = unsafe { raw.read() };
        let ctx = &*this.ctx;
        let shard = &ctx.shards[this.shard];
        if shard
            .spare
            .compare_exchange(
                std::ptr::null_mut(),
                raw as *mut u8,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_err()
        {
            // SAFETY: the slot is taken; we still own `raw`, contents moved.
            unsafe { free_spare::<C>(raw as *mut u8) };
        }
        let r = &shard.roles[this.role.index()];
        bump(&r.settled_bytes, this.bytes);
        bump(&r.settled_count, 1);
        if let Some(p) = &this.stream_pending {
            sub(p, this.bytes);
        }
        ctx.uncharge(this.bytes, this.bytes, 0);
        match outcome {
            // `retired` is derived: settled minus abandoned.
            RetireOutcome::Retired => {}
            RetireOutcome::Abandoned => bump(&ctx.counters.abandoned, 1),
        }
        if ctx.phase() == TERMINATED {
            add(&ctx.counters.late_settlements, 1);
        }
        // Admission waiters register in the epoch word: the bump says whether
        // one waits (no fence, no lock otherwise).
        if ctx.settle_epoch.bump() {
            ctx.settled.wake_all();
        }
        // The pin this release carried leaves with it. Lifecycle waiters wait
        // for `drained()` (or the gate, or termination); a settlement can
        // only make that true by taking `pending` to zero, so only that one
        // wakes them, and only if one registered in `pending`: a teardown
        // waiter is not woken once per release.
        if ctx.pending.decrement() {
            ctx.lifecycle.wake_all();
        }
        if let Some(s) = &ctx.shared {
            s.0.epoch.fetch_add(1, Ordering::SeqCst);
            s.0.retired.notify();
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
pub(crate) fn release<C: DeviceContext>(
    ctx: &Arc<ContextInner<C>>,
    live_shard: usize,
    stream: &StreamShared<C>,
    memory: C::Memory,
    bytes: u64,
    role: Role,
) -> Released {
    let Some(backend) = ctx.enter() else {
        // Only force closes the gate while buffers live: it already revoked
        // this buffer's pin and uncharged it; teardown frees the memory.
        drop(memory);
        return Released::Reclaimed;
    };
    // Everything below runs with the gate claim held: `force` reads
    // `live_count` only once the gate has drained, so a buffer is either
    // still counted live (and force revokes its pin) or has moved on (and
    // released or transferred its pin itself) -- never both.
    if ctx.is_lost() {
        drop(memory);
        settle_live_as_lost(ctx, live_shard, bytes, role);
        drop(backend);
        return Released::SettledLost;
    }
    // Move the buffer's pin into the pending release: pending first, so the
    // sum of the two counters never touches zero in between.
    ctx.pending.increment();
    if live_shard != stream.shard {
        // `release_on` another stream: the buffer leaves its own shard and
        // is queued in the other one (as if allocated there).
        let from = &ctx.shards[live_shard].roles[role.index()];
        bump(&from.gone_bytes, bytes);
        bump(&from.gone_count, 1);
        let to = &ctx.shards[stream.shard].roles[role.index()];
        bump(&to.alloc_bytes, bytes);
        bump(&to.alloc_count, 1);
    }
    let q = &ctx.shards[stream.shard].roles[role.index()];
    bump(&q.queued_bytes, bytes);
    bump(&q.queued_count, 1);
    if let Some(p) = &stream.pending_bytes {
        add(p, bytes);
    }
    if let Some(s) = &ctx.shared {
        add(&s.0.pending, bytes);
    }
    let signal = RetireSignal::from_sink(boxed(PendingRelease {
        ctx: ctx.clone(),
        stream_pending: stream.pending_bytes.clone(),
        bytes,
        role,
        shard: stream.shard,
    }));
    match backend.free_async(stream.raw(), memory, signal) {
        Ok(()) => {
            ctx.release_pin();
            drop(backend);
            Released::Queued
        }
        Err((memory, signal, err)) => {
            // Undo the move without settling: the release never happened.
            signal.defuse();
            undo_pending(ctx, live_shard, stream, bytes, role);
            if ctx.pending.decrement() {
                ctx.lifecycle.wake_all();
            }
            ctx.note_backend_error(&err);
            let released = if err.is_device_lost() {
                drop(memory);
                settle_live_as_lost(ctx, live_shard, bytes, role);
                Released::SettledLost
            } else {
                quarantine(ctx, live_shard, memory, bytes, role, &err);
                Released::Quarantined(err)
            };
            drop(backend);
            released
        }
    }
}

fn undo_pending<C: DeviceContext>(
    ctx: &ContextInner<C>,
    live_shard: usize,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
) {
    let q = &ctx.shards[stream.shard].roles[role.index()];
    sub(&q.queued_bytes, bytes);
    sub(&q.queued_count, 1);
    if live_shard != stream.shard {
        let to = &ctx.shards[stream.shard].roles[role.index()];
        sub(&to.alloc_bytes, bytes);
        sub(&to.alloc_count, 1);
        let from = &ctx.shards[live_shard].roles[role.index()];
        sub(&from.gone_bytes, bytes);
        sub(&from.gone_count, 1);
    }
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
    let r = &ctx.shards[live_shard].roles[role.index()];
    bump(&r.gone_bytes, bytes);
    bump(&r.gone_count, 1);
    ctx.uncharge(bytes, 0, 0);
    add(&ctx.counters.settled_lost, 1);
    if ctx.settle_epoch.bump() {
        ctx.settled.wake_all();
    }
    ctx.release_pin();
}

/// Keep refused memory owned and charged, visible with its reason, until the
/// context terminates. It holds no pin: teardown frees it with the context.
fn quarantine<C: DeviceContext>(
    ctx: &ContextInner<C>,
    live_shard: usize,
    memory: C::Memory,
    bytes: u64,
    role: Role,
    err: &BackendError,
) {
    let live = &ctx.shards[live_shard].roles[role.index()];
    bump(&live.gone_bytes, bytes);
    bump(&live.gone_count, 1);
    let r = &ctx.roles[role.index()];
    add(&r.quarantined_bytes, bytes);
    add(&r.quarantined_count, 1);
    if let Some(s) = &ctx.shared {
        add(&s.0.quarantined, bytes);
    }
    add(&ctx.counters.quarantined, 1);
    #[cfg(feature = "tracing")]
    tracing::warn!(context = %ctx.id, label = %ctx.label, bytes, role = %role, error = %err, "memgov: release refused; memory quarantined");
    lock(&ctx.quarantine).push(Quarantined {
        role,
        bytes,
        reason: err.to_string(),
        _memory: memory,
    });
    ctx.release_pin();
}

impl RetireSignal {
    /// Drop the receiver without settling it: for a release the backend
    /// refused, which the governor unwinds itself.
    pub(crate) fn defuse(self) {
        let mut this = std::mem::ManuallyDrop::new(self);
        // The sink's settle is never called; dropping the box only drops its
        // fields (an Arc of the context and counters).
        drop(this.take_sink());
    }
}
