//! Graph capture on the CUDA backend's arena: the cases CUDA shares with
//! HIP (`backends/cases/capture.rs`, instantiated here through the
//! `vendor` module), and CUDA's own: the capability cases, graph capture on
//! a governed context (`capture/governed.rs`), and the stand-in driver's
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

use common::{EXIT_CHECK, LATENCY, SEED};

const CHILD: &str = "MEMGOV_CAPTURE_CHILD";

/// What the shared cases (`backends/cases/capture.rs`) need of CUDA.
mod vendor {
    pub use crate::common::{
        entry_paused, fail_entry, pause_entry, resume_entry, EXIT_CHECK, LATENCY, SEED,
    };
    pub use memgov::cuda::{
        capture_gate, ArenaConfig, CaptureConfig, CaptureMode, CudaArena as Arena,
        CudaConfig as Config, CudaContext as Context, CudaMemory as Memory, CudaStream as Stream,
        PoolExhausted,
    };

    /// The backend name a typed refusal carries.
    pub const BACKEND: &str = "cuda";
    /// The call that makes the context current before a capture ends.
    pub const MAKE_CURRENT_ENTRY: &str = "cuCtxPushCurrent_v2";
    /// The enqueue of a write and of a graph launch.
    pub const HTOD_ENTRY: &std::ffi::CStr = c"cuMemcpyHtoDAsync_v2";
    pub const GRAPH_LAUNCH_ENTRY: &std::ffi::CStr = c"cuGraphLaunch";
    /// The entry points whose fault cells the capture runs.
    pub const BEGIN_CAPTURE_ENTRY: &str = "cuStreamBeginCapture_v2";
    pub const END_CAPTURE_ENTRY: &str = "cuStreamEndCapture";
    /// The stand-in's abort messages for the planted violations.
    pub const DESTROY_CAPTURING_ABORT: &str = "in a capture sequence";
    pub const LAUNCH_FREED_ABORT: &str =
        "cuGraphLaunch of 4096 bytes at already freed device pointer";
    /// The latency seeds the replay under churn runs with.
    pub const CHURN_SEEDS: &[&str] = &["1", "2", "3"];

    pub fn passes(case: &str, env: &[(&str, &str)]) {
        crate::common::passes(crate::CHILD, case, env);
    }

    pub fn aborts(case: &str, env: &[(&str, &str)], what: &str) {
        crate::common::aborts(crate::CHILD, case, env, what);
    }

    pub fn fault_cells(entries: &[(&str, u32)]) {
        crate::common::fault_cells(crate::CHILD, entries);
    }

    /// The stand-in's capture counters.
    pub use crate::common::capture_stats as stats;
}

fn passes(case: &str, env: &[(&str, &str)]) {
    vendor::passes(case, env);
}

#[test]
fn capability_capture_cases_pass_on_the_cuda_backend() {
    passes("capability_capture", &[(EXIT_CHECK, "1")]);
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

/// Entry point of the re-executed binary; does nothing in a normal run.
#[test]
#[ignore = "runs only as the child process of another test"]
fn child_entry() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    if !cases::run(&case) {
        own::run(&case);
    }
    println!("child {case}: ok");
}

/// CUDA's own cases: the capability cases, the governed capture, and the
/// stand-in driver's capture rules called raw.
mod own {
    use crate::common;
    use crate::vendor::stats;
    use cudarc::driver::sys::{self, CUresult};
    use memgov::cuda::{CudaConfig, CudaContext};

    const G: usize = 2 << 20;

    // ---- raw driver calls for the stand-in's rules ----------------------

    fn ok(r: CUresult, what: &str) {
        assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
    }

    struct Raw {
        _ctx: CudaContext,
        s: sys::CUstream,
    }

    /// A context current on this thread and a raw stream.
    fn raw() -> Raw {
        let ctx = CudaContext::new(CudaConfig::default()).expect("context");
        let mut s = std::ptr::null_mut();
        // SAFETY: raw calls on the stand-in with valid out pointers.
        unsafe {
            ok(sys::cuCtxSetCurrent(ctx.cu_context()), "current");
            ok(sys::cuStreamCreate(&mut s, 1), "stream");
        }
        Raw { _ctx: ctx, s }
    }

