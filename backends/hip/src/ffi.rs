//! The HIP runtime, loaded at run time: `libamdhip64.so.6`, else
//! `libamdhip64.so.5`, opened once per process, its entry points resolved
//! into one table, and every HIP call of the crate made through that table.
//!
//! [`RUNTIME_VAR`] names another library to open instead. Nothing here is
//! linked at build time, so a binary built with the `hip`
//! feature starts on a machine without ROCm (an NVIDIA or a CPU-only one)
//! and `HipContext::new` answers `Unavailable` ("no HIP runtime") there. The
//! library, once opened, stays loaded until the process exits: the table's
//! function pointers are valid for as long as the process runs.
//!
//! Every result is read as the C `int` it is ([`HipResult`]), never as a
//! Rust enum: a runtime newer than these declarations may return a code no
//! enum lists, and materialising such a value as an enum would be undefined
//! behaviour. The `result` module classifies the integer. The handle types are
//! opaque pointers and [`hipMemPoolProps`] is the header's `#[repr(C)]`
//! struct; enum arguments are passed as the integers the header gives them
//! (values from ROCm's `hip_runtime_api.h`, the same in ROCm 5 and 6).
//!
//! The functions below are public to the crate's users through the
//! `raw` module, for raw work next to memgov's (tests, benches, a
//! runtime's own calls on a stream memgov lent it). Each calls through the
//! table and panics when no HIP runtime can be loaded: call
//! [`driver_present`] (or open a `HipContext`) first.

#![allow(non_snake_case, non_camel_case_types, non_upper_case_globals)]

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

/// A HIP result as the C `int` it is.
pub type HipResult = i32;

/// `hipUUID`: a device's 16-byte UUID.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct hipUUID {
    /// The UUID's bytes.
    pub bytes: [c_char; 16],
}

/// The library names tried, newest ROCm first.
pub const LIBRARY_NAMES: [&str; 2] = ["libamdhip64.so.6", "libamdhip64.so.5"];

/// The environment variable naming the one library to open instead of
/// [`LIBRARY_NAMES`] (a path, or a name the loader searches for): a ROCm
/// outside the loader's path, or a stand-in on a machine that has ROCm.
pub const RUNTIME_VAR: &str = "MEMGOV_HIP_RUNTIME";

/// An opaque HIP stream (`struct ihipStream_t`).
#[repr(C)]
pub struct ihipStream_t {
    _opaque: [u8; 0],
}
/// An opaque HIP event (`struct ihipEvent_t`).
#[repr(C)]
pub struct ihipEvent_t {
    _opaque: [u8; 0],
}
/// An opaque HIP memory pool (`struct ihipMemPoolHandle_t`).
#[repr(C)]
pub struct ihipMemPoolHandle_t {
    _opaque: [u8; 0],
}
/// `hipStream_t`.
pub type hipStream_t = *mut ihipStream_t;
/// `hipEvent_t`.
pub type hipEvent_t = *mut ihipEvent_t;
/// `hipMemPool_t`.
pub type hipMemPool_t = *mut ihipMemPoolHandle_t;
/// `hipDeviceptr_t`.
pub type hipDeviceptr_t = *mut c_void;

/// `hipMemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemLocation {
    /// `hipMemLocationType` (`hipMemLocationTypeDevice`).
    pub type_: c_int,
    /// The device ordinal.
    pub id: c_int,
}

/// `hipMemPoolProps`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemPoolProps {
    /// `hipMemAllocationType` (`hipMemAllocationTypePinned`).
    pub allocType: c_int,
    /// `hipMemAllocationHandleType` (`hipMemHandleTypeNone`).
    pub handleTypes: c_int,
    /// Where the pool's memory lives.
    pub location: hipMemLocation,
    /// Windows only; null.
    pub win32SecurityAttributes: *mut c_void,
    /// Zero (ROCm 6 uses the first eight bytes as `maxSize`, 0 = no limit).
    pub reserved: [u8; 64],
}

// The header's layout: 4 + 4 + 8, a pointer, 64 reserved bytes.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<hipMemPoolProps>() == 88);

