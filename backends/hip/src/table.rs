//! HIP's table of entry points for the stream-ordered core
//! ([`memgov_stream_ordered`]): every call the core makes into the loaded
//! HIP runtime ([`crate::ffi`]), under the core's neutral names, in one
//! place. [`VmmTable`] for the virtual-memory arena, its page-locked host
//! memory and its copy stream; [`StreamTable`] for the events that order
//! one stream after another; [`CaptureTable`] for stream capture and
//! graphs; [`RetireTable`] for the stream callback queued behind a release,
//! with its `extern "C"` trampoline; [`PinnedTable`] for the pinned tier's
//! mapped host memory; `TeardownTable` for the free of what a forced
//! retire left; `PoolTable` for the context's own memory pool; `OpenTable`
//! for opening a device. The results of these
//! calls are classified in [`result`](crate::result) ([`Hip`]'s
//! [`Vendor`](memgov_stream_ordered::Vendor)).
//!
//! The entries are static: the runtime's functions with thin shims where
//! the core's signature differs (out parameters returned, device addresses
//! as `u64`, host addresses as `usize`). What needs a context's state (its
//! streams, its lost state, its arena) is the context's, beside that
//! state: the core's [`Context`] and `StreamContext` on the shared state,
//! the fallback frees and their free thread.
//!
//! Where an entry narrows or departs from the HIP runtime API reference
//! (rocm.docs.amd.com/projects/HIP: virtual memory management, memory
//! management, stream management, event management, graph management), and
//! from CUDA's table:
//!
//! * **A stream carries its device**, and the runtime takes it from any
//!   thread, so stream calls are made without setting the device
//!   ([`StreamTable::STREAM_CALLS_NEED_CURRENT`] is false). After a sticky
//!   error the runtime may block in a call that waits for work that never
//!   finishes, so no call is made once one was seen
//!   ([`StreamTable::CALLS_AFTER_STICKY`] is false).
//! * **The virtual-memory calls take device addresses as pointers**
//!   (`void*`), and a `hipMemGenericAllocationHandle_t` is a pointer too,
//!   carried across threads as a [`Raw`] value. **The allocation
//!   properties** are passed in the layout the loaded runtime reads
//!   (ROCm 6 reordered `hipMemAllocationProp`; [`ffi::allocation_prop`]).
//!   As on CUDA: **`mem_granularity`** asks the recommended granularity;
//!   **`mem_address_reserve`** no fixed address (null) and flags 0;
//!   **`mem_map`** offset 0 and flags 0; **`mem_set_access`** read-write
//!   for the owning device only.
//! * **`host_alloc`** passes `hipHostMallocDefault`.
//! * **`stream_create`** passes `hipStreamNonBlocking`: no implicit
//!   synchronization with the NULL stream.
//! * **`stream_destroy`**: `hipStreamDestroy` may destroy the stream while
//!   commands are still in flight, or wait for all of them; so the context
//!   synchronizes a stream (and waits for its callbacks) before destroying
//!   it, never retires it, and on a dead device only forgets it
//!   (its `stream` module).
//! * **`event_create`** disables timing (`hipEventDisableTiming`): the
//!   events only order.
//! * **`launch_callback`** is `hipStreamAddCallback` (flags 0, reserved):
//!   its callback receives the stream's status, also after an error
//!   (unlike CUDA's `cuLaunchHostFunc` function, which is not called
//!   then); the trampoline reports whether it is `hipSuccess`, and a pool
//!   free whose callback saw an error marks the context lost. The callback
//!   may make no HIP call: it only hands its ticket to the core. The status
//!   is read as a plain `int` ([`crate::ffi`]).
//! * **`capture_id`** and **`still_capturing`** both read
//!   `hipStreamGetCaptureInfo` (its id, its status; an error counted as
//!   still capturing); **`end_capture`** returns no graph where the runtime
//!   returns a null one; **`instantiate`** is `hipGraphInstantiate` with no
//!   error node and no log buffer.
//! * **`graph_memory`** reads no nodes: a graph's memory is 0 with no call
//!   ([`CaptureTable::READS_GRAPH_NODES`] is false).
//! * **`capture_supported`**: the capture and graph calls are resolved
//!   optionally when the runtime is opened; a runtime that lacks one makes
//!   a capture `Unsupported`, naming it (and no runtime, `Unavailable`).

