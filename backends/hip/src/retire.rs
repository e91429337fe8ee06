//! Stream-ordered frees and how their retirement is learnt.
//!
//! * **Pool memory**: `hipFreeAsync` on the stream, then
//!   `hipStreamAddCallback`. The callback runs on a HIP runtime thread once
//!   everything queued before it (the free included) has executed. It makes
//!   no HIP call (the runtime forbids it): it takes its ticket out of the
//!   pending table and fires the [`RetireSignal`], or drops it unfired when
//!   the stream reports an error (the free did not execute).
//! * **Fallback memory** (`hipMalloc`) and **pinned host memory**
//!   (`hipHostMalloc`): their frees are synchronous, so an event is recorded
//!   on the stream and the free is handed to the context's free thread
//!   ([`memgov_backend::FreeThread`]), which takes it off its queue, waits
//!   for the event (`hipEventSynchronize`: every copy queued before the
//!   release has run), calls `hipFree` / `hipHostFree`, destroys the event
//!   and fires the signal. Teardown joins the free thread, so the free it
//!   holds is settled, and no call of that thread reaches HIP, once teardown
//!   returns.
//!
//! Signals of pool frees wait in the context's [`memgov_backend::Tickets`],
//! not inside the runtime's callback data, so that teardown of a lost device
//! can drop every one of them even if the runtime never runs the callbacks.
//! The callback's user data is a number, not a pointer: the ticket, which
//! the core's process-wide table routes to its context
//! ([`memgov_stream_ordered::retire`], which also parks, claims, handles a
//! failed `hipStreamAddCallback` and device loss). A runtime that drops
//! queued callbacks without running them (a lost device, a stream destroyed
//! with callbacks pending) leaks nothing: teardown removes the routes of
//! the tickets it settles.

#![allow(clippy::result_large_err)]

use super::ffi::{
    hipEventCreateWithFlags, hipEventDestroy, hipEventDisableTiming, hipEventRecord,
    hipEventSynchronize, hipEvent_t, hipFree, hipFreeAsync, hipHostFree, hipSetDevice,
};
use super::memory::{HipMemory, Origin};
use super::result::err;
use super::stream::HipStream;
use crate::shared::{Event, PlainFree, Shared};
use memgov_backend::{BackendError, BackendErrorKind, FreeThread, FreeWork, RetireSignal, Stop};
use memgov_stream_ordered::parts::Books;
use memgov_stream_ordered::retire::{self, Queued, Settle};
use memgov_stream_ordered::table::Context as _;
use std::ffi::c_void;
use std::sync::Arc;

/// A pool free's callback ran: the free executed, or the stream failed (the
/// free did not visibly execute; the runtime reports only sticky errors
/// here, so the device is lost).
impl Settle for Shared {
    fn settle(&self, ticket: u64, ok: bool) {
        // Teardown of a lost device may have taken the ticket already.
        let Some(claim) = self.pending.claim(ticket) else {
            return;
        };
        if !ok {
            self.mark_lost("a stream callback reported an error status after a queued free");
        }
        let stream = retire::settle_claim(claim, ok, self.probe());
        self.outstanding.settle(stream);
    }
}

/// A refused free: the memory and the signal go back to the caller, as
/// `DeviceContext::free_async` requires (hence the large `Err` variants
/// below, which clippy flags).
type Refused = memgov_stream_ordered::parts::Refused<HipMemory>;

/// Queue the free of `memory` behind the work on `stream`.
pub(crate) fn free_async(
    shared: &Arc<Shared>,
    stream: &HipStream,
    memory: HipMemory,
    signal: RetireSignal,
) -> Result<(), Refused> {
    // The checks and the books are the core's; the device is made current
    // only where a free needs it (not for `hipFreeAsync`).
    let what = format_args!("allocation {}", *memory);
    let taken = retire::begin_free(&**shared, stream, memory.context, what, || {
        shared.take_live(&memory)
    });
    if let Err(e) = taken {
        return Err((memory, signal, e));
    }
    match memory.origin {
        Origin::Pool => queue_pool_free(shared, stream, memory, signal),
        Origin::Plain | Origin::PinnedHost => queue_plain_free(shared, stream, memory, signal),
        // Released through the arena by `HipContext::free_async`, never here.
        Origin::Arena => refuse(shared, memory, signal, crate::arena::misrouted()),
    }
}

fn refuse(
    shared: &Shared,
    memory: HipMemory,
    signal: RetireSignal,
    e: BackendError,
) -> Result<(), Refused> {
    shared.put_back(&memory, (memory.bytes, memory.origin));
    Err((memory, signal, e))
}