/// An opaque handle of physical memory (`struct ihipMemGenericAllocationHandle`).
#[repr(C)]
pub struct ihipMemGenericAllocationHandle {
    _opaque: [u8; 0],
}
/// `hipMemGenericAllocationHandle_t`: physical memory made by `hipMemCreate`.
pub type hipMemGenericAllocationHandle_t = *mut ihipMemGenericAllocationHandle;

/// `hipMemAllocationProp` as ROCm 5 lays it out (`hip_runtime_api.h` of
/// ROCm 5.x: the compression type first). ROCm 6 reordered the struct
/// ([`hipMemAllocationProp_v6`]); [`allocation_prop`] builds the one the
/// loaded runtime reads.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemAllocationProp_v5 {
    /// Zero.
    pub compressionType: u8,
    /// Where the memory lives.
    pub location: hipMemLocation,
    /// `hipMemAllocationHandleType` (`hipMemHandleTypeNone`).
    pub requestedHandleType: c_int,
    /// `hipMemAllocationType` (`hipMemAllocationTypePinned`).
    pub type_: c_int,
    /// Zero.
    pub usage: u16,
    /// Windows only; null.
    pub win32HandleMetaData: *mut c_void,
}

/// `hipMemAllocationProp` as ROCm 6 lays it out (the type first, the
/// allocation flags last).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemAllocationProp_v6 {
    /// `hipMemAllocationType` (`hipMemAllocationTypePinned`).
    pub type_: c_int,
    /// `hipMemAllocationHandleType` (`hipMemHandleTypeNone`).
    pub requestedHandleTypes: c_int,
    /// Where the memory lives.
    pub location: hipMemLocation,
    /// Windows only; null.
    pub win32HandleMetaData: *mut c_void,
    /// Compression type, RDMA capability (bytes) and usage (`u16`): zero.
    pub allocFlags: [u8; 4],
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(
    std::mem::size_of::<hipMemAllocationProp_v5>() == 32
        && std::mem::size_of::<hipMemAllocationProp_v6>() == 32
);

/// Pinned device memory of device `ordinal`, no shareable handle, in the
/// layout of the runtime that reports `runtime_version`
/// (`hipRuntimeGetVersion`: ROCm 6 and later answer 60000000 and up).
/// Pass [`AllocationProp::as_ptr`] where a call takes a
/// `const hipMemAllocationProp*`.
pub fn allocation_prop(ordinal: i32, runtime_version: i32) -> AllocationProp {
    let location = hipMemLocation {
        type_: hipMemLocationTypeDevice,
        id: ordinal,
    };
    if runtime_version >= 60_000_000 {
        AllocationProp::V6(hipMemAllocationProp_v6 {
            type_: hipMemAllocationTypePinned,
            requestedHandleTypes: hipMemHandleTypeNone,
            location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: [0; 4],
        })
    } else {
        AllocationProp::V5(hipMemAllocationProp_v5 {
            compressionType: 0,
            location,
            requestedHandleType: hipMemHandleTypeNone,
            type_: hipMemAllocationTypePinned,
            usage: 0,
            win32HandleMetaData: std::ptr::null_mut(),
        })
    }
}

/// A `hipMemAllocationProp` in the loaded runtime's layout.
#[derive(Debug, Clone, Copy)]
pub enum AllocationProp {
    /// ROCm 5.x.
    V5(hipMemAllocationProp_v5),
    /// ROCm 6 and later.
    V6(hipMemAllocationProp_v6),
}

impl AllocationProp {
    /// The pointer a call takes; valid while `self` is.
    pub fn as_ptr(&self) -> *const c_void {
        match self {
            Self::V5(p) => (p as *const hipMemAllocationProp_v5).cast(),
            Self::V6(p) => (p as *const hipMemAllocationProp_v6).cast(),
        }
    }

    /// Where the memory lives.
    pub fn location(&self) -> hipMemLocation {
        match self {
            Self::V5(p) => p.location,
            Self::V6(p) => p.location,
        }
    }
}

/// `hipMemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemAccessDesc {
    /// The device the access is for.
    pub location: hipMemLocation,
    /// `hipMemAccessFlags` (`hipMemAccessFlagsProtReadWrite`).
    pub flags: c_int,
}