    fn alloc(r: &Raw, bytes: usize) -> u64 {
        let mut p = 0;
        // SAFETY: valid out pointer, live stream.
        ok(unsafe { sys::cuMemAllocAsync(&mut p, bytes, r.s) }, "alloc");
        p
    }

    fn begin(s: sys::CUstream, mode: sys::CUstreamCaptureMode) {
        // SAFETY: a live stream.
        ok(unsafe { sys::cuStreamBeginCapture_v2(s, mode) }, "begin");
    }

    fn end(s: sys::CUstream) -> (CUresult, sys::CUgraph) {
        let mut g = std::ptr::null_mut();
        // SAFETY: a live stream, valid out pointer.
        let r = unsafe { sys::cuStreamEndCapture(s, &mut g) };
        (r, g)
    }

    fn status(s: sys::CUstream) -> sys::CUstreamCaptureStatus {
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream, valid out pointer.
        ok(
            unsafe { sys::cuStreamIsCapturing(s, &mut st) },
            "is capturing",
        );
        st
    }

    fn instantiate(g: sys::CUgraph) -> sys::CUgraphExec {
        let mut e = std::ptr::null_mut();
        // SAFETY: a graph from cuStreamEndCapture, valid out pointer.
        ok(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g, 0) },
            "instantiate",
        );
        e
    }

    fn create_handle() -> (CUresult, sys::CUmemGenericAllocationHandle) {
        // SAFETY: plain C struct, all-zero valid.
        let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let mut h = 0;
        // SAFETY: valid out pointer and properties.
        let r = unsafe { sys::cuMemCreate(&mut h, G, &p, 0) };
        (r, h)
    }

    const GLOBAL: sys::CUstreamCaptureMode =
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    const LOCAL: sys::CUstreamCaptureMode =
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    const RELAXED: sys::CUstreamCaptureMode =
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    const UNSUPPORTED: CUresult = CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;

    /// A raw pointer the closure of another thread may carry.
    #[derive(Clone, Copy)]
    struct Send<T>(T);
    // SAFETY: driver handles, used on the other thread only with the
    // context made current there.
    unsafe impl<T> std::marker::Send for Send<T> {}

    fn on_other_thread<R: std::marker::Send + 'static>(
        r: &Raw,
        f: impl FnOnce(sys::CUstream) -> R + std::marker::Send + 'static,
    ) -> R {
        let c = Send(r._ctx.cu_context());
        let s = Send(r.s);
        std::thread::spawn(move || {
            let (c, s) = (c, s);
            // SAFETY: a live context.
            ok(unsafe { sys::cuCtxSetCurrent(c.0) }, "current");
            f(s.0)
        })
        .join()
        .expect("thread")
    }

    pub(super) fn run(case: &str) {
        // SAFETY: raw driver calls on the stand-in, each valid or the
        // violation the case plants on purpose; the stand-in aborts before
        // anything undefined happens.
        unsafe {
            match case {
                "capability_capture" => memgov_conformance::capability::report_cases(
                    memgov_conformance::capability::run_capture_cases(
                        common::capability_factory,
                        || stats()[2],
                    ),
                ),
                "fault_cells" => common::fault_cells_child(),
                "governed_pool_charged" => crate::governed::pool_charged(),
                "governed_pool_over_budget" => crate::governed::pool_over_budget(),
                "governed_teardown_waits" => crate::governed::teardown_waits_for_live_graph(),
                "governed_no_graph_memory" => crate::governed::no_graph_memory_nodes(),
                "governed_graph_memory" => crate::governed::graph_memory_charged(),
                "governed_churn" => crate::governed::governed_churn(),
                "standin_records" => {
                    let r = raw();
                    let d = alloc(&r, 4096);
                    let mut src = vec![1u8; 4096];
                    let mut dst = vec![0u8; 4096];
                    begin(r.s, GLOBAL);
                    assert_eq!(
                        status(r.s),
                        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
                    );
                    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                    let mut id = 0;
                    ok(
                        sys::cuStreamGetCaptureInfo_v2(
                            r.s,
                            &mut st,
                            &mut id,
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                        ),
                        "info",
                    );
                    assert_ne!(id, 0, "a capture id");
                    ok(
                        sys::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), 4096, r.s),
                        "h2d",
                    );
                    ok(
                        sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), d, 4096, r.s),
                        "d2h",
                    );
                    // Recorded, not executed.
                    assert_eq!(dst, vec![0u8; 4096]);
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    assert_eq!(
                        status(r.s),
                        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                    );
                    let x = instantiate(g);
                    ok(sys::cuGraphDestroy(g), "graph destroy");
                    for v in [5u8, 6, 7] {
                        src.fill(v);
                        ok(sys::cuGraphLaunch(x, r.s), "launch");
                        ok(sys::cuStreamSynchronize(r.s), "sync");
                        assert_eq!(dst, vec![v; 4096], "launch replays the copies");
                    }
                    ok(sys::cuGraphExecDestroy(x), "exec destroy");
                    ok(sys::cuMemFreeAsync(d, r.s), "free");
                    ok(sys::cuStreamSynchronize(r.s), "sync");
                }
                "standin_sync_invalidates" => {
                    let r = raw();
                    for conflicting in [0, 1] {
                        begin(r.s, RELAXED);
                        let got = if conflicting == 0 {
                            sys::cuStreamSynchronize(r.s)
                        } else {
                            sys::cuStreamQuery(r.s)
                        };
                        assert_eq!(got, UNSUPPORTED);
                        assert_eq!(
                            status(r.s),
                            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED
                        );
                        let (e, g) = end(r.s);
                        assert_eq!(e, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                        assert!(g.is_null());
                        assert_eq!(
                            status(r.s),
                            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                        );
                    }
                    assert_eq!(stats()[1], 2);
                }
                "standin_modes" => {
                    let r = raw();
                    // GLOBAL: another thread's cuMemCreate is prohibited and
                    // invalidates the capture.
                    begin(r.s, GLOBAL);
                    let (c, _) = on_other_thread(&r, |_| Send(create_handle()).0);
                    assert_eq!(c, UNSUPPORTED, "GLOBAL, other thread");
                    let (e, _) = end(r.s);
                    assert_eq!(e, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                    // THREAD_LOCAL: another thread's is allowed, this
                    // thread's is not.
                    begin(r.s, LOCAL);
                    let (c, h) = on_other_thread(&r, |_| Send(create_handle()).0);
                    ok(c, "THREAD_LOCAL, other thread");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    ok(sys::cuGraphDestroy(g), "graph destroy");
                    ok(sys::cuMemRelease(h), "release");
                    begin(r.s, LOCAL);
                    assert_eq!(create_handle().0, UNSUPPORTED, "THREAD_LOCAL, own thread");
                    assert_eq!(end(r.s).0, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                    // RELAXED: allowed on the capturing thread, and the
                    // capture may end on another thread.
                    begin(r.s, RELAXED);
                    let (c, h) = create_handle();
                    ok(c, "RELAXED, own thread");
                    let g = on_other_thread(&r, |s| {
                        let (e, g) = end(s);
                        ok(e, "RELAXED ends on another thread");
                        Send(g)
                    });
                    ok(sys::cuGraphDestroy(g.0), "graph destroy");
                    ok(sys::cuMemRelease(h), "release");
                    // GLOBAL ends only on its own thread.
                    begin(r.s, GLOBAL);
                    let e = on_other_thread(&r, |s| end(s).0);
                    assert_eq!(e, CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
                    let (e, g) = end(r.s);
                    ok(e, "end on the capturing thread");
                    ok(sys::cuGraphDestroy(g), "graph destroy");
                    // Driver allocations made while a capture was under way:
                    // the prohibited and the allowed ones.
                    assert_eq!(stats()[2], 4);
                }
                "standin_page_locked" => {
                    // CUDA's documentation of CU_STREAM_CAPTURE_MODE_GLOBAL:
                    // potentially unsafe API calls (page-locked allocation
                    // and free among them) are prohibited on every thread
                    // while a global capture is under way; the call fails
                    // and the capture is invalidated.
                    let r = raw();
                    let before = stats();
                    let mut kept: *mut std::ffi::c_void = std::ptr::null_mut();
                    ok(sys::cuMemHostAlloc(&mut kept, 4096, 0), "host alloc");
                    let kept = Send(kept);
                    begin(r.s, GLOBAL);
                    let c = on_other_thread(&r, |_| {
                        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
                        sys::cuMemHostAlloc(&mut p, 4096, 0)
                    });
                    assert_eq!(c, UNSUPPORTED, "cuMemHostAlloc, GLOBAL, other thread");
                    let (e, g) = end(r.s);
                    assert_eq!(e, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                    assert!(g.is_null());
                    begin(r.s, GLOBAL);
                    let c = on_other_thread(&r, move |_| {
                        let kept = kept;
                        sys::cuMemFreeHost(kept.0)
                    });
                    assert_eq!(c, UNSUPPORTED, "cuMemFreeHost, GLOBAL, other thread");
                    let (e, _) = end(r.s);
                    assert_eq!(e, CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                    // THREAD_LOCAL: another thread's are allowed.
                    begin(r.s, LOCAL);
                    let c = on_other_thread(&r, move |_| {
                        let kept = kept;
                        sys::cuMemFreeHost(kept.0)
                    });
                    ok(c, "cuMemFreeHost, THREAD_LOCAL, other thread");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    ok(sys::cuGraphDestroy(g), "graph destroy");
                    assert_eq!(stats()[1] - before[1], 2, "two captures invalidated");
                }
                "standin_destroy_capturing" => {
                    let r = raw();
                    begin(r.s, GLOBAL);
                    // Planted: destroyed before cuStreamEndCapture.
                    let _ = sys::cuStreamDestroy_v2(r.s);
                }
                "standin_launch_freed" => {
                    let r = raw();
                    let d = alloc(&r, 4096);
                    let src = vec![1u8; 4096];
                    begin(r.s, GLOBAL);
                    ok(
                        sys::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), 4096, r.s),
                        "h2d",
                    );
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let x = instantiate(g);
                    ok(sys::cuMemFreeAsync(d, r.s), "free");
                    ok(sys::cuStreamSynchronize(r.s), "sync");
                    // Planted: the graph's copy targets freed memory.
                    let _ = sys::cuGraphLaunch(x, r.s);
                }
                "standin_launch_unmapped" => {
                    let r = raw();
                    let mut base = 0;
                    ok(sys::cuMemAddressReserve(&mut base, G, 0, 0, 0), "reserve");
                    let (c, h) = create_handle();
                    ok(c, "create");
                    ok(sys::cuMemMap(base, G, 0, h, 0), "map");
                    let desc = sys::CUmemAccessDesc {
                        location: sys::CUmemLocation {
                            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                            id: 0,
                        },
                        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    };
                    ok(sys::cuMemSetAccess(base, G, &desc, 1), "access");
                    let src = vec![1u8; 4096];
                    begin(r.s, GLOBAL);
                    ok(
                        sys::cuMemcpyHtoDAsync_v2(base, src.as_ptr().cast(), 4096, r.s),
                        "h2d",
                    );
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let x = instantiate(g);
                    ok(sys::cuMemUnmap(base, G), "unmap");
                    ok(sys::cuMemRelease(h), "release");
                    // Planted: the graph's copy targets unmapped memory.
                    let _ = sys::cuGraphLaunch(x, r.s);
                }
                other => panic!("unknown case {other}"),
            }
        }
    }
}
