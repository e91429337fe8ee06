//! Stream-ordered release: moving a buffer's pin into a pending release,
//! settling it when the backend fires (or abandons) its signal, and
//! quarantining releases the backend refuses.

use super::config::Role;
use super::record::{add, sub, ContextInner, Quarantined, TERMINATED};
use super::stream::StreamShared;
use crate::context::{RetireOutcome, RetireSignal, RetireSink};
use crate::sync::lock;
use crate::{BackendError, DeviceContext};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The governor's side of one pending release. Boxed once per release; this
/// is the only heap allocation a release makes.
struct PendingRelease<C: DeviceContext> {
    ctx: Arc<ContextInner<C>>,
    stream_pending: Option<Arc<AtomicU64>>,
    bytes: u64,
    role: Role,
}

impl<C: DeviceContext> RetireSink for PendingRelease<C> {
    /// Runs on whatever thread fires the signal (possibly a driver thread):
    /// atomics and wake-ups only.
    fn settle(self: Box<Self>, outcome: RetireOutcome) {
        let ctx = &*self.ctx;
        let r = &ctx.roles[self.role.index()];
        sub(&r.pending_bytes, self.bytes);
        sub(&r.pending_count, 1);
        if let Some(p) = &self.stream_pending {
            sub(p, self.bytes);
        }
        ctx.uncharge(self.bytes, self.bytes, 0);
        match outcome {
            RetireOutcome::Retired => add(&ctx.counters.retired, 1),
            RetireOutcome::Abandoned => add(&ctx.counters.abandoned, 1),
        }
        if ctx.phase() == TERMINATED {
            add(&ctx.counters.late_settlements, 1);
        }
        ctx.settle_epoch.fetch_add(1, Ordering::SeqCst);
        // The pin this release carried leaves with it. Lifecycle waiters wait
        // for `drained()` (or the gate, or termination); a settlement can
        // only make that true by taking `pending` to zero, so only that one
        // wakes them: a teardown waiter is not woken once per release.
        if ctx.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            ctx.lifecycle.notify();
        }
        ctx.settled.notify();
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
/// `role`) stream-ordered on `stream`.
pub(crate) fn release<C: DeviceContext>(
    ctx: &Arc<ContextInner<C>>,
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
    let r = &ctx.roles[role.index()];
    // Everything below runs with the gate claim held: `force` reads
    // `live_count` only once the gate has drained, so a buffer is either
    // still counted live (and force revokes its pin) or has moved on (and
    // released or transferred its pin itself) -- never both.
    if ctx.is_lost() {
        drop(memory);
        settle_live_as_lost(ctx, bytes, role);
        drop(backend);
        return Released::SettledLost;
    }
    // Move the buffer's pin into the pending release: pending first, so the
    // sum of the two counters never touches zero in between.
    ctx.pending.fetch_add(1, Ordering::SeqCst);
    sub(&r.live_bytes, bytes);
    sub(&r.live_count, 1);
    add(&r.pending_bytes, bytes);
    add(&r.pending_count, 1);
    if let Some(p) = &stream.pending_bytes {
        add(p, bytes);
    }
    if let Some(s) = &ctx.shared {
        add(&s.0.pending, bytes);
    }
    add(&ctx.counters.releases_queued, 1);
    let signal = RetireSignal::from_sink(Box::new(PendingRelease {
        ctx: ctx.clone(),
        stream_pending: stream.pending_bytes.clone(),
        bytes,
        role,
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
            undo_pending(ctx, stream, bytes, role);
            ctx.pending.fetch_sub(1, Ordering::SeqCst);
            ctx.note_backend_error(&err);
            let released = if err.is_device_lost() {
                drop(memory);
                settle_live_as_lost(ctx, bytes, role);
                Released::SettledLost
            } else {
                quarantine(ctx, memory, bytes, role, &err);
                Released::Quarantined(err)
            };
            drop(backend);
            released
        }
    }
}

fn undo_pending<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
) {
    let r = &ctx.roles[role.index()];
    sub(&r.pending_bytes, bytes);
    sub(&r.pending_count, 1);
    add(&r.live_bytes, bytes);
    add(&r.live_count, 1);
    if let Some(p) = &stream.pending_bytes {
        sub(p, bytes);
    }
    if let Some(s) = &ctx.shared {
        sub(&s.0.pending, bytes);
    }
    sub(&ctx.counters.releases_queued, 1);
}

/// A live buffer of a lost context goes away with the device.
fn settle_live_as_lost<C: DeviceContext>(ctx: &ContextInner<C>, bytes: u64, role: Role) {
    let r = &ctx.roles[role.index()];
    sub(&r.live_bytes, bytes);
    sub(&r.live_count, 1);
    ctx.uncharge(bytes, 0, 0);
    add(&ctx.counters.settled_lost, 1);
    ctx.settle_epoch.fetch_add(1, Ordering::SeqCst);
    ctx.settled.notify();
    ctx.release_pin();
}

/// Keep refused memory owned and charged, visible with its reason, until the
/// context terminates. It holds no pin: teardown frees it with the context.
fn quarantine<C: DeviceContext>(
    ctx: &ContextInner<C>,
    memory: C::Memory,
    bytes: u64,
    role: Role,
    err: &BackendError,
) {
    let r = &ctx.roles[role.index()];
    sub(&r.live_bytes, bytes);
    sub(&r.live_count, 1);
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