/// An opaque graph (`struct ihipGraph`).
#[repr(C)]
pub struct ihipGraph {
    _opaque: [u8; 0],
}
/// `hipGraph_t`.
pub type hipGraph_t = *mut ihipGraph;
/// An opaque executable graph (`struct hipGraphExec`).
#[repr(C)]
pub struct hipGraphExec {
    _opaque: [u8; 0],
}
/// `hipGraphExec_t`.
pub type hipGraphExec_t = *mut hipGraphExec;

/// `hipStreamCaptureModeGlobal`.
pub const hipStreamCaptureModeGlobal: c_int = 0;
/// `hipStreamCaptureModeThreadLocal`.
pub const hipStreamCaptureModeThreadLocal: c_int = 1;
/// `hipStreamCaptureModeRelaxed`.
pub const hipStreamCaptureModeRelaxed: c_int = 2;
/// `hipStreamCaptureStatusNone`: the stream is not capturing.
pub const hipStreamCaptureStatusNone: c_int = 0;
/// `hipStreamCaptureStatusActive`.
pub const hipStreamCaptureStatusActive: c_int = 1;
/// `hipErrorStreamCaptureUnsupported`: not permitted while the stream captures.
pub const hipErrorStreamCaptureUnsupported: HipResult = 900;
/// `hipErrorStreamCaptureInvalidated`: the capture was invalidated by an earlier error.
pub const hipErrorStreamCaptureInvalidated: HipResult = 901;
/// `hipErrorStreamCaptureWrongThread`: a non-relaxed capture ended on another thread.
pub const hipErrorStreamCaptureWrongThread: HipResult = 908;

/// `hipMemAccessFlagsProtReadWrite`.
pub const hipMemAccessFlagsProtReadWrite: c_int = 3;
/// `hipMemAllocationGranularityRecommended`.
pub const hipMemAllocationGranularityRecommended: c_int = 1;

/// The stream callback as memgov declares it: the status is an `i32` for
/// the same reason as every result.
pub type StreamCallback = unsafe extern "C" fn(hipStream_t, HipResult, *mut c_void);

/// `hipSuccess`.
pub const SUCCESS: HipResult = hipSuccess;

// `hipError_t` codes the crate names (the header's values; their meanings
// as HIP's documentation gives them).
/// `hipSuccess`: the call succeeded.
pub const hipSuccess: HipResult = 0;
/// `hipErrorInvalidValue`: an argument is out of range.
pub const hipErrorInvalidValue: HipResult = 1;
/// `hipErrorOutOfMemory`: the allocation did not fit in device memory.
pub const hipErrorOutOfMemory: HipResult = 2;
/// `hipErrorNotInitialized`: the runtime is not initialized.
pub const hipErrorNotInitialized: HipResult = 3;
/// `hipErrorDeinitialized`: the runtime is shutting down.
pub const hipErrorDeinitialized: HipResult = 4;
/// `hipErrorInvalidDevicePointer`: the pointer is not device memory.
pub const hipErrorInvalidDevicePointer: HipResult = 17;
/// `hipErrorInvalidMemcpyDirection`: the copy kind does not match the pointers.
pub const hipErrorInvalidMemcpyDirection: HipResult = 21;
/// `hipErrorInsufficientDriver`: the kernel driver is older than the runtime.
pub const hipErrorInsufficientDriver: HipResult = 35;
/// `hipErrorPriorLaunchFailure`: an earlier launch failed.
pub const hipErrorPriorLaunchFailure: HipResult = 53;
/// `hipErrorNoDevice`: no HIP device is present.
pub const hipErrorNoDevice: HipResult = 100;
/// `hipErrorInvalidDevice`: the device ordinal names no device.
pub const hipErrorInvalidDevice: HipResult = 101;
/// `hipErrorInvalidContext`: the context is not valid.
pub const hipErrorInvalidContext: HipResult = 201;
/// `hipErrorNoBinaryForGpu`: the code object has no binary for this GPU.
pub const hipErrorNoBinaryForGpu: HipResult = 209;
/// `hipErrorECCNotCorrectable`: an uncorrectable ECC error occurred.
pub const hipErrorECCNotCorrectable: HipResult = 214;
/// `hipErrorInvalidHandle`: the handle (stream, event, pool) is not valid.
pub const hipErrorInvalidHandle: HipResult = 400;
/// `hipErrorNotReady`: the work queried has not completed yet (not a failure).
pub const hipErrorNotReady: HipResult = 600;
/// `hipErrorIllegalAddress`: a kernel accessed an illegal address (sticky: the device is lost).
pub const hipErrorIllegalAddress: HipResult = 700;
/// `hipErrorLaunchTimeOut`: a kernel ran past the watchdog.
pub const hipErrorLaunchTimeOut: HipResult = 702;
/// `hipErrorContextIsDestroyed`: the context has been destroyed.
pub const hipErrorContextIsDestroyed: HipResult = 709;
/// `hipErrorAssert`: a device-side assertion failed.
pub const hipErrorAssert: HipResult = 710;
/// `hipErrorLaunchFailure`: a kernel launch failed.
pub const hipErrorLaunchFailure: HipResult = 719;
/// `hipErrorNotSupported`: the operation is not supported on this device or runtime.
pub const hipErrorNotSupported: HipResult = 801;

