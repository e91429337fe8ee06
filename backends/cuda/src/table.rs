//! CUDA's table of entry points for the stream-ordered core
//! ([`memgov_stream_ordered`]): every call the core makes into the CUDA
//! driver, under the core's neutral names, in one place. [`VmmTable`] for
//! the virtual-memory arena, its page-locked host memory and its copy
//! stream; [`StreamTable`] for the events that order one stream after
//! another; [`CaptureTable`] for stream capture and graphs; [`RetireTable`]
//! for the host function queued behind a release, with its `extern "C"`
//! trampoline; [`PinnedTable`] for the pinned tier's mapped host memory;
//! `TeardownTable` for the free of what a forced retire left; `PoolTable`
//! for the context's own memory pool; `OpenTable` for opening a device. The results of these calls are classified in
//! [`result`](crate::result) ([`Cuda`]'s [`Vendor`](memgov_stream_ordered::Vendor)).
//!
//! The entries are static: cudarc's `sys` functions with thin shims where
//! the core's signature differs (out parameters returned, host addresses
//! as `usize`). What needs a context's state (its streams, its lost state,
//! its arena) is the context's, beside that state: the core's
//! [`Context`] and `StreamContext` on the shared state, the retired
//! streams and the page-locked host frees.
//!
//! Where an entry narrows or departs from the CUDA Driver API reference
//! (docs.nvidia.com/cuda/cuda-driver-api: Virtual Memory Management, Memory
//! Management, Stream Management, Event Management, Execution Control,
//! Graph Management):
//!
//! * **Every call acts on the calling thread's current context** (the
//!   driver API's rule), so the core makes the context current around each
//!   one, stream calls included ([`StreamTable::STREAM_CALLS_NEED_CURRENT`]).
//!   After a sticky error the driver answers every call at once with that
//!   error, so calls are still made ([`StreamTable::CALLS_AFTER_STICKY`]),
//!   an event still destroyed.
//! * **`mem_granularity`** asks `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`, not
//!   the minimum; **`mem_address_reserve`** asks no fixed address (0) and
//!   passes flags 0; **`mem_create`** makes pinned device memory with no
//!   shareable handle type ([`prop`]); **`mem_map`** maps at offset 0 with
//!   flags 0 (both reserved, must be 0); **`mem_set_access`** grants
//!   `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` to the owning device only.
//! * **`host_alloc`** passes `CU_MEMHOSTALLOC_PORTABLE`: without it the
//!   memory is page-locked only for the context current at the call.
//! * **`stream_create`** passes `CU_STREAM_NON_BLOCKING`: no implicit
//!   synchronization with the NULL stream.
//! * **`stream_destroy`**: `cuStreamDestroy` returns at once while work is
//!   queued on the stream, and the driver releases the stream once the
//!   device completed it; so a stream whose host functions may still run is
//!   retired by the context, not destroyed (its `stream` module).
//! * **`event_create`** disables timing (`CU_EVENT_DISABLE_TIMING`): the
//!   events only order; **`event_destroy`** is legal on a recorded event not
//!   yet completed (the driver releases it on completion), which is what
//!   the core's contract asks.
//! * **`launch_callback`** is `cuLaunchHostFunc`, whose function, unlike
//!   `cuStreamAddCallback`'s, is not called once the context hit an error:
//!   the trampoline always reports success, and a sticky error is learnt
//!   from the driver's answers (device loss abandons the parked tickets).
//!   The function may make no CUDA call: it only hands its ticket to the
//!   core.
//! * **`capture_id`** reads only the status and id of
//!   `cuStreamGetCaptureInfo_v2` (the optional outputs are null);
//!   **`still_capturing`** is `cuStreamIsCapturing`, an error counted as
//!   still capturing; **`end_capture`** returns no graph where the driver
//!   returns a NULL one (an invalidated capture); **`instantiate`** passes
//!   flags 0.
//! * **`graph_memory`** reads the graph's nodes (`cuGraphGetNodes`,
//!   `cuGraphNodeGetType`, `cuGraphMemAllocNodeGetParams`) and sums the
//!   `bytesize` of its `CU_GRAPH_NODE_TYPE_MEM_ALLOC` nodes.

