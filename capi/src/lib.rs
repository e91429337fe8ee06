//! # memgov-capi
//!
//! memgov's C ABI (`include/memgov.h`): governed memory, pins and pressure
//! callbacks for C and C++ runtimes and for plugins loaded with `dlopen`,
//! with an unload gate that refuses to unload a plugin while anything it
//! created is outstanding. See `docs/c-api.md` for the ownership rules, the
//! error model and the unload protocol.
//!
//! Every entry point returns a status code (`MEMGOV_OK` or `MEMGOV_ERR_*`)
//! and sets this thread's message (`memgov_last_error_message`); every
//! handle is checked against a registry of live handles; no panic crosses
//! the boundary.

#![deny(unsafe_op_in_unsafe_fn)]
#![allow(clippy::missing_safety_doc)]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("memgov-capi encodes its handles in pointers: 64-bit targets only");

pub mod ffi;
mod metrics;
mod objects;
mod plugin;
mod registry;
mod runtimes;
pub mod status;

pub use ffi::*;
pub use metrics::*;
pub use objects::*;
pub use plugin::*;
pub use runtimes::*;
pub use status::*;

use registry::Kind;
use std::ffi::{c_char, CStr};

/// Opaque: a governor. Created by `memgov_governor_create`.
#[repr(C)]
pub struct memgov_governor {
    _private: [u8; 0],
}
/// Opaque: a context handle.
#[repr(C)]
pub struct memgov_context {
    _private: [u8; 0],
}
/// Opaque: a stream.
#[repr(C)]
pub struct memgov_stream {
    _private: [u8; 0],
}
/// Opaque: a buffer.
#[repr(C)]
pub struct memgov_buffer {
    _private: [u8; 0],
}
/// Opaque: a pin source.
#[repr(C)]
pub struct memgov_pin_source {
    _private: [u8; 0],
}
/// Opaque: a pin.
#[repr(C)]
pub struct memgov_pin {
    _private: [u8; 0],
}
/// Opaque: a registered pressure callback.
#[repr(C)]
pub struct memgov_callback {
    _private: [u8; 0],
}
/// Opaque: a plugin.
#[repr(C)]
pub struct memgov_plugin {
    _private: [u8; 0],
}

/// The registry id a handle pointer carries (never dereferenced).
#[inline]
pub(crate) fn id<T>(p: *const T) -> u64 {
    p as usize as u64
}

/// The handle pointer for a registry id.
#[inline]
pub(crate) fn handle<T>(id: u64) -> *mut T {
    id as usize as *mut T
}

/// Look a handle up.
pub(crate) fn get<T: Kind, P>(p: *const P) -> status::Result<std::sync::Arc<T>> {
    registry::get::<T>(id(p))
}

/// Write `value` through an out-pointer.
///
/// # Safety
///
/// `out` is null or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) -> status::Result<()> {
    if out.is_null() {
        return Err(Error::invalid("the out-pointer is NULL"));
    }
    // SAFETY: non-null, and the caller's contract makes it valid for a write.
    unsafe { out.write(value) };
    Ok(())
}

/// A C string argument, `None` for NULL.
///
/// # Safety
///
/// `p` is null or a NUL-terminated string valid for the call.
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> status::Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract: a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| Error::invalid(format!("{what} is not UTF-8")))
}

/// A required C string argument.
///
/// # Safety
///
/// As [`opt_str`].
pub(crate) unsafe fn req_str<'a>(p: *const c_char, what: &str) -> status::Result<&'a str> {
    // SAFETY: forwarded contract.
    unsafe { opt_str(p, what) }?.ok_or_else(|| Error::invalid(format!("{what} is NULL")))
}