/// `hipStreamNonBlocking`.
pub const hipStreamNonBlocking: c_uint = 0x01;
/// `hipHostMallocDefault`.
pub const hipHostMallocDefault: c_uint = 0;
/// `hipHostMallocPortable`: page-locked for every context.
pub const hipHostMallocPortable: c_uint = 0x1;
/// `hipHostMallocMapped`: mapped into the device's address space; its
/// device pointer comes from `hipHostGetDevicePointer`.
pub const hipHostMallocMapped: c_uint = 0x2;
/// `hipMemcpyHostToHost`: `hipMemcpyAsync` from a host pointer to a host
/// pointer.
pub const hipMemcpyHostToHost: c_int = 0;
/// `hipMemcpyHostToDevice`: `hipMemcpyAsync` from a host pointer to a
/// device pointer.
pub const hipMemcpyHostToDevice: c_int = 1;
/// `hipMemcpyDeviceToHost`: `hipMemcpyAsync` from a device pointer to a
/// host pointer.
pub const hipMemcpyDeviceToHost: c_int = 2;
/// `hipMemcpyDeviceToDevice`: `hipMemcpyAsync` from a device pointer to a
/// device pointer.
pub const hipMemcpyDeviceToDevice: c_int = 3;
/// `hipMemcpyDefault`: the runtime tells each pointer's kind from its
/// address.
pub const hipMemcpyDefault: c_int = 4;
/// `hipEventDisableTiming`.
pub const hipEventDisableTiming: c_uint = 0x02;
/// `hipDeviceAttributeMemoryPoolsSupported`.
pub const hipDeviceAttributeMemoryPoolsSupported: c_int = 88;
/// `hipMemPoolAttrReleaseThreshold` (value: `u64`).
pub const hipMemPoolAttrReleaseThreshold: c_int = 4;
/// `hipMemAllocationTypePinned`.
pub const hipMemAllocationTypePinned: c_int = 1;
/// `hipMemHandleTypeNone`.
pub const hipMemHandleTypeNone: c_int = 0;
/// `hipMemLocationTypeDevice`.
pub const hipMemLocationTypeDevice: c_int = 1;

