//! Streams: non-blocking `CUstream`s created on the context, or streams a
//! runtime already owns and lent to the context by [`CudaContext::adopt`].

use super::result::BACKEND;
use super::{lock, CudaContext, RawStream};
use crate::BackendError;
use cudarc::driver::sys::{self, CUstream, CUstream_flags};

/// A stream of ordered work on a CUDA context.
///
/// A plain handle: dropping it does nothing. The context destroys the
/// streams it created in `destroy_stream` or teardown; adopted streams are
/// never destroyed by memgov.
#[derive(Debug)]
pub struct CudaStream {
    pub(crate) raw: CUstream,
    pub(crate) id: u64,
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
            s.probe.stream_created();
            return Ok(CudaStream {
                raw: raw.0,
                id,
                adopted: true,
            });
        }
        s.make_current("create_stream")?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer; the context is current on
        // this thread (make_current above) and alive (check_usable: teardown
        // has not run, it consumes the context).
        let r =
            unsafe { sys::cuStreamCreate(&mut raw, CUstream_flags::CU_STREAM_NON_BLOCKING as u32) };
        s.checked("create_stream", "cuStreamCreate", r)?;
        lock(&s.streams).insert(id, (raw, false));
        s.probe.stream_created();
        Ok(CudaStream {
            raw,
            id,
            adopted: false,
        })
    }

    pub(crate) fn destroy_stream_impl(&self, stream: CudaStream) -> Result<(), BackendError> {
        let s = &*self.shared;
        if lock(&s.streams).remove(&stream.id).is_none() {
            s.probe.violation(
                BACKEND,
                format!("destroy_stream of stream {} that is not live", stream.id),
            );
            return Ok(());
        }
        s.probe.stream_destroyed();
        if s.is_lost() {
            // The stream dies with the context; no call on a lost device.
            return Ok(());
        }
        s.make_current("destroy_stream")?;
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
        self.reap_retired_streams()
    }

    /// Destroy the retired streams whose work has completed.
    pub(crate) fn reap_retired_streams(&self) -> Result<(), BackendError> {
        let s = &*self.shared;
        let retired: Vec<RawStream> = std::mem::take(&mut *lock(&s.retired_streams));
        let mut keep = Vec::new();
        let mut result = Ok(());
        for raw in retired {
            // SAFETY: a stream this context created and the governor
            // destroyed; held only in the retired list, which this call took,
            // so no other call uses it; the context is current.
            let r = unsafe { sys::cuStreamQuery(raw.0) };
            match r {
                sys::CUresult::CUDA_SUCCESS => {
                    // SAFETY: as above; its work has completed.
                    let r = unsafe { sys::cuStreamDestroy_v2(raw.0) };
                    result = result.and(s.checked("destroy_stream", "cuStreamDestroy_v2", r));
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => keep.push(raw),
                r => {
                    keep.push(raw);
                    result = result.and(Err(s.classify("destroy_stream", "cuStreamQuery", r)));
                }
            }
        }
        lock(&s.retired_streams).extend(keep);
        result
    }

    pub(crate) fn synchronize_impl(&self, stream: &CudaStream) -> Result<(), BackendError> {
        let s = &*self.shared;
        s.check_usable("synchronize")?;
        s.make_current("synchronize")?;
        // SAFETY: the stream is live (the governor destroys it only after its
        // last use); the context is current.
        let r = unsafe { sys::cuStreamSynchronize(stream.raw) };
        s.checked("synchronize", "cuStreamSynchronize", r)
    }
}