/// Read a sized input struct: its first `u32` is its size as the caller
/// compiled it. A caller built against an older header passes a smaller
/// size; the fields it does not have keep their defaults. Fewer than `min`
/// bytes is refused.
///
/// # Safety
///
/// `p` is null or points to at least `size` readable bytes, where `size` is
/// its first `u32`.
pub(crate) unsafe fn read_sized<T: Copy + Default>(
    p: *const T,
    min: usize,
    what: &str,
) -> status::Result<T> {
    if p.is_null() {
        return Err(Error::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null; every sized struct starts with its `u32` size.
    let size = unsafe { p.cast::<u32>().read_unaligned() } as usize;
    if size < min {
        return Err(Error::invalid(format!(
            "{what}.size is {size}, below the {min} B of the first version; set it to sizeof({what})"
        )));
    }
    let mut value = T::default();
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `n` bytes are readable at `p` (the caller's size says so, and
    // `n <= size`) and writable in `value` (`n <= size_of::<T>()`); `T` is a
    // plain-data `repr(C)` struct, valid for any bytes of its fields.
    unsafe {
        std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&mut value as *mut T).cast::<u8>(), n)
    };
    Ok(value)
}

/// Write a sized output struct: as many bytes as both sides know, with its
/// `size` field set to that number.
///
/// # Safety
///
/// `p` is null or points to at least `size` writable bytes, where `size` is
/// its first `u32` as the caller set it.
pub(crate) unsafe fn write_sized<T: Copy>(p: *mut T, value: T, what: &str) -> status::Result<()> {
    if p.is_null() {
        return Err(Error::invalid(format!("{what} out-pointer is NULL")));
    }
    // SAFETY: non-null; the caller set the first `u32`.
    let size = unsafe { p.cast::<u32>().read_unaligned() } as usize;
    if size < 8 {
        return Err(Error::invalid(format!(
            "{what}.size is {size}; set it to sizeof({what}) before the call"
        )));
    }
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `n` bytes are writable at `p` (the caller's size) and readable
    // in `value`; then the size field, inside those bytes, says how many.
    unsafe {
        std::ptr::copy_nonoverlapping((&value as *const T).cast::<u8>(), p.cast::<u8>(), n);
        p.cast::<u32>().write_unaligned(n as u32);
    }
    Ok(())
}

/// The ABI version of this library (`MEMGOV_ABI_VERSION` of the header it
/// was built with). A caller built with another version must not call it.
#[no_mangle]
pub extern "C" fn memgov_abi_version() -> u32 {
    MEMGOV_ABI_VERSION
}

/// The `MEMGOV_CAP_*` bits of this build.
#[no_mangle]
pub extern "C" fn memgov_capabilities() -> u64 {
    let mut caps = MEMGOV_CAP_RECORD_STREAM
        | MEMGOV_CAP_PRESSURE_CALLBACKS
        | MEMGOV_CAP_PLUGIN_LOADER
        | MEMGOV_CAP_TORCH_ALLOCATOR
        | MEMGOV_CAP_ORT_ALLOCATOR;
    for kind in memgov::any::BackendKind::all() {
        caps |= match kind.name() {
            "host" => MEMGOV_CAP_BACKEND_HOST,
            "null" => MEMGOV_CAP_BACKEND_NULL,
            "cuda" => MEMGOV_CAP_BACKEND_CUDA,
            "hip" => MEMGOV_CAP_BACKEND_HIP,
            "vulkan" => MEMGOV_CAP_BACKEND_VULKAN,
            _ => 0,
        };
    }
    caps
}

/// This thread's message about its last memgov call: empty after a call
/// that succeeded. Valid until the next memgov call on this thread; never
/// NULL.
#[no_mangle]
pub extern "C" fn memgov_last_error_message() -> *const c_char {
    status::message_ptr()
}

/// Copy this thread's last message (as `memgov_last_error_message` returns
/// it) into `buf`, `len` bytes: truncated to `len - 1` bytes and always
/// NUL-terminated when `len > 0`; nothing is written when `buf` is NULL or
/// `len` is 0. Returns the message's full length without the NUL, as
/// `snprintf` does: the copy is whole when that is below `len`. The message
/// itself is left as it is.
#[no_mangle]
pub unsafe extern "C" fn memgov_last_error_copy(buf: *mut c_char, len: usize) -> usize {
    // No guard: it must not replace the message it copies. Nothing in it
    // panics; the unwind is caught all the same.
    std::panic::catch_unwind(|| {
        // SAFETY: `buf` is NULL or valid for `len` bytes (the contract).
        unsafe { status::copy_message(buf, len) }
    })
    .unwrap_or(0)
}

/// The name of a status code ("MEMGOV_ERR_TIMEOUT"), or "MEMGOV_ERR_UNKNOWN".
/// A static string; never NULL.
#[no_mangle]
pub extern "C" fn memgov_status_name(status: i32) -> *const c_char {
    const NAMES: [&CStr; 14] = [
        c"MEMGOV_OK",
        c"MEMGOV_ERR_INVALID_HANDLE",
        c"MEMGOV_ERR_INVALID_ARGUMENT",
        c"MEMGOV_ERR_OUT_OF_MEMORY",
        c"MEMGOV_ERR_RETIRING",
        c"MEMGOV_ERR_DEVICE_LOST",
        c"MEMGOV_ERR_TIMEOUT",
        c"MEMGOV_ERR_BUSY",
        c"MEMGOV_ERR_UNSUPPORTED",
        c"MEMGOV_ERR_UNAVAILABLE",
        c"MEMGOV_ERR_BACKEND",
        c"MEMGOV_ERR_PLUGIN",
        c"MEMGOV_ERR_LIMIT",
        c"MEMGOV_ERR_PANIC",
    ];
    usize::try_from(status)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or(c"MEMGOV_ERR_UNKNOWN".as_ptr(), |s| s.as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_match_the_table() {
        for (code, name) in STATUS_NAMES {
            // SAFETY: static NUL-terminated strings.
            let got = unsafe { CStr::from_ptr(memgov_status_name(code)) };
            assert_eq!(got.to_str().unwrap(), name);
        }
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(memgov_status_name(99)) };
        assert_eq!(unknown.to_str().unwrap(), "MEMGOV_ERR_UNKNOWN");
    }
}