use crate::ffi::{
    self, hipEventCreateWithFlags, hipEventDestroy, hipEventDisableTiming, hipEventRecord,
    hipEvent_t, hipGraphExec_t, hipGraph_t, hipMemGenericAllocationHandle_t, hipStreamAddCallback,
    hipStreamWaitEvent, hipStream_t, HipResult, SUCCESS,
};
use crate::result::{err, Hip};
use memgov_backend::capability::CaptureMode;
use memgov_backend::{BackendError, BackendErrorKind};
use memgov_stream_ordered::pinned::PinnedTable;
use memgov_stream_ordered::retire::{self, RetireTable};
use memgov_stream_ordered::table::{
    CaptureNames, CaptureTable, Context, Raw, StreamNames, StreamTable, VmmNames, VmmTable,
};
use std::ffi::c_void;
use std::time::Duration;

// ---- the arena: virtual memory, page-locked host memory, copies ----------

/// A `hipMemGenericAllocationHandle_t`, carried across threads (the
/// runtime accepts it from any host thread).
type Handle = Raw<hipMemGenericAllocationHandle_t>;

/// The runtime's functions, with thin shims where the core's neutral
/// signature differs (device addresses as `u64`, host addresses as `usize`,
/// the properties in the loaded runtime's layout passed as a pointer).
impl VmmTable for Hip {
    type Handle = Handle;
    type Stream = hipStream_t;
    type Prop = ffi::AllocationProp;

    const NAMES: VmmNames = VmmNames {
        arena: "HipArena",
        mem_granularity: "hipMemGetAllocationGranularity",
        mem_address_reserve: "hipMemAddressReserve",
        mem_address_free: "hipMemAddressFree",
        mem_get_info: "hipMemGetInfo",
        stream_query: "hipStreamQuery",
        mem_create: "hipMemCreate",
        mem_map: "hipMemMap",
        mem_set_access: "hipMemSetAccess",
        mem_unmap: "hipMemUnmap",
        mem_release: "hipMemRelease",
        host_alloc: "hipHostMalloc",
        host_free: "hipHostFree",
        stream_create: "hipStreamCreateWithFlags",
        stream_sync: "hipStreamSynchronize",
        copy_dtoh_async: "hipMemcpyDtoHAsync",
        copy_htod_async: "hipMemcpyHtoDAsync",
    };

    unsafe fn mem_granularity(prop: &Self::Prop) -> (HipResult, usize) {
        let mut g: usize = 0;
        // SAFETY: valid out pointer; the properties in the loaded runtime's
        // layout, alive for the call; the caller has the device current.
        let r = unsafe {
            ffi::hipMemGetAllocationGranularity(
                &mut g,
                prop.as_ptr(),
                ffi::hipMemAllocationGranularityRecommended,
            )
        };
        (r, g)
    }

    unsafe fn mem_address_reserve(bytes: usize, align: usize) -> (HipResult, u64) {
        let mut base: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; no address asked for; flags 0; the
        // caller frees it once.
        let r =
            unsafe { ffi::hipMemAddressReserve(&mut base, bytes, align, std::ptr::null_mut(), 0) };
        (r, base as u64)
    }

    unsafe fn mem_address_free(at: u64, bytes: usize) -> HipResult {
        // SAFETY: the caller's contract (nothing mapped, freed once).
        unsafe { ffi::hipMemAddressFree(at as *mut c_void, bytes) }
    }

    unsafe fn mem_get_info() -> (HipResult, usize, usize) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out pointers; the device is current (the caller's
        // contract).
        let r = unsafe { ffi::hipMemGetInfo(&mut free, &mut total) };
        (r, free, total)
    }

    unsafe fn stream_query(stream: hipStream_t) -> HipResult {
        // SAFETY: the caller's contract (a live stream).
        unsafe { ffi::hipStreamQuery(stream) }
    }

    unsafe fn mem_create(bytes: usize, prop: &Self::Prop) -> (HipResult, Handle) {
        let mut h: hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: valid out pointer; the properties live until the call
        // returns, in the loaded runtime's layout; the caller has the device
        // current.
        let r = unsafe { ffi::hipMemCreate(&mut h, bytes, prop.as_ptr(), 0) };
        (r, Raw(h))
    }

