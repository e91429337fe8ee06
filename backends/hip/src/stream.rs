//! Streams: non-blocking `hipStream_t`s created on the context's device and
//! tracked so that teardown can destroy any the governor left behind, over
//! the core's [`stream`] module (HIP's stream and event entry points are
//! its table's, [`crate::table`]), and what HIP does its own way: a destroyed stream is synchronized (its
//! free callbacks waited for) and destroyed at once, never retired.

use super::ffi::hipStream_t;
use crate::shared::Shared;
use memgov_backend::BackendError;
use memgov_stream_ordered::stream;
use memgov_stream_ordered::table::Context as _;

memgov_stream_ordered::handle! {
    /// A non-blocking HIP stream of one [`HipContext`](super::HipContext).
    ///
    /// A plain handle: dropping it does nothing; `destroy_stream` (or teardown,
    /// for streams the governor abandoned) destroys the `hipStream_t`.
    pub struct HipStream(Stream<hipStream_t>);
    /// The raw `hipStream_t`, for launching a runtime's own kernels and
    /// copies ordered with memgov's work on this stream.
    ///
    /// Valid until the stream is destroyed (the governed stream is dropped,
    /// or its context torn down). The caller must not destroy it, must not
    /// add callbacks that call HIP, and must not use it after teardown.
    /// Memory of this context used by work queued here must stay owned (not
    /// released) until that work has executed: the governor orders its free
    /// after the work, but only on this same stream.
    pub fn hip_stream;
}

/// Wait for the stream's work (its free callbacks included), then destroy it.
///
/// On a context declared lost whose device still answers, the stream is
/// still synchronized and destroyed (the runtime would keep it otherwise);
/// on a dead device (a sticky code seen, now or before) it is only dropped
/// from the table: the runtime may wait for the stream's work inside
/// `hipStreamDestroy`, and that work never finishes.
pub(crate) fn destroy(shared: &Shared, handle: HipStream) -> Result<(), BackendError> {
    const OP: &str = "destroy_stream";
    let raw = stream::check(shared, OP, &handle)?;
    if !shared.is_dead() {
        let synced = stream::sync_raw(shared, OP, raw);
        if synced.is_err() && !shared.is_dead() {
            return synced;
        }
        shared
            .outstanding
            .wait(handle.id(), || shared.is_lost(), None);
    }
    if shared.streams.remove(handle.id()).is_none() {
        return Ok(());
    }
    if shared.is_dead() {
        shared.probe().stream_destroyed();
        return Ok(());
    }
    stream::destroy_raw(shared, OP, raw)
}

/// Block until the stream's queued work and callbacks have run.
pub(crate) fn synchronize(shared: &Shared, handle: &HipStream) -> Result<(), BackendError> {
    stream::synchronize(shared, "synchronize", handle)?;
    shared
        .outstanding
        .wait(handle.id(), || shared.is_lost(), None);
    Ok(())
}
