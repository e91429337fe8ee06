//! Graph capture on the CUDA backend's arena: the cases CUDA shares with
//! HIP (`backends/cases/capture.rs`, the capability cases among them,
//! instantiated here through the `vendor` module), and CUDA's own: graph
//! capture on a governed context (`capture/governed.rs`), and the stand-in driver's
//! stream capture rules called raw (`cudarc`'s `sys`), each with a planted
//! violation.
//!
//! Every case runs in a child process (this binary re-executed with
//! `MEMGOV_CAPTURE_CHILD` set): the stand-in reads its knobs once per
//! process and aborts the process on a violation. Without the stand-in
//! every test prints `skipped: ...` and passes.
//!
//! `MEMGOV_CAPTURE_REPLAYS` sets how many times the captured graph is
//! launched under churn (default 1000).

#[path = "../../cases/capture.rs"]
mod cases;
mod common;
#[path = "capture/governed.rs"]
mod governed;

use common::{passes, EXIT_CHECK, LATENCY, SEED};

const CHILD: &str = "MEMGOV_CAPTURE_CHILD";

/// What the shared cases (`backends/cases/capture.rs`) need of CUDA.
mod vendor {
    pub use crate::common::{
        aborts, entry_paused, fail_entry, fault_cells, passes, pause_entry, resume_entry,
        EXIT_CHECK, LATENCY, SEED,
    };
    pub use memgov::cuda::{
        capture_gate, ArenaConfig, CaptureConfig, CaptureMode, CudaArena as Arena,
        CudaConfig as Config, CudaContext as Context, CudaMemory as Memory, CudaStream as Stream,
        PoolExhausted,
    };

    crate::cases::capture_vendor! {
        backend: "cuda",
        make_current: "cuCtxPushCurrent_v2",
        htod: c"cuMemcpyHtoDAsync_v2",
        graph_launch: c"cuGraphLaunch",
        begin_capture: "cuStreamBeginCapture_v2",
        end_capture: "cuStreamEndCapture",
        destroy_capturing_abort: "in a capture sequence",
        launch_freed_abort: "cuGraphLaunch of 4096 bytes at already freed device pointer",
        churn_seeds: ["1", "2", "3"],
    }

    /// The stand-in's capture counters.
    pub use crate::common::capture_stats as stats;

    /// The raw driver calls the stand-in capture cases make.
    pub mod raw {
        use super::Context;
        use cudarc::driver::sys::{self, CUresult};
        use std::ffi::c_void;

        pub type Code = CUresult;
        pub type Status = sys::CUstreamCaptureStatus;
        pub type RawStream = sys::CUstream;

        pub(crate) use crate::cases::G;
        /// The capture modes, results and statuses, under neutral names.
        pub use sys::CUstreamCaptureMode::{
            CU_STREAM_CAPTURE_MODE_GLOBAL as GLOBAL, CU_STREAM_CAPTURE_MODE_RELAXED as RELAXED,
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL as LOCAL,
        };
        pub use sys::CUstreamCaptureStatus::{
            CU_STREAM_CAPTURE_STATUS_ACTIVE as ACTIVE,
            CU_STREAM_CAPTURE_STATUS_INVALIDATED as STATUS_INVALIDATED,
            CU_STREAM_CAPTURE_STATUS_NONE as NONE,
        };
        pub use CUresult::{
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED as INVALIDATED,
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as UNSUPPORTED,
            CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD as WRONG_THREAD,
        };

        pub fn ok(r: Code, what: &str) {
            assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
        }

        pub struct Raw {
            ctx: Context,
            pub s: RawStream,
        }

        /// A context current on this thread and a raw stream.
        pub fn raw() -> Raw {
            let ctx = Context::new(Default::default()).expect("context");
            let mut s = std::ptr::null_mut();
            // SAFETY: raw calls on the stand-in with valid out pointers.
            unsafe {
                ok(sys::cuCtxSetCurrent(ctx.cu_context()), "current");
                ok(sys::cuStreamCreate(&mut s, 1), "stream");
            }
            Raw { ctx, s }
        }

        pub fn alloc(r: &Raw, bytes: usize) -> u64 {
            let mut p = 0;
            // SAFETY: valid out pointer, live stream.
            ok(unsafe { sys::cuMemAllocAsync(&mut p, bytes, r.s) }, "alloc");
            p
        }

        pub fn begin(s: RawStream, mode: sys::CUstreamCaptureMode) {
            // SAFETY: a live stream.
            ok(unsafe { sys::cuStreamBeginCapture_v2(s, mode) }, "begin");
        }

        pub fn end(s: RawStream) -> (Code, sys::CUgraph) {
            let mut g = std::ptr::null_mut();
            // SAFETY: a live stream, valid out pointer.
            let r = unsafe { sys::cuStreamEndCapture(s, &mut g) };
            (r, g)
        }