    unsafe fn mem_map(at: u64, bytes: usize, h: Handle) -> HipResult {
        // SAFETY: the caller's contract (a free range of a reservation, a
        // handle of exactly `bytes`).
        unsafe { ffi::hipMemMap(at as *mut c_void, bytes, 0, h.0, 0) }
    }

    unsafe fn mem_set_access(at: u64, bytes: usize, prop: &Self::Prop) -> HipResult {
        let desc = ffi::hipMemAccessDesc {
            location: prop.location(),
            flags: ffi::hipMemAccessFlagsProtReadWrite,
        };
        // SAFETY: the caller's contract (exactly one mapping); one
        // descriptor, alive for the call.
        unsafe { ffi::hipMemSetAccess(at as *mut c_void, bytes, &desc, 1) }
    }

    unsafe fn mem_unmap(at: u64, bytes: usize) -> HipResult {
        // SAFETY: the caller's contract (one unused mapping).
        unsafe { ffi::hipMemUnmap(at as *mut c_void, bytes) }
    }

    unsafe fn mem_release(h: Handle) -> HipResult {
        // SAFETY: the caller's contract (released once).
        unsafe { ffi::hipMemRelease(h.0) }
    }

    unsafe fn host_alloc(bytes: usize) -> (HipResult, usize) {
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; the caller has the device current.
        let r = unsafe { ffi::hipHostMalloc(&mut host, bytes, ffi::hipHostMallocDefault) };
        (r, host as usize)
    }

    unsafe fn host_free(host: usize) -> HipResult {
        // SAFETY: the caller's contract (from `host_alloc`, freed once).
        unsafe { ffi::hipHostFree(host as *mut c_void) }
    }

    unsafe fn stream_create() -> (HipResult, hipStream_t) {
        let mut raw: hipStream_t = std::ptr::null_mut();
        // SAFETY: valid out pointer; the flag is a documented value; the
        // caller has the device current.
        let r = unsafe { ffi::hipStreamCreateWithFlags(&mut raw, ffi::hipStreamNonBlocking) };
        (r, raw)
    }

    unsafe fn stream_sync(stream: hipStream_t) -> HipResult {
        // SAFETY: the caller's contract (a live stream).
        unsafe { ffi::hipStreamSynchronize(stream) }
    }

    unsafe fn stream_destroy(stream: hipStream_t) -> HipResult {
        // SAFETY: the caller's contract (live, destroyed once).
        unsafe { ffi::hipStreamDestroy(stream) }
    }

    unsafe fn copy_dtoh_async(
        host: usize,
        at: u64,
        bytes: usize,
        stream: hipStream_t,
    ) -> HipResult {
        // SAFETY: the caller's contract (both ranges valid until the copy
        // completes; a live stream).
        unsafe { ffi::hipMemcpyDtoHAsync(host as *mut c_void, at as *mut c_void, bytes, stream) }
    }

    unsafe fn copy_htod_async(
        at: u64,
        host: usize,
        bytes: usize,
        stream: hipStream_t,
    ) -> HipResult {
        // SAFETY: as for `copy_dtoh_async`.
        unsafe { ffi::hipMemcpyHtoDAsync(at as *mut c_void, host as *mut c_void, bytes, stream) }
    }
}

/// Pinned host memory: `hipHostMalloc` with `hipHostMallocMapped |
/// hipHostMallocPortable`; HIP's copies take the pointer kind their
/// `hipMemcpyKind` names, so the device's view is the one
/// `hipHostGetDevicePointer` (flags 0) returns, which may differ from the
/// host pointer.
impl PinnedTable for Hip {
    const HOST_ALLOC_MAPPED: &'static str = "hipHostMalloc";
    const HOST_DEVICE_POINTER: &'static str = "hipHostGetDevicePointer";

    unsafe fn host_alloc_mapped(bytes: usize) -> (HipResult, usize) {
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = ffi::hipHostMallocMapped | ffi::hipHostMallocPortable;
        // SAFETY: valid out pointer, documented flags; the caller has the
        // device current.
        let r = unsafe { ffi::hipHostMalloc(&mut host, bytes, flags) };
        (r, host as usize)
    }

    unsafe fn host_device_pointer(host: usize) -> (HipResult, u64) {
        let mut device: *mut c_void = std::ptr::null_mut();
        // SAFETY: `host` was allocated mapped (the caller's contract); valid
        // out pointer.
        let r = unsafe { ffi::hipHostGetDevicePointer(&mut device, host as *mut c_void, 0) };
        (r, device as u64)
    }
}

