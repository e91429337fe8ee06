//! Capture on a governed context (`memgov::cuda_capture`): the pool charged
//! to the budget before the capture begins and until the graph is
//! destroyed, a pool over budget refused with nothing begun, teardown held
//! by a live graph. Run as children of `capture.rs`'s tests.

use crate::cases::{
    arena_context, governed_capture, governed_capture_refused, pattern, retire_clean, MIB,
};
use crate::vendor::stats;
use memgov::cuda::{CaptureConfig, CaptureMode, CudaContext};
use memgov::cuda_capture::{CaptureExt, POOL_LABEL};
use memgov::{Alloc, BudgetScope, ContextConfig, ContextHandle, Governor, GovernorError, Role};
use std::time::{Duration, Instant};

fn governed(budget: u64) -> (Governor<CudaContext>, ContextHandle<CudaContext>) {
    let gov = Governor::new();
    let ctx = gov.register(
        arena_context(256 * MIB),
        ContextConfig::new().label("captured").budget(budget),
    );
    (gov, ctx)
}

fn config(pool_bytes: u64) -> CaptureConfig {
    CaptureConfig {
        pool_bytes,
        mode: CaptureMode::Global,
    }
}

/// The pool is charged before the capture begins (seen from inside the
/// recording), stays charged while the graph lives, and comes back when it
/// is destroyed; allocations beside it are charged on top.
pub fn pool_charged() {
    let (_gov, ctx) = governed(64 * MIB);
    let s = ctx.create_stream("s").expect("stream");
    let (mut graph, out) = governed_capture(&ctx, &s, 4 * MIB);
    assert_eq!(
        graph.graph_memory_bytes(),
        0,
        "memgov's capture makes no graph memory"
    );
    let other = ctx
        .allocate(&s, Alloc::new(8 * MIB, Role::Activation))
        .expect("beside the pool");
    assert_eq!(ctx.snapshot().charged, 12 * MIB);
    for _ in 0..5 {
        graph.launch(&s).expect("launch");
    }
    assert_eq!(
        graph.read_output(out).expect("read"),
        pattern(5, MIB as usize)
    );
    // Over what the pool left of the budget: refused by the governor.
    let e = ctx
        .allocate(&s, Alloc::new(60 * MIB, Role::Activation))
        .expect_err("the pool counts against the budget");
    assert!(e.budget().is_some(), "{e}");
    graph.destroy().expect("destroy");
    assert!(graph.is_destroyed());
    graph.destroy().expect("a second destroy does nothing");
    assert_eq!(
        ctx.snapshot().charged,
        8 * MIB,
        "the pool's charge came back"
    );
    assert!(
        graph.launch(&s).is_err(),
        "a destroyed graph does not launch"
    );
    drop((other, graph, s));
    retire_clean(&ctx);
    println!("governed capture: 4 MiB pool charged from before begin to destroy");
}

/// A pool that does not fit the budget is the governor's BudgetExceeded,
/// and no driver capture call was made (nothing begun, no arena memory).
pub fn pool_over_budget() {
    let (_gov, ctx) = governed(8 * MIB);
    let s = ctx.create_stream("s").expect("stream");
    let _held = ctx
        .allocate(&s, Alloc::new(6 * MIB, Role::Weights))
        .expect("weights");
    let e = governed_capture_refused(&ctx, &s, 4 * MIB);
    let GovernorError::BudgetExceeded(b) = &e else {
        panic!("expected BudgetExceeded, got {e}");
    };
    assert_eq!(
        (b.scope.clone(), b.requested),
        (BudgetScope::Context, 4 * MIB),
        "{e}"
    );
    let arena = ctx
        .with_backend(|c| c.arena().expect("arena"))
        .expect("backend");
    assert_eq!(
        arena.snapshot().in_use,
        6 * MIB,
        "no pool taken from the arena"
    );
    assert_eq!(
        ctx.snapshot().charged,
        6 * MIB,
        "nothing charged for the pool"
    );
    drop((_held, s));
    retire_clean(&ctx);
}

/// A live governed graph holds the context: retire waits for it and lists
/// its pool; once it is destroyed the teardown is clean.
pub fn teardown_waits_for_live_graph() {
    let (_gov, ctx) = governed(64 * MIB);
    let s = ctx.create_stream("s").expect("stream");
    let (mut graph, ()) = ctx
        .capture(&s, config(MIB), |cap| {
            let a = cap.allocate(4096)?;
            cap.upload(&a, 0, pattern(6, 4096))
        })
        .expect("capture");
    graph.launch(&s).expect("launch");
    drop(s);
    let retire = ctx.retire();
    let e = retire
        .wait(Instant::now() + Duration::from_millis(50))
        .expect_err("the live graph holds the context");
    let text = e.to_string();
    assert!(text.contains("1 other pin"), "{text}");
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.reservations.len(), snap.charged),
        (1, MIB),
        "the pool is listed and charged while teardown waits"
    );
    assert_eq!(snap.reservations[0].label, POOL_LABEL);
    assert!(
        ctx.with_backend(|_| ()).is_err(),
        "no capture (nor any backend call) on a retiring context"
    );
    graph.destroy().expect("destroy");
    let report = retire
        .wait(Instant::now() + Duration::from_secs(10))
        .expect("teardown after the graph");
    report.backend_result.expect("clean teardown");
    println!("governed capture: teardown waited for the live graph ({text})");
}

