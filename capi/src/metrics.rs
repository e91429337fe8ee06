//! `memgov_metrics_render`: a governor's contexts in Prometheus's
//! exposition format (`memgov::metrics::render`, docs/metrics.md), for a
//! C or C++ runtime that serves its own `/metrics` page.

use crate::objects::GovernorObj;
use crate::status::{guard, Error};
use crate::{get, memgov_governor};
use std::ffi::c_char;

/// Render the contexts of `gov` in Prometheus's exposition format into
/// `buf` (`len` bytes), as `snprintf` does: truncated to `len - 1` bytes
/// and NUL-terminated when `len > 0`, nothing written when `buf` is NULL or
/// `len` is 0. `*out_len` (when not NULL) receives the page's full length
/// without the NUL: the page is whole when that is below `len`; call again
/// with a larger buffer otherwise. Serve it with the content type
/// `application/openmetrics-text; version=1.0.0; charset=utf-8`.
#[no_mangle]
pub unsafe extern "C" fn memgov_metrics_render(
    gov: *mut memgov_governor,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> i32 {
    guard("memgov_metrics_render", || {
        let g = get::<GovernorObj, _>(gov)?;
        let text = memgov::metrics::render(g.governor());
        if !buf.is_null() && len > 0 {
            let n = text.len().min(len - 1);
            // SAFETY: `buf` is valid for `len` bytes (the caller's contract)
            // and `n < len`: `n` bytes and the NUL after them fit; the text
            // is ours, so the two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
                buf.add(n).write(0);
            }
        }
        if !out_len.is_null() {
            // SAFETY: non-null; the caller passes a writable size_t.
            unsafe { out_len.write(text.len()) };
        } else if buf.is_null() {
            return Err(Error::invalid(
                "both buf and out_len are NULL: nothing to render into; pass out_len to learn the size",
            ));
        }
        Ok(())
    })
}