// ---- streams and events --------------------------------------------------

/// HIP's stream and event calls under the core's names.
impl StreamTable for Hip {
    type Event = hipEvent_t;

    const STREAM_NAMES: StreamNames = StreamNames {
        stream_destroy: "hipStreamDestroy",
        event_create: "hipEventCreateWithFlags",
        event_record: "hipEventRecord",
        stream_wait_event: "hipStreamWaitEvent",
        event_destroy: "hipEventDestroy",
    };

    const STREAM_CALLS_NEED_CURRENT: bool = false;
    const CALLS_AFTER_STICKY: bool = false;
    const POLL_INTERVAL: Duration = Duration::from_millis(1);

    unsafe fn event_create() -> (HipResult, hipEvent_t) {
        let mut event: hipEvent_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer, documented flag; the caller has the
        // device current.
        let r = unsafe { hipEventCreateWithFlags(&mut event, hipEventDisableTiming) };
        (r, event)
    }

    unsafe fn event_record(event: hipEvent_t, stream: hipStream_t) -> HipResult {
        // SAFETY: the caller's contract (both live, of the current device).
        unsafe { hipEventRecord(event, stream) }
    }

    unsafe fn stream_wait_event(stream: hipStream_t, event: hipEvent_t) -> HipResult {
        // SAFETY: as above, the event recorded.
        unsafe { hipStreamWaitEvent(stream, event, 0) }
    }

    unsafe fn event_destroy(event: hipEvent_t) -> HipResult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { hipEventDestroy(event) }
    }
}

// ---- capture and graphs --------------------------------------------------

/// The loaded runtime's functions under the core's names.
impl CaptureTable for Hip {
    type Graph = hipGraph_t;
    type Exec = hipGraphExec_t;

    const CAPTURE_NAMES: CaptureNames = CaptureNames {
        begin_capture: "hipStreamBeginCapture",
        capture_id: "hipStreamGetCaptureInfo",
        end_capture: "hipStreamEndCapture",
        instantiate: "hipGraphInstantiate",
        exec_destroy: "hipGraphExecDestroy",
        graph_destroy: "hipGraphDestroy",
        launch: "hipGraphLaunch",
        capture: "HipCapture",
        graph: "HipGraph",
        arena_setting: "HipConfig::arena",
    };

    type DevicePtr = ffi::hipDeviceptr_t;
    /// memgov does not read a graph's nodes on HIP.
    const READS_GRAPH_NODES: bool = false;

    fn capture_supported() -> Result<(), BackendError> {
        capture_calls()
    }

    unsafe fn graph_memory<C: Context<Table = Self>>(
        _: &C,
        _: hipGraph_t,
    ) -> Result<u64, BackendError> {
        Ok(0)
    }

    unsafe fn begin_capture(stream: hipStream_t, mode: CaptureMode) -> HipResult {
        let mode = match mode {
            CaptureMode::Global => ffi::hipStreamCaptureModeGlobal,
            CaptureMode::ThreadLocal => ffi::hipStreamCaptureModeThreadLocal,
            CaptureMode::Relaxed => ffi::hipStreamCaptureModeRelaxed,
        };
        // SAFETY: the caller's contract (a live stream, its device current).
        unsafe { ffi::hipStreamBeginCapture(stream, mode) }
    }

    unsafe fn capture_id(stream: hipStream_t) -> (HipResult, u64) {
        let (mut status, mut id) = (0i32, 0u64);
        // SAFETY: valid out pointers; a live stream (the caller's contract).
        let r = unsafe { ffi::hipStreamGetCaptureInfo(stream, &mut status, &mut id) };
        (r, id)
    }

    unsafe fn end_capture(stream: hipStream_t) -> (HipResult, Option<hipGraph_t>) {
        let mut graph: hipGraph_t = std::ptr::null_mut();
        // SAFETY: valid out pointer; a live stream (the caller's contract).
        let r = unsafe { ffi::hipStreamEndCapture(stream, &mut graph) };
        (r, (!graph.is_null()).then_some(graph))
    }

    unsafe fn still_capturing(stream: hipStream_t) -> bool {
        let (mut status, mut id) = (0, 0u64);
        // SAFETY: a live stream of this context; valid out pointers.
        let r = unsafe { ffi::hipStreamGetCaptureInfo(stream, &mut status, &mut id) };
        r != ffi::SUCCESS || status != ffi::hipStreamCaptureStatusNone
    }