/// Declares the table's entry points once: the [`Api`] struct with one
/// function pointer per entry, its loader, and a public wrapper of the same
/// name per entry that calls through the loaded table.
macro_rules! hip_api {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;
    )*) => {
        /// The HIP runtime's entry points, resolved from the library.
        pub struct Api {
            $($name: unsafe extern "C" fn($($ty),*) $(-> $ret)?,)*
            /// The entry points a runtime may lack.
            optional: Optional,
            /// Keeps the library loaded for as long as the table lives (the
            /// table is a process-wide static: until exit).
            library: Library,
        }

        impl Api {
            /// Resolve every entry point from `library`; the name of the
            /// first one missing otherwise.
            ///
            /// # Safety
            ///
            /// `library` is ROCm's HIP runtime (or a library with its ABI):
            /// each symbol has the C signature declared here.
            unsafe fn resolve(library: Library) -> Result<Self, &'static str> {
                $(
                    // SAFETY: the symbol's C signature is the one declared
                    // here (the caller's contract); the pointer is copied out
                    // and stays valid while `library` keeps the library
                    // loaded.
                    let $name = *unsafe {
                        library.get::<unsafe extern "C" fn($($ty),*) $(-> $ret)?>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                    }
                    .map_err(|_| stringify!($name))?;
                )*
                // SAFETY: as above, for the optional entry points.
                let optional = unsafe { Optional::resolve(&library) };
                Ok(Self { $($name,)* optional, library })
            }
        }

        $(
            $(#[$doc])*
            ///
            /// # Safety
            ///
            /// As for the C function: valid handles and pointers.
            ///
            /// # Panics
            ///
            /// When no HIP runtime can be loaded ([`driver_present`] is
            /// false).
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: the pointer was resolved from the loaded library
                // with this signature; the caller upholds the function's
                // own contract.
                unsafe { (api().$name)($($arg),*) }
            }
        )*
    };
}

hip_api! {
    /// `hipGetErrorName`: a static string for any code.
    fn hipGetErrorName(code: HipResult) -> *const c_char;
    fn hipGetDeviceCount(count: *mut c_int) -> HipResult;
    fn hipGetDevice(device: *mut c_int) -> HipResult;
    fn hipSetDevice(device: c_int) -> HipResult;
    fn hipDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> HipResult;
    fn hipDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, device: c_int) -> HipResult;
    fn hipDeviceGetUuid(uuid: *mut hipUUID, device: c_int) -> HipResult;
    fn hipDeviceTotalMem(bytes: *mut usize, device: c_int) -> HipResult;
    fn hipDriverGetVersion(version: *mut c_int) -> HipResult;
    fn hipRuntimeGetVersion(version: *mut c_int) -> HipResult;
    fn hipDeviceGetAttribute(value: *mut c_int, attr: c_int, device: c_int) -> HipResult;
    fn hipMemGetInfo(free: *mut usize, total: *mut usize) -> HipResult;

    fn hipStreamCreateWithFlags(stream: *mut hipStream_t, flags: c_uint) -> HipResult;
    fn hipStreamDestroy(stream: hipStream_t) -> HipResult;
    fn hipStreamSynchronize(stream: hipStream_t) -> HipResult;
    fn hipStreamQuery(stream: hipStream_t) -> HipResult;
    fn hipStreamAddCallback(
        stream: hipStream_t,
        callback: Option<StreamCallback>,
        user: *mut c_void,
        flags: c_uint,
    ) -> HipResult;
    fn hipStreamWaitEvent(stream: hipStream_t, event: hipEvent_t, flags: c_uint) -> HipResult;

    fn hipEventCreateWithFlags(event: *mut hipEvent_t, flags: c_uint) -> HipResult;
    fn hipEventRecord(event: hipEvent_t, stream: hipStream_t) -> HipResult;
    fn hipEventSynchronize(event: hipEvent_t) -> HipResult;
    fn hipEventDestroy(event: hipEvent_t) -> HipResult;

    fn hipMalloc(ptr: *mut *mut c_void, bytes: usize) -> HipResult;
    fn hipFree(ptr: *mut c_void) -> HipResult;
    /// Page-locked host memory (mapped into the device's address space with
    /// `hipHostMallocMapped`).
    fn hipHostMalloc(ptr: *mut *mut c_void, bytes: usize, flags: c_uint) -> HipResult;
    /// The device pointer of mapped host memory, which may differ from the
    /// host pointer; `flags` must be 0.
    fn hipHostGetDevicePointer(
        device: *mut *mut c_void,
        host: *mut c_void,
        flags: c_uint,
    ) -> HipResult;
    /// Synchronous: the memory must not be in use by queued work.
    fn hipHostFree(ptr: *mut c_void) -> HipResult;
    /// `hipMallocAsync` from the device's default pool. memgov allocates
    /// from a pool of its own; this is for raw work next to it.
    fn hipMallocAsync(ptr: *mut *mut c_void, bytes: usize, stream: hipStream_t) -> HipResult;
    fn hipMallocFromPoolAsync(
        ptr: *mut *mut c_void,
        bytes: usize,
        pool: hipMemPool_t,
        stream: hipStream_t,
    ) -> HipResult;
    fn hipFreeAsync(ptr: *mut c_void, stream: hipStream_t) -> HipResult;
    /// The device's default pool. memgov never changes it; this is for raw
    /// work next to memgov.
    fn hipDeviceGetDefaultMemPool(pool: *mut hipMemPool_t, device: c_int) -> HipResult;
    fn hipMemPoolCreate(pool: *mut hipMemPool_t, props: *const hipMemPoolProps) -> HipResult;
    fn hipMemPoolDestroy(pool: hipMemPool_t) -> HipResult;
    fn hipMemPoolTrimTo(pool: hipMemPool_t, keep: usize) -> HipResult;
    fn hipMemPoolSetAttribute(pool: hipMemPool_t, attr: c_int, value: *mut c_void) -> HipResult;
    fn hipMemPoolGetAttribute(pool: hipMemPool_t, attr: c_int, value: *mut c_void) -> HipResult;

    fn hipMemcpyHtoDAsync(
        dst: *mut c_void,
        src: *mut c_void,
        bytes: usize,
        stream: hipStream_t,
    ) -> HipResult;
    fn hipMemcpyDtoHAsync(
        dst: *mut c_void,
        src: *mut c_void,
        bytes: usize,
        stream: hipStream_t,
    ) -> HipResult;
    /// A copy whose direction is `kind` (`hipMemcpyHostToDevice`, ...): the
    /// pointers must match it. memgov copies with the HtoD / DtoH forms;
    /// this is for raw work next to memgov.
    fn hipMemcpyAsync(
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
        kind: c_int,
        stream: hipStream_t,
    ) -> HipResult;
    /// `hipDeviceReset`: destroys every allocation and stream of the process
    /// on the current device. memgov never calls it.
    fn hipDeviceReset() -> HipResult;
}