use crate::result::Cuda;
use cudarc::driver::sys::{
    self, CUdeviceptr, CUevent, CUgraph, CUgraphExec, CUmemGenericAllocationHandle, CUresult,
    CUstream,
};
use memgov_backend::capability::CaptureMode;
use memgov_backend::BackendError;
use memgov_stream_ordered::pinned::PinnedTable;
use memgov_stream_ordered::retire::{self, RetireTable};
use memgov_stream_ordered::table::{
    CaptureNames, CaptureTable, Context, StreamNames, StreamTable, VmmNames, VmmTable,
};
use std::ffi::c_void;
use std::time::Duration;

// ---- the arena: virtual memory, page-locked host memory, copies ----------

/// Pinned device memory of device `ordinal`, no shareable handle.
pub(crate) fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero bytes are valid (null
    // pointer, zero enums and flags); the fields that matter are set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = ordinal;
    p
}

/// cudarc's `sys` functions, with thin shims where the core's neutral
/// signature differs (out parameters returned, host addresses as `usize`).
impl VmmTable for Cuda {
    type Handle = CUmemGenericAllocationHandle;
    type Stream = CUstream;
    type Prop = sys::CUmemAllocationProp;

    const NAMES: VmmNames = VmmNames {
        arena: "CudaArena",
        mem_granularity: "cuMemGetAllocationGranularity",
        mem_address_reserve: "cuMemAddressReserve",
        mem_address_free: "cuMemAddressFree",
        mem_get_info: "cuMemGetInfo_v2",
        stream_query: "cuStreamQuery",
        mem_create: "cuMemCreate",
        mem_map: "cuMemMap",
        mem_set_access: "cuMemSetAccess",
        mem_unmap: "cuMemUnmap",
        mem_release: "cuMemRelease",
        host_alloc: "cuMemHostAlloc",
        host_free: "cuMemFreeHost",
        stream_create: "cuStreamCreate",
        stream_sync: "cuStreamSynchronize",
        copy_dtoh_async: "cuMemcpyDtoHAsync_v2",
        copy_htod_async: "cuMemcpyHtoDAsync_v2",
    };

    unsafe fn mem_granularity(prop: &Self::Prop) -> (CUresult, usize) {
        let mut g: usize = 0;
        // SAFETY: valid out pointer and property struct; the caller has the
        // context current.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        };
        (r, g)
    }

    unsafe fn mem_address_reserve(bytes: usize, align: usize) -> (CUresult, u64) {
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer; no address asked for; flags 0; the
        // caller frees it once.
        let r = unsafe { sys::cuMemAddressReserve(&mut base, bytes, align, 0, 0) };
        (r, base)
    }

    unsafe fn mem_address_free(at: u64, bytes: usize) -> CUresult {
        // SAFETY: the caller's contract (nothing mapped, freed once).
        unsafe { sys::cuMemAddressFree(at, bytes) }
    }

    unsafe fn mem_get_info() -> (CUresult, usize, usize) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out pointers; the device is current (the caller's
        // contract).
        let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        (r, free, total)
    }

    unsafe fn stream_query(stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (a live stream).
        unsafe { sys::cuStreamQuery(stream) }
    }

    unsafe fn mem_create(bytes: usize, prop: &Self::Prop) -> (CUresult, Self::Handle) {
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out pointer and properties; the caller has the
        // context current.
        let r = unsafe { sys::cuMemCreate(&mut h, bytes, prop, 0) };
        (r, h)
    }

    unsafe fn mem_map(at: u64, bytes: usize, h: Self::Handle) -> CUresult {
        // SAFETY: the caller's contract (a free range of a reservation, a
        // handle of exactly `bytes`).
        unsafe { sys::cuMemMap(at, bytes, 0, h, 0) }
    }

    unsafe fn mem_set_access(at: u64, bytes: usize, prop: &Self::Prop) -> CUresult {
        let desc = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the caller's contract (exactly one mapping); one
        // descriptor, alive for the call.
        unsafe { sys::cuMemSetAccess(at, bytes, &desc, 1) }
    }

    unsafe fn mem_unmap(at: u64, bytes: usize) -> CUresult {
        // SAFETY: the caller's contract (one unused mapping).
        unsafe { sys::cuMemUnmap(at, bytes) }
    }

    unsafe fn mem_release(h: Self::Handle) -> CUresult {
        // SAFETY: the caller's contract (released once).
        unsafe { sys::cuMemRelease(h) }
    }

