//! A raw copy the CUDA backend does not wait for, which the main suite and
//! the arena's cases queue to put work on a stream under the backend.

use cudarc::driver::sys::{self, CUresult};
use memgov::cuda::{CudaMemory, CudaStream};

/// Queues a copy of `src` into `m` on `s` (a raw `cuMemcpyHtoDAsync_v2`,
/// the context `ctx` pushed current around it) that the backend does not
/// wait for.
///
/// # Safety
///
/// `ctx` is a live context; `m` and `s` are live, `m` mapped and
/// accessible; `src` outlives the copy.
pub unsafe fn copy_in_unwaited(ctx: sys::CUcontext, s: &CudaStream, m: &CudaMemory, src: &[u8]) {
    // SAFETY: the caller's: a live context, popped below.
    let r = unsafe { sys::cuCtxPushCurrent_v2(ctx) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "push");
    // SAFETY: the caller's: `m` and `s` live, `src` alive until the copy
    // ran.
    let copy = unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            m.device_ptr(),
            src.as_ptr().cast(),
            src.len(),
            s.cu_stream(),
        )
    };
    let mut prev: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: balances the push.
    let r = unsafe { sys::cuCtxPopCurrent_v2(&mut prev) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "pop");
    assert_eq!(copy, CUresult::CUDA_SUCCESS, "raw copy in");
}