/// Declares the entry points a runtime may lack (resolved when the library
/// is opened, each `None` where it is missing): the [`Optional`] table, and
/// a public wrapper per entry that calls through it and answers
/// `hipErrorNotSupported` when the loaded runtime lacks it. What needs one
/// asks [`missing`] first, to name the symbol in its error.
macro_rules! hip_api_optional {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> HipResult;
    )*) => {
        /// The optional entry points, `None` where the runtime lacks one.
        struct Optional {
            $($name: Option<unsafe extern "C" fn($($ty),*) -> HipResult>,)*
        }

        impl Optional {
            /// # Safety
            ///
            /// As for [`Api::resolve`].
            unsafe fn resolve(library: &Library) -> Self {
                Self {
                    $(
                        // SAFETY: the caller's contract: the symbol, where
                        // present, has this signature; the library stays
                        // loaded with the table.
                        $name: unsafe {
                            library.get::<unsafe extern "C" fn($($ty),*) -> HipResult>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        }
                        .ok()
                        .map(|f| *f),
                    )*
                }
            }

            fn has(&self, name: &str) -> Option<bool> {
                match name {
                    $(stringify!($name) => Some(self.$name.is_some()),)*
                    _ => None,
                }
            }
        }

        $(
            $(#[$doc])*
            ///
            /// Returns `hipErrorNotSupported` when the loaded runtime lacks
            /// it (see [`missing`]).
            ///
            /// # Safety
            ///
            /// As for the C function: valid handles and pointers.
            ///
            /// # Panics
            ///
            /// When no HIP runtime can be loaded ([`driver_present`] is
            /// false).
            pub unsafe fn $name($($arg: $ty),*) -> HipResult {
                match api().optional.$name {
                    // SAFETY: resolved from the loaded library with this
                    // signature; the caller upholds the function's contract.
                    Some(f) => unsafe { f($($arg),*) },
                    None => hipErrorNotSupported,
                }
            }
        )*
    };
}