    unsafe fn host_alloc(bytes: usize) -> (CUresult, usize) {
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; the caller has the context current.
        let r = unsafe { sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_PORTABLE) };
        (r, host as usize)
    }

    unsafe fn host_free(host: usize) -> CUresult {
        // SAFETY: the caller's contract (from `host_alloc`, freed once).
        unsafe { sys::cuMemFreeHost(host as *mut c_void) }
    }

    unsafe fn stream_create() -> (CUresult, CUstream) {
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: valid out pointer; flag 1 is CU_STREAM_NON_BLOCKING; the
        // caller has the context current.
        let r = unsafe { sys::cuStreamCreate(&mut raw, 1) };
        (r, raw)
    }

    unsafe fn stream_sync(stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (a live stream).
        unsafe { sys::cuStreamSynchronize(stream) }
    }

    unsafe fn stream_destroy(stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (live, destroyed once).
        unsafe { sys::cuStreamDestroy_v2(stream) }
    }

    unsafe fn copy_dtoh_async(host: usize, at: u64, bytes: usize, stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (both ranges valid until the copy
        // completes; a live stream).
        unsafe { sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, at, bytes, stream) }
    }

    unsafe fn copy_htod_async(at: u64, host: usize, bytes: usize, stream: CUstream) -> CUresult {
        // SAFETY: as for `copy_dtoh_async`.
        unsafe { sys::cuMemcpyHtoDAsync_v2(at, host as *const c_void, bytes, stream) }
    }
}

/// Pinned host memory: `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE |
/// CU_MEMHOSTALLOC_DEVICEMAP`, reached by copies through
/// `cuMemHostGetDevicePointer_v2` (flags 0).
impl PinnedTable for Cuda {
    const HOST_ALLOC_MAPPED: &'static str = "cuMemHostAlloc";
    const HOST_DEVICE_POINTER: &'static str = "cuMemHostGetDevicePointer_v2";

    unsafe fn host_alloc_mapped(bytes: usize) -> (CUresult, usize) {
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: valid out pointer; the caller has the context current.
        let r = unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) };
        (r, host as usize)
    }

    unsafe fn host_device_pointer(host: usize) -> (CUresult, u64) {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated mapped in the current context (the
        // caller's contract); valid out pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ptr, host as *mut c_void, 0) };
        (r, ptr)
    }
}

// ---- streams and events --------------------------------------------------

/// CUDA's stream and event calls under the core's names.
impl StreamTable for Cuda {
    type Event = CUevent;

    const STREAM_NAMES: StreamNames = StreamNames {
        stream_destroy: "cuStreamDestroy_v2",
        event_create: "cuEventCreate",
        event_record: "cuEventRecord",
        stream_wait_event: "cuStreamWaitEvent",
        event_destroy: "cuEventDestroy_v2",
    };

    const STREAM_CALLS_NEED_CURRENT: bool = true;
    const CALLS_AFTER_STICKY: bool = true;
    /// How often a wait that must not block asks the driver again (the free
    /// thread watches retired streams at this interval too).
    const POLL_INTERVAL: Duration = Duration::from_millis(2);

    unsafe fn event_create() -> (CUresult, CUevent) {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: valid out pointer; the caller has the context current.
        let r = unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        };
        (r, event)
    }

    unsafe fn event_record(event: CUevent, stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (both live, of the current context).
        unsafe { sys::cuEventRecord(event, stream) }
    }

    unsafe fn stream_wait_event(stream: CUstream, event: CUevent) -> CUresult {
        // SAFETY: as above, the event recorded.
        unsafe { sys::cuStreamWaitEvent(stream, event, 0) }
    }

    unsafe fn event_destroy(event: CUevent) -> CUresult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { sys::cuEventDestroy_v2(event) }
    }
}

// ---- capture and graphs --------------------------------------------------

/// cudarc's `sys` functions under the core's names.
impl CaptureTable for Cuda {
    type Graph = CUgraph;
    type Exec = CUgraphExec;

    const CAPTURE_NAMES: CaptureNames = CaptureNames {
        begin_capture: "cuStreamBeginCapture_v2",
        capture_id: "cuStreamGetCaptureInfo_v2",
        end_capture: "cuStreamEndCapture",
        instantiate: "cuGraphInstantiateWithFlags",
        exec_destroy: "cuGraphExecDestroy",
        graph_destroy: "cuGraphDestroy",
        launch: "cuGraphLaunch",
        capture: "CudaCapture",
        graph: "CudaGraph",
        arena_setting: "CudaConfig::arena",
    };

    type DevicePtr = CUdeviceptr;
    const READS_GRAPH_NODES: bool = true;

