//! Streams: non-blocking `CUstream`s created on the context, or streams a
//! runtime already owns and lent to the context by [`CudaContext::adopt`],
//! over the core's [`stream`] module (CUDA's stream and event entry points
//! are its table's, [`crate::table`]), and what CUDA does its own way: a destroyed stream is *retired*, not
//! destroyed, while its work may still be queued (`cuStreamDestroy` returns
//! before the host functions queued on the stream have run, and the context
//! must not be released under a running host function); an adopted stream
//! is only synchronized.

use crate::shared::WATCH_INTERVAL;
use crate::CudaContext;
use cudarc::driver::sys::{self, CUstream};
use memgov_backend::BackendError;
use memgov_stream_ordered::stream;
use memgov_stream_ordered::table::Context as _;

memgov_stream_ordered::handle! {
    /// A stream of ordered work on a CUDA context.
    ///
    /// A plain handle: dropping it does nothing. The context destroys the
    /// streams it created in `destroy_stream` or teardown; adopted streams are
    /// never destroyed by memgov.
    pub struct CudaStream(Stream<CUstream>);
    /// The raw `CUstream`, for launching a runtime's own kernels and copies
    /// ordered with memgov's work on it.
    ///
    /// The caller must not destroy it, must not use it after the governed
    /// stream that lent it is dropped (memgov destroys it then) or after the
    /// context is retired, and must make the stream's context current on the
    /// calling thread before using it.
    pub fn cu_stream;
}

impl CudaContext {
    pub(crate) fn destroy_stream_impl(&self, handle: CudaStream) -> Result<(), BackendError> {
        const OP: &str = "destroy_stream";
        let s = &*self.parts.shared;
        stream::check(s, OP, &handle)?;
        let Some((raw, adopted)) = s.streams.remove(handle.id()) else {
            // Taken by value: no other call destroys it.
            return Ok(());
        };
        s.probe().stream_destroyed();
        if s.is_lost() {
            // The stream dies with the context; no call on a lost device.
            return Ok(());
        }
        let current = s.make_current(OP)?;
        if adopted {
            // The runtime owns it: only finish memgov's work on it.
            // SAFETY: an adopted stream is valid until the context is torn
            // down (the contract of `adopt`); the context is current.
            let r = unsafe { sys::cuStreamSynchronize(raw) };
            return s.checked(OP, "cuStreamSynchronize", r);
        }
        // Its frees and host functions may still be queued: the stream is
        // retired, not destroyed, until its work has completed (the context
        // must not be released under a running host function, and only a
        // completed stream proves the host function returned).
        s.streams.retire(raw);
        drop(current);
        let result = stream::reap_retired(s, OP);
        if s.streams.has_retired() {
            // Work still queued on it: the free thread keeps asking, so that an
            // asynchronous fault in that work is observed even if nothing
            // else calls the backend (retire waits without calling it).
            self.parts.shared.start_free_thread();
        }
        result
    }

    pub(crate) fn synchronize_impl(&self, handle: &CudaStream) -> Result<(), BackendError> {
        let s = &*self.parts.shared;
        stream::synchronize(s, "synchronize", handle)?;
        // The stream's page-locked host frees: their host functions have
        // run, and their frees (and signals) follow off the stream, on the
        // free thread. Do those that are ready here and wait for the thread's,
        // so that the signals of the stream's frees have fired on return.
        s.free_ready_host("synchronize")?;
        s.pending
            .host_unsettled
            .wait(handle.id(), || s.is_lost(), Some(WATCH_INTERVAL));
        // Destroyed streams still holding work are asked too: a fault in
        // their work is observed when the governor synchronizes (force).
        stream::reap_retired(s, "synchronize")
    }
}
