//! Allocation from the device's stream-ordered memory pool, and copies
//! ordered on a stream.
//!
//! Memory comes from `cuMemAllocAsync` on the device's default memory pool,
//! so a free queued on a stream is reusable at once by allocations ordered
//! after it on that stream (the context declares `stream_ordered_reuse`).
//! The backend owns raw `CUdeviceptr`s, not cudarc's `CudaSlice` (which frees
//! itself in `Drop` without telling anyone): only `free_async` and teardown
//! free device memory, so the retire signal can fire after the free.

use super::{lock, CudaContext, Live};
use crate::{BackendError, MemoryInfo};
use cudarc::driver::sys::{self, CUdeviceptr};

/// A raw device allocation. A plain handle: dropping it does nothing; only
/// `free_async` or teardown release it.
#[derive(Debug)]
pub struct CudaMemory {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) bytes: u64,
    pub(crate) id: u64,
}

impl CudaMemory {
    /// The raw `CUdeviceptr`, for a runtime's kernels and copies.
    ///
    /// Valid for `len()` bytes while the governed buffer that owns this
    /// memory is alive. The caller must not free it (`cuMemFree*`), must
    /// order every use on the buffer's stream (or synchronize with it) so
    /// that no use runs after the buffer is released, and must not keep the
    /// pointer past the buffer's release or the context's retirement.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    /// Size in bytes as requested.
    pub fn len(&self) -> u64 {
        self.bytes
    }
    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl CudaContext {
    pub(crate) fn allocate_impl(
        &self,
        stream: &super::CudaStream,
        bytes: u64,
    ) -> Result<CudaMemory, BackendError> {
        let s = &*self.shared;
        s.check_usable("allocate")?;
        let size = usize::try_from(bytes).map_err(|_| {
            super::result::err(
                "allocate",
                crate::BackendErrorKind::InvalidArgument,
                format!("{bytes} B does not fit this platform's size_t"),
            )
        })?;
        s.make_current("allocate")?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out pointer; the stream is live and belongs
        // to this context, which is current on this thread.
        let r = unsafe { sys::cuMemAllocAsync(&mut ptr, size, stream.raw) };
        s.checked("allocate", "cuMemAllocAsync", r)?;
        let id = s.next_id();
        lock(&s.live).insert(id, Live { ptr, bytes });
        s.probe.allocated(bytes);
        Ok(CudaMemory { ptr, bytes, id })
    }

    pub(crate) fn write_impl(
        &self,
        stream: &super::CudaStream,
        memory: &CudaMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        let s = &*self.shared;
        s.check_usable("write")?;
        if src.is_empty() {
            return Ok(());
        }
        s.make_current("write")?;
        // SAFETY: the governor checked offset + len <= size of the live
        // allocation; `src` outlives the copy because the stream is
        // synchronized before returning; the context is current.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                memory.ptr + offset,
                src.as_ptr().cast(),
                src.len(),
                stream.raw,
            )
        };
        s.checked("write", "cuMemcpyHtoDAsync_v2", r)?;
        // SAFETY: as above.
        let r = unsafe { sys::cuStreamSynchronize(stream.raw) };
        s.checked("write", "cuStreamSynchronize", r)
    }

    pub(crate) fn read_impl(
        &self,
        stream: &super::CudaStream,
        memory: &CudaMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        let s = &*self.shared;
        s.check_usable("read")?;
        if dst.is_empty() {
            return Ok(());
        }
        s.make_current("read")?;
        // SAFETY: bounds as in write; `dst` is exclusively borrowed until the
        // stream is synchronized below, so the copy lands before it is read.
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr().cast(),
                memory.ptr + offset,
                dst.len(),
                stream.raw,
            )
        };
        s.checked("read", "cuMemcpyDtoHAsync_v2", r)?;
        // SAFETY: as above.
        let r = unsafe { sys::cuStreamSynchronize(stream.raw) };
        s.checked("read", "cuStreamSynchronize", r)
    }

    pub(crate) fn memory_info_impl(&self) -> Result<MemoryInfo, BackendError> {
        let s = &*self.shared;
        s.check_usable("memory_info")?;
        s.make_current("memory_info")?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out pointers; the context is current.
        let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        s.checked("memory_info", "cuMemGetInfo_v2", r)?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }
}
