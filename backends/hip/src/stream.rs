//! Streams: non-blocking `hipStream_t`s created on the context's device and
//! tracked so that teardown can destroy any the governor left behind.

use super::ffi::{
    hipEventCreateWithFlags, hipEventDestroy, hipEventDisableTiming, hipEventRecord,
    hipStreamCreateWithFlags, hipStreamDestroy, hipStreamNonBlocking, hipStreamSynchronize,
    hipStreamWaitEvent, hipStream_t,
};
use crate::result::err;
use crate::shared::{RawStream, Shared};
use memgov_backend::lock;
use memgov_backend::{BackendError, BackendErrorKind};
use std::sync::atomic::Ordering;

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
pub(crate) fn create_raw(shared: &Shared, op: &'static str) -> Result<RawStream, BackendError> {
    let mut raw: hipStream_t = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer; the flag is a documented value.
    let r = unsafe { hipStreamCreateWithFlags(&mut raw, hipStreamNonBlocking) };
    shared.checked(op, "hipStreamCreateWithFlags", r)?;
    Ok(RawStream(raw))
}

/// Create a non-blocking stream on the context's device.
pub(crate) fn create(shared: &Shared) -> Result<HipStream, BackendError> {
    shared.check_usable("create_stream")?;
    let _device = shared.make_current("create_stream")?;
    let RawStream(raw) = create_raw(shared, "create_stream")?;
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    lock(&shared.streams).insert(id, RawStream(raw));
    shared.probe().stream_created();
    Ok(HipStream {
        raw: RawStream(raw),
        id,
        context: shared.id,
    })
}

/// Wait for the stream's work (its free callbacks included), then destroy it.
///
/// On a context declared lost whose device still answers, the stream is
/// still synchronized and destroyed (the runtime would keep it otherwise);
/// on a dead device (a sticky code seen, now or before) it is only dropped
/// from the table: the runtime may wait for the stream's work inside
/// `hipStreamDestroy`, and that work never finishes.
pub(crate) fn destroy(shared: &Shared, stream: HipStream) -> Result<(), BackendError> {
    shared.check_stream("destroy_stream", &stream)?;
    if !shared.is_dead() {
        // SAFETY: the stream is alive (it is in `streams`, removed below).
        let r = unsafe { hipStreamSynchronize(stream.raw.0) };
        let synced = shared.checked("destroy_stream", "hipStreamSynchronize", r);
        if synced.is_err() && !shared.is_dead() {
            return synced;
        }
        shared
            .outstanding
            .wait(stream.id, || shared.is_lost(), None);
    }
    if lock(&shared.streams).remove(&stream.id).is_none() {
        return Ok(());
    }
    if shared.is_dead() {
        shared.probe().stream_destroyed();
        return Ok(());
    }
    destroy_raw(shared, "destroy_stream", stream.raw)
}

/// Destroy a stream already removed from the table.
pub(crate) fn destroy_raw(
    shared: &Shared,
    op: &'static str,
    raw: RawStream,
) -> Result<(), BackendError> {
    shared.probe().stream_destroyed();
    // SAFETY: the handle was created by this context and has just been
    // removed from its table, so no other path destroys it; its queued work
    // has been synchronized.
    let r = unsafe { hipStreamDestroy(raw.0) };
    shared.checked(op, "hipStreamDestroy", r)
}

/// Block until the stream's queued work and callbacks have run.
pub(crate) fn synchronize(shared: &Shared, stream: &HipStream) -> Result<(), BackendError> {
    shared.check_stream("synchronize", stream)?;
    shared.check_lost("synchronize")?;
    // SAFETY: the stream belongs to this live context (checked above).
    let r = unsafe { hipStreamSynchronize(stream.raw.0) };
    shared.checked("synchronize", "hipStreamSynchronize", r)?;
    shared
        .outstanding
        .wait(stream.id, || shared.is_lost(), None);
    Ok(())
}

/// Order every operation queued on `stream` from now on after everything
/// already queued on `after`: an event recorded on `after`, a wait for it
/// queued on `stream`, the event destroyed at once (HIP keeps what a queued
/// wait needs). Returns without waiting for the device.
pub(crate) fn order_after(
    shared: &Shared,
    stream: &HipStream,
    after: &HipStream,
) -> Result<(), BackendError> {
    shared.check_stream("order_after", stream)?;
    shared.check_stream("order_after", after)?;
    shared.check_usable("order_after")?;
    if stream.id == after.id {
        return Ok(());
    }
    // Events belong to the current device.
    let _device = shared.make_current("order_after")?;
    let mut event = std::ptr::null_mut();
    // SAFETY: valid out-pointer, documented flag.
    let r = unsafe { hipEventCreateWithFlags(&mut event, hipEventDisableTiming) };
    shared.checked("order_after", "hipEventCreateWithFlags", r)?;
    // SAFETY: the event was just created; `after` is a live stream of this
    // context (checked above).
    let r = unsafe { hipEventRecord(event, after.raw.0) };
    let mut result = shared.checked("order_after", "hipEventRecord", r);
    if result.is_ok() {
        // SAFETY: the event is recorded; `stream` is a live stream of this
        // context.
        let r = unsafe { hipStreamWaitEvent(stream.raw.0, event, 0) };
        result = shared.checked("order_after", "hipStreamWaitEvent", r);
    }
    if !shared.is_dead() {
        // SAFETY: the event is ours; destroying it with a wait still queued
        // is allowed (the runtime releases it once the wait has run).
        let r = unsafe { hipEventDestroy(event) };
        let destroyed = shared.checked("order_after", "hipEventDestroy", r);
        result = result.and(destroyed);
    }
    result
}

impl Shared {
    /// Refuse a stream that is not a live stream of this context.
    pub(crate) fn check_stream(&self, op: &'static str, s: &HipStream) -> Result<(), BackendError> {
        if s.context != self.id || !lock(&self.streams).contains_key(&s.id) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "stream {} is not a live stream of HIP context {} (it belongs to context {})",
                    s.id, self.id, s.context
                ),
            ));
        }
        Ok(())
    }
}