        /// The stream's capture status (`cuStreamIsCapturing`) and, while
        /// it captures, the capture's id (`cuStreamGetCaptureInfo_v2`,
        /// which must report the same status).
        pub fn capture_info(s: RawStream) -> (Status, u64) {
            let mut st = NONE;
            // SAFETY: a live stream, valid out pointer.
            ok(
                unsafe { sys::cuStreamIsCapturing(s, &mut st) },
                "is capturing",
            );
            if st != ACTIVE {
                return (st, 0);
            }
            let (mut info, mut id) = (NONE, 0);
            // SAFETY: a live stream, valid out pointers, the optional ones
            // null.
            ok(
                unsafe {
                    sys::cuStreamGetCaptureInfo_v2(
                        s,
                        &mut info,
                        &mut id,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                },
                "info",
            );
            assert_eq!(info, st, "both calls report the same status");
            (st, id)
        }

        pub fn instantiate(g: sys::CUgraph) -> sys::CUgraphExec {
            let mut e = std::ptr::null_mut();
            // SAFETY: a graph from cuStreamEndCapture, valid out pointer.
            ok(
                unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g, 0) },
                "instantiate",
            );
            e
        }

        /// A physical allocation of a granule on device 0.
        pub fn create_handle() -> (Code, sys::CUmemGenericAllocationHandle) {
            // SAFETY: plain C struct, all-zero valid.
            let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
            p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            let mut h = 0;
            // SAFETY: valid out pointer and properties.
            let r = unsafe { sys::cuMemCreate(&mut h, G, &p, 0) };
            (r, h)
        }

        /// What another thread runs before its raw calls on `r`: `r`'s
        /// context made current there.
        pub fn enter(r: &Raw) -> impl FnOnce() + Send + 'static {
            // The handle as an address, which a closure may carry.
            let c = r.ctx.cu_context() as usize;
            move || {
                // SAFETY: `r`'s context, alive while the thread runs.
                ok(
                    unsafe { sys::cuCtxSetCurrent(c as sys::CUcontext) },
                    "current",
                );
            }
        }

        include!("../../cases/forward.rs");

        forward! {
            htod(d: u64, src: &[u8], s: RawStream) =>
                sys::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), src.len(), s);
            dtoh(dst: &mut [u8], d: u64, s: RawStream) =>
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), d, dst.len(), s);
            graph_destroy(g: sys::CUgraph) => sys::cuGraphDestroy(g);
            exec_destroy(x: sys::CUgraphExec) => sys::cuGraphExecDestroy(x);
            launch(x: sys::CUgraphExec, s: RawStream) => sys::cuGraphLaunch(x, s);
            sync(s: RawStream) => sys::cuStreamSynchronize(s);
            query(s: RawStream) => sys::cuStreamQuery(s);
            free_async(d: u64, s: RawStream) => sys::cuMemFreeAsync(d, s);
            stream_destroy(s: RawStream) => sys::cuStreamDestroy_v2(s);
            host_alloc(p: &mut *mut c_void, bytes: usize) => sys::cuMemHostAlloc(p, bytes, 0);
            host_free(p: *mut c_void) => sys::cuMemFreeHost(p);
            mem_release(h: sys::CUmemGenericAllocationHandle) => sys::cuMemRelease(h);
            map(base: u64, size: usize, h: sys::CUmemGenericAllocationHandle) =>
                sys::cuMemMap(base, size, 0, h, 0);
            unmap(base: u64, size: usize) => sys::cuMemUnmap(base, size);
        }

        /// An address range of `size` bytes reserved.
        pub fn reserve(size: usize) -> u64 {
            let mut base = 0;
            // SAFETY: valid out pointer.
            ok(
                unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) },
                "reserve",
            );
            base
        }

        /// Read-write access to `size` bytes at `base` for device 0.
        ///
        /// # Safety
        ///
        /// The driver's: a mapped range.
        pub unsafe fn set_access(base: u64, size: usize) -> Code {
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: 0,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the caller's; one valid descriptor.
            unsafe { sys::cuMemSetAccess(base, size, &desc, 1) }
        }
    }
}

#[test]
fn a_governed_capture_charges_its_pool_from_before_begin_until_destroy() {
    passes("governed_pool_charged", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_governed_capture_pool_over_budget_is_refused_before_any_driver_call() {
    passes("governed_pool_over_budget", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_governed_capture_replays_while_another_thread_allocates_releases_and_trims_through_the_governor(
) {
    for seed in ["1", "2", "3"] {
        passes(
            "governed_churn",
            &[(LATENCY, "200"), (SEED, seed), (EXIT_CHECK, "1")],
        );
    }
}

#[test]
fn a_live_governed_graph_holds_teardown_until_destroyed() {
    passes("governed_teardown_waits", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_governed_capture_with_allocations_makes_no_graph_memory_node_and_no_driver_allocation() {
    passes("governed_no_graph_memory", &[(EXIT_CHECK, "1")]);
}

#[test]
fn graph_memory_a_runtime_captures_is_charged_while_the_graph_lives() {
    passes("governed_graph_memory", &[(EXIT_CHECK, "1")]);
}

common::child_process::child_entry!(CHILD, cases::run, own::run);

/// CUDA's own cases: the governed capture.
mod own {
    pub(super) fn run(case: &str) {
        match case {
            "governed_pool_charged" => crate::governed::pool_charged(),
            "governed_pool_over_budget" => crate::governed::pool_over_budget(),
            "governed_teardown_waits" => crate::governed::teardown_waits_for_live_graph(),
            "governed_no_graph_memory" => crate::governed::no_graph_memory_nodes(),
            "governed_graph_memory" => crate::governed::graph_memory_charged(),
            "governed_churn" => crate::governed::governed_churn(),
            other => panic!("unknown case {other}"),
        }
    }
}