hip_api_optional! {
    /// The allocation granularity (`option`: minimum 0, recommended 1);
    /// `prop` is an [`AllocationProp`] pointer.
    fn hipMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const c_void,
        option: c_int,
    ) -> HipResult;
    /// Reserve `size` bytes of device address space; `flags` must be 0.
    fn hipMemAddressReserve(
        ptr: *mut *mut c_void,
        size: usize,
        alignment: usize,
        addr: *mut c_void,
        flags: u64,
    ) -> HipResult;
    /// Free a reservation (nothing may be mapped in it).
    fn hipMemAddressFree(ptr: *mut c_void, size: usize) -> HipResult;
    /// Physical memory of `size` bytes; `prop` is an [`AllocationProp`]
    /// pointer; `flags` must be 0.
    fn hipMemCreate(
        handle: *mut hipMemGenericAllocationHandle_t,
        size: usize,
        prop: *const c_void,
        flags: u64,
    ) -> HipResult;
    /// Release a handle (its memory goes once no mapping uses it).
    fn hipMemRelease(handle: hipMemGenericAllocationHandle_t) -> HipResult;
    /// Map `handle` at `ptr` in a reservation; `offset` and `flags` must be 0.
    fn hipMemMap(
        ptr: *mut c_void,
        size: usize,
        offset: usize,
        handle: hipMemGenericAllocationHandle_t,
        flags: u64,
    ) -> HipResult;
    /// Unmap whole mappings.
    fn hipMemUnmap(ptr: *mut c_void, size: usize) -> HipResult;
    /// Grant access to mapped memory.
    fn hipMemSetAccess(
        ptr: *mut c_void,
        size: usize,
        desc: *const hipMemAccessDesc,
        count: usize,
    ) -> HipResult;
    /// Put `stream` in capture mode (`mode`: a `hipStreamCaptureMode`).
    fn hipStreamBeginCapture(stream: hipStream_t, mode: c_int) -> HipResult;
    /// End the capture of `stream`, returning its graph.
    fn hipStreamEndCapture(stream: hipStream_t, graph: *mut hipGraph_t) -> HipResult;
    /// Whether `stream` captures (`status`: a `hipStreamCaptureStatus`),
    /// and the capture's id while it is active.
    fn hipStreamGetCaptureInfo(stream: hipStream_t, status: *mut c_int, id: *mut u64)
        -> HipResult;
    /// An executable graph of `graph`; the error node and log are optional.
    fn hipGraphInstantiate(
        exec: *mut hipGraphExec_t,
        graph: hipGraph_t,
        error_node: *mut *mut c_void,
        log: *mut c_char,
        log_size: usize,
    ) -> HipResult;
    /// Queue one run of `exec` on `stream`.
    fn hipGraphLaunch(exec: hipGraphExec_t, stream: hipStream_t) -> HipResult;
    /// Destroy an executable graph (launches queued keep what they need).
    fn hipGraphExecDestroy(exec: hipGraphExec_t) -> HipResult;
    /// Destroy a graph.
    fn hipGraphDestroy(graph: hipGraph_t) -> HipResult;
}

/// The stream capture and graph entry points a capture needs.
pub const CAPTURE_SYMBOLS: [&str; 7] = [
    "hipStreamBeginCapture",
    "hipStreamEndCapture",
    "hipStreamGetCaptureInfo",
    "hipGraphInstantiate",
    "hipGraphLaunch",
    "hipGraphExecDestroy",
    "hipGraphDestroy",
];

/// The virtual memory management entry points a virtual-memory arena needs.
pub const VMM_SYMBOLS: [&str; 8] = [
    "hipMemGetAllocationGranularity",
    "hipMemAddressReserve",
    "hipMemAddressFree",
    "hipMemCreate",
    "hipMemRelease",
    "hipMemMap",
    "hipMemUnmap",
    "hipMemSetAccess",
];