    unsafe fn instantiate(graph: hipGraph_t) -> (HipResult, hipGraphExec_t) {
        let mut exec: hipGraphExec_t = std::ptr::null_mut();
        // SAFETY: a live graph (the caller's contract); valid out pointer;
        // no error node or log asked for.
        let r = unsafe {
            ffi::hipGraphInstantiate(
                &mut exec,
                graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        (r, exec)
    }

    unsafe fn exec_destroy(exec: hipGraphExec_t) -> HipResult {
        // SAFETY: the caller's contract (destroyed once, after its launches).
        unsafe { ffi::hipGraphExecDestroy(exec) }
    }

    unsafe fn graph_destroy(graph: hipGraph_t) -> HipResult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { ffi::hipGraphDestroy(graph) }
    }

    unsafe fn launch(exec: hipGraphExec_t, stream: hipStream_t) -> HipResult {
        // SAFETY: the caller's contract (both live).
        unsafe { ffi::hipGraphLaunch(exec, stream) }
    }

    fn stream_key(stream: hipStream_t) -> usize {
        stream as usize
    }
}

/// The loaded runtime has every call a capture needs; else why not.
fn capture_calls() -> Result<(), BackendError> {
    if let Some(why) = ffi::runtime_missing() {
        return Err(err("begin_capture", BackendErrorKind::Unavailable, why));
    }
    match ffi::missing(&ffi::CAPTURE_SYMBOLS) {
        None => Ok(()),
        Some(symbol) => Err(err(
            "begin_capture",
            BackendErrorKind::Unsupported,
            format!(
                "a stream capture needs {symbol}, which the loaded HIP runtime does not export \
                 (ROCm 4.3 or newer has HIP's graph calls)"
            ),
        )),
    }
}

// ---- retirement ----------------------------------------------------------

/// Runs on a HIP runtime thread once the stream reached it. Makes no HIP
/// call. The status is read as a plain integer (see `ffi.rs`); the user data
/// is the ticket number, not a pointer.
unsafe extern "C" fn callback(_stream: hipStream_t, status: HipResult, user: *mut c_void) {
    retire::callback_ran(user as usize as u64, status == SUCCESS);
}

/// `hipStreamAddCallback`, its callback the trampoline above.
impl RetireTable for Hip {
    const LAUNCH_CALLBACK: &'static str = "hipStreamAddCallback";

    unsafe fn launch_callback(stream: hipStream_t, ticket: u64) -> HipResult {
        // SAFETY: the caller's contract (a live stream); the callback has
        // the ABI HIP expects (an `int` status is what the C header's enum
        // is passed as), makes no HIP call and reads its user data as a
        // number.
        unsafe { hipStreamAddCallback(stream, Some(callback), ticket as usize as *mut c_void, 0) }
    }
}

// ---- teardown --------------------------------------------------------------

/// `hipFreeAsync`, for the pool memory a forced retire left live.
impl memgov_stream_ordered::teardown::TeardownTable for Hip {
    const FREE_ASYNC: &'static str = "hipFreeAsync";

    unsafe fn free_async(ptr: u64, stream: hipStream_t) -> HipResult {
        // SAFETY: the caller's contract (a pointer from
        // hipMallocFromPoolAsync of the current device, freed once; the
        // stream live).
        unsafe { ffi::hipFreeAsync(ptr as usize as *mut c_void, stream) }
    }
}

// ---- the context's own memory pool ---------------------------------------

use crate::ffi::{
    hipMemPoolCreate, hipMemPoolDestroy, hipMemPoolProps, hipMemPoolSetAttribute, hipMemPoolTrimTo,
    hipMemPool_t,
};
use memgov_stream_ordered::pool::{PoolNames, PoolTable};

/// `hipMemPoolCreate` of pinned device memory, no shareable handle; the
/// release threshold is `hipMemPoolAttrReleaseThreshold` (a `uint64_t`);
/// trimmed to 0 bytes. A runtime without pools for the device answers
/// `hipErrorNotSupported`, which the core reads as no pool.
impl PoolTable for Hip {
    type Pool = hipMemPool_t;

    const POOL_NAMES: PoolNames = PoolNames {
        create: "hipMemPoolCreate",
        set_attribute: "hipMemPoolSetAttribute",
        trim: "hipMemPoolTrimTo",
        destroy: "hipMemPoolDestroy",
    };

