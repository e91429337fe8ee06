//! The CUDA backend against whatever `libcuda` the loader finds: NVIDIA's
//! driver on a GPU machine, memgov's stand-in in CI
//! (`export LD_LIBRARY_PATH="$(backends/stand-ins/build.sh)"`).
//!
//! Without a driver every test prints `skipped: no CUDA driver` and passes.
//! Tests that need the stand-in's knobs or plant a violation run in a child
//! process (this binary re-executed with `MEMGOV_CUDA_CHILD` set), because
//! the stand-in reads its knobs once and aborts the whole process on a
//! violation; on real hardware they print `skipped: needs the stand-in`.

#[path = "../../stand-ins/support/cache.rs"]
mod cache;
#[path = "../../stand-ins/support/cases.rs"]
mod cases;
#[path = "../../stand-ins/support/child.rs"]
mod child_process;
#[path = "../../stand-ins/support/recorded.rs"]
mod recorded;
#[path = "../../cases/core.rs"]
mod shared;

use recorded::signal;

use memgov::cuda::{CudaConfig, CudaContext};
use memgov::{
    Alloc, BackendErrorKind, ContextConfig, DeviceContext, Governor, RetireOutcome, Role,
};
use std::time::{Duration, Instant};

#[macro_use]
#[path = "common/table.rs"]
mod table;

fn factory() -> Result<CudaContext, memgov::BackendError> {
    CudaContext::new(CudaConfig::default())
}

memgov_conformance::conformance_tests!(conformance, super::factory);

/// A context, or `None` after printing why the test is skipped.
fn context() -> Option<CudaContext> {
    match factory() {
        Ok(c) => Some(c),
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            println!("skipped: {}", e.message);
            None
        }
        Err(e) => panic!("CudaContext::new failed: {e}"),
    }
}

/// A context on the stand-in only.
fn stand_in() -> Option<CudaContext> {
    let ctx = context()?;
    if !ctx.is_stand_in() {
        println!("skipped: needs the stand-in libcuda (this is real hardware)");
        ctx.teardown(false).expect("teardown");
        return None;
    }
    Some(ctx)
}

