//! A raw copy the HIP backend does not wait for, which the main suite and
//! the arena's cases queue to put work on a stream under the backend.

use memgov::hip::raw as hip;
use memgov::hip::{HipMemory, HipStream};

/// Queues a copy of `src` into `m` on `s` (a raw `hipMemcpyHtoDAsync`;
/// device 0 is current on every thread by default) that the backend does
/// not wait for.
///
/// # Safety
///
/// `m` and `s` are live, `m` mapped and accessible; `src` outlives the
/// copy.
pub unsafe fn copy_in_unwaited(s: &HipStream, m: &HipMemory, src: &[u8]) {
    // SAFETY: the caller's.
    let r = unsafe {
        hip::hipMemcpyHtoDAsync(
            m.device_ptr(),
            src.as_ptr() as *mut std::ffi::c_void,
            src.len(),
            s.hip_stream(),
        )
    };
    assert_eq!(r, hip::SUCCESS, "raw copy in");
}
