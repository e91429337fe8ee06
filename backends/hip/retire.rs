//! Stream-ordered frees and how their retirement is learnt.
//!
//! * **Pool memory**: `hipFreeAsync` on the stream, then
//!   `hipStreamAddCallback`. The callback runs on a HIP runtime thread once
//!   everything queued before it (the free included) has executed. It makes
//!   no HIP call (the runtime forbids it): it takes its ticket out of the
//!   pending table and fires the [`RetireSignal`], or drops it unfired when
//!   the stream reports an error (the free did not execute).
//! * **Fallback memory** (`hipMalloc`): an event is recorded on the stream and
//!   the free is handed to the reaper thread, which waits for the event
//!   (`hipEventSynchronize`), calls `hipFree`, and fires the signal.
//!
//! Signals live in this module's tables, not inside the runtime's callback
//! data, so that teardown of a lost device can drop every one of them even
//! if the runtime never runs the callbacks.

#![allow(clippy::result_large_err)]

use super::memory::{HipMemory, Origin};
use super::result::{err, error_name};
use super::stream::HipStream;
use super::Inner;
use crate::sync::lock;
use crate::{BackendError, BackendErrorKind, RetireSignal};
use hip_sys::hiprt::{
    hipError_t, hipEventCreateWithFlags, hipEventDestroy, hipEventDisableTiming, hipEventRecord,
    hipEventSynchronize, hipEvent_t, hipFree, hipFreeAsync, hipStreamAddCallback,
    hipStreamCallback_t, hipStreamSynchronize, hipStream_t,
};
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A queued free whose signal has not fired.
struct Ticket {
    signal: RetireSignal,
    bytes: u64,
    stream: u64,
}

/// Frees queued with `hipFreeAsync` whose callback has not run yet.
#[derive(Default)]
pub(crate) struct PendingFrees {
    tickets: Mutex<HashMap<u64, Ticket>>,
}

impl PendingFrees {
    /// How many frees are queued and not yet retired.
    pub(crate) fn len(&self) -> usize {
        lock(&self.tickets).len()
    }
}

/// Unsettled frees per stream, so that `synchronize` returns only after the
/// signals of the frees queued on its stream have fired (the reaper runs
/// after the stream, and a runtime may run a callback after the stream's
/// own synchronize has returned).
#[derive(Default)]
pub(crate) struct Outstanding {
    per_stream: Mutex<HashMap<u64, u64>>,
    settled: Condvar,
}

impl Outstanding {
    fn add(&self, stream: u64) {
        *lock(&self.per_stream).entry(stream).or_default() += 1;
    }

    /// One free of `stream` settled (its signal fired or was dropped).
    fn settle(&self, stream: u64) {
        let mut m = lock(&self.per_stream);
        if let Some(n) = m.get_mut(&stream) {
            *n -= 1;
            if *n == 0 {
                m.remove(&stream);
            }
        }
        drop(m);
        self.settled.notify_all();
    }

    fn clear(&self) {
        lock(&self.per_stream).clear();
        self.settled.notify_all();
    }

