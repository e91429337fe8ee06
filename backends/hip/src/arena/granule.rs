//! HIP's half of the arena's vendor table: the virtual-memory, page-locked
//! host memory and stream calls of the loaded runtime (`ffi::Api`) under
//! the core's neutral names ([`VmmTable`]), and the context they run in
//! ([`Context`]). The steps themselves (create, map, set access, each
//! undone on failure; unmap, release; the sleep's copies) are the core's
//! ([`memgov_stream_ordered::arena`]).

use crate::ffi::{self, hipMemGenericAllocationHandle_t, hipStream_t, HipResult};
use crate::result::Hip;
use crate::shared::Shared;
use memgov_backend::vmm::Gate;
use memgov_backend::BackendError;
use memgov_stream_ordered::state::State;
use memgov_stream_ordered::stream::StreamContext as _;
use memgov_stream_ordered::table::{Context, Raw, VmmNames, VmmTable};
use std::ffi::c_void;

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

/// The arena's calls run with the context's device set on the calling
/// thread (the shell's [`MakeCurrent`](memgov_backend::shell::MakeCurrent)
/// for HIP: the thread's own device set back after).
impl Context for Shared {
    type Table = Hip;
    type Stream = crate::HipStream;
    type Arena = super::Arena;

    fn on_sticky(&self) {
        self.outstanding.wake();
    }

    fn capture_gate(&self) -> &'static Gate {
        crate::shared::gate()
    }

    fn granule_prop(arena: &super::Arena) -> ffi::AllocationProp {
        ffi::allocation_prop(arena.ordinal, arena.vendor)
    }

    fn raw_stream(
        &self,
        op: &'static str,
        stream: &crate::HipStream,
    ) -> Result<<Hip as VmmTable>::Stream, BackendError> {
        self.check_stream(op, stream).map(|()| stream.raw())
    }

    fn state(&self) -> &State<Hip, hipStream_t> {
        &self.state
    }

    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        memgov_stream_ordered::stream::quiesce(self, op, None)
    }

    /// HIP has no per-context synchronize: every stream of the context is.
    fn wait_launches(&self, op: &'static str) -> Result<(), BackendError> {
        memgov_stream_ordered::stream::quiesce(self, op, None)
    }
}