/// The stand-in's `memgov_standin_cuda_graph_mem`: {allocation nodes
/// recorded, free nodes recorded, bytes of allocation nodes a graph holds}.
fn graph_mem() -> [u64; 3] {
    use libloading::os::unix::{Library, RTLD_LAZY};
    const RTLD_NOLOAD: std::os::raw::c_int = 4;
    // SAFETY: the stand-in is loaded already (cudarc opened it); the hook
    // has the declared signature (`int (unsigned long long out[3])`).
    unsafe {
        let lib = Library::open(Some("libcuda.so.1"), RTLD_NOLOAD | RTLD_LAZY)
            .expect("the stand-in libcuda is loaded");
        let query: libloading::os::unix::Symbol<unsafe extern "C" fn(*mut u64) -> i32> =
            lib.get(b"memgov_standin_cuda_graph_mem").expect("hook");
        let mut out = [u64::MAX; 3];
        assert_eq!(query(out.as_mut_ptr()), 0);
        out
    }
}

/// memgov's capture makes no graph memory: across a capture with
/// allocations, no stream-ordered allocation or free is recorded and no
/// driver allocation is made.
pub fn no_graph_memory_nodes() {
    let (_gov, ctx) = governed(64 * MIB);
    let s = ctx.create_stream("s").expect("stream");
    let (nodes, driver) = (graph_mem(), stats());
    let (mut graph, out) = ctx
        .capture(&s, config(4 * MIB), |cap| {
            let mut last = None;
            for i in 0..8 {
                let b = cap.allocate(256 << 10)?;
                cap.upload(&b, 0, pattern(70 + i, 4096))?;
                last = Some(cap.download(&b, 0, 4096)?);
            }
            Ok(last.expect("eight allocations"))
        })
        .expect("capture");
    let (nodes_after, driver_after) = (graph_mem(), stats());
    assert_eq!(
        nodes_after, nodes,
        "no graph memory node: {nodes:?} -> {nodes_after:?}"
    );
    assert_eq!(
        driver_after[2], driver[2],
        "no driver allocation during the capture"
    );
    assert_eq!(graph.graph_memory_bytes(), 0);
    graph.launch(&s).expect("launch");
    assert_eq!(graph.read_output(out).expect("read"), pattern(77, 4096));
    graph.destroy().expect("destroy");
    drop(s);
    retire_clean(&ctx);
    println!("governed capture: 8 allocations carved, 0 graph memory nodes, 0 driver allocations");
}

/// A runtime's own stream-ordered allocation on the capturing stream makes
/// a graph memory node: it is seen, and charged to the context (as memory
/// outside memgov) while the graph lives; one on another stream during the
/// capture is seen as a driver allocation during capture.
pub fn graph_memory_charged() {
    use cudarc::driver::sys;
    let (_gov, ctx) = governed(64 * MIB);
    let s = ctx.create_stream("s").expect("stream");
    let other = ctx.create_stream("other").expect("stream");
    let raw = s.raw().expect("live").cu_stream();
    let raw_other = other.raw().expect("live").cu_stream();
    let (nodes, driver) = (graph_mem(), stats());
    let (mut graph, ()) = ctx
        .capture(&s, config(MIB), |cap| {
            let b = cap.allocate(4096)?;
            cap.upload(&b, 0, pattern(80, 4096))?;
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: the capturing stream of a context current through
            // the capture (the stand-in records a node); valid out pointer.
            unsafe {
                let _current = CurrentContext::push();
                assert_eq!(
                    sys::cuMemAllocAsync(&mut p, 3 * MIB as usize, raw),
                    sys::CUresult::CUDA_SUCCESS
                );
                assert_eq!(sys::cuMemFreeAsync(p, raw), sys::CUresult::CUDA_SUCCESS);
                // The planted violation of the other kind: a driver
                // allocation on a stream that is not capturing.
                let mut q: sys::CUdeviceptr = 0;
                assert_eq!(
                    sys::cuMemAllocAsync(&mut q, 4096, raw_other),
                    sys::CUresult::CUDA_SUCCESS
                );
                assert_eq!(
                    sys::cuMemFreeAsync(q, raw_other),
                    sys::CUresult::CUDA_SUCCESS
                );
            }
            Ok(())
        })
        .expect("capture");
    let (nodes_after, driver_after) = (graph_mem(), stats());
    assert_eq!(
        (
            nodes_after[0] - nodes[0],
            nodes_after[1] - nodes[1],
            nodes_after[2]
        ),
        (1, 1, 3 * MIB),
        "one allocation node and one free node recorded, 3 MiB held"
    );
    assert_eq!(
        driver_after[2] - driver[2],
        1,
        "the other stream's allocation is seen"
    );
    assert_eq!(graph.graph_memory_bytes(), 3 * MIB);
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.outside_bytes, snap.charged),
        (3 * MIB, 4 * MIB),
        "graph memory and the pool charged while the graph lives"
    );
    graph.launch(&s).expect("launch");
    graph.destroy().expect("destroy");
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.outside_bytes, snap.charged),
        (0, 0),
        "all returned at destroy"
    );
    assert_eq!(graph_mem()[2], 0, "the driver freed the graph's memory");
    other.synchronize().expect("sync");
    drop((s, other));
    retire_clean(&ctx);
    println!("governed capture: a 3 MiB graph memory node charged while its graph lived");
}

