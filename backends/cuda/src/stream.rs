//! Streams: non-blocking `CUstream`s created on the context, or streams a
//! runtime already owns and lent to the context by [`CudaContext::adopt`];
//! CUDA's stream and event entry points for the core's [`stream`] module,
//! and what CUDA does its own way: a destroyed stream is *retired*, not
//! destroyed, while its work may still be queued (`cuStreamDestroy` returns
//! before the host functions queued on the stream have run, and the context
//! must not be released under a running host function); an adopted stream
//! is only synchronized.

use crate::result::Cuda;
use crate::shared::{Shared, WATCH_INTERVAL};
use crate::CudaContext;
use cudarc::driver::sys::{self, CUevent, CUresult, CUstream};
use memgov_backend::BackendError;
use memgov_stream_ordered::stream::{self, StreamContext};
use memgov_stream_ordered::table::Context as _;
use memgov_stream_ordered::table::{StreamNames, StreamTable};
use std::time::Duration;

memgov_stream_ordered::handle! {
    /// A stream of ordered work on a CUDA context.
    ///
    /// A plain handle: dropping it does nothing. The context destroys the
    /// streams it created in `destroy_stream` or teardown; adopted streams are
    /// never destroyed by memgov.
    pub struct CudaStream(stream::Stream<CUstream>);
}

impl CudaStream {
    /// The raw `CUstream`, for launching a runtime's own kernels and copies
    /// ordered with memgov's work on it.
    ///
    /// The caller must not destroy it, must not use it after the governed
    /// stream that lent it is dropped (memgov destroys it then) or after the
    /// context is retired, and must make the stream's context current on the
    /// calling thread before using it.
    pub fn cu_stream(&self) -> CUstream {
        self.raw()
    }
}

/// CUDA's stream and event calls under the core's names.
impl StreamTable for Cuda {
    type Event = CUevent;

    const STREAM_NAMES: StreamNames = StreamNames {
        vendor: "CUDA",
        stream_destroy: "cuStreamDestroy_v2",
        event_create: "cuEventCreate",
        event_record: "cuEventRecord",
        stream_wait_event: "cuStreamWaitEvent",
        event_destroy: "cuEventDestroy_v2",
    };

    const STREAM_CALLS_NEED_CURRENT: bool = true;
    const CALLS_AFTER_STICKY: bool = true;
    const POLL_INTERVAL: Duration = WATCH_INTERVAL;

    unsafe fn event_create() -> (CUresult, CUevent) {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: valid out pointer; the caller has the context current.
        let r = unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        };
        (r, event)
    }

    unsafe fn event_record(event: CUevent, stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (both live, of the current context).
        unsafe { sys::cuEventRecord(event, stream) }
    }

    unsafe fn stream_wait_event(stream: CUstream, event: CUevent) -> CUresult {
        // SAFETY: as above, the event recorded.
        unsafe { sys::cuStreamWaitEvent(stream, event, 0) }
    }

    unsafe fn event_destroy(event: CUevent) -> CUresult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { sys::cuEventDestroy_v2(event) }
    }
}

impl StreamContext for Shared {
    fn wrap(stream: stream::Stream<CUstream>) -> CudaStream {
        CudaStream(stream)
    }
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