fn queue_pool_free(
    shared: &Arc<Shared>,
    stream: &HipStream,
    memory: HipMemory,
    signal: RetireSignal,
) -> Result<(), Refused> {
    // SAFETY: the pointer came from hipMallocAsync of this context and was
    // live until just now (removed from `live`, so no other path frees it);
    // the stream is alive.
    let r = unsafe { hipFreeAsync(memory.own() as *mut c_void, stream.raw()) };
    if let Err(e) = shared.checked("free_async", "hipFreeAsync", r) {
        return refuse(shared, memory, signal, e);
    }
    // The ticket is in the table before the callback can run.
    shared.outstanding.add(stream.id());
    let owner = Arc::downgrade(shared);
    // SAFETY: the stream is alive; the free is queued on it.
    let queued = unsafe {
        retire::queue(
            &**shared,
            shared.probe(),
            owner,
            &shared.pending,
            stream.raw(),
            (retire::next_ticket(), signal, memory.bytes, stream.id()),
            |_| true,
        )
    };
    if let Queued::Settled(stream, retired) = queued {
        if !retired {
            shared.note(
                "hipStreamAddCallback failed, and so did the synchronize after the queued free: \
                 the release is abandoned"
                    .to_owned(),
            );
        }
        shared.outstanding.settle(stream);
    }
    Ok(())
}

fn queue_plain_free(
    shared: &Arc<Shared>,
    stream: &HipStream,
    memory: HipMemory,
    signal: RetireSignal,
) -> Result<(), Refused> {
    // Events belong to the current device.
    let _device = match shared.make_current("free_async") {
        Ok(d) => d,
        Err(e) => return refuse(shared, memory, signal, e),
    };
    let mut event: hipEvent_t = std::ptr::null_mut();
    // SAFETY: valid out-pointer, documented flag.
    let r = unsafe { hipEventCreateWithFlags(&mut event, hipEventDisableTiming) };
    if let Err(e) = shared.checked("free_async", "hipEventCreateWithFlags", r) {
        return refuse(shared, memory, signal, e);
    }
    // SAFETY: the event was just created; the stream is alive.
    let r = unsafe { hipEventRecord(event, stream.raw()) };
    if let Err(e) = shared.checked("free_async", "hipEventRecord", r) {
        // SAFETY: the event is ours and unused.
        unsafe { hipEventDestroy(event) };
        return refuse(shared, memory, signal, e);
    }
    if let Err(e) = start_free_thread(shared) {
        // SAFETY: recorded but nobody waits on it; destroying a recorded
        // event is allowed.
        unsafe { hipEventDestroy(event) };
        return refuse(shared, memory, signal, e);
    }
    shared.outstanding.add(stream.id());
    shared.frees.push(PlainFree {
        event: memgov_stream_ordered::table::Raw(event),
        ptr: memory.own(),
        origin: memory.origin,
        bytes: memory.bytes,
        stream: stream.id(),
        signal,
    });
    Ok(())
}

/// Start the context's free thread, unless it runs (or was stopped).
fn start_free_thread(shared: &Arc<Shared>) -> Result<(), BackendError> {
    FreeThread::start(shared, format!("memgov-hip-free-{}", shared.id))
        .map(|_| ())
        .map_err(|e| {
            err(
                "free_async",
                BackendErrorKind::Other,
                format!("could not spawn the HIP free thread: {e}"),
            )
        })
}

/// The free thread: take each free in order, wait for its event, then
/// `hipFree`. The free it holds is its own until settled, so teardown (which
/// joins it) never returns while it is in flight; the ones still queued can
/// be taken by device loss. On a dead device it settles what it takes
/// without a HIP call.
impl FreeWork for Shared {
    type Job = PlainFree;

    fn free_thread(&self) -> &FreeThread<PlainFree> {
        &self.frees
    }

    fn on_start(&self) {
        // The fallback allocations were made on this device; the thread is
        // the context's own, so its current device is not restored.
        // SAFETY: plain call with the ordinal validated at creation.
        let r = unsafe { hipSetDevice(self.ordinal()) };
        let _ = self.checked("free_async", "hipSetDevice", r);
    }

    fn work(&self, frees: Vec<PlainFree>) {
        for free in frees {
            settle_plain(self, free);
        }
    }
}

