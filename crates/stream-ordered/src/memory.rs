//! What every vendor's allocations and copies check and do the same way:
//! the size an allocation may ask for, the range a copy may touch, and the
//! blocking copy (queued on the caller's stream, then that stream
//! synchronized, so the caller's buffer is free to reuse on return), over
//! the table's [`VmmTable::copy_htod_async`], [`VmmTable::copy_dtoh_async`]
//! and [`VmmTable::stream_sync`]. Where the memory comes from (CUDA's pool;
//! HIP's pool or its `hipMalloc` fallback; page-locked host memory) stays
//! the vendor's.

use crate::result::err;
use crate::table::{CodeOf, Context, VmmTable};
use memgov_backend::{BackendError, BackendErrorKind};

/// The checks every allocation makes before its driver call, in any tier:
/// a usable context, a live stream of its own, and a size above zero that
/// fits `size_t`. Returns the size.
pub fn allocation_size<C: Context>(
    ctx: &C,
    stream: &C::Stream,
    bytes: u64,
) -> Result<usize, BackendError> {
    ctx.check_usable("allocate")?;
    ctx.raw_stream("allocate", stream)?;
    if bytes == 0 {
        return Err(err::<C::Table>(
            "allocate",
            BackendErrorKind::InvalidArgument,
            "a 0-byte allocation was asked for; ask for at least 1 byte",
        ));
    }
    usize::try_from(bytes).map_err(|_| {
        err::<C::Table>(
            "allocate",
            BackendErrorKind::InvalidArgument,
            format!("{bytes} B does not fit this platform's size_t"),
        )
    })
}

/// The device address of `len` bytes at `offset` of the `bytes` B
/// allocation at `at`, or `InvalidArgument` when the range runs past it.
pub fn range<C: Context>(
    op: &'static str,
    at: u64,
    bytes: u64,
    offset: u64,
    len: usize,
) -> Result<u64, BackendError> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= bytes => Ok(at + offset),
        _ => Err(err::<C::Table>(
            op,
            BackendErrorKind::InvalidArgument,
            format!("{len} B at offset {offset} runs past the {bytes} B allocation"),
        )),
    }
}

/// Copy `src` to device address `at` on `stream` and wait for it.
///
/// # Safety
///
/// `[at, at + src.len())` lies in a live allocation of `ctx`; `stream` is a
/// live stream of it; the device is current where the vendor needs it.
pub unsafe fn write<C: Context>(
    ctx: &C,
    stream: <C::Table as VmmTable>::Stream,
    at: u64,
    src: &[u8],
) -> Result<(), BackendError> {
    let names = <C::Table as VmmTable>::NAMES;
    // SAFETY: the caller's contract; `src` outlives the copy because the
    // stream is synchronized before returning (the driver only reads it).
    let r: CodeOf<C> = unsafe {
        <C::Table as VmmTable>::copy_htod_async(at, src.as_ptr() as usize, src.len(), stream)
    };
    ctx.checked("write", names.copy_htod_async, r)?;
    // SAFETY: the stream is live.
    let r = unsafe { <C::Table as VmmTable>::stream_sync(stream) };
    ctx.checked("write", names.stream_sync, r)
}

/// Copy `dst.len()` bytes from device address `at` into `dst` on `stream`
/// and wait for it.
///
/// # Safety
///
/// As for [`write`](fn@write).
pub unsafe fn read<C: Context>(
    ctx: &C,
    stream: <C::Table as VmmTable>::Stream,
    at: u64,
    dst: &mut [u8],
) -> Result<(), BackendError> {
    let names = <C::Table as VmmTable>::NAMES;
    // SAFETY: the caller's contract; `dst` stays exclusively borrowed until
    // the stream is synchronized below, so the copy lands before it is read.
    let r: CodeOf<C> = unsafe {
        <C::Table as VmmTable>::copy_dtoh_async(dst.as_mut_ptr() as usize, at, dst.len(), stream)
    };
    ctx.checked("read", names.copy_dtoh_async, r)?;
    // SAFETY: the stream is live.
    let r = unsafe { <C::Table as VmmTable>::stream_sync(stream) };
    ctx.checked("read", names.stream_sync, r)
}
