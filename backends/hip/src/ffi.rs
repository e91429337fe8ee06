//! The HIP runtime functions the backend calls, declared here with their
//! result read as a plain `i32`.
//!
//! hip-sys declares every function as returning its Rust enum `hipError_t`.
//! A runtime newer than those bindings may return a code the enum does not
//! list, and materialising such a value as the enum is undefined behaviour.
//! Reading the same C `int` as `i32` is always defined; [`super::result`]
//! classifies the integer. The handle and struct types still come from
//! hip-sys (they are plain pointers and `#[repr(C)]` structs); enum
//! arguments are passed as the integers the C header gives them.
//!
//! The library itself is linked by hip-sys's build script
//! (`cargo:rustc-link-lib=dylib=amdhip64`); these are the same symbols, so
//! they bind to the same versions (`hip_4.2`, `hip_5.1`) of ROCm's library.

#![allow(non_snake_case)]

pub(crate) use hip_sys::hiprt::{hipEvent_t, hipMemPoolProps, hipMemPool_t, hipStream_t};
use std::ffi::{c_char, c_int, c_uint, c_void};

/// A HIP result as the C `int` it is.
pub type HipResult = i32;

/// `hipSuccess`.
pub const SUCCESS: HipResult = 0;

/// The stream callback as memgov declares it: the status is an `i32` for
/// the same reason as every result.
pub(crate) type StreamCallback = unsafe extern "C" fn(hipStream_t, HipResult, *mut c_void);

/// `hipStreamNonBlocking`.
pub(crate) const STREAM_NON_BLOCKING: c_uint = 0x01;
/// `hipEventDisableTiming`.
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 0x02;
/// `hipDeviceAttributeMemoryPoolsSupported`.
pub(crate) const ATTR_MEMORY_POOLS_SUPPORTED: c_int =
    hip_sys::hiprt::hipDeviceAttribute_t::hipDeviceAttributeMemoryPoolsSupported as c_int;
/// `hipMemPoolAttrReleaseThreshold` (value: `u64`).
pub(crate) const POOL_ATTR_RELEASE_THRESHOLD: c_int =
    hip_sys::hiprt::hipMemPoolAttr::hipMemPoolAttrReleaseThreshold as c_int;

extern "C" {
    pub(crate) fn hipGetErrorName(code: HipResult) -> *const c_char;
    pub(crate) fn hipGetDeviceCount(count: *mut c_int) -> HipResult;
    pub(crate) fn hipGetDevice(device: *mut c_int) -> HipResult;
    pub(crate) fn hipSetDevice(device: c_int) -> HipResult;
    pub(crate) fn hipDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> HipResult;
    pub(crate) fn hipDeviceTotalMem(bytes: *mut usize, device: c_int) -> HipResult;
    pub(crate) fn hipDriverGetVersion(version: *mut c_int) -> HipResult;
    pub(crate) fn hipRuntimeGetVersion(version: *mut c_int) -> HipResult;
    pub(crate) fn hipDeviceGetAttribute(value: *mut c_int, attr: c_int, device: c_int)
        -> HipResult;
    pub(crate) fn hipMemGetInfo(free: *mut usize, total: *mut usize) -> HipResult;

    pub(crate) fn hipStreamCreateWithFlags(stream: *mut hipStream_t, flags: c_uint) -> HipResult;
    pub(crate) fn hipStreamDestroy(stream: hipStream_t) -> HipResult;
    pub(crate) fn hipStreamSynchronize(stream: hipStream_t) -> HipResult;
    pub(crate) fn hipStreamAddCallback(
        stream: hipStream_t,
        callback: Option<StreamCallback>,
        user: *mut c_void,
        flags: c_uint,
    ) -> HipResult;
    pub(crate) fn hipStreamWaitEvent(
        stream: hipStream_t,
        event: hipEvent_t,
        flags: c_uint,
    ) -> HipResult;

    pub(crate) fn hipEventCreateWithFlags(event: *mut hipEvent_t, flags: c_uint) -> HipResult;
    pub(crate) fn hipEventRecord(event: hipEvent_t, stream: hipStream_t) -> HipResult;
    pub(crate) fn hipEventSynchronize(event: hipEvent_t) -> HipResult;
    pub(crate) fn hipEventDestroy(event: hipEvent_t) -> HipResult;

    pub(crate) fn hipMalloc(ptr: *mut *mut c_void, bytes: usize) -> HipResult;
    pub(crate) fn hipFree(ptr: *mut c_void) -> HipResult;
    pub(crate) fn hipMallocFromPoolAsync(
        ptr: *mut *mut c_void,
        bytes: usize,
        pool: hipMemPool_t,
        stream: hipStream_t,
    ) -> HipResult;
    pub(crate) fn hipFreeAsync(ptr: *mut c_void, stream: hipStream_t) -> HipResult;
    pub(crate) fn hipMemPoolCreate(
        pool: *mut hipMemPool_t,
        props: *const hipMemPoolProps,
    ) -> HipResult;
    pub(crate) fn hipMemPoolDestroy(pool: hipMemPool_t) -> HipResult;
    pub(crate) fn hipMemPoolTrimTo(pool: hipMemPool_t, keep: usize) -> HipResult;
    pub(crate) fn hipMemPoolSetAttribute(
        pool: hipMemPool_t,
        attr: c_int,
        value: *mut c_void,
    ) -> HipResult;

    pub(crate) fn hipMemcpyHtoDAsync(
        dst: *mut c_void,
        src: *mut c_void,
        bytes: usize,
        stream: hipStream_t,
    ) -> HipResult;
    pub(crate) fn hipMemcpyDtoHAsync(
        dst: *mut c_void,
        src: *mut c_void,
        bytes: usize,
        stream: hipStream_t,
    ) -> HipResult;
}