    /// Block until every free queued on `stream` so far has settled, or
    /// the device is lost (then teardown settles them).
    pub(crate) fn wait(&self, stream: u64, lost: &AtomicBool) {
        let mut m = lock(&self.per_stream);
        while m.contains_key(&stream) && !lost.load(Ordering::Acquire) {
            m = self.settled.wait(m).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wake every waiter to look at the lost flag again.
    pub(crate) fn wake(&self) {
        let _m = lock(&self.per_stream);
        self.settled.notify_all();
    }
}

/// What the callback receives as user data: the context and its ticket.
struct CallbackData {
    inner: Arc<Inner>,
    ticket: u64,
}

/// The callback as HIP declares it, but with the status read as a plain
/// integer: hip-sys's `hipError_t` is a Rust enum, and a code outside it
/// (from a newer runtime) must not become an invalid enum value.
type RawCallback = unsafe extern "C" fn(hipStream_t, u32, *mut c_void);

/// Runs on a HIP runtime thread after the free before it executed. Makes no
/// HIP call.
unsafe extern "C" fn free_executed(_stream: hipStream_t, status: u32, user: *mut c_void) {
    // SAFETY: `user` is the `Box<CallbackData>` leaked by `queue_pool_free`
    // for exactly this callback, which HIP runs exactly once.
    let data = unsafe { Box::from_raw(user as *mut CallbackData) };
    let inner = &data.inner;
    // Teardown of a lost device may have taken the ticket already.
    let Some(ticket) = lock(&inner.pending.tickets).remove(&data.ticket) else {
        return;
    };
    if status == hipError_t::hipSuccess as u32 {
        inner.probe.free_retired(ticket.bytes);
        ticket.signal.retire();
    } else {
        // The stream failed: the free did not (visibly) execute. The
        // runtime reports only sticky errors here, so the device is lost.
        inner.mark_lost(&format!(
            "a stream callback reported status {status} after a queued free"
        ));
        inner.probe.free_abandoned(ticket.bytes);
        drop(ticket.signal);
    }
    inner.outstanding.settle(ticket.stream);
}

fn callback() -> hipStreamCallback_t {
    let f: RawCallback = free_executed;
    // SAFETY: `RawCallback` and the declared callback type differ only in
    // the status parameter, `u32` versus `hipError_t`, which is
    // `#[repr(u32)]`: the two have the same C ABI.
    Some(unsafe {
        std::mem::transmute::<RawCallback, unsafe extern "C" fn(hipStream_t, hipError_t, *mut c_void)>(
            f,
        )
    })
}

/// A refused free: the memory and the signal go back to the caller, as
/// `DeviceContext::free_async` requires (hence the large `Err` variants
/// below, which clippy flags).
type Refused = (HipMemory, RetireSignal, BackendError);

/// Queue the free of `memory` behind the work on `stream`.
pub(crate) fn free_async(
    inner: &Arc<Inner>,
    stream: &HipStream,
    memory: HipMemory,
    signal: RetireSignal,
) -> Result<(), Refused> {
    let ready = inner
        .check_stream("free_async", stream)
        .and_then(|()| inner.check_usable("free_async"));
    if let Err(e) = ready {
        return Err((memory, signal, e));
    }
    let known = memory.context == inner.id && lock(&inner.live).remove(&memory.ptr).is_some();
    if !known {
        inner.probe.violation(
            "hip",
            format!(
                "free_async of allocation {:#x} ({} B), which is not live in context {}",
                memory.ptr, memory.bytes, inner.id
            ),
        );
        let e = err(
            "free_async",
            BackendErrorKind::InvalidArgument,
            format!(
                "allocation {:#x} ({} B) is not live in HIP context {} (freed twice, or another context's)",
                memory.ptr, memory.bytes, inner.id
            ),
        );
        return Err((memory, signal, e));
    }
    match memory.origin {
        Origin::Pool => queue_pool_free(inner, stream, memory, signal),
        Origin::Plain => queue_plain_free(inner, stream, memory, signal),
    }
}

fn refuse(
    inner: &Inner,
    memory: HipMemory,
    signal: RetireSignal,
    e: BackendError,
) -> Result<(), Refused> {
    lock(&inner.live).insert(memory.ptr, (memory.bytes, memory.origin));
    Err((memory, signal, e))
}

fn queue_pool_free(
    inner: &Arc<Inner>,
    stream: &HipStream,
    memory: HipMemory,
    signal: RetireSignal,
) -> Result<(), Refused> {
    // SAFETY: the pointer came from hipMallocAsync of this context and was
    // live until just now (removed from `live`, so no other path frees it);
    // the stream is alive.
    let r = unsafe { hipFreeAsync(memory.ptr as *mut c_void, stream.raw.0) };
    if let Err(e) = inner.checked("free_async", "hipFreeAsync", r) {
        return refuse(inner, memory, signal, e);
    }
    let ticket = inner.next_id.fetch_add(1, Ordering::Relaxed);
    let bytes = memory.bytes;
    // The ticket is in the table before the callback can run.
    inner.outstanding.add(stream.id);
    lock(&inner.pending.tickets).insert(
        ticket,
        Ticket {
            signal,
            bytes,
            stream: stream.id,
        },
    );
    let data = Box::into_raw(Box::new(CallbackData {
        inner: Arc::clone(inner),
        ticket,
    }));
    // SAFETY: the stream is alive; the callback has the ABI HIP expects (see
    // `callback`); `data` stays valid until the callback takes it back.
    let r = unsafe { hipStreamAddCallback(stream.raw.0, callback(), data as *mut c_void, 0) };
    if r == hipError_t::hipSuccess {
        return Ok(());
    }
    // The callback will never run: take its data back, then learn when the
    // already-queued free has executed by synchronizing the stream.
    // SAFETY: HIP refused the callback, so it never sees `data`.
    drop(unsafe { Box::from_raw(data) });
    let add_failed = error_name(r);
    let ticket = lock(&inner.pending.tickets).remove(&ticket);
    let Some(ticket) = ticket else { return Ok(()) };
    // SAFETY: the stream is alive.
    let s = unsafe { hipStreamSynchronize(stream.raw.0) };
    match inner.checked("free_async", "hipStreamSynchronize", s) {
        Ok(()) => {
            inner.probe.free_retired(ticket.bytes);
            ticket.signal.retire();
        }
        Err(e) => {
            inner.probe.free_abandoned(ticket.bytes);
            drop(ticket.signal);
            inner.note(format!(
                "hipStreamAddCallback returned {add_failed}, and the synchronize after the queued free failed: {e}; the release is abandoned"
            ));
        }
    }
    inner.outstanding.settle(ticket.stream);
    Ok(())
}

/// An event that may cross threads.
struct Event(hipEvent_t);
// SAFETY: a hipEvent_t is an opaque runtime handle usable from any thread.
unsafe impl Send for Event {}

/// A `hipMalloc` allocation waiting for its event before `hipFree`.
struct PlainFree {
    event: Event,
    ptr: usize,
    bytes: u64,
    stream: u64,
    signal: RetireSignal,
}

/// The reaper's queue, in the order the frees were queued.
#[derive(Default)]
pub(crate) struct Reaper {
    queue: Mutex<ReaperQueue>,
    wake: Condvar,
}

#[derive(Default)]
struct ReaperQueue {
    frees: VecDeque<PlainFree>,
    stop: bool,
}

impl Reaper {
    /// Frees handed over and not yet done.
    pub(crate) fn len(&self) -> usize {
        lock(&self.queue).frees.len()
    }
}

fn queue_plain_free(
    inner: &Arc<Inner>,
    stream: &HipStream,
    memory: HipMemory,
    signal: RetireSignal,
) -> Result<(), Refused> {
    let mut event: hipEvent_t = std::ptr::null_mut();
    // SAFETY: valid out-pointer, documented flag.
    let r = unsafe { hipEventCreateWithFlags(&mut event, hipEventDisableTiming) };
    if let Err(e) = inner.checked("free_async", "hipEventCreateWithFlags", r) {
        return refuse(inner, memory, signal, e);
    }
    // SAFETY: the event was just created; the stream is alive.
    let r = unsafe { hipEventRecord(event, stream.raw.0) };
    if let Err(e) = inner.checked("free_async", "hipEventRecord", r) {
        // SAFETY: the event is ours and unused.
        unsafe { hipEventDestroy(event) };
        return refuse(inner, memory, signal, e);
    }
    if let Err(e) = ensure_reaper(inner) {
        // SAFETY: recorded but nobody waits on it; destroying a recorded
        // event is allowed.
        unsafe { hipEventDestroy(event) };
        return refuse(inner, memory, signal, e);
    }
    inner.outstanding.add(stream.id);
    let mut q = lock(&inner.reaper.queue);
    q.frees.push_back(PlainFree {
        event: Event(event),
        ptr: memory.ptr,
        bytes: memory.bytes,
        stream: stream.id,
        signal,
    });
    drop(q);
    inner.reaper.wake.notify_one();
    Ok(())
}

fn ensure_reaper(inner: &Arc<Inner>) -> Result<(), BackendError> {
    let mut slot = lock(&inner.reaper_thread);
    if slot.is_some() {
        return Ok(());
    }
    let shared = Arc::clone(inner);
    let join = std::thread::Builder::new()
        .name(format!("memgov-hip-reaper-{}", inner.id))
        .spawn(move || reap(&shared))
        .map_err(|e| {
            err(
                "free_async",
                BackendErrorKind::Other,
                format!("could not spawn the HIP reaper thread: {e}"),
            )
        })?;
    *slot = Some(join);
    Ok(())
}

/// The reaper thread: wait for each free's event in order, then `hipFree`.
fn reap(inner: &Inner) {
    // The fallback allocations were made on this device.
    let _ = inner.make_current("free_async");
    loop {
        let event = {
            let mut q = lock(&inner.reaper.queue);
            loop {
                if let Some(f) = q.frees.front() {
                    break f.event.0;
                }
                if q.stop {
                    return;
                }
                q = inner.reaper.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        if inner.is_lost() {
            return;
        }
        // SAFETY: the event stays alive while its free is in the queue
        // (destroyed below, after it is popped; teardown of a lost device
        // takes queue entries without destroying their events).
        let r = unsafe { hipEventSynchronize(event) };
        let Some(free) = lock(&inner.reaper.queue).frees.pop_front() else {
            return;
        };
        let result = inner
            .checked("free_async", "hipEventSynchronize", r)
            .and_then(|()| {
                // SAFETY: the event has completed, so all work queued before the
                // free on its stream has executed; the pointer came from
                // hipMalloc of this context and nothing else frees it.
                let r = unsafe { hipFree(free.ptr as *mut c_void) };
                inner.checked("free_async", "hipFree", r)
            });
        // SAFETY: the event is ours and no longer waited on.
        unsafe { hipEventDestroy(free.event.0) };
        match result {
            Ok(()) => {
                inner.probe.free_retired(free.bytes);
                free.signal.retire();
            }
            Err(e) => {
                inner.note(format!("fallback free of {:#x} failed: {e}", free.ptr));
                inner.probe.free_abandoned(free.bytes);
                drop(free.signal);
            }
        }
        inner.outstanding.settle(free.stream);
    }
}

/// Stop the reaper after it has finished every queued free, and join it.
pub(crate) fn stop_reaper(inner: &Inner) {
    lock(&inner.reaper.queue).stop = true;
    inner.reaper.wake.notify_all();
    if let Some(join) = lock(&inner.reaper_thread).take() {
        let _: Result<(), _> = join.join().map_err(|_| ());
    }
}

/// Device lost: take every signal still held and drop it unfired, with no
/// HIP call. Returns how many were abandoned.
pub(crate) fn abandon_all(inner: &Inner) -> u64 {
    let tickets: Vec<Ticket> = lock(&inner.pending.tickets)
        .drain()
        .map(|(_, t)| t)
        .collect();
    let frees: Vec<PlainFree> = {
        let mut q = lock(&inner.reaper.queue);
        q.stop = true;
        q.frees.drain(..).collect()
    };
    inner.reaper.wake.notify_all();
    let n = (tickets.len() + frees.len()) as u64;
    for t in tickets {
        inner.probe.free_abandoned(t.bytes);
        drop(t.signal);
    }
    for f in frees {
        inner.probe.free_abandoned(f.bytes);
        drop(f.signal);
    }
    inner.outstanding.clear();
    n
}

/// The reaper's join handle slot type.
pub(crate) type ReaperThread = Mutex<Option<JoinHandle<()>>>;
