//! Streams: non-blocking `hipStream_t`s created on the context's device and
//! tracked so that teardown can destroy any the governor left behind.

use super::ffi::{
    hipEventCreateWithFlags, hipEventDestroy, hipEventDisableTiming, hipEventRecord,
    hipStreamCreateWithFlags, hipStreamDestroy, hipStreamNonBlocking, hipStreamSynchronize,
    hipStreamWaitEvent, hipStream_t,
};
use super::Inner;
use memgov_backend::BackendError;
use memgov_sync::lock;
use std::sync::atomic::Ordering;

/// A `hipStream_t` that may cross threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawStream(pub(crate) hipStream_t);

// SAFETY: a hipStream_t is an opaque handle into the HIP runtime, which
// accepts it from any host thread; this type only carries the value.
unsafe impl Send for RawStream {}
// SAFETY: as above; shared references only copy the handle.
unsafe impl Sync for RawStream {}

/// A non-blocking HIP stream of one [`HipContext`](super::HipContext).
///
/// A plain handle: dropping it does nothing; `destroy_stream` (or teardown,
/// for streams the governor abandoned) destroys the `hipStream_t`.
#[derive(Debug)]
pub struct HipStream {
    pub(crate) raw: RawStream,
    pub(crate) id: u64,
    pub(crate) context: u64,
}

impl HipStream {
    /// The raw `hipStream_t`, for launching a runtime's own kernels and
    /// copies ordered with memgov's work on this stream.
    ///
    /// Valid until the stream is destroyed (the governed stream is dropped,
    /// or its context torn down). The caller must not destroy it, must not
    /// add callbacks that call HIP, and must not use it after teardown.
    /// Memory of this context used by work queued here must stay owned (not
    /// released) until that work has executed: the governor orders its free
    /// after the work, but only on this same stream.
    pub fn hip_stream(&self) -> hipStream_t {
        self.raw.0
    }

    /// This stream's number within its context (for logs).
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// A non-blocking stream on the thread's current device (the caller has
/// made the context's device current), known to no table.
pub(crate) fn create_raw(inner: &Inner, op: &'static str) -> Result<RawStream, BackendError> {
    let mut raw: hipStream_t = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer; the flag is a documented value.
    let r = unsafe { hipStreamCreateWithFlags(&mut raw, hipStreamNonBlocking) };
    inner.checked(op, "hipStreamCreateWithFlags", r)?;
    Ok(RawStream(raw))
}

/// Create a non-blocking stream on the context's device.
pub(crate) fn create(inner: &Inner) -> Result<HipStream, BackendError> {
    inner.check_usable("create_stream")?;
    let _device = inner.make_current("create_stream")?;
    let RawStream(raw) = create_raw(inner, "create_stream")?;
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    lock(&inner.streams).insert(id, RawStream(raw));
    inner.probe.stream_created();
    Ok(HipStream {
        raw: RawStream(raw),
        id,
        context: inner.id,
    })
}

/// Wait for the stream's work (its free callbacks included), then destroy it.
///
/// On a context declared lost whose device still answers, the stream is
/// still synchronized and destroyed (the runtime would keep it otherwise);
/// on a dead device (a sticky code seen, now or before) it is only dropped
/// from the table: the runtime may wait for the stream's work inside
/// `hipStreamDestroy`, and that work never finishes.
pub(crate) fn destroy(inner: &Inner, stream: HipStream) -> Result<(), BackendError> {
    inner.check_stream("destroy_stream", &stream)?;
    if !inner.is_dead() {
        // SAFETY: the stream is alive (it is in `streams`, removed below).
        let r = unsafe { hipStreamSynchronize(stream.raw.0) };
        let synced = inner.checked("destroy_stream", "hipStreamSynchronize", r);
        if synced.is_err() && !inner.is_dead() {
            return synced;
        }
        inner.outstanding.wait(stream.id, inner.lost.flag());
    }
    if lock(&inner.streams).remove(&stream.id).is_none() {
        return Ok(());
    }
    if inner.is_dead() {
        inner.probe.stream_destroyed();
        return Ok(());
    }
    destroy_raw(inner, "destroy_stream", stream.raw)
}

/// Destroy a stream already removed from the table.
pub(crate) fn destroy_raw(
    inner: &Inner,
    op: &'static str,
    raw: RawStream,
) -> Result<(), BackendError> {
    inner.probe.stream_destroyed();
    // SAFETY: the handle was created by this context and has just been
    // removed from its table, so no other path destroys it; its queued work
    // has been synchronized.
    let r = unsafe { hipStreamDestroy(raw.0) };
    inner.checked(op, "hipStreamDestroy", r)
}

/// Block until the stream's queued work and callbacks have run.
pub(crate) fn synchronize(inner: &Inner, stream: &HipStream) -> Result<(), BackendError> {
    inner.check_stream("synchronize", stream)?;
    inner.check_lost("synchronize")?;
    // SAFETY: the stream belongs to this live context (checked above).
    let r = unsafe { hipStreamSynchronize(stream.raw.0) };
    inner.checked("synchronize", "hipStreamSynchronize", r)?;
    inner.outstanding.wait(stream.id, inner.lost.flag());
    Ok(())
}

/// Order every operation queued on `stream` from now on after everything
/// already queued on `after`: an event recorded on `after`, a wait for it
/// queued on `stream`, the event destroyed at once (HIP keeps what a queued
/// wait needs). Returns without waiting for the device.
pub(crate) fn order_after(
    inner: &Inner,
    stream: &HipStream,
    after: &HipStream,
) -> Result<(), BackendError> {
    inner.check_stream("order_after", stream)?;
    inner.check_stream("order_after", after)?;
    inner.check_usable("order_after")?;
    if stream.id == after.id {
        return Ok(());
    }
    // Events belong to the current device.
    let _device = inner.make_current("order_after")?;
    let mut event = std::ptr::null_mut();
    // SAFETY: valid out-pointer, documented flag.
    let r = unsafe { hipEventCreateWithFlags(&mut event, hipEventDisableTiming) };
    inner.checked("order_after", "hipEventCreateWithFlags", r)?;
    // SAFETY: the event was just created; `after` is a live stream of this
    // context (checked above).
    let r = unsafe { hipEventRecord(event, after.raw.0) };
    let mut result = inner.checked("order_after", "hipEventRecord", r);
    if result.is_ok() {
        // SAFETY: the event is recorded; `stream` is a live stream of this
        // context.
        let r = unsafe { hipStreamWaitEvent(stream.raw.0, event, 0) };
        result = inner.checked("order_after", "hipStreamWaitEvent", r);
    }
    if !inner.is_dead() {
        // SAFETY: the event is ours; destroying it with a wait still queued
        // is allowed (the runtime releases it once the wait has run).
        let r = unsafe { hipEventDestroy(event) };
        let destroyed = inner.checked("order_after", "hipEventDestroy", r);
        result = result.and(destroyed);
    }
    result
}
