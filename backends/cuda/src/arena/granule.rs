//! CUDA's half of the arena's vendor table: the virtual-memory, page-locked
//! host memory and stream calls under the core's neutral names
//! ([`VmmTable`]), and the context they run in ([`Context`]). The
//! steps themselves (create, map, set access, each undone on failure;
//! unmap, release; the sleep's copies) are the core's
//! ([`memgov_stream_ordered::arena`]).

use crate::result::Cuda;
use crate::shared::Shared;
use cudarc::driver::sys::{self, CUmemGenericAllocationHandle, CUresult, CUstream};
use memgov_backend::vmm::Gate;
use memgov_backend::BackendError;
use memgov_stream_ordered::state::State;
use memgov_stream_ordered::stream::StreamContext as _;
use memgov_stream_ordered::table::{Context, VmmNames, VmmTable};
use std::ffi::c_void;

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

/// The arena's calls run with the context's primary context pushed (the
/// shell's [`MakeCurrent`](memgov_backend::shell::MakeCurrent) for CUDA).
impl Context for Shared {
    type Table = Cuda;
    type Stream = crate::CudaStream;
    type Arena = super::Arena;

    fn on_sticky(&self) {
        self.abandon_pending();
    }

    fn capture_gate(&self) -> &'static Gate {
        crate::shared::gate()
    }

    fn granule_prop(arena: &super::Arena) -> sys::CUmemAllocationProp {
        prop(arena.ordinal)
    }

    fn raw_stream(
        &self,
        op: &'static str,
        stream: &crate::CudaStream,
    ) -> Result<<Cuda as VmmTable>::Stream, BackendError> {
        self.check_stream(op, stream).map(|()| stream.raw())
    }

    fn state(&self) -> &State<Cuda, CUstream> {
        &self.state
    }

    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        memgov_stream_ordered::stream::quiesce(self, op, None)
    }

    fn wait_launches(&self, op: &'static str) -> Result<(), BackendError> {
        Shared::wait_launches(self, op)
    }
}

impl Shared {
    /// `cuCtxSynchronize`: every launch of the context finished (the
    /// context current, the call admitted by the capture gate).
    pub(crate) fn wait_launches(&self, op: &'static str) -> Result<(), BackendError> {
        // SAFETY: the context is current (the caller's guard).
        let r = unsafe { sys::cuCtxSynchronize() };
        self.checked(op, "cuCtxSynchronize", r)
    }
}