/// Wait for a fallback free's event, `hipFree` it, destroy the event and
/// settle the signal; on a dead device, abandon it without a call.
fn settle_plain(shared: &Shared, free: PlainFree) {
    let result = if shared.is_dead() {
        Err(err(
            "free_async",
            BackendErrorKind::DeviceLost,
            "the device is lost; the fallback free was not sent",
        ))
    } else {
        // SAFETY: the event is alive: it is destroyed only below, by the
        // holder of its free (this thread).
        let r = unsafe { hipEventSynchronize(free.event.0) };
        shared
            .checked("free_async", "hipEventSynchronize", r)
            .and_then(|()| {
                // SAFETY: the event has completed, so all work queued before
                // the free on its stream has executed; the pointer came from
                // hipMalloc / hipHostMalloc of this context (as its origin
                // says) and nothing else frees it.
                unsafe { free_synchronous(shared, "free_async", free.ptr, free.origin) }
            })
    };
    if !shared.is_dead() {
        // SAFETY: the event is ours and no longer waited on.
        unsafe { hipEventDestroy(free.event.0) };
    }
    match result {
        Ok(()) => {
            shared.probe().free_retired(free.bytes);
            free.signal.retire();
        }
        Err(e) => {
            shared.note(format!("fallback free of {:#x} failed: {e}", free.ptr));
            shared.probe().free_abandoned(free.bytes);
            drop(free.signal);
        }
    }
    shared.outstanding.settle(free.stream);
}

/// Stop the free thread after it has finished every queued free, and join
/// it (unless the caller is the free thread itself, settling a signal whose
/// owner tore the context down: it returns once the queue is empty).
pub(crate) fn stop_free_thread(shared: &Shared) {
    shared.frees.stop(Stop::AfterQueue);
}

/// `hipFree` or `hipHostFree` of `ptr`, as `origin` says.
///
/// # Safety
///
/// `ptr` came from `hipMalloc` (`Origin::Plain`) or `hipHostMalloc`
/// (`Origin::PinnedHost`) of this context, no queued work uses it any more,
/// and nothing else frees it.
pub(crate) unsafe fn free_synchronous(
    shared: &Shared,
    op: &'static str,
    ptr: usize,
    origin: Origin,
) -> Result<(), BackendError> {
    // `hipFree` and `hipHostFree` are potentially unsafe calls: they wait
    // for the captures under way anywhere in the process to end (the free
    // thread's and teardown's; on a capturing thread they go ahead and the
    // runtime decides).
    let _call = crate::shared::gate().call(op, false);
    if origin == Origin::PinnedHost {
        // SAFETY: the caller's contract.
        let r = unsafe { hipHostFree(ptr as *mut c_void) };
        shared.checked(op, "hipHostFree", r)
    } else {
        // SAFETY: the caller's contract.
        let r = unsafe { hipFree(ptr as *mut c_void) };
        shared.checked(op, "hipFree", r)
    }
}

/// A fallback free a lost teardown took from the free thread's queue before
/// the thread started it: its signal is already dropped; the memory and the
/// event are released by teardown while the device answers.
pub(crate) struct Taken {
    ptr: usize,
    origin: Origin,
    event: Event,
}

/// Release a taken fallback free: its event was recorded before the free
/// was queued, so synchronize it, then `hipFree` and destroy the event.
pub(crate) fn free_taken(shared: &Shared, t: &Taken) -> Result<(), BackendError> {
    if shared.is_dead() {
        return Ok(());
    }
    // SAFETY: the event is alive (never destroyed while its free is queued
    // or taken); the streams are synchronized.
    let r = unsafe { hipEventSynchronize(t.event.0) };
    let mut result = shared.checked("teardown", "hipEventSynchronize", r);
    if result.is_ok() {
        // SAFETY: the pointer came from hipMalloc / hipHostMalloc of this
        // context; the work before its free has executed and nothing else
        // frees it.
        result = unsafe { free_synchronous(shared, "teardown", t.ptr, t.origin) };
    }
    if !shared.is_dead() {
        // SAFETY: the event is ours and no longer waited on.
        unsafe { hipEventDestroy(t.event.0) };
    }
    result
}

/// Device lost: take every signal still held and drop it unfired, with no
/// HIP call, and stop the free thread after the free it holds. Returns the
/// fallback frees taken off the free thread's queue, for teardown to
/// release while the device answers.
pub(crate) fn abandon_all(shared: &Shared) -> Vec<Taken> {
    let tickets = retire::claim_all(&shared.pending);
    let frees = shared.frees.stop_and_take();
    for claim in tickets {
        claim.abandon(shared.probe());
    }
    let mut taken = Vec::with_capacity(frees.len());
    for f in frees {
        shared.probe().free_abandoned(f.bytes);
        drop(f.signal);
        taken.push(Taken {
            ptr: f.ptr,
            origin: f.origin,
            event: f.event,
        });
    }
    shared.outstanding.clear();
    taken
}