/// The stand-in's primary context pushed current on this thread, popped on
/// drop (the raw calls above need a current context).
struct CurrentContext;

impl CurrentContext {
    /// # Safety
    /// On the stand-in, device 0, whose primary context a live CudaContext
    /// retains.
    unsafe fn push() -> Self {
        use cudarc::driver::sys;
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: device 0 exists on the stand-in; valid out pointer; the
        // retain is released in drop.
        unsafe {
            assert_eq!(
                sys::cuDevicePrimaryCtxRetain(&mut c, 0),
                sys::CUresult::CUDA_SUCCESS
            );
            assert_eq!(sys::cuCtxPushCurrent_v2(c), sys::CUresult::CUDA_SUCCESS);
        }
        Self
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        use cudarc::driver::sys;
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pushed and retained in `push`, undone once here.
        unsafe {
            sys::cuCtxPopCurrent_v2(&mut popped);
            sys::cuDevicePrimaryCtxRelease_v2(0);
        }
    }
}

/// A governed capture while another thread allocates, releases and trims
/// through the governor: no capture invalidated, no driver allocation
/// during it, the graph replays, the budget holds the pool throughout.
pub fn governed_churn() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let (_gov, ctx) = governed(128 * MIB);
    let arena = ctx
        .with_backend(|c| c.arena().expect("arena"))
        .expect("backend");
    let s = ctx.create_stream("capture").expect("stream");
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let churn = {
        let (ctx, arena, stop, rounds) = (ctx.clone(), arena.clone(), stop.clone(), rounds.clone());
        std::thread::spawn(move || {
            let t = ctx.create_stream("churn").expect("stream");
            let mut held = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                rounds.fetch_add(1, Ordering::SeqCst);
                // Held buffers grow the arena: most rounds map a granule.
                let b = ctx
                    .allocate(&t, Alloc::new(2 * MIB + 4096, Role::Activation))
                    .expect("churn allocate");
                b.write(0, &pattern(i, 4096)).expect("churn write");
                held.push(b);
                if held.len() == 8 {
                    held.clear();
                    t.synchronize().expect("churn sync");
                    arena.trim().expect("churn trim");
                }
                i += 1;
            }
        })
    };
    while rounds.load(Ordering::SeqCst) < 3 {
        std::thread::yield_now();
    }
    let before = stats();
    let started = rounds.load(Ordering::SeqCst);
    let (mut graph, outs) = ctx
        .capture(&s, config(4 * MIB), |cap| {
            let mut outs = Vec::new();
            for i in 0..3 {
                let b = cap.allocate(MIB)?;
                cap.upload(&b, 0, pattern(100 + i, MIB as usize))?;
                outs.push(cap.download(&b, 0, MIB as usize)?);
            }
            // Let the churn reach its next map during the capture (or
            // find it held at the gate already, which starts no round until
            // the end).
            let gate = memgov::cuda::capture_gate();
            while rounds.load(Ordering::SeqCst) < started + 1 && gate.waiting() == 0 {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(20));
            Ok(outs)
        })
        .expect("capture: not invalidated");
    let during = stats();
    assert_eq!(during[1], before[1], "no capture invalidated");
    assert_eq!(
        during[2], before[2],
        "no driver allocation during the capture"
    );
    for n in 0..100u64 {
        graph.launch(&s).expect("launch");
        assert!(ctx.snapshot().charged >= 4 * MIB, "the pool stays charged");
        if n % 25 == 0 {
            for (i, out) in outs.iter().enumerate() {
                assert_eq!(
                    graph.read_output(*out).expect("read"),
                    pattern(100 + i as u64, MIB as usize)
                );
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    churn.join().expect("churn thread");
    graph.destroy().expect("destroy");
    assert_eq!(ctx.snapshot().reservations.len(), 0);
    drop(s);
    retire_clean(&ctx);
    println!(
        "governed capture under churn: {} churn rounds, 100 replays, 0 invalidated, 0 driver allocations during the capture",
        rounds.load(Ordering::SeqCst)
    );
}