#[test]
fn works_from_threads_without_a_current_context() {
    let Some(ctx) = context() else { return };
    let probe = ctx.probe();
    let ctx = std::sync::Arc::new(ctx);
    let threads: Vec<_> = (0..4u8)
        .map(|i| {
            let ctx = ctx.clone();
            std::thread::spawn(move || {
                // A fresh thread has no current context; the backend makes
                // its own current before every call.
                let s = ctx.create_stream().expect("stream");
                let m = ctx.allocate(&s, 4096).expect("allocate");
                ctx.write(&s, &m, 0, &[i; 64]).expect("write");
                let mut back = [0u8; 64];
                ctx.read(&s, &m, 0, &mut back).expect("read");
                assert_eq!(back, [i; 64]);
                let (sig, rx) = signal();
                ctx.free_async(&s, m, sig)
                    .map_err(|(_, _, e)| e)
                    .expect("free");
                ctx.synchronize(&s).expect("sync");
                assert_eq!(
                    rx.recv_timeout(Duration::from_secs(10)).expect("fired").0,
                    RetireOutcome::Retired
                );
                ctx.destroy_stream(s).expect("destroy");
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    let ctx = std::sync::Arc::into_inner(ctx).expect("sole owner");
    ctx.teardown(false).expect("teardown");
    probe.check_clean_teardown().expect("clean");
    assert_eq!(probe.frees_retired(), 4);
}

// ---- child-process tests: knobs and planted violations -----------------------

/// The variable that tells a re-executed test binary which scenario to run.
const CHILD: &str = "MEMGOV_CUDA_CHILD";

// The stand-in's knobs (see `backends/stand-ins/README.md`), from the table.
use table::knobs::{LATENCY, SEED};

/// Run `scenario` in a child process with extra environment. `None` (after
/// printing why) when there is no stand-in to run it on. A child that sets
/// its own latency gets exactly that latency: a latency seed the parent runs
/// with (which would draw each delay from 0 to twice the latency) is not
/// passed on, unless the child's environment names one itself.
fn child(scenario: &str, env: &[(&str, &str)]) -> Option<child_process::ChildRun> {
    stand_in()?.teardown(false).expect("teardown");
    let mut env = env.to_vec();
    if env.iter().any(|(k, _)| *k == LATENCY) && !env.iter().any(|(k, _)| *k == SEED) {
        env.push((SEED, ""));
    }
    Some(child_process::run(CHILD, scenario, &env))
}

/// The child passed (its scenario's assertions held).
fn assert_child_passed(scenario: &str, env: &[(&str, &str)]) {
    if let Some(run) = child(scenario, env) {
        child_process::assert_passed(scenario, &run, &format!("child {scenario}: ok"));
    }
}

/// The child was aborted by the stand-in with a contract violation that
/// names `what`.
fn assert_stand_in_aborts(scenario: &str, env: &[(&str, &str)], what: &str) {
    if let Some(run) = child(scenario, env) {
        child_process::assert_aborted(
            scenario,
            &run,
            "memgov libcuda stand-in: contract violation:",
            what,
            &format!("child {scenario}: ok"),
        );
    }
}

#[test]
fn negative_harness_tells_a_clean_child_from_an_aborted_one() {
    // The control: the same harness, no violation planted, exits 0.
    assert_child_passed("clean", &[]);
}

#[test]
fn negative_call_on_destroyed_context_aborts() {
    assert_stand_in_aborts("destroyed_context", &[], "destroyed context");
}

#[test]
fn negative_copy_of_freed_pointer_aborts() {
    assert_stand_in_aborts("copy_after_free", &[], "already freed device pointer");
}

#[test]
fn negative_release_with_frees_pending_aborts() {
    assert_stand_in_aborts(
        "release_pending",
        &[("MEMGOV_STANDIN_CUDA_LATENCY_US", "200000")],
        "still pending",
    );
}

#[test]
fn negative_last_reference_released_with_device_memory_live_aborts() {
    // The driver would destroy the allocation with the context; the
    // stand-in refuses it, since the same release with a runtime still
    // holding the context would leave the allocation in it.
    assert_stand_in_aborts(
        "release_allocated",
        &[],
        "released (last reference) with 1 device allocation(s) (1048576 bytes) and 0 \
         page-locked host allocation(s) (0 bytes) still live",
    );
}

#[test]
fn negative_last_reference_released_with_page_locked_memory_live_aborts() {
    assert_stand_in_aborts(
        "release_host_allocated",
        &[],
        "released (last reference) with 0 device allocation(s) (0 bytes) and 1 page-locked \
         host allocation(s) (4096 bytes) still live",
    );
}

#[test]
fn last_reference_released_on_a_sticky_device_takes_its_allocations_with_it() {
    // The control of the two above: on a device in the sticky error state
    // nothing can be freed, the release is legal and the allocations go
    // with the context (the stand-in counts what they were).
    assert_child_passed(
        "release_allocated_sticky",
        &[
            ("MEMGOV_STANDIN_CUDA_STICKY_ERROR_AT_EXEC", "1"),
            ("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1"),
        ],
    );
}

#[test]
fn lost_teardown_of_a_healthy_device_frees_before_the_last_reference_goes() {
    // memgov holds the only reference to the primary context: declared lost
    // while the driver still answers, with four 64 MiB allocations, a
    // page-locked buffer and a queued release, its retirement must free all
    // of it before its release, which is the last (the stand-in aborts on a
    // last release over live allocations), and nothing goes with the context.
    for (latency, seed) in [("0", ""), ("2000", ""), ("2000", "1"), ("2000", "2")] {
        assert_child_passed(
            "lost_teardown_alone",
            &[
                ("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1"),
                (LATENCY, latency),
                (SEED, seed),
            ],
        );
    }
}

#[test]
fn a_page_locked_free_whose_signal_device_loss_abandoned_is_still_freed() {
    // cuMemFreeHost runs on the free thread after the host function queued
    // behind the buffer's last use. Device loss declared while that host
    // function waits abandons the signal, but the buffer is still the
    // context's to free: the host function, when it runs, hands it over
    // and the lost teardown frees it before the last reference goes (the
    // stand-in aborts on a last release over live page-locked memory).
    assert_child_passed(
        "page_locked_free_behind_loss",
        &[("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1")],
    );
}

#[test]
fn lost_teardown_never_releases_under_running_work() {
    // Declared lost on a device that answers but whose queued work is still
    // running at the drain deadline (a free queued behind 7 s of latency):
    // teardown gives up after its 5 s deadline, frees nothing and keeps the
    // context reference rather than releasing it under that work, and says so.
    assert_child_passed(
        "lost_teardown_running",
        &[("MEMGOV_STANDIN_CUDA_LATENCY_US", "7000000")],
    );
}

#[test]
fn conformance_suite_alone_frees_everything_before_each_last_release() {
    // In this process other tests hold the primary context too, so a case's
    // release is not always the last one. Alone in a child every case's
    // release is, and the stand-in checks that nothing is live at it, with
    // the block cache off and on.
    for (latency, seed) in [("0", ""), ("300", ""), ("300", "1")] {
        assert_child_passed(
            "suite_alone",
            &[
                ("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1"),
                (LATENCY, latency),
                (SEED, seed),
            ],
        );
    }
}

#[test]
fn negative_free_ordered_by_an_event_recorded_too_early_aborts() {
    assert_stand_in_aborts("event_recorded_too_early", &[], "missing stream ordering");
}

#[test]
fn negative_memory_of_another_context_aborts() {
    assert_stand_in_aborts(
        "foreign_context_memory",
        &[("MEMGOV_STANDIN_CUDA_DEVICES", "2")],
        "cuMemFreeAsync of unknown pointer",
    );
}

#[test]
fn negative_release_while_current_on_a_thread_aborts() {
    assert_stand_in_aborts("release_while_current", &[], "still the current context");
}

#[test]
fn negative_default_pool_left_changed_aborts() {
    assert_stand_in_aborts(
        "default_pool_changed",
        &[],
        "default memory pool is 123, but the process found it at 0",
    );
}

#[test]
fn negative_context_reference_left_at_exit_aborts() {
    // The violation is found at exit, after the child printed its marker.
    if let Some(run) = child("exit_leak", &[("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1")]) {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(run.status.signal(), Some(6), "{}", run.output());
        assert!(
            run.stderr.contains("contract violation: at exit: the primary context of device 0 still has 1 reference(s)"),
            "{}",
            run.output()
        );
    }
}

// ---- regressions: the backend against the stricter stand-in --------------------

#[test]
fn raw_misuse_is_refused_before_the_driver_sees_it() {
    assert_child_passed("raw_misuse", &[]);
}

#[test]
fn retire_and_force_finish_after_a_fault_in_a_destroyed_streams_work() {
    for case in ["async_fault_retire", "async_fault_force"] {
        assert_child_passed(
            case,
            &[
                ("MEMGOV_STANDIN_CUDA_STICKY_ERROR_AT_EXEC", "1"),
                ("MEMGOV_STANDIN_CUDA_LATENCY_US", "20000"),
            ],
        );
    }
}

#[test]
fn lost_teardown_of_a_healthy_device_frees_before_the_shared_context_reference_goes() {
    // A runtime shares the primary context. memgov's context is declared
    // lost while the driver still answers, with device and page-locked host
    // memory live: its teardown frees all of it before letting go of its
    // reference, so nothing of memgov's stays in the runtime's context.
    for latency in ["0", "2000"] {
        assert_child_passed(
            "lost_teardown_shared",
            &[
                ("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1"),
                ("MEMGOV_STANDIN_CUDA_LATENCY_US", latency),
            ],
        );
    }
}

#[test]
fn negative_context_reference_released_over_a_destroyed_pools_allocations_aborts() {
    assert_stand_in_aborts(
        "pool_destroyed_with_allocations",
        &[],
        "still has 1 allocation(s) (4096 bytes) outstanding",
    );
}

#[test]
fn lost_teardown_of_an_adopted_context_leaves_only_the_runtimes_objects() {
    assert_child_passed("adopt_lost", &[("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1")]);
}

#[test]
fn the_default_memory_pool_is_never_changed() {
    assert_child_passed("default_pool", &[("MEMGOV_STANDIN_CUDA_EXIT_CHECK", "1")]);
}

#[test]
fn negative_driver_call_from_host_function_aborts() {
    assert_stand_in_aborts("call_in_host_fn", &[], "from inside a host function");
}

#[test]
fn call_without_current_context_fails_with_the_drivers_code() {
    assert_child_passed("no_current_context", &[]);
}

#[test]
fn teardown_waits_for_slow_frees_before_releasing_the_context() {
    // 20 ms per queued operation: releases are really pending when retire
    // starts; the stand-in aborts if the context is released before they ran.
    assert_child_passed(
        "slow_teardown",
        &[("MEMGOV_STANDIN_CUDA_LATENCY_US", "20000")],
    );
}

#[test]
fn teardown_after_a_stream_destroyed_with_frees_queued_waits_for_them() {
    assert_child_passed(
        "destroyed_with_frees_queued",
        &[("MEMGOV_STANDIN_CUDA_LATENCY_US", "20000")],
    );
}

#[test]
fn context_is_never_released_under_a_running_host_function() {
    // The signal fires inside the host function, so the governor may tear
    // down before the host function has returned; the stand-in aborts if the
    // context is released while it still runs.
    assert_child_passed("release_races_host_fn", &[]);
}

#[test]
fn adopted_context_and_streams_are_used_but_never_destroyed() {
    // The child retains the primary context and creates a stream itself, lends
    // both, and destroys/releases them after memgov's teardown: the stand-in
    // aborts if memgov destroyed the stream or released the context too.
    assert_child_passed("adopt", &[("MEMGOV_STANDIN_CUDA_LATENCY_US", "2000")]);
}

/// The conformance suite on every configuration (`shared`'s case, under
/// its own name here).
#[test]
fn whole_suite_report() {
    shared::whole_suite_report();
}

// What the shared cases (`backends/cases/core.rs`) need of CUDA, and the
// `StandInBackend` implementation: CUDA's table (`common/table.rs`).
core_table!();

child_process::child_entry!(CHILD, shared::run, children::run);

mod children {
    use super::*;
    use crate::table::calls::{alloc, current, ok, raw_setup, stand_in_live, stand_in_query};
    use cudarc::driver::sys;

    unsafe extern "C" fn calls_the_driver(_: *mut std::ffi::c_void) {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: deliberately forbidden (the planted violation).
        let _ = unsafe { sys::cuCtxGetCurrent(&mut c) };
    }

    pub(super) fn run(scenario: &str) {
        // SAFETY: every call below is a raw driver call on the stand-in,
        // either valid or the violation the scenario plants on purpose; the
        // stand-in aborts before doing anything undefined.
        unsafe {
            match scenario {
                "clean" => {
                    let (ctx, s) = raw_setup();
                    let p = alloc(s, 64);
                    ok(sys::cuMemFreeAsync(p, s), "free");
                    ok(sys::cuStreamSynchronize(s), "sync");
                    ok(sys::cuStreamDestroy_v2(s), "destroy");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear current");
                    ctx.teardown(false).expect("teardown");
                }
                "destroyed_context" => {
                    let ctx = factory().expect("context");
                    let old = ctx.cu_context();
                    ctx.teardown(false).expect("teardown");
                    let _ = sys::cuCtxSetCurrent(old);
                }
                "copy_after_free" => {
                    let (_ctx, s) = raw_setup();
                    let p = alloc(s, 64);
                    ok(sys::cuMemFreeAsync(p, s), "free");
                    ok(sys::cuStreamSynchronize(s), "sync");
                    let src = [0u8; 8];
                    let _ = sys::cuMemcpyHtoDAsync_v2(p, src.as_ptr().cast(), 8, s);
                }
                "release_pending" => {
                    let (ctx, s) = raw_setup();
                    let p = alloc(s, 64);
                    ok(sys::cuMemFreeAsync(p, s), "free (200 ms latency)");
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(0);
                    drop(ctx);
                }
                "release_allocated" => {
                    // The planted violation: the last reference released
                    // over a live allocation on a healthy device.
                    let (ctx, s) = raw_setup();
                    let _p = alloc(s, 1 << 20);
                    ok(sys::cuStreamSynchronize(s), "sync");
                    ok(sys::cuStreamDestroy_v2(s), "destroy stream");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear current");
                    std::mem::forget(ctx); // its reference is released below
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(0);
                }
                "release_host_allocated" => {
                    // Likewise, with page-locked host memory.
                    let ctx = factory().expect("context");
                    ok(sys::cuCtxSetCurrent(ctx.cu_context()), "set current");
                    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
                    ok(sys::cuMemHostAlloc(&mut host, 4096, 3), "cuMemHostAlloc");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear current");
                    std::mem::forget(ctx);
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(0);
                }
                "release_allocated_sticky" => release_allocated_sticky(),
                "lost_teardown_alone" => lost_teardown_alone(),
                "lost_teardown_running" => lost_teardown_running(),
                "page_locked_free_behind_loss" => page_locked_free_behind_loss(),
                "suite_alone" => suite_alone(),
                "event_recorded_too_early" => {
                    let (_ctx, s) = raw_setup();
                    let mut other: sys::CUstream = std::ptr::null_mut();
                    ok(sys::cuStreamCreate(&mut other, 1), "stream");
                    let mut ev: sys::CUevent = std::ptr::null_mut();
                    ok(sys::cuEventCreate(&mut ev, 2), "event");
                    // Recorded before the allocation: waiting on it orders
                    // nothing after the allocation.
                    ok(sys::cuEventRecord(ev, s), "record");
                    let p = alloc(s, 64);
                    ok(sys::cuStreamWaitEvent(other, ev, 0), "wait");
                    let _ = sys::cuMemFreeAsync(p, other);
                }
                "foreign_context_memory" => {
                    let (_ctx, s) = raw_setup();
                    let p = alloc(s, 64);
                    let (mut dev1, mut ctx1) = (0, std::ptr::null_mut());
                    ok(sys::cuDeviceGet(&mut dev1, 1), "device 1");
                    ok(sys::cuDevicePrimaryCtxRetain(&mut ctx1, dev1), "retain 1");
                    ok(sys::cuCtxSetCurrent(ctx1), "current 1");
                    let mut s1: sys::CUstream = std::ptr::null_mut();
                    ok(sys::cuStreamCreate(&mut s1, 1), "stream 1");
                    let _ = sys::cuMemFreeAsync(p, s1);
                }
                "release_while_current" => {
                    let (mut dev, mut c) = (0, std::ptr::null_mut());
                    ok(sys::cuInit(0), "init");
                    ok(sys::cuDeviceGet(&mut dev, 0), "device");
                    ok(sys::cuDevicePrimaryCtxRetain(&mut c, dev), "retain");
                    ok(sys::cuCtxSetCurrent(c), "current");
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(dev);
                }
                "default_pool_changed" => {
                    let (mut dev, mut c) = (0, std::ptr::null_mut());
                    ok(sys::cuInit(0), "init");
                    ok(sys::cuDeviceGet(&mut dev, 0), "device");
                    ok(sys::cuDevicePrimaryCtxRetain(&mut c, dev), "retain");
                    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
                    ok(
                        sys::cuDeviceGetDefaultMemPool(&mut pool, dev),
                        "default pool",
                    );
                    let mut v: u64 = 123;
                    ok(
                        sys::cuMemPoolSetAttribute(
                            pool,
                            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                            (&mut v as *mut u64).cast(),
                        ),
                        "set threshold",
                    );
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(dev);
                }
                "exit_leak" => {
                    let (mut dev, mut c) = (0, std::ptr::null_mut());
                    ok(sys::cuInit(0), "init");
                    ok(sys::cuDeviceGet(&mut dev, 0), "device");
                    ok(
                        sys::cuDevicePrimaryCtxRetain(&mut c, dev),
                        "retain, never released",
                    );
                }
                "raw_misuse" => raw_misuse(),
                "async_fault_retire" => async_fault(false),
                "async_fault_force" => async_fault(true),
                "lost_teardown_shared" => lost_teardown_shared(),
                "pool_destroyed_with_allocations" => {
                    // The planted violation: an allocation from a created
                    // pool, the pool destroyed (legal: it goes once the
                    // allocation is freed), then the context reference
                    // released with the allocation still outstanding.
                    let (mut dev, mut c) = (0, std::ptr::null_mut());
                    ok(sys::cuInit(0), "init");
                    ok(sys::cuDeviceGet(&mut dev, 0), "device");
                    ok(sys::cuDevicePrimaryCtxRetain(&mut c, dev), "retain");
                    ok(sys::cuCtxSetCurrent(c), "current");
                    let mut s: sys::CUstream = std::ptr::null_mut();
                    ok(sys::cuStreamCreate(&mut s, 1), "stream");
                    let mut props: sys::CUmemPoolProps = std::mem::zeroed();
                    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
                    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                    props.location.id = dev;
                    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
                    ok(sys::cuMemPoolCreate(&mut pool, &props), "pool");
                    let mut p = 0;
                    ok(sys::cuMemAllocFromPoolAsync(&mut p, 4096, pool, s), "alloc");
                    ok(sys::cuStreamSynchronize(s), "sync");
                    ok(sys::cuStreamDestroy_v2(s), "destroy stream");
                    ok(sys::cuMemPoolDestroy(pool), "destroy pool");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear current");
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(dev);
                }
                "default_pool" => default_pool(),
                "adopt_lost" => adopt_lost(),
                "call_in_host_fn" => {
                    let (_ctx, s) = raw_setup();
                    ok(
                        sys::cuLaunchHostFunc(s, Some(calls_the_driver), std::ptr::null_mut()),
                        "launch",
                    );
                    let _ = sys::cuStreamSynchronize(s);
                }
                "no_current_context" => {
                    let ctx = factory().expect("context");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear current");
                    let mut s: sys::CUstream = std::ptr::null_mut();
                    let r = sys::cuStreamCreate(&mut s, 1);
                    assert_eq!(r, sys::CUresult::CUDA_ERROR_INVALID_CONTEXT);
                    // The backend makes its context current itself.
                    let st = ctx.create_stream().expect("backend stream");
                    ctx.destroy_stream(st).expect("destroy");
                    ctx.teardown(false).expect("teardown");
                }
                "slow_teardown" => slow_teardown(),
                "adopt" => adopt(),
                "release_races_host_fn" => {
                    for _ in 0..200 {
                        let ctx = factory().expect("context");
                        let probe = ctx.probe();
                        let gov = Governor::new();
                        let handle = gov.register(ctx, ContextConfig::new());
                        let stream = handle.create_stream("s").expect("stream");
                        drop(
                            handle
                                .allocate(&stream, Alloc::new(4096, Role::Activation))
                                .expect("allocate"),
                        );
                        drop(stream);
                        let report = handle
                            .retire()
                            .wait_timeout(Duration::from_secs(10))
                            .expect("retire");
                        assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
                        probe.check_clean_teardown().expect("clean");
                    }
                }
                "destroyed_with_frees_queued" => destroyed_with_frees_queued(),
                other => panic!("unknown child scenario {other}"),
            }
        }
    }

    fn slow_teardown() {
        let ctx = factory().expect("context");
        let probe = ctx.probe();
        let gov = Governor::new();
        let handle = gov.register(ctx, ContextConfig::new().label("slow"));
        let stream = handle.create_stream("main").expect("stream");
        for _ in 0..5 {
            drop(
                handle
                    .allocate(&stream, Alloc::new(65536, Role::Activation))
                    .expect("allocate"),
            );
        }
        drop(stream);
        let start = Instant::now();
        let report = handle
            .retire()
            .wait_timeout(Duration::from_secs(30))
            .expect("retire");
        let waited = start.elapsed();
        assert_eq!(report.retired_releases, 5);
        assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
        // Five frees and five host functions at 20 ms each were still queued.
        assert!(
            waited >= Duration::from_millis(100),
            "retire returned after {waited:?}"
        );
        probe.check_clean_teardown().expect("clean");
        assert_eq!(probe.frees_retired(), 5);
    }

    /// A runtime's primary context, retained and made current (pushed when
    /// `push`), and a stream of its own, both handed to memgov with
    /// `CudaContext::adopt`: (memgov's context, device, context, stream).
    fn adopted_by_memgov(
        push: bool,
    ) -> (CudaContext, sys::CUdevice, sys::CUcontext, sys::CUstream) {
        use memgov::cuda::AdoptedContext;
        let (mut device, mut context, mut lent) = (0, std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: plain driver calls with valid out pointers.
        unsafe {
            ok(sys::cuInit(0), "init");
            ok(sys::cuDeviceGet(&mut device, 0), "device");
            ok(
                sys::cuDevicePrimaryCtxRetain(&mut context, device),
                "retain",
            );
            if push {
                ok(sys::cuCtxPushCurrent_v2(context), "push");
            } else {
                ok(sys::cuCtxSetCurrent(context), "current");
            }
            ok(sys::cuStreamCreate(&mut lent, 1), "stream");
        }
        // SAFETY: the context and stream stay valid until after teardown
        // (destroyed and released by the caller, after it).
        let ctx = unsafe {
            CudaContext::adopt(
                AdoptedContext {
                    ordinal: 0,
                    context,
                    streams: vec![lent],
                },
                CudaConfig::default(),
            )
        }
        .expect("adopt");
        (ctx, device, context, lent)
    }

    fn adopt() {
        let (ctx, device, context, lent) = adopted_by_memgov(false);
        let probe = ctx.probe();
        let gov = Governor::new();
        let handle = gov.register(ctx, ContextConfig::new().label("adopted"));
        let first = handle.create_stream("lent").expect("stream");
        let second = handle.create_stream("own").expect("stream");
        let raw = first.raw().expect("live");
        assert!(raw.is_adopted());
        assert_eq!(raw.cu_stream(), lent);
        assert!(!second.raw().expect("live").is_adopted());
        for s in [&first, &second] {
            let buf = handle
                .allocate(s, Alloc::new(4096, Role::Activation))
                .expect("allocate");
            buf.write(0, b"adopted").expect("write");
            drop(buf);
        }
        drop((first, second));
        let report = handle
            .retire()
            .wait_timeout(Duration::from_secs(10))
            .expect("retire");
        assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
        probe.check_clean_teardown().expect("clean");
        // The runtime's objects are still its own, and still valid.
        // SAFETY: the stream and context created above, released once.
        unsafe {
            ok(sys::cuCtxSetCurrent(context), "current");
            ok(sys::cuStreamSynchronize(lent), "lent stream still valid");
            ok(sys::cuStreamDestroy_v2(lent), "destroy lent stream");
            ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear current");
            ok(
                sys::cuDevicePrimaryCtxRelease_v2(device),
                "release (last reference)",
            );
        }
    }

    fn destroyed_with_frees_queued() {
        // A direct caller breaks the contract (teardown before its frees
        // retired); the backend reports it and still releases the context
        // only after the queued work ran (else the stand-in aborts).
        let ctx = factory().expect("context");
        let probe = ctx.probe();
        let s = ctx.create_stream().expect("stream");
        let m = ctx.allocate(&s, 4096).expect("allocate");
        let (sig, rx) = signal();
        ctx.free_async(&s, m, sig)
            .map_err(|(_, _, e)| e)
            .expect("free");
        ctx.destroy_stream(s).expect("destroy");
        ctx.teardown(false).expect("teardown");
        assert_eq!(
            rx.try_recv().expect("fired before teardown returned").0,
            RetireOutcome::Retired
        );
        assert_eq!(probe.violations(), 1, "{:?}", probe.violation_log());
        assert_eq!(probe.live_allocations(), 0);
    }

    fn invalid<T: std::fmt::Debug>(r: Result<T, memgov::BackendError>, what: &str) {
        let e = r.expect_err(what);
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{what}: {e}");
    }

    fn raw_misuse() {
        let a = factory().expect("context a");
        let b = factory().expect("context b");
        let sa = a.create_stream().expect("a stream");
        let sb = b.create_stream().expect("b stream");
        let ma = a.allocate(&sa, 4096).expect("a memory");
        let mb = b.allocate(&sb, 4096).expect("b memory");
        let mut buf = [0u8; 16];
        // Foreign memory, foreign streams.
        invalid(b.write(&sb, &ma, 0, b"x"), "write of a's memory through b");
        invalid(
            b.read(&sb, &ma, 0, &mut buf),
            "read of a's memory through b",
        );
        invalid(a.write(&sb, &ma, 0, b"x"), "write on b's stream through a");
        invalid(a.synchronize(&sb), "synchronize of b's stream through a");
        invalid(a.allocate(&sb, 64), "allocate on b's stream through a");
        invalid(a.order_after(&sa, &sb), "order after b's stream through a");
        // Out-of-range offsets.
        invalid(a.write(&sa, &ma, 4090, &[0u8; 10]), "write past the end");
        invalid(a.read(&sa, &ma, 4096, &mut buf[..1]), "read past the end");
        invalid(a.write(&sa, &ma, u64::MAX, b"x"), "offset overflow");
        // A free of another context's memory is refused and hands it back.
        let (ma, _sig, e) = b
            .free_async(&sb, ma, signal().0)
            .expect_err("free of a's memory through b");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        // The refused calls reached no driver: both contexts are intact.
        a.write(&sa, &ma, 0, b"fine").expect("a still works");
        // A stream of another context cannot be destroyed through this one
        // (the handle is consumed; `a` still owns the stream).
        invalid(b.destroy_stream(sa), "destroy of a's stream through b");
        b.write(&sb, &mb, 0, b"fine").expect("b still works");
        b.free_async(&sb, mb, signal().0)
            .map_err(|(_, _, e)| e)
            .expect("own free");
        b.synchronize(&sb).expect("sync");
        b.destroy_stream(sb).expect("destroy");
        b.teardown(false).expect("teardown b");
        // `a` still owns its memory (and its stream, refused by b above):
        // its teardown frees it, once.
        a.teardown(false).expect("teardown a");
    }

    fn async_fault(force: bool) {
        // The first queued free to execute faults (sticky), after the call
        // that queued it returned; its host function never runs. Nothing
        // calls the backend while retire waits.
        let ctx = factory().expect("context");
        let probe = ctx.probe();
        let gov = Governor::new();
        let handle = gov.register(ctx, ContextConfig::new().label("async fault"));
        let stream = handle.create_stream("s").expect("stream");
        drop(
            handle
                .allocate(&stream, Alloc::new(4096, Role::Activation))
                .expect("allocate"),
        );
        drop(stream);
        let retire = handle.retire();
        let deadline = Instant::now() + Duration::from_secs(10);
        let report = if force {
            retire.force(deadline)
        } else {
            retire.wait(deadline)
        }
        .expect("retire finishes: the fault is observed");
        assert_eq!(
            report.retired_releases + report.abandoned_releases + report.settled_lost,
            1,
            "{report:?}"
        );
        assert_eq!(report.unsettled_releases, 0, "{report:?}");
        assert!(probe.lost(), "the loss was observed");
        probe.check_clean_teardown().expect("clean");
        let snap = handle.snapshot();
        assert_eq!(snap.charged, 0);
        assert_eq!(snap.total().pending_count, 0);
    }

    fn release_allocated_sticky() {
        // Allocations live (device and page-locked), then an asynchronous
        // fault (the first queued operation to execute, a free, faults): the
        // device is in the sticky error state, nothing can be freed, and the
        // last release is legal; the allocations go with the context.
        let (mut dev, mut c) = (0, std::ptr::null_mut());
        let mut s: sys::CUstream = std::ptr::null_mut();
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: raw driver calls on the stand-in with valid out pointers;
        // the push is popped below, before the release.
        unsafe {
            ok(sys::cuInit(0), "init");
            ok(sys::cuDeviceGet(&mut dev, 0), "device");
            ok(sys::cuDevicePrimaryCtxRetain(&mut c, dev), "retain");
            ok(sys::cuCtxPushCurrent_v2(c), "push");
            ok(sys::cuStreamCreate(&mut s, 1), "stream");
            let _kept = alloc(s, 1 << 20);
            ok(sys::cuMemHostAlloc(&mut host, 4096, 3), "cuMemHostAlloc");
            let faults = alloc(s, 64);
            ok(sys::cuMemFreeAsync(faults, s), "free (faults when it runs)");
            assert_eq!(
                sys::cuStreamSynchronize(s),
                sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
                "the fault surfaces at the synchronize"
            );
            let mut popped = std::ptr::null_mut();
            ok(sys::cuCtxPopCurrent_v2(&mut popped), "pop");
            ok(
                sys::cuDevicePrimaryCtxRelease_v2(dev),
                "release (last reference) on a sticky device",
            );
        }
        // The faulted free never executed: both device allocations went with
        // the context, and the page-locked one.
        assert_eq!(
            stand_in_query("memgov_standin_cuda_reclaimed", 0),
            Some([2, (1 << 20) + 64, 1, 4096])
        );
    }

    /// The governed half of a lost teardown on a healthy device: four
    /// 64 MiB allocations and a 1 MiB page-locked one live, a release still
    /// queued, the loss declared (the driver still answers), then retire.
    /// Checks the report and the backend's books; returns the context for the
    /// caller's checks of what the stand-in still holds.
    fn declare_lost_and_retire(label: &str, device: i32) -> memgov::ContextHandle<CudaContext> {
        use memgov::Tier;
        let gov = Governor::new();
        let backend = factory().expect("context");
        let probe = backend.probe();
        let ctx = gov.register(backend, ContextConfig::new().label(label));
        let s = ctx.create_stream("s").expect("stream");
        let weights: Vec<_> = (0..4)
            .map(|_| {
                ctx.allocate(&s, Alloc::new(64 << 20, Role::Weights))
                    .expect("allocate")
            })
            .collect();
        let pinned = ctx
            .allocate(&s, Alloc::new(1 << 20, Role::Other).tier(Tier::PinnedHost))
            .expect("pinned allocation");
        weights[0].write(0, b"weights").expect("write");
        pinned.write(0, b"pinned").expect("write");
        // A release still queued when the loss is declared.
        drop(
            ctx.allocate(&s, Alloc::new(4096, Role::Activation))
                .expect("allocate"),
        );
        let before = stand_in_live(device);
        assert!(
            before[0] >= 4 && before[1] >= 4 * (64 << 20) && before[2] == 1,
            "{before:?}"
        );
        assert!(ctx.mark_lost("test: declared lost; the driver still answers"));
        drop((weights, pinned, s));
        let report = ctx
            .retire()
            .wait_timeout(Duration::from_secs(30))
            .expect("retire");
        assert!(report.lost, "{report:?}");
        assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
        assert_eq!(probe.live_allocations(), 0);
        assert_eq!(probe.live_streams(), 0);
        assert_eq!(probe.violations(), 0, "{:?}", probe.violation_log());
        ctx
    }

    fn lost_teardown_alone() {
        // memgov holds the only reference to the primary context.
        let ctx = declare_lost_and_retire("alone", 0);
        // memgov's release was the last: the context is gone, and nothing
        // went with it (the stand-in would have aborted on live memory).
        assert_eq!(
            stand_in_query("memgov_standin_cuda_live", 0),
            None,
            "the primary context is still retained"
        );
        assert_eq!(
            stand_in_query("memgov_standin_cuda_reclaimed", 0),
            Some([0, 0, 0, 0]),
            "memgov's allocations went with the context instead of being freed"
        );
        let snap = ctx.snapshot();
        assert_eq!(snap.charged, 0);
        assert_eq!(snap.total().pending_count, 0);
    }

    /// The stream held by a host function of the test's own until the
    /// loss is declared, so memgov's host function runs after it.
    fn page_locked_free_behind_loss() {
        use std::sync::{Condvar, Mutex};
        static OPEN: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());
        /// Waits until the test opens the gate; makes no CUDA call.
        unsafe extern "C" fn hold(_: *mut std::ffi::c_void) {
            let (open, cv) = &OPEN;
            let mut o = open.lock().unwrap_or_else(|p| p.into_inner());
            while !*o {
                o = cv.wait(o).unwrap_or_else(|p| p.into_inner());
            }
        }
        let ctx = factory().expect("context");
        let probe = ctx.probe();
        let s = ctx.create_stream().expect("stream");
        let m = ctx
            .allocate_in(&s, 4096, memgov::Tier::PinnedHost)
            .expect("page-locked allocation");
        // SAFETY: the context is live (pushed for the launch, popped after);
        // the stream is a live stream of it; `hold` makes no CUDA call.
        unsafe {
            ok(sys::cuCtxPushCurrent_v2(ctx.cu_context()), "push");
            let r = sys::cuLaunchHostFunc(s.cu_stream(), Some(hold), std::ptr::null_mut());
            ok(r, "hold the stream");
            let mut popped = std::ptr::null_mut();
            ok(sys::cuCtxPopCurrent_v2(&mut popped), "pop");
        }
        let (sig, outcome) = signal();
        ctx.free_async(&s, m, sig)
            .map_err(|(_, _, e)| e)
            .expect("free queued behind the hold");
        ctx.device_lost();
        let (o, _) = outcome
            .recv_timeout(Duration::from_secs(30))
            .expect("settled");
        assert_eq!(
            o,
            RetireOutcome::Abandoned,
            "device loss abandons the signal"
        );
        {
            let (open, cv) = &OPEN;
            *open.lock().unwrap_or_else(|p| p.into_inner()) = true;
            cv.notify_all();
        }
        ctx.teardown(true)
            .expect("lost teardown of a healthy device");
        assert_eq!(probe.violations(), 0, "{:?}", probe.violation_log());
        // The last reference went with nothing in the context: the stand-in
        // would have aborted on the page-locked buffer.
        assert_eq!(
            stand_in_query("memgov_standin_cuda_reclaimed", 0),
            Some([0, 0, 0, 0]),
            "the page-locked buffer went with the context instead of being freed"
        );
    }

    fn lost_teardown_running() {
        let ctx = factory().expect("context");
        let probe = ctx.probe();
        let s = ctx.create_stream().expect("stream");
        let _kept = ctx.allocate(&s, 4096).expect("allocate");
        let m = ctx.allocate(&s, 4096).expect("allocate");
        ctx.free_async(&s, m, signal().0)
            .map_err(|(_, _, e)| e)
            .expect("free, queued behind 7 s");
        ctx.device_lost();
        let start = Instant::now();
        let e = ctx
            .teardown(true)
            .expect_err("teardown must not release under running work");
        let waited = start.elapsed();
        assert_eq!(e.kind, BackendErrorKind::DeviceLost, "{e}");
        assert!(
            e.message
                .contains("kept rather than released under running work")
                && e.message.contains("cuDevicePrimaryCtxReset"),
            "{e}"
        );
        assert!(
            waited >= Duration::from_secs(5) && waited < Duration::from_secs(7),
            "gave up after {waited:?}"
        );
        assert!(probe.lost());
        // The reference was kept, with memgov's allocations in it (the
        // queued free has not run yet).
        let held = stand_in_live(0);
        assert_eq!((held[0], held[1]), (2, 8192), "{held:?}");
        // The process exits with the reference held and the work queued.
    }

    fn suite_alone() {
        use memgov_conformance::{run_suite_with, SuiteOptions};
        let cached = SuiteOptions::new().cache(memgov::CacheConfig::new(64 << 20));
        for options in [SuiteOptions::new(), cached] {
            let report = run_suite_with(&options, factory);
            println!("{report}");
            let (passed, failed, skipped) = report.counts();
            assert_eq!(
                (passed, failed, skipped),
                (report.cases.len(), 0, 0),
                "{report}"
            );
            assert_eq!(
                stand_in_query("memgov_standin_cuda_reclaimed", 0),
                Some([0, 0, 0, 0]),
                "a case left memory to go with the context ({options})"
            );
        }
    }

    fn lost_teardown_shared() {
        // The runtime's reference, taken first and let go last.
        let (mut device, mut runtime) = (0, std::ptr::null_mut());
        // SAFETY: plain driver calls with valid out pointers.
        unsafe {
            ok(sys::cuInit(0), "init");
            ok(sys::cuDeviceGet(&mut device, 0), "device");
            ok(
                sys::cuDevicePrimaryCtxRetain(&mut runtime, device),
                "retain",
            );
        }
        declare_lost_and_retire("shared", device);
        assert_eq!(
            stand_in_live(device),
            [0, 0, 0, 0],
            "memgov's allocations stayed in the runtime's primary context"
        );
        // SAFETY: the runtime's own reference, released once.
        ok(
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) },
            "release",
        );
    }

    fn default_pool() {
        let threshold = || {
            let (mut dev, mut pool, mut v) = (0, std::ptr::null_mut(), 7u64);
            // SAFETY: valid out pointers; the attribute is a cuuint64_t.
            unsafe {
                ok(sys::cuInit(0), "init");
                ok(sys::cuDeviceGet(&mut dev, 0), "device");
                ok(
                    sys::cuDeviceGetDefaultMemPool(&mut pool, dev),
                    "default pool",
                );
                ok(
                    sys::cuMemPoolGetAttribute(
                        pool,
                        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                        (&mut v as *mut u64).cast(),
                    ),
                    "get threshold",
                );
            }
            v
        };
        let before = threshold();
        let ctx = factory().expect("context");
        assert_eq!(
            threshold(),
            before,
            "the default pool changed while memgov runs"
        );
        let s = ctx.create_stream().expect("stream");
        let m = ctx.allocate(&s, 4096).expect("allocate");
        ctx.free_async(&s, m, signal().0)
            .map_err(|(_, _, e)| e)
            .expect("free");
        ctx.synchronize(&s).expect("sync");
        ctx.destroy_stream(s).expect("destroy");
        ctx.teardown(false).expect("teardown");
        assert_eq!(
            threshold(),
            before,
            "the default pool changed after teardown"
        );
    }

    fn adopt_lost() {
        // memgov's own pool is destroyed by a lost teardown of an adopted
        // context too; the runtime's context and stream stay the runtime's,
        // and once it lets go of them nothing is left at exit.
        let (ctx, device, context, lent) = adopted_by_memgov(true);
        let s = ctx.create_stream().expect("lent stream");
        let _m = ctx.allocate(&s, 4096).expect("allocate");
        ctx.device_lost();
        ctx.teardown(true).expect("lost teardown");
        assert_eq!(current(), context, "the runtime's current context is kept");
        // SAFETY: the runtime's own objects, destroyed and released once.
        unsafe {
            ok(sys::cuStreamSynchronize(lent), "sync lent stream");
            ok(sys::cuStreamDestroy_v2(lent), "destroy lent stream");
            let mut popped = std::ptr::null_mut();
            ok(sys::cuCtxPopCurrent_v2(&mut popped), "pop");
            ok(sys::cuDevicePrimaryCtxRelease_v2(device), "release");
        }
    }
}