/// The first of `names` (optional entry points) the loaded runtime lacks;
/// `None` when it has them all, or when no runtime is loaded (opening a
/// context says why).
pub fn missing(names: &[&'static str]) -> Option<&'static str> {
    let api = runtime().as_ref().ok()?;
    names
        .iter()
        .copied()
        .find(|n| api.optional.has(n) != Some(true))
}

/// The table, or why there is none: loaded by the first caller, once per
/// process.
fn runtime() -> &'static Result<Api, String> {
    static RUNTIME: OnceLock<Result<Api, String>> = OnceLock::new();
    RUNTIME.get_or_init(load)
}

fn load() -> Result<Api, String> {
    let chosen = std::env::var(RUNTIME_VAR).ok().filter(|v| !v.is_empty());
    let names: Vec<&str> = match &chosen {
        Some(path) => vec![path.as_str()],
        None => LIBRARY_NAMES.to_vec(),
    };
    let mut opened = None;
    // A library that is there but does not load (a dependency of its own
    // missing, the wrong architecture) is named with the loader's reason.
    let mut unloadable = None;
    for name in names {
        // SAFETY: opening ROCm's HIP runtime runs its initialisers, which
        // set up the runtime and touch no state of this process's own.
        match unsafe { Library::new(name) } {
            Ok(library) => {
                opened = Some((name.to_owned(), library));
                break;
            }
            Err(e) => {
                let why = e.to_string();
                if !why.contains("No such file or directory") {
                    unloadable.get_or_insert(why);
                }
            }
        }
    }
    let Some((name, library)) = opened else {
        let mut message = not_found(chosen.as_deref());
        if let Some(why) = unloadable {
            message.push_str(&format!("; the loader said: {why}"));
        }
        return Err(message);
    };
    // SAFETY: a library of that name is ROCm's HIP runtime (or memgov's
    // stand-in, built from ROCm's header): the symbols have the declared
    // signatures.
    unsafe { Api::resolve(library) }.map_err(|missing| {
        format!(
            "no HIP runtime usable by memgov: {name} lacks {missing} \
             (install ROCm 5.2 or newer, whose HIP runtime has the stream-ordered allocator)"
        )
    })
}

/// Why no library was opened: none of [`LIBRARY_NAMES`], or not the one
/// [`RUNTIME_VAR`] chose.
fn not_found(chosen: Option<&str>) -> String {
    match chosen {
        None => {
            "no HIP runtime: libamdhip64.so.{6,5} not found (install ROCm's HIP runtime)".to_owned()
        }
        Some(path) => format!(
            "no HIP runtime: {path} (from {RUNTIME_VAR}) could not be opened \
             (point {RUNTIME_VAR} at a libamdhip64, or unset it)"
        ),
    }
}

fn api() -> &'static Api {
    match runtime() {
        Ok(api) => api,
        Err(why) => panic!(
            "a HIP function was called without a HIP runtime ({why}); \
             check memgov_hip::driver_present() or open a HipContext first"
        ),
    }
}

/// Whether a HIP runtime memgov can use (the driver library of this
/// backend, named so in every backend: `memgov::cuda::driver_present`) is
/// loadable here, loading it, once per process, if not yet loaded. Never
/// panics.
pub fn driver_present() -> bool {
    runtime().is_ok()
}

/// Why no HIP runtime can be used here (`None` when one is loaded).
pub fn runtime_missing() -> Option<&'static str> {
    runtime().as_ref().err().map(String::as_str)
}

/// The address of the loaded runtime's symbol `name` (for a stand-in's
/// test hooks); `None` when there is no runtime or no such
/// symbol.
pub fn symbol(name: &CStr) -> Option<*mut c_void> {
    let api = runtime().as_ref().ok()?;
    // SAFETY: the symbol is only looked up, as an untyped address; the
    // caller decides what it is.
    unsafe { api.library.get::<*mut c_void>(name.to_bytes_with_nul()) }
        .ok()
        .map(|s| *s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_runtime_names_both_libraries_and_the_way_out() {
        assert_eq!(
            not_found(None),
            "no HIP runtime: libamdhip64.so.{6,5} not found (install ROCm's HIP runtime)"
        );
        let chosen = not_found(Some("/opt/x/libamdhip64.so"));
        assert!(
            chosen.starts_with("no HIP runtime: /opt/x/libamdhip64.so (from MEMGOV_HIP_RUNTIME)"),
            "{chosen}"
        );
    }
}