    unsafe fn pool_create(ordinal: i32) -> (HipResult, hipMemPool_t) {
        let props = hipMemPoolProps {
            allocType: ffi::hipMemAllocationTypePinned,
            handleTypes: ffi::hipMemHandleTypeNone,
            location: ffi::hipMemLocation {
                type_: ffi::hipMemLocationTypeDevice,
                id: ordinal,
            },
            win32SecurityAttributes: std::ptr::null_mut(),
            reserved: [0; 64],
        };
        let mut pool: hipMemPool_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and a fully initialised properties
        // struct (reserved bytes zero, as documented); the caller's
        // contract (a device of the runtime).
        let r = unsafe { hipMemPoolCreate(&mut pool, &props) };
        (r, pool)
    }

    unsafe fn pool_set_release_threshold(pool: hipMemPool_t, bytes: u64) -> HipResult {
        let mut value = bytes;
        // SAFETY: the attribute's value is a u64, alive for the call; the
        // caller's contract (a live pool).
        unsafe {
            hipMemPoolSetAttribute(
                pool,
                ffi::hipMemPoolAttrReleaseThreshold,
                &mut value as *mut u64 as *mut c_void,
            )
        }
    }

    unsafe fn pool_trim(pool: hipMemPool_t) -> HipResult {
        // SAFETY: the caller's contract (a live pool).
        unsafe { hipMemPoolTrimTo(pool, 0) }
    }

    unsafe fn pool_destroy(pool: hipMemPool_t) -> HipResult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { hipMemPoolDestroy(pool) }
    }
}

// ---- opening a device ----------------------------------------------------

use crate::ffi::{
    hipDeviceGetName, hipDeviceGetPCIBusId, hipDeviceGetUuid, hipDeviceTotalMem, hipGetDeviceCount,
};
use memgov_stream_ordered::open::{OpenNames, OpenTable, NAME_BYTES, PCI_BUS_ID_BYTES};
use std::ffi::c_char;

/// `hipGetDeviceCount`, the name, UUID, PCI bus id and total memory of a
/// device, which HIP names by its ordinal (no handle to get: no call).
impl OpenTable for Hip {
    type Device = i32;

    const OPEN_NAMES: OpenNames = OpenNames {
        device_count: "hipGetDeviceCount",
        device_get: "(none: HIP names a device by its ordinal)",
        device_name: "hipDeviceGetName",
        device_total_mem: "hipDeviceTotalMem",
    };

    const IDENTITY_LAST: bool = false;

    unsafe fn device_count() -> (HipResult, i32) {
        let mut count = 0i32;
        // SAFETY: valid out pointer; the runtime is loaded (the caller's
        // contract).
        let r = unsafe { hipGetDeviceCount(&mut count) };
        (r, count)
    }

    unsafe fn device_get(ordinal: i32) -> (HipResult, i32) {
        (SUCCESS, ordinal)
    }

    unsafe fn device_name(buf: &mut [c_char; NAME_BYTES], device: i32) -> HipResult {
        // SAFETY: the buffer holds `len` bytes; HIP writes a NUL-terminated
        // name of at most `len - 1` bytes, so the last is never written;
        // the ordinal is in range.
        unsafe { hipDeviceGetName(buf.as_mut_ptr(), buf.len() as i32 - 1, device) }
    }

    unsafe fn device_uuid(device: i32) -> (HipResult, [u8; 16]) {
        let mut uuid = ffi::hipUUID::default();
        // SAFETY: valid out pointer to a hipUUID; the ordinal is in range.
        let r = unsafe { hipDeviceGetUuid(&mut uuid, device) };
        (r, uuid.bytes.map(|b| b as u8))
    }

    unsafe fn device_pci_bus_id(buf: &mut [c_char; PCI_BUS_ID_BYTES], device: i32) -> HipResult {
        // SAFETY: the buffer holds `len` bytes; HIP writes at most `len`
        // bytes, NUL included; the ordinal is in range.
        unsafe { hipDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, device) }
    }

    unsafe fn device_total_mem(device: i32) -> (HipResult, usize) {
        let mut total = 0usize;
        // SAFETY: valid out pointer; the ordinal is in range.
        let r = unsafe { hipDeviceTotalMem(&mut total, device) };
        (r, total)
    }
}
