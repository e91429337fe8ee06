//! Streams: non-blocking `CUstream`s created on the context, or streams a
//! runtime already owns and lent to the context by [`CudaContext::adopt`].

use crate::shared::{RawStream, WATCH_INTERVAL};
use crate::CudaContext;
use cudarc::driver::sys::{self, CUevent, CUstream, CUstream_flags};
use memgov_backend::lock;
use memgov_backend::BackendError;

/// A stream of ordered work on a CUDA context.
///
/// A plain handle: dropping it does nothing. The context destroys the
/// streams it created in `destroy_stream` or teardown; adopted streams are
/// never destroyed by memgov.
#[derive(Debug)]
pub struct CudaStream {
    pub(crate) raw: CUstream,
    pub(crate) id: u64,
    /// The id of the context that created it (checked on every use).
    pub(crate) context: u64,
    pub(crate) adopted: bool,
}

// SAFETY: a CUstream is a driver handle, usable from any thread on which its
// context is current; every driver call the backend makes with it first makes
// the context current on the calling thread. The struct holds no thread-bound
// state.
unsafe impl Send for CudaStream {}
// SAFETY: as above; `&CudaStream` only reads the handle value.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// The raw `CUstream`, for launching a runtime's own kernels and copies
    /// ordered with memgov's work on it.
    ///
    /// The caller must not destroy it, must not use it after the governed
    /// stream that lent it is dropped (memgov destroys it then) or after the
    /// context is retired, and must make the stream's context current on the
    /// calling thread before using it.
    pub fn cu_stream(&self) -> CUstream {
        self.raw
    }

    /// Whether this stream was lent by the runtime that adopted the context
    /// (memgov synchronizes it but never destroys it).
    pub fn is_adopted(&self) -> bool {
        self.adopted
    }
}

impl CudaContext {
    pub(crate) fn create_stream_impl(&self) -> Result<CudaStream, BackendError> {
        let s = &*self.shared;
        s.check_usable("create_stream")?;
        let id = s.next_id();
        if let Some(raw) = lock(&s.lendable).pop_front() {
            lock(&s.streams).insert(id, (raw.0, true));
            s.probe().stream_created();
            return Ok(CudaStream {
                raw: raw.0,
                id,
                context: s.id,
                adopted: true,
            });
        }
        let _current = s.make_current("create_stream")?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer; the context is current on
        // this thread (make_current above) and alive (check_usable: teardown
        // has not run, it consumes the context).
        let r =
            unsafe { sys::cuStreamCreate(&mut raw, CUstream_flags::CU_STREAM_NON_BLOCKING as u32) };
        s.checked("create_stream", "cuStreamCreate", r)?;
        lock(&s.streams).insert(id, (raw, false));
        s.probe().stream_created();
        Ok(CudaStream {
            raw,
            id,
            context: s.id,
            adopted: false,
        })
    }

    pub(crate) fn destroy_stream_impl(&self, stream: CudaStream) -> Result<(), BackendError> {
        let s = &*self.shared;
        if stream.context != s.id || lock(&s.streams).remove(&stream.id).is_none() {
            return Err(crate::result::err(
                "destroy_stream",
                memgov_backend::BackendErrorKind::InvalidArgument,
                format!(
                    "stream {} is not a live stream of CUDA context {} (another context's, or \
                     destroyed already)",
                    stream.id, s.id
                ),
            ));
        }
        s.probe().stream_destroyed();
        if s.is_lost() {
            // The stream dies with the context; no call on a lost device.
            return Ok(());
        }
        let current = s.make_current("destroy_stream")?;
        if stream.adopted {
            // The runtime owns it: only finish memgov's work on it.
            // SAFETY: an adopted stream is valid until the context is torn
            // down (the contract of `adopt`); the context is current.
            let r = unsafe { sys::cuStreamSynchronize(stream.raw) };
            return s.checked("destroy_stream", "cuStreamSynchronize", r);
        }
        // Its frees and host functions may still be queued: the stream is
        // retired, not destroyed, until its work has completed (the context
        // must not be released under a running host function, and only a
        // completed stream proves the host function returned).
        lock(&s.retired_streams).push(RawStream(stream.raw));
        drop(current);
        let result = s.reap_retired("destroy_stream");
        if !lock(&s.retired_streams).is_empty() {
            // Work still queued on it: the free thread keeps asking, so that an
            // asynchronous fault in that work is observed even if nothing
            // else calls the backend (retire waits without calling it).
            self.shared.start_free_thread();
        }
        result
    }

    pub(crate) fn synchronize_impl(&self, stream: &CudaStream) -> Result<(), BackendError> {
        let s = &*self.shared;
        s.check_usable("synchronize")?;
        s.check_stream("synchronize", stream)?;
        {
            let _current = s.make_current("synchronize")?;
            // SAFETY: the stream is a live stream of this context (checked
            // above); the context is current.
            let r = unsafe { sys::cuStreamSynchronize(stream.raw) };
            s.checked("synchronize", "cuStreamSynchronize", r)?;
        }
        // The stream's page-locked host frees: their host functions have
        // run, and their frees (and signals) follow off the stream, on the
        // free thread. Do those that are ready here and wait for the thread's,
        // so that the signals of the stream's frees have fired on return.
        s.free_ready_host("synchronize")?;
        s.pending
            .host_unsettled
            .wait(stream.id, || s.is_lost(), Some(WATCH_INTERVAL));
        // Destroyed streams still holding work are asked too: a fault in
        // their work is observed when the governor synchronizes (force).
        s.reap_retired("synchronize")
    }

    pub(crate) fn order_after_impl(
        &self,
        stream: &CudaStream,
        after: &CudaStream,
    ) -> Result<(), BackendError> {
        let s = &*self.shared;
        s.check_usable("order_after")?;
        s.check_stream("order_after", stream)?;
        s.check_stream("order_after", after)?;
        if stream.id == after.id {
            // A stream is ordered after its own queued work already.
            return Ok(());
        }
        let _current = s.make_current("order_after")?;
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: valid out pointer; the context is current. Timing is
        // disabled: the event only orders.
        let r = unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        };
        s.checked("order_after", "cuEventCreate", r)?;
        // SAFETY: the event just created; `after` is a live stream of this
        // context (checked above).
        let r = unsafe { sys::cuEventRecord(event, after.raw) };
        let mut result = s.checked("order_after", "cuEventRecord", r);
        if result.is_ok() {
            // SAFETY: the recorded event; `stream` is a live stream of this
            // context. Work queued on `stream` after this call waits for the
            // work `after` had queued when the event was recorded.
            let r = unsafe { sys::cuStreamWaitEvent(stream.raw, event, 0) };
            result = s.checked("order_after", "cuStreamWaitEvent", r);
        }
        // SAFETY: the event created above, destroyed once. Legal while the
        // wait is pending: the driver releases it once it has completed.
        let r = unsafe { sys::cuEventDestroy_v2(event) };
        result.and(s.checked("order_after", "cuEventDestroy_v2", r))
    }
}