    /// The sum of `bytesize` over the graph's
    /// `CU_GRAPH_NODE_TYPE_MEM_ALLOC` nodes.
    unsafe fn graph_memory<C: Context<Table = Self>>(
        s: &C,
        graph: CUgraph,
    ) -> Result<u64, BackendError> {
        const OP: &str = "graph_memory";
        let mut n: usize = 0;
        // SAFETY: a live graph, its context current (the caller's
        // contract); a null node array asks for the count only.
        let r = unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) };
        s.checked(OP, "cuGraphGetNodes", r)?;
        if n == 0 {
            return Ok(0);
        }
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` holds `n` entries, the count passed in.
        let r = unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) };
        s.checked(OP, "cuGraphGetNodes", r)?;
        let mut bytes = 0u64;
        for &node in &nodes[..n.min(nodes.len())] {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node the driver just listed; valid out pointer.
            let r = unsafe { sys::cuGraphNodeGetType(node, &mut kind) };
            s.checked(OP, "cuGraphNodeGetType", r)?;
            if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC {
                continue;
            }
            // SAFETY: all-zero is a valid value of this plain-data struct
            // (null pointers, zero sizes, the first enum variants).
            let mut params: sys::CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
            // SAFETY: an allocation node (its type checked above); valid out
            // pointer.
            let r = unsafe { sys::cuGraphMemAllocNodeGetParams(node, &mut params) };
            s.checked(OP, "cuGraphMemAllocNodeGetParams", r)?;
            bytes = bytes.saturating_add(params.bytesize as u64);
        }
        Ok(bytes)
    }

    unsafe fn begin_capture(stream: CUstream, mode: CaptureMode) -> CUresult {
        let mode = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: the caller's contract (a live stream, its context
        // current).
        unsafe { sys::cuStreamBeginCapture_v2(stream, mode) }
    }

    unsafe fn capture_id(stream: CUstream) -> (CUresult, u64) {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: u64 = 0;
        // SAFETY: valid out pointers; the optional ones are null; a live
        // stream (the caller's contract).
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v2(
                stream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        (r, id)
    }

    unsafe fn end_capture(stream: CUstream) -> (CUresult, Option<CUgraph>) {
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: valid out pointer; a live stream (the caller's contract).
        let r = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
        (r, (!graph.is_null()).then_some(graph))
    }

    unsafe fn still_capturing(stream: CUstream) -> bool {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of the current context; valid out pointer.
        let r = unsafe { sys::cuStreamIsCapturing(stream, &mut status) };
        r != CUresult::CUDA_SUCCESS
            || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }

    unsafe fn instantiate(graph: CUgraph) -> (CUresult, CUgraphExec) {
        let mut exec: CUgraphExec = std::ptr::null_mut();
        // SAFETY: a live graph (the caller's contract); valid out pointer.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        (r, exec)
    }

    unsafe fn exec_destroy(exec: CUgraphExec) -> CUresult {
        // SAFETY: the caller's contract (destroyed once, after its launches).
        unsafe { sys::cuGraphExecDestroy(exec) }
    }

    unsafe fn graph_destroy(graph: CUgraph) -> CUresult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { sys::cuGraphDestroy(graph) }
    }

    unsafe fn launch(exec: CUgraphExec, stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (both live, the context current).
        unsafe { sys::cuGraphLaunch(exec, stream) }
    }

    fn stream_key(stream: CUstream) -> usize {
        stream as usize
    }
}

// ---- retirement ----------------------------------------------------------

/// The host function: the ticket is its user data, a number never
/// dereferenced.
///
/// # Safety
///
/// Called by the driver with the user data given to `cuLaunchHostFunc`.
unsafe extern "C" fn host_fn(user: *mut c_void) {
    retire::callback_ran(user as usize as u64, true);
}

/// `cuLaunchHostFunc`, its function the trampoline above.
impl RetireTable for Cuda {
    const LAUNCH_CALLBACK: &'static str = "cuLaunchHostFunc";

    unsafe fn launch_callback(stream: sys::CUstream, ticket: u64) -> sys::CUresult {
        // SAFETY: the caller's contract (a live stream, the context
        // current); `host_fn` makes no CUDA call and reads its user data
        // as a number.
        unsafe { sys::cuLaunchHostFunc(stream, Some(host_fn), ticket as usize as *mut c_void) }
    }
}

// ---- teardown --------------------------------------------------------------

/// `cuMemFreeAsync`, for the pool memory a forced retire left live.
impl memgov_stream_ordered::teardown::TeardownTable for Cuda {
    const FREE_ASYNC: &'static str = "cuMemFreeAsync";

    unsafe fn free_async(ptr: u64, stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (a live pool allocation of the
        // current context, freed once; the stream live).
        unsafe { sys::cuMemFreeAsync(ptr, stream) }
    }
}

// ---- the context's own memory pool ---------------------------------------

use memgov_stream_ordered::pool::{PoolNames, PoolTable};

/// `cuMemPoolCreate` of pinned device memory, no shareable handle; the
/// release threshold is `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` (a
/// `cuuint64_t`); trimmed to 0 bytes.
impl PoolTable for Cuda {
    type Pool = sys::CUmemoryPool;

    const POOL_NAMES: PoolNames = PoolNames {
        create: "cuMemPoolCreate",
        set_attribute: "cuMemPoolSetAttribute",
        trim: "cuMemPoolTrimTo",
        destroy: "cuMemPoolDestroy",
    };

    unsafe fn pool_create(ordinal: i32) -> (CUresult, sys::CUmemoryPool) {
        // SAFETY: CUmemPoolProps is a plain C struct for which all-zero
        // bytes are valid (null pointer, zero sizes); the fields memgov
        // needs are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ordinal;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out pointer and properties; the caller's contract
        // (a device of the driver, its context current).
        let r = unsafe { sys::cuMemPoolCreate(&mut pool, &props) };
        (r, pool)
    }

    unsafe fn pool_set_release_threshold(pool: sys::CUmemoryPool, bytes: u64) -> CUresult {
        let mut value: u64 = bytes;
        // SAFETY: the attribute takes a cuuint64_t, alive for the call; the
        // caller's contract (a live pool).
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )
        }
    }

    unsafe fn pool_trim(pool: sys::CUmemoryPool) -> CUresult {
        // SAFETY: the caller's contract (a live pool).
        unsafe { sys::cuMemPoolTrimTo(pool, 0) }
    }

    unsafe fn pool_destroy(pool: sys::CUmemoryPool) -> CUresult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { sys::cuMemPoolDestroy(pool) }
    }
}

// ---- opening a device ----------------------------------------------------

use memgov_stream_ordered::open::{OpenNames, OpenTable, NAME_BYTES, PCI_BUS_ID_BYTES};
use std::ffi::{c_char, c_int};

/// `cuDeviceGetCount`, `cuDeviceGet`, the name, UUID, PCI bus id and total
/// memory of a `CUdevice`; called after `cuInit`.
impl OpenTable for Cuda {
    type Device = sys::CUdevice;

    const OPEN_NAMES: OpenNames = OpenNames {
        device_count: "cuDeviceGetCount",
        device_get: "cuDeviceGet",
        device_name: "cuDeviceGetName",
        device_total_mem: "cuDeviceTotalMem_v2",
    };

    const IDENTITY_LAST: bool = true;

    unsafe fn device_count() -> (CUresult, i32) {
        let mut count: c_int = 0;
        // SAFETY: valid out pointer; the driver is initialised (the
        // caller's contract).
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        (r, count)
    }

    unsafe fn device_get(ordinal: i32) -> (CUresult, sys::CUdevice) {
        let mut device: sys::CUdevice = 0;
        // SAFETY: valid out pointer; the ordinal is below the count.
        let r = unsafe { sys::cuDeviceGet(&mut device, ordinal) };
        (r, device)
    }

    unsafe fn device_name(buf: &mut [c_char; NAME_BYTES], device: sys::CUdevice) -> CUresult {
        // SAFETY: the buffer holds `len` bytes; the driver writes at most
        // `len`, NUL included; `device` came from cuDeviceGet.
        unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device) }
    }

    unsafe fn device_uuid(device: sys::CUdevice) -> (CUresult, [u8; 16]) {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: valid out pointer to a CUuuid; `device` came from
        // cuDeviceGet.
        let r = unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, device) };
        (r, uuid.bytes.map(|b| b as u8))
    }

    unsafe fn device_pci_bus_id(
        buf: &mut [c_char; PCI_BUS_ID_BYTES],
        device: sys::CUdevice,
    ) -> CUresult {
        // SAFETY: the buffer holds `len` bytes; the driver writes at most
        // `len`, NUL included; `device` came from cuDeviceGet.
        unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, device) }
    }

    unsafe fn device_total_mem(device: sys::CUdevice) -> (CUresult, usize) {
        let mut total: usize = 0;
        // SAFETY: valid out pointer; `device` came from cuDeviceGet.
        let r = unsafe { sys::cuDeviceTotalMem_v2(&mut total, device) };
        (r, total)
    }
}
