//! Graph capture on the HIP backend's arena (a pool reserved before
//! capture, the process-wide gate, graphs pinning their pools), and the
//! stand-in runtime's stream capture rules, each with a planted violation.
//!
//! Every case runs in a child process (this binary re-executed with
//! `MEMGOV_HIP_CAPTURE_CHILD` set): the stand-in reads its knobs once per
//! process and aborts the process on a violation. Without the stand-in
//! every test prints `skipped: ...` and passes.
//!
//! `MEMGOV_CAPTURE_REPLAYS` sets how many times the captured graph is
//! launched under churn (default 1000).

#[path = "../../stand-ins/support/child.rs"]
mod child_process;
mod common;

use memgov::hip::raw as hip;
use memgov::hip::{HipConfig, HipContext};
use memgov::{BackendErrorKind, DeviceContext, Execution};

const CHILD: &str = "MEMGOV_HIP_CAPTURE_CHILD";
const LATENCY: &str = "MEMGOV_STANDIN_HIP_LATENCY_US";
const SEED: &str = "MEMGOV_STANDIN_HIP_LATENCY_SEED";
const EXIT_CHECK: &str = "MEMGOV_STANDIN_HIP_EXIT_CHECK";
const BANNER: &str = "memgov libamdhip64 stand-in: contract violation:";

/// Whether the stand-in is what the backend opens (after printing why not).
fn on_stand_in() -> bool {
    match HipContext::new(HipConfig::default()) {
        Ok(ctx) => {
            let stand_in = ctx.describe().execution == Execution::StandIn;
            ctx.teardown(false).expect("teardown");
            if !stand_in {
                println!("skipped: needs the stand-in libamdhip64 (this is real hardware)");
            }
            stand_in
        }
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            println!("skipped: {}", e.message);
            false
        }
        Err(e) => panic!("HipContext::new failed: {e}"),
    }
}

fn child(case: &str, env: &[(&str, &str)]) -> Option<child_process::ChildRun> {
    if !on_stand_in() {
        return None;
    }
    let mut env = env.to_vec();
    if env.iter().any(|(k, _)| *k == LATENCY) && !env.iter().any(|(k, _)| *k == SEED) {
        env.push((SEED, ""));
    }
    Some(child_process::run(CHILD, case, &env))
}

fn passes(case: &str, env: &[(&str, &str)]) {
    if let Some(run) = child(case, env) {
        print!("{}", run.stdout);
        child_process::assert_passed(case, &run, &format!("child {case}: ok"));
    }
}

fn aborts(case: &str, env: &[(&str, &str)], what: &str) {
    if let Some(run) = child(case, env) {
        child_process::assert_aborted(case, &run, BANNER, what, &format!("child {case}: ok"));
    }
}

#[test]
fn a_graph_with_allocations_replays_while_another_thread_allocates_trims_and_releases() {
    for seed in ["1", "2"] {
        passes(
            "replay_under_churn",
            &[(LATENCY, "200"), (SEED, seed), (EXIT_CHECK, "1")],
        );
    }
}

#[test]
fn a_capture_pool_running_out_is_a_typed_refusal_and_the_capture_stays_valid() {
    passes("pool_exhausted", &[(EXIT_CHECK, "1")]);
}

#[test]
fn capability_capture_cases_pass_on_the_hip_backend() {
    passes("capability_capture", &[(EXIT_CHECK, "1")]);
}

#[test]
fn fault_matrix_cells_begin_and_end_capture_at_each_position() {
    passes(
        "fault_cells",
        &[
            (
                common::FAULT_ENTRIES,
                "hipStreamBeginCapture:2,hipStreamEndCapture:2",
            ),
            (EXIT_CHECK, "1"),
        ],
    );
}

#[test]
fn a_map_on_the_capturing_thread_is_refused_not_invalidating() {
    passes("own_thread_map", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_map_on_another_thread_waits_for_the_capture_to_end() {
    passes("map_waits", &[(EXIT_CHECK, "1")]);
}

#[test]
fn another_contexts_page_locked_allocation_and_free_wait_for_a_global_capture() {
    passes("page_locked_waits", &[(EXIT_CHECK, "1")]);
}

#[test]
fn an_end_that_leaves_the_capture_live_keeps_the_gate_closed_until_teardown() {
    passes("end_fails_live", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_capture_pool_too_large_to_round_is_a_typed_refusal() {
    passes("huge_pool", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_graph_launch_while_its_arena_sleeps_is_refused() {
    passes("launch_asleep", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_sleep_waits_for_a_copy_or_launch_between_its_awake_check_and_its_enqueue() {
    passes("paused_enqueue_sleep", &[(EXIT_CHECK, "1")]);
}

#[test]
fn graph_launches_and_copies_racing_sleeps_never_touch_released_memory() {
    for seed in ["1", "2", "3"] {
        passes(
            "launch_sleep_race",
            &[(LATENCY, "100"), (SEED, seed), (EXIT_CHECK, "1")],
        );
    }
}

#[test]
fn a_governed_capture_charges_its_pool_until_the_graph_is_destroyed() {
    passes("governed_pool_charged", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_trim_during_a_capture_is_deferred_to_its_end() {
    passes("trim_deferred", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_sleep_during_a_capture_waits_for_its_end() {
    passes("sleep_waits", &[(EXIT_CHECK, "1")]);
}

#[test]
fn teardown_destroys_live_graphs_after_their_launches_and_reports_them() {
    passes("teardown_live_graph", &[(EXIT_CHECK, "1")]);
}

/// A ROCm with the virtual memory calls but without the graph calls: the
/// stand-in built without its `graph.c`. A capture is `Unsupported`,
/// naming the first missing symbol; the arena still works.
#[test]
fn a_runtime_lacking_the_capture_calls_makes_capture_unsupported() {
    if !on_stand_in() {
        return;
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hip-without-graphs");
    std::fs::create_dir_all(&out).expect("a directory for the partial stand-in");
    let lib = out.join("libamdhip64.so.5");
    let status = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=gnu11", "-O1", "-fPIC", "-shared", "-pthread"])
        .arg(format!("-I{root}/stand-ins/common"))
        .arg("-Wl,-soname,libamdhip64.so.5")
        .arg("-o")
        .arg(&lib)
        .arg(format!("{root}/hip/stand-in/libamdhip64.c"))
        .arg(format!("{root}/hip/stand-in/vmm.c"))
        .arg(format!("{root}/stand-ins/common/standin.c"))
        .status()
        .expect("run the C compiler (the stand-in needs one)");
    assert!(status.success(), "building the partial stand-in failed");
    let run = child_process::run(
        CHILD,
        "no_graphs",
        &[("MEMGOV_HIP_RUNTIME", lib.to_str().expect("a UTF-8 path"))],
    );
    print!("{}", run.stdout);
    child_process::assert_passed("no_graphs", &run, "child no_graphs: ok");
}

#[test]
fn stand_in_records_a_capture_and_replays_it() {
    passes("standin_records", &[]);
}

#[test]
fn stand_in_synchronizing_a_capturing_stream_invalidates_the_capture() {
    passes("standin_sync_invalidates", &[]);
}

#[test]
fn stand_in_prohibits_unsafe_calls_per_capture_mode() {
    passes("standin_modes", &[]);
}

#[test]
fn stand_in_page_locked_allocation_and_free_on_another_thread_invalidate_a_global_capture() {
    passes("standin_page_locked", &[]);
}

#[test]
fn negative_destroying_a_capturing_stream_aborts() {
    aborts("standin_destroy_capturing", &[], "while it is capturing");
}

#[test]
fn negative_launch_of_a_graph_copying_into_freed_memory_aborts() {
    aborts(
        "standin_launch_freed",
        &[],
        "hipGraphLaunch of 4096 bytes at already freed device pointer",
    );
}

#[test]
fn negative_launch_of_a_graph_copying_into_unmapped_memory_aborts() {
    aborts("standin_launch_unmapped", &[], "that is not mapped");
}

#[test]
fn negative_graphs_left_at_exit_abort() {
    // The case itself runs to its end; the exit check aborts after it.
    if let Some(run) = child("standin_graph_leftovers", &[(EXIT_CHECK, "1")]) {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(run.status.signal(), Some(6), "{}", run.output());
        assert!(
            run.stdout.contains("child standin_graph_leftovers: ok"),
            "{}",
            run.output()
        );
        assert!(
            run.stderr.contains(&format!(
                "{BANNER} at exit: 1 graph(s) and 1 executable graph(s) never destroyed"
            )),
            "{}",
            run.output()
        );
    }
}

/// Entry point of the re-executed binary; does nothing in a normal run.
#[test]
#[ignore = "runs only as the child process of another test"]
fn child_entry() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    cases::run(&case);
    println!("child {case}: ok");
}

mod cases {
    use super::*;
    use memgov::hip::{
        ArenaConfig, CaptureConfig, CaptureMode, HipArena, HipMemory, HipStream, PoolExhausted,
    };
    use memgov::RetireSignal;
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;
    const G: usize = 2 << 20;

    /// The stand-in's `memgov_standin_hip_capture`: {captures begun,
    /// invalidated, runtime allocations made during a capture, launches}.
    fn stats() -> [u64; 4] {
        let p = hip::symbol(c"memgov_standin_hip_capture").expect("the stand-in's hook");
        // SAFETY: the stand-in's hook, `int (unsigned long long out[4])`.
        let query: unsafe extern "C" fn(*mut u64) -> i32 = unsafe { std::mem::transmute(p) };
        let mut out = [u64::MAX; 4];
        // SAFETY: four writable slots.
        assert_eq!(unsafe { query(out.as_mut_ptr()) }, 0);
        out
    }

    fn arena_context(limit: u64) -> HipContext {
        HipContext::new(HipConfig {
            arena: Some(ArenaConfig {
                reserve_bytes: 1 << 30,
                limit_bytes: limit,
            }),
            ..HipConfig::default()
        })
        .expect("a context with an arena")
    }

    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
            .collect()
    }

    fn release(ctx: &HipContext, s: &HipStream, m: HipMemory, retired: &Arc<AtomicU64>) {
        let r = retired.clone();
        ctx.free_async(
            s,
            m,
            RetireSignal::from_fn(move |_| {
                r.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .map_err(|(_, _, e)| e)
        .expect("release");
    }

    /// A capture with three buffers from its pool, uploads and downloads,
    /// while another thread allocates, releases and trims the same arena;
    /// then the graph replays while the churn goes on.
    fn replay_under_churn() {
        let replays: u64 = std::env::var("MEMGOV_CAPTURE_REPLAYS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        let ctx = Arc::new(arena_context(256 * MIB));
        let arena: HipArena = ctx.arena().expect("arena");
        let s = ctx.create_stream().expect("stream");
        let t = ctx.create_stream().expect("stream");
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicU64::new(0));
        let churn = {
            let (ctx, arena, stop, started) =
                (ctx.clone(), arena.clone(), stop.clone(), started.clone());
            std::thread::spawn(move || {
                let retired = Arc::new(AtomicU64::new(0));
                let mut released = 0;
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    started.fetch_add(1, Ordering::SeqCst);
                    // 3 granules and a bit: maps at least one granule each
                    // time after the trim below.
                    let m = ctx.allocate(&t, 6 * MIB + 4096).expect("churn allocate");
                    ctx.write(&t, &m, 0, &pattern(i, 4096))
                        .expect("churn write");
                    release(&ctx, &t, m, &retired);
                    released += 1;
                    ctx.synchronize(&t).expect("churn sync");
                    while retired.load(Ordering::SeqCst) < released {
                        std::thread::yield_now();
                    }
                    arena.trim().expect("churn trim");
                    i += 1;
                }
                t
            })
        };
        while started.load(Ordering::SeqCst) < 3 {
            std::thread::yield_now();
        }
        let before = stats();
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: 4 * MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin capture");
        let at_begin = started.load(Ordering::SeqCst);
        let a = cap.allocate(MIB).expect("a");
        let b = cap.allocate(MIB + 100).expect("b");
        let c = cap.allocate(4096).expect("c");
        cap.upload(&a, 0, pattern(1, MIB as usize))
            .expect("upload a");
        cap.upload(&b, 100, pattern(2, MIB as usize))
            .expect("upload b");
        cap.upload(&c, 0, pattern(3, 4096)).expect("upload c");
        let out_a = cap.download(&a, 0, MIB as usize).expect("download a");
        let out_b = cap.download(&b, 100, MIB as usize).expect("download b");
        let out_c = cap.download(&c, 0, 4096).expect("download c");
        // Let the churn thread reach its next map during the capture: with
        // the gate it waits for the end; without, the runtime would refuse
        // it and invalidate the capture.
        // (A churn thread already held at the gate, by a trim that found no
        // capture and then a map or unmap that found this one, starts no
        // round until the end: that counts too.)
        let gate = memgov::hip::capture_gate();
        while started.load(Ordering::SeqCst) < at_begin + 1 && gate.waiting() == 0 {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(30));
        let during = stats();
        let mut graph = cap.end().expect("end capture: not invalidated");
        assert_eq!(during[1], before[1], "no capture invalidated");
        assert_eq!(
            during[2], before[2],
            "no runtime allocation while the capture was under way"
        );
        for n in 0..replays {
            graph.launch(&s).expect("launch");
            if n % 100 == 0 || n + 1 == replays {
                assert_eq!(
                    graph.read_output(out_a).expect("a"),
                    pattern(1, MIB as usize)
                );
                assert_eq!(
                    graph.read_output(out_b).expect("b"),
                    pattern(2, MIB as usize)
                );
                assert_eq!(graph.read_output(out_c).expect("c"), pattern(3, 4096));
            }
        }
        let after = stats();
        assert_eq!(after[1], before[1], "no capture invalidated");
        assert_eq!(after[3] - before[3], replays, "every launch ran");
        stop.store(true, Ordering::SeqCst);
        let t = churn.join().expect("churn thread");
        let churned = started.load(Ordering::SeqCst);
        graph.destroy().expect("destroy");
        assert_eq!(
            arena.snapshot().in_use,
            0,
            "the pool went back to the arena"
        );
        let ctx = Arc::into_inner(ctx).expect("sole owner");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.destroy_stream(t).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
        println!(
            "{replays} replays, {churned} churn rounds (allocate, write, release, trim), \
             0 invalidated, 0 runtime allocations during the capture"
        );
    }

    fn pool_exhausted() {
        let ctx = arena_context(64 * MIB);
        let s = ctx.create_stream().expect("stream");
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        let a = cap.allocate(768 << 10).expect("fits");
        let refused = cap.allocate(512 << 10).expect_err("does not fit");
        assert_eq!(
            refused,
            PoolExhausted {
                backend: "hip",
                requested: 512 << 10,
                free: 256 << 10,
                pool: MIB
            }
        );
        let e = memgov::BackendError::from(refused);
        assert_eq!(e.kind, BackendErrorKind::OutOfMemory);
        assert!(
            e.message.contains("262144 B free of 1048576 B"),
            "{}",
            e.message
        );
        cap.upload(&a, 0, pattern(9, 4096))
            .expect("still capturing");
        let out = cap.download(&a, 0, 4096).expect("download");
        let mut graph = cap.end().expect("the capture is still valid");
        graph.launch(&s).expect("launch");
        assert_eq!(graph.read_output(out).expect("read"), pattern(9, 4096));
        graph.launch(&s).expect("launch");
        // Dropped, not destroyed: the drop waits for the launch, then gives
        // the pool back.
        drop(graph);
        assert_eq!(ctx.arena().expect("arena").snapshot().in_use, 0);
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    fn own_thread_map() {
        let ctx = arena_context(64 * MIB);
        let s = ctx.create_stream().expect("stream");
        let before = stats();
        let cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        // Needs granules beyond the pool's: refused by the gate, not by
        // the runtime.
        let e = ctx.allocate(&s, 8 * MIB).expect_err("refused");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains("stream capture is under way"), "{e}");
        // Synchronizing the stream being captured: refused, not invalidating.
        let e = ctx.synchronize(&s).expect_err("refused");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains("end the capture first"), "{e}");
        // Destroying it: refused, the stream kept.
        let e = ctx.destroy_stream(s).expect_err("refused");
        assert!(e.message.contains("is being captured"), "{e}");
        let s = ctx.create_stream().expect("the governed stream again");
        let graph = cap.end().expect("not invalidated");
        assert_eq!(stats()[1], before[1]);
        graph.destroy().expect("destroy");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    /// Another thread's allocation needs a map while a global capture is
    /// under way: the gate holds it until the capture ends, so the capture
    /// is not invalidated and the runtime sees no allocation during it.
    /// (A broken gate fails here: the stand-in would invalidate the
    /// capture; a slow thread can only make the test pass vacuously.)
    fn map_waits() {
        let ctx = Arc::new(arena_context(64 * MIB));
        let s = ctx.create_stream().expect("stream");
        let t = ctx.create_stream().expect("stream");
        let before = stats();
        let cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        let asking = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let other = {
            let (ctx, asking, done) = (ctx.clone(), asking.clone(), done.clone());
            std::thread::spawn(move || {
                asking.store(true, Ordering::SeqCst);
                let m = ctx
                    .allocate(&t, 8 * MIB)
                    .expect("allocate after the capture");
                done.store(true, Ordering::SeqCst);
                (t, m)
            })
        };
        while !asking.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !done.load(Ordering::SeqCst),
            "the map waited for the capture"
        );
        let graph = cap.end().expect("not invalidated");
        let (t, m) = other.join().expect("the other thread");
        let after = stats();
        assert_eq!(after[1], before[1], "no capture invalidated");
        assert_eq!(
            after[2], before[2],
            "no runtime allocation during the capture"
        );
        graph.destroy().expect("destroy");
        let retired = Arc::new(AtomicU64::new(0));
        release(&ctx, &t, m, &retired);
        ctx.synchronize(&t).expect("synchronize");
        let ctx = Arc::into_inner(ctx).expect("sole owner");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.destroy_stream(t).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    /// A second context's page-locked allocation, and the free thread's
    /// `hipHostFree` of its release, on other threads while a global-mode
    /// capture is under way: both wait at the gate until the capture ends
    /// (the runtime forbids them during the capture and would invalidate
    /// it), then complete.
    fn page_locked_waits() {
        use memgov::Tier;
        let ctx = arena_context(64 * MIB);
        let s = ctx.create_stream().expect("stream");
        let other = Arc::new(HipContext::new(HipConfig::default()).expect("a second context"));
        let os = Arc::new(other.create_stream().expect("stream"));
        let kept = other
            .allocate_in(&os, 4096, Tier::PinnedHost)
            .expect("page-locked, before the capture");
        let gate = memgov::hip::capture_gate();
        let before = stats();
        let global = || CaptureConfig {
            pool_bytes: MIB,
            mode: CaptureMode::Global,
        };
        // The allocation: held back until the capture ends.
        let cap = ctx.begin_capture(&s, global()).expect("begin");
        let alloc = {
            let (other, os) = (other.clone(), os.clone());
            std::thread::spawn(move || other.allocate_in(&os, 4096, Tier::PinnedHost))
        };
        while gate.waiting() == 0 && !alloc.is_finished() {
            std::thread::yield_now();
        }
        let graph = cap.end().expect("not invalidated by the other allocation");
        let m = alloc
            .join()
            .expect("thread")
            .expect("allocated after the end");
        graph.destroy().expect("destroy");
        // The free: the free thread's hipHostFree waits for the end.
        let cap = ctx.begin_capture(&s, global()).expect("begin");
        let retired = Arc::new(AtomicU64::new(0));
        {
            let (other, os, retired) = (other.clone(), os.clone(), retired.clone());
            std::thread::spawn(move || {
                release(&other, &os, kept, &retired);
                release(&other, &os, m, &retired);
            })
            .join()
            .expect("thread");
        }
        while gate.waiting() == 0 && stats()[1] == before[1] && retired.load(Ordering::SeqCst) < 2 {
            std::thread::yield_now();
        }
        let graph = cap.end().expect("not invalidated by the other free");
        assert_eq!(stats()[1], before[1], "no capture invalidated");
        other.synchronize(&os).expect("synchronize");
        assert_eq!(retired.load(Ordering::SeqCst), 2, "both frees retired");
        graph.destroy().expect("destroy");
        let other = Arc::into_inner(other).expect("sole owner");
        other
            .destroy_stream(Arc::into_inner(os).expect("sole owner"))
            .expect("destroy stream");
        other.teardown(false).expect("teardown");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    /// An end (or a drop) whose device cannot be made current
    /// (`hipGetDevice` refused) never reaches `hipStreamEndCapture`: the
    /// runtime still captures, so the gate keeps another context's
    /// page-locked allocation waiting (it would invalidate the global
    /// capture). The context's teardown ends the capture and opens the
    /// gate; the allocation then runs and nothing was invalidated.
    fn end_fails_live() {
        use memgov::Tier;
        let gate = memgov::hip::capture_gate();
        for via_drop in [false, true] {
            let ctx = arena_context(64 * MIB);
            let s = ctx.create_stream().expect("stream");
            let other = Arc::new(HipContext::new(HipConfig::default()).expect("a second context"));
            let os = Arc::new(other.create_stream().expect("stream"));
            let before = stats();
            let global = CaptureConfig {
                pool_bytes: MIB,
                mode: CaptureMode::Global,
            };
            let mut cap = ctx.begin_capture(&s, global).expect("begin");
            let buf = cap.allocate(4096).expect("carve");
            cap.upload(&buf, 0, vec![7; 4096]).expect("upload");
            let alloc = {
                let (other, os) = (other.clone(), os.clone());
                std::thread::spawn(move || other.allocate_in(&os, 4096, Tier::PinnedHost))
            };
            while gate.waiting() == 0 {
                assert!(!alloc.is_finished(), "the allocation waits for the capture");
                std::thread::yield_now();
            }
            common::fail_entry(Some(("hipGetDevice", 1)));
            if via_drop {
                drop(cap);
            } else {
                let e = cap.end().expect_err("the device could not be made current");
                assert!(e.message.contains("hipGetDevice"), "{e}");
            }
            common::fail_entry(None);
            assert!(
                gate.capturing(),
                "the runtime still captures (drop: {via_drop}): the gate keeps it"
            );
            assert_eq!(gate.waiting(), 1, "the allocation still waits");
            assert!(!alloc.is_finished(), "the allocation still waits");
            assert_eq!(stats()[1], before[1], "nothing invalidated yet");
            ctx.teardown(false).expect("teardown ends the capture");
            assert!(!gate.capturing(), "teardown opened the gate");
            let m = alloc
                .join()
                .expect("thread")
                .expect("allocated after the capture ended");
            assert_eq!(m.tier(), Tier::PinnedHost);
            assert_eq!(stats()[1], before[1], "no capture invalidated");
            let retired = Arc::new(AtomicU64::new(0));
            release(&other, &os, m, &retired);
            other.synchronize(&os).expect("synchronize");
            assert_eq!(retired.load(Ordering::SeqCst), 1, "the free retired");
            let other = Arc::into_inner(other).expect("sole owner");
            other
                .destroy_stream(Arc::into_inner(os).expect("sole owner"))
                .expect("destroy stream");
            other.teardown(false).expect("teardown");
        }
    }

    /// Pool sizes near and at `u64::MAX`: refused before anything is taken
    /// (those whose rounding passes 64 bits with a typed error naming the
    /// largest that rounds, the others by the arena), never wrapped to a
    /// small pool; the arena is untouched and a capture works after.
    fn huge_pool() {
        let ctx = arena_context(64 * MIB);
        let arena = ctx.arena().expect("arena");
        let s = ctx.create_stream().expect("stream");
        let max = u64::MAX / 256 * 256;
        for pool_bytes in [u64::MAX, u64::MAX - 1, max + 1] {
            let e = ctx
                .begin_capture(
                    &s,
                    CaptureConfig {
                        pool_bytes,
                        mode: CaptureMode::Global,
                    },
                )
                .expect_err("too large to round");
            assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
            assert!(e.message.contains(&format!("at most {max} B")), "{e}");
        }
        for pool_bytes in [max, 1 << 62] {
            let e = ctx
                .begin_capture(
                    &s,
                    CaptureConfig {
                        pool_bytes,
                        mode: CaptureMode::Global,
                    },
                )
                .expect_err("larger than the arena");
            assert_ne!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        }
        let snap = arena.snapshot();
        assert_eq!((snap.in_use, snap.mapped), (0, 0), "{snap:?}");
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("a pool that fits");
        let a = cap.allocate(4096).expect("carved");
        cap.upload(&a, 0, pattern(8, 4096)).expect("upload");
        let graph = cap.end().expect("end");
        graph.destroy().expect("destroy");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    /// A captured graph whose pool sleeps with the arena: its launch is
    /// refused (the driver would run its copies on reserved memory that is
    /// not mapped), and after the wake it launches with the contents kept.
    fn launch_asleep() {
        let ctx = arena_context(64 * MIB);
        let arena = ctx.arena().expect("arena");
        let s = ctx.create_stream().expect("stream");
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        let a = cap.allocate(4096).expect("a");
        cap.upload(&a, 0, pattern(6, 4096)).expect("upload");
        let out = cap.download(&a, 0, 4096).expect("download");
        let mut graph = cap.end().expect("end");
        graph.launch(&s).expect("launch");
        arena.sleep(true).expect("sleep");
        let e = graph.launch(&s).expect_err("refused while asleep");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains("asleep"), "{e}");
        arena.wake().expect("wake");
        graph.launch(&s).expect("launch after the wake");
        assert_eq!(graph.read_output(out).expect("read"), pattern(6, 4096));
        graph.destroy().expect("destroy");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    /// The stand-in's pause hook (the tests' shared knob): the next call of
    /// `entry` blocks at its entry until resumed.
    fn pause_entry(entry: &std::ffi::CStr) {
        crate::common::pause_entry(Some((entry.to_str().expect("an ASCII name"), 1)));
    }

    fn paused() -> bool {
        crate::common::entry_paused()
    }

    fn resume() {
        crate::common::resume_entry();
        crate::common::pause_entry(None);
    }

    /// A write and a graph launch each held by the stand-in at the entry of
    /// their enqueue (`hipMemcpyHtoDAsync`, `hipGraphLaunch`), after their
    /// awake check; a sleep asked for then waits for them (seen waiting),
    /// so the work lands on mapped memory; the sleep then runs, and after
    /// the wake every byte is back.
    fn paused_enqueue_sleep() {
        let ctx = Arc::new(arena_context(64 * MIB));
        let arena = ctx.arena().expect("arena");
        let s = Arc::new(ctx.create_stream().expect("stream"));
        let m = Arc::new(ctx.allocate(&s, 4096).expect("buffer"));
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        let a = cap.allocate(4096).expect("a");
        cap.upload(&a, 0, pattern(9, 4096)).expect("upload");
        let out = cap.download(&a, 0, 4096).expect("download");
        let graph = Arc::new(std::sync::Mutex::new(cap.end().expect("end")));
        for entry in [c"hipMemcpyHtoDAsync", c"hipGraphLaunch"] {
            pause_entry(entry);
            let work = {
                let (ctx, s, m, graph) = (ctx.clone(), s.clone(), m.clone(), graph.clone());
                let write = entry == c"hipMemcpyHtoDAsync";
                std::thread::spawn(move || {
                    if write {
                        ctx.write(&s, &m, 0, &pattern(10, 4096))
                    } else {
                        graph.lock().unwrap().launch(&s)
                    }
                })
            };
            while !paused() {
                std::thread::yield_now();
            }
            let sleeper = {
                let arena = arena.clone();
                std::thread::spawn(move || arena.sleep(true))
            };
            // The sleep waits for the work held past its check (or, were
            // it not excluded, would sleep under it).
            while arena.sleeps_waiting() == 0 && arena.snapshot().asleep == 0 {
                std::thread::yield_now();
            }
            assert_eq!(
                arena.snapshot().asleep,
                0,
                "{entry:?}: slept under queued work"
            );
            resume();
            work.join().expect("work").expect("the held work ran awake");
            sleeper.join().expect("sleeper").expect("sleep");
            arena.wake().expect("wake");
        }
        let mut back = vec![0u8; 4096];
        ctx.read(&s, &m, 0, &mut back).expect("read");
        assert_eq!(
            back,
            pattern(10, 4096),
            "written before the sleep, back after the wake"
        );
        let mut graph = Arc::into_inner(graph).unwrap().into_inner().unwrap();
        assert_eq!(graph.read_output(out).expect("output"), pattern(9, 4096));
        graph.destroy().expect("destroy");
        let retired = Arc::new(AtomicU64::new(0));
        release(&ctx, &s, Arc::into_inner(m).expect("sole owner"), &retired);
        ctx.synchronize(&s).expect("synchronize");
        let ctx = Arc::into_inner(ctx).expect("sole owner");
        ctx.destroy_stream(Arc::into_inner(s).expect("sole owner"))
            .expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    /// One thread launches a graph and writes and reads an arena buffer in
    /// a loop; another puts the arena to sleep and wakes it. Each launch and
    /// copy is either refused as asleep or runs on mapped memory (the
    /// stand-in aborts on a copy to reserved memory that is not mapped);
    /// what was written is read back at the same address.
    fn launch_sleep_race() {
        let ctx = Arc::new(arena_context(64 * MIB));
        let arena = ctx.arena().expect("arena");
        let s = Arc::new(ctx.create_stream().expect("stream"));
        let m = ctx.allocate(&s, 4096).expect("buffer");
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        let a = cap.allocate(4096).expect("a");
        cap.upload(&a, 0, pattern(7, 4096)).expect("upload");
        let graph = cap.end().expect("end");
        let cycles = 50u64;
        let done = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let sleeper = {
            let (arena, done, rounds) = (arena.clone(), done.clone(), rounds.clone());
            std::thread::spawn(move || {
                for _ in 0..cycles {
                    // Each sleep begins during a round of the other thread.
                    let r = rounds.load(Ordering::SeqCst);
                    while rounds.load(Ordering::SeqCst) == r {
                        std::thread::yield_now();
                    }
                    arena.sleep(true).expect("sleep");
                    arena.wake().expect("wake");
                }
                done.store(true, Ordering::SeqCst);
            })
        };
        let (mut ran, mut refused) = (0u64, 0u64);
        let mut i = 0u64;
        while !done.load(Ordering::SeqCst) {
            i += 1;
            let data = pattern(i, 4096);
            let launched = graph.launch(&s);
            let written = ctx.write(&s, &m, 0, &data);
            let mut back = vec![0u8; 4096];
            let read = written.as_ref().map(|_| ctx.read(&s, &m, 0, &mut back));
            for r in [&launched, &written] {
                match r {
                    Ok(()) => ran += 1,
                    Err(e) => {
                        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
                        assert!(e.message.contains("asleep"), "{e}");
                        refused += 1;
                    }
                }
            }
            if let Ok(Ok(())) = read {
                assert_eq!(back, data, "read back at the same address");
            }
            rounds.fetch_add(1, Ordering::SeqCst);
        }
        sleeper.join().expect("sleeper");
        ctx.synchronize(&s).expect("synchronize");
        graph.destroy().expect("destroy");
        let retired = Arc::new(AtomicU64::new(0));
        release(&ctx, &s, m, &retired);
        ctx.synchronize(&s).expect("synchronize");
        let ctx = Arc::into_inner(ctx).expect("sole owner");
        ctx.destroy_stream(Arc::into_inner(s).expect("sole owner"))
            .expect("destroy stream");
        ctx.teardown(false).expect("teardown");
        println!("launch/sleep race: {ran} ran, {refused} refused as asleep, {cycles} sleeps");
    }

    /// A capture on a governed HIP context (`memgov::hip_capture`): a
    /// 64 MiB pool charged to the budget from before the capture begins
    /// (seen from inside the recording) while the graph lives, 0 after
    /// destroy; a pool over budget refused with no capture begun; a pool
    /// too large to round refused with nothing charged.
    fn governed_pool_charged() {
        use memgov::hip_capture::{CaptureExt, POOL_LABEL};
        use memgov::{ContextConfig, Governor, GovernorError};
        use std::time::{Duration, Instant};
        let gov = Governor::new();
        let ctx = gov.register(
            arena_context(256 * MIB),
            ContextConfig::new().label("captured").budget(96 * MIB),
        );
        let s = ctx.create_stream("s").expect("stream");
        let watcher = ctx.clone();
        let config = |pool_bytes| CaptureConfig {
            pool_bytes,
            mode: CaptureMode::Global,
        };
        let (mut graph, out) = ctx
            .capture(&s, config(64 * MIB), |cap| {
                let during = watcher.snapshot();
                assert_eq!(during.charged, 64 * MIB, "charged before capture began");
                assert_eq!(during.reservations[0].label, POOL_LABEL);
                let a = cap.allocate(MIB)?;
                cap.upload(&a, 0, pattern(5, MIB as usize))?;
                cap.download(&a, 0, MIB as usize)
            })
            .expect("capture");
        assert_eq!(
            ctx.snapshot().charged,
            64 * MIB,
            "charged while the graph lives"
        );
        assert_eq!(graph.pool_usage(), (MIB, 64 * MIB));
        graph.launch(&s).expect("launch");
        assert_eq!(
            graph.read_output(out).expect("read"),
            pattern(5, MIB as usize)
        );
        // A second pool over what the first left of the budget: refused by
        // the governor, no capture begun.
        let before = stats();
        let e = ctx
            .capture(
                &s,
                config(64 * MIB),
                |_| -> Result<(), memgov::BackendError> { panic!("the recording must not run") },
            )
            .expect_err("over budget");
        assert!(matches!(e, GovernorError::BudgetExceeded(_)), "{e}");
        assert_eq!(stats()[0], before[0], "no hipStreamBeginCapture");
        let e = ctx
            .capture(
                &s,
                config(u64::MAX),
                |_| -> Result<(), memgov::BackendError> { panic!("the recording must not run") },
            )
            .expect_err("too large to round");
        assert!(e.to_string().contains("64-bit limit"), "{e}");
        assert_eq!(ctx.snapshot().charged, 64 * MIB, "nothing more charged");
        graph.destroy().expect("destroy");
        assert!(graph.is_destroyed());
        assert_eq!(ctx.snapshot().charged, 0, "the pool's charge came back");
        drop((graph, s));
        let report = ctx
            .retire()
            .wait(Instant::now() + Duration::from_secs(10))
            .expect("retire");
        report.backend_result.expect("clean teardown");
        println!(
            "governed capture on HIP: 64 MiB pool charged while its graph lived, 0 after destroy"
        );
    }

    fn trim_deferred() {
        let ctx = arena_context(64 * MIB);
        let arena = ctx.arena().expect("arena");
        let s = ctx.create_stream().expect("stream");
        let retired = Arc::new(AtomicU64::new(0));
        let m = ctx.allocate(&s, 8 * MIB).expect("allocate");
        release(&ctx, &s, m, &retired);
        ctx.synchronize(&s).expect("synchronize");
        assert_eq!(retired.load(Ordering::SeqCst), 1, "the release retired");
        assert_eq!(arena.snapshot().cached, 8 * MIB);
        let before = stats();
        let cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        // The pool took one cached granule; the other three stay mapped:
        // the trim is deferred, not run.
        assert_eq!(arena.trim().expect("trim"), 0);
        assert_eq!(
            arena.snapshot().cached,
            6 * MIB,
            "nothing unmapped during the capture"
        );
        let graph = cap.end().expect("not invalidated");
        assert_eq!(stats()[1], before[1]);
        // The end of the capture ran the deferred trim.
        let snap = arena.snapshot();
        assert_eq!((snap.cached, snap.mapped), (0, 2 * MIB), "{snap:?}");
        graph.destroy().expect("destroy");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    /// Another thread puts the arena to sleep while a capture is under way:
    /// the sleep (which synchronizes every stream, the captured one too, and
    /// unmaps) waits for the capture's end.
    fn sleep_waits() {
        let ctx = Arc::new(arena_context(64 * MIB));
        let arena = ctx.arena().expect("arena");
        let s = ctx.create_stream().expect("stream");
        let before = stats();
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::Global,
                },
            )
            .expect("begin");
        let a = cap.allocate(4096).expect("a");
        let sleeper = {
            let arena = arena.clone();
            std::thread::spawn(move || arena.sleep(true).expect("sleep"))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        cap.upload(&a, 0, pattern(5, 4096)).expect("upload");
        let out = cap.download(&a, 0, 4096).expect("download");
        let mut graph = cap.end().expect("not invalidated");
        let report = sleeper.join().expect("sleeper");
        assert_eq!(stats()[1], before[1], "no capture invalidated");
        assert!(arena.snapshot().asleep > 0, "{report:?}");
        arena.wake().expect("wake");
        graph.launch(&s).expect("launch");
        assert_eq!(graph.read_output(out).expect("read"), pattern(5, 4096));
        graph.destroy().expect("destroy");
        let ctx = Arc::into_inner(ctx).expect("sole owner");
        ctx.destroy_stream(s).expect("destroy stream");
        ctx.teardown(false).expect("teardown");
    }

    fn teardown_live_graph() {
        let ctx = arena_context(64 * MIB);
        let arena = ctx.arena().expect("arena");
        let s = ctx.create_stream().expect("stream");
        let mut cap = ctx
            .begin_capture(
                &s,
                CaptureConfig {
                    pool_bytes: MIB,
                    mode: CaptureMode::ThreadLocal,
                },
            )
            .expect("begin");
        let a = cap.allocate(4096).expect("a");
        cap.upload(&a, 0, pattern(4, 4096)).expect("upload");
        let graph = cap.end().expect("end");
        for _ in 0..10 {
            graph.launch(&s).expect("launch");
        }
        assert_eq!(arena.snapshot().in_use, MIB, "the graph pins its pool");
        ctx.destroy_stream(s).expect("destroy stream");
        let e = ctx.teardown(false).expect_err("a live graph is reported");
        assert!(e.message.contains("1 executable graph(s)"), "{e}");
        // Destroyed by teardown already: nothing left to do, no runtime call.
        graph.destroy().expect("destroy after teardown");
    }

    // ---- raw runtime calls for the stand-in's rules ----------------------

    fn ok(r: i32, what: &str) {
        assert_eq!(r, hip::SUCCESS, "{what}");
    }

    struct Raw {
        _ctx: HipContext,
        s: hip::hipStream_t,
    }

    /// A context and a raw stream (device 0 is current on every thread by
    /// default).
    fn raw() -> Raw {
        let ctx = HipContext::new(HipConfig::default()).expect("context");
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        ok(
            unsafe { hip::hipStreamCreateWithFlags(&mut s, hip::hipStreamNonBlocking) },
            "stream",
        );
        Raw { _ctx: ctx, s }
    }

    fn alloc(r: &Raw, bytes: usize) -> *mut c_void {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out pointer, live stream.
        ok(unsafe { hip::hipMallocAsync(&mut p, bytes, r.s) }, "alloc");
        p
    }

    fn begin(s: hip::hipStream_t, mode: i32) {
        // SAFETY: a live stream.
        ok(unsafe { hip::hipStreamBeginCapture(s, mode) }, "begin");
    }

    fn end(s: hip::hipStream_t) -> (i32, hip::hipGraph_t) {
        let mut g = std::ptr::null_mut();
        // SAFETY: a live stream, valid out pointer.
        let r = unsafe { hip::hipStreamEndCapture(s, &mut g) };
        (r, g)
    }

    fn status(s: hip::hipStream_t) -> (i32, u64) {
        let (mut st, mut id) = (-1, 0);
        // SAFETY: a live stream, valid out pointers.
        ok(
            unsafe { hip::hipStreamGetCaptureInfo(s, &mut st, &mut id) },
            "capture info",
        );
        (st, id)
    }

    fn instantiate(g: hip::hipGraph_t) -> hip::hipGraphExec_t {
        let mut e = std::ptr::null_mut();
        // SAFETY: a graph from hipStreamEndCapture, valid out pointer.
        ok(
            unsafe {
                hip::hipGraphInstantiate(&mut e, g, std::ptr::null_mut(), std::ptr::null_mut(), 0)
            },
            "instantiate",
        );
        e
    }

    fn create_handle() -> (i32, hip::hipMemGenericAllocationHandle_t) {
        let mut v = 0;
        // SAFETY: valid out pointer.
        ok(unsafe { hip::hipRuntimeGetVersion(&mut v) }, "version");
        let p = hip::allocation_prop(0, v);
        let mut h = std::ptr::null_mut();
        // SAFETY: valid out pointer and properties.
        let r = unsafe { hip::hipMemCreate(&mut h, G, p.as_ptr(), 0) };
        (r, h)
    }

    const GLOBAL: i32 = hip::hipStreamCaptureModeGlobal;
    const LOCAL: i32 = hip::hipStreamCaptureModeThreadLocal;
    const RELAXED: i32 = hip::hipStreamCaptureModeRelaxed;
    const UNSUPPORTED: i32 = hip::hipErrorStreamCaptureUnsupported;
    const INVALIDATED: i32 = hip::hipErrorStreamCaptureInvalidated;
    const NONE: i32 = 0;
    const ACTIVE: i32 = hip::hipStreamCaptureStatusActive;
    const STATUS_INVALIDATED: i32 = 2;

    /// A raw pointer the closure of another thread may carry.
    #[derive(Clone, Copy)]
    struct Send<T>(T);
    // SAFETY: runtime handles, usable from any host thread.
    unsafe impl<T> std::marker::Send for Send<T> {}

    fn on_other_thread<R: std::marker::Send + 'static>(
        r: &Raw,
        f: impl FnOnce(hip::hipStream_t) -> R + std::marker::Send + 'static,
    ) -> R {
        let s = Send(r.s);
        std::thread::spawn(move || {
            let s = s;
            f(s.0)
        })
        .join()
        .expect("thread")
    }

    pub(super) fn run(case: &str) {
        // SAFETY: raw runtime calls on the stand-in, each valid or the
        // violation the case plants on purpose; the stand-in aborts before
        // anything undefined happens.
        unsafe {
            match case {
                "capability_capture" => memgov_conformance::capability::report_cases(
                    memgov_conformance::capability::run_capture_cases(
                        common::capability_factory,
                        || common::capture_stats()[2],
                    ),
                ),
                "fault_cells" => common::fault_cells_child(),
                "replay_under_churn" => replay_under_churn(),
                "pool_exhausted" => pool_exhausted(),
                "own_thread_map" => own_thread_map(),
                "teardown_live_graph" => teardown_live_graph(),
                "trim_deferred" => trim_deferred(),
                "governed_pool_charged" => governed_pool_charged(),
                "launch_asleep" => launch_asleep(),
                "launch_sleep_race" => launch_sleep_race(),
                "paused_enqueue_sleep" => paused_enqueue_sleep(),
                "huge_pool" => huge_pool(),
                "page_locked_waits" => page_locked_waits(),
                "end_fails_live" => end_fails_live(),
                "sleep_waits" => sleep_waits(),
                "map_waits" => map_waits(),
                "no_graphs" => {
                    let ctx = arena_context(64 * MIB);
                    let s = ctx.create_stream().expect("stream");
                    let e = ctx
                        .begin_capture(
                            &s,
                            CaptureConfig {
                                pool_bytes: MIB,
                                mode: CaptureMode::Global,
                            },
                        )
                        .expect_err("no capture without the graph calls");
                    assert_eq!(e.kind, BackendErrorKind::Unsupported, "{e}");
                    assert!(
                        e.message.contains(
                            "needs hipStreamBeginCapture, which the loaded HIP runtime does not \
                             export"
                        ),
                        "names the missing symbol: {e}"
                    );
                    println!("no graph calls: {e}");
                    assert_eq!(ctx.arena().expect("arena").snapshot().mapped, 0);
                    // The arena still works on that runtime.
                    let m = ctx.allocate(&s, 4096).expect("allocate");
                    let retired = Arc::new(AtomicU64::new(0));
                    release(&ctx, &s, m, &retired);
                    ctx.synchronize(&s).expect("synchronize");
                    assert_eq!(retired.load(Ordering::SeqCst), 1);
                    ctx.destroy_stream(s).expect("destroy");
                    ctx.teardown(false).expect("teardown");
                }
                "standin_records" => {
                    let r = raw();
                    let d = alloc(&r, 4096);
                    let mut src = vec![1u8; 4096];
                    let mut dst = vec![0u8; 4096];
                    begin(r.s, GLOBAL);
                    let (st, id) = status(r.s);
                    assert_eq!(st, ACTIVE);
                    assert_ne!(id, 0, "a capture id");
                    ok(
                        hip::hipMemcpyHtoDAsync(d, src.as_ptr() as *mut c_void, 4096, r.s),
                        "h2d",
                    );
                    ok(
                        hip::hipMemcpyDtoHAsync(dst.as_mut_ptr().cast(), d, 4096, r.s),
                        "d2h",
                    );
                    // Recorded, not executed.
                    assert_eq!(dst, vec![0u8; 4096]);
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    assert_eq!(status(r.s).0, NONE);
                    let x = instantiate(g);
                    ok(hip::hipGraphDestroy(g), "graph destroy");
                    for v in [5u8, 6, 7] {
                        src.fill(v);
                        ok(hip::hipGraphLaunch(x, r.s), "launch");
                        ok(hip::hipStreamSynchronize(r.s), "sync");
                        assert_eq!(dst, vec![v; 4096], "launch replays the copies");
                    }
                    ok(hip::hipGraphExecDestroy(x), "exec destroy");
                    ok(hip::hipFreeAsync(d, r.s), "free");
                    ok(hip::hipStreamSynchronize(r.s), "sync");
                    ok(hip::hipStreamDestroy(r.s), "destroy");
                }
                "standin_sync_invalidates" => {
                    let r = raw();
                    for conflicting in [0, 1] {
                        begin(r.s, RELAXED);
                        let got = if conflicting == 0 {
                            hip::hipStreamSynchronize(r.s)
                        } else {
                            hip::hipStreamQuery(r.s)
                        };
                        assert_eq!(got, UNSUPPORTED);
                        assert_eq!(status(r.s).0, STATUS_INVALIDATED);
                        let (e, g) = end(r.s);
                        assert_eq!(e, INVALIDATED);
                        assert!(g.is_null());
                        assert_eq!(status(r.s).0, NONE);
                    }
                    assert_eq!(stats()[1], 2);
                    ok(hip::hipStreamDestroy(r.s), "destroy");
                }
                "standin_modes" => {
                    let r = raw();
                    // Global: another thread's hipMemCreate is prohibited and
                    // invalidates the capture.
                    begin(r.s, GLOBAL);
                    let (c, _) = on_other_thread(&r, |_| Send(create_handle())).0;
                    assert_eq!(c, UNSUPPORTED, "Global, other thread");
                    let (e, _) = end(r.s);
                    assert_eq!(e, INVALIDATED);
                    // ThreadLocal: another thread's is allowed, this
                    // thread's is not.
                    begin(r.s, LOCAL);
                    let (c, h) = on_other_thread(&r, |_| Send(create_handle())).0;
                    ok(c, "ThreadLocal, other thread");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    ok(hip::hipGraphDestroy(g), "graph destroy");
                    ok(hip::hipMemRelease(h), "release");
                    begin(r.s, LOCAL);
                    assert_eq!(create_handle().0, UNSUPPORTED, "ThreadLocal, own thread");
                    assert_eq!(end(r.s).0, INVALIDATED);
                    // Relaxed: allowed on the capturing thread, and the
                    // capture may end on another thread.
                    begin(r.s, RELAXED);
                    let (c, h) = create_handle();
                    ok(c, "Relaxed, own thread");
                    let g = on_other_thread(&r, |s| {
                        let (e, g) = end(s);
                        ok(e, "Relaxed ends on another thread");
                        Send(g)
                    });
                    ok(hip::hipGraphDestroy(g.0), "graph destroy");
                    ok(hip::hipMemRelease(h), "release");
                    // Global ends only on its own thread.
                    begin(r.s, GLOBAL);
                    let e = on_other_thread(&r, |s| end(s).0);
                    assert_eq!(e, hip::hipErrorStreamCaptureWrongThread);
                    let (e, g) = end(r.s);
                    ok(e, "end on the capturing thread");
                    ok(hip::hipGraphDestroy(g), "graph destroy");
                    // Runtime allocations made while a capture was under
                    // way: the prohibited and the allowed ones.
                    assert_eq!(stats()[2], 4);
                    ok(hip::hipStreamDestroy(r.s), "destroy");
                }
                "standin_page_locked" => {
                    // hipStreamCaptureModeGlobal, as CUDA's global mode:
                    // potentially unsafe API calls (page-locked allocation
                    // and free among them) are prohibited on every thread
                    // while a global capture is under way; the call fails
                    // and the capture is invalidated.
                    let r = raw();
                    let before = common::capture_stats();
                    let mut kept: *mut c_void = std::ptr::null_mut();
                    ok(
                        hip::hipHostMalloc(&mut kept, 4096, hip::hipHostMallocDefault),
                        "host alloc",
                    );
                    let kept = Send(kept);
                    begin(r.s, GLOBAL);
                    let c = on_other_thread(&r, |_| {
                        let mut p: *mut c_void = std::ptr::null_mut();
                        hip::hipHostMalloc(&mut p, 4096, hip::hipHostMallocDefault)
                    });
                    assert_eq!(c, UNSUPPORTED, "hipHostMalloc, Global, other thread");
                    let (e, g) = end(r.s);
                    assert_eq!(e, INVALIDATED);
                    assert!(g.is_null());
                    begin(r.s, GLOBAL);
                    let c = on_other_thread(&r, move |_| {
                        let kept = kept;
                        hip::hipHostFree(kept.0)
                    });
                    assert_eq!(c, UNSUPPORTED, "hipHostFree, Global, other thread");
                    assert_eq!(end(r.s).0, INVALIDATED);
                    // ThreadLocal: another thread's are allowed.
                    begin(r.s, LOCAL);
                    let c = on_other_thread(&r, move |_| {
                        let kept = kept;
                        hip::hipHostFree(kept.0)
                    });
                    ok(c, "hipHostFree, ThreadLocal, other thread");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    ok(hip::hipGraphDestroy(g), "graph destroy");
                    assert_eq!(
                        common::capture_stats()[1] - before[1],
                        2,
                        "two captures invalidated"
                    );
                    ok(hip::hipStreamDestroy(r.s), "destroy");
                }
                "standin_destroy_capturing" => {
                    let r = raw();
                    begin(r.s, GLOBAL);
                    // Planted: destroyed before hipStreamEndCapture.
                    let _ = hip::hipStreamDestroy(r.s);
                }
                "standin_launch_freed" => {
                    let r = raw();
                    let d = alloc(&r, 4096);
                    let src = vec![1u8; 4096];
                    begin(r.s, GLOBAL);
                    ok(
                        hip::hipMemcpyHtoDAsync(d, src.as_ptr() as *mut c_void, 4096, r.s),
                        "h2d",
                    );
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let x = instantiate(g);
                    ok(hip::hipFreeAsync(d, r.s), "free");
                    ok(hip::hipStreamSynchronize(r.s), "sync");
                    // Planted: the graph's copy targets freed memory.
                    let _ = hip::hipGraphLaunch(x, r.s);
                }
                "standin_launch_unmapped" => {
                    let r = raw();
                    let mut base = std::ptr::null_mut();
                    ok(
                        hip::hipMemAddressReserve(&mut base, G, 0, std::ptr::null_mut(), 0),
                        "reserve",
                    );
                    let (c, h) = create_handle();
                    ok(c, "create");
                    ok(hip::hipMemMap(base, G, 0, h, 0), "map");
                    let desc = hip::hipMemAccessDesc {
                        location: hip::hipMemLocation {
                            type_: hip::hipMemLocationTypeDevice,
                            id: 0,
                        },
                        flags: hip::hipMemAccessFlagsProtReadWrite,
                    };
                    ok(hip::hipMemSetAccess(base, G, &desc, 1), "access");
                    let src = vec![1u8; 4096];
                    begin(r.s, GLOBAL);
                    ok(
                        hip::hipMemcpyHtoDAsync(base, src.as_ptr() as *mut c_void, 4096, r.s),
                        "h2d",
                    );
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let x = instantiate(g);
                    ok(hip::hipMemUnmap(base, G), "unmap");
                    ok(hip::hipMemRelease(h), "release");
                    // Planted: the graph's copy targets unmapped memory.
                    let _ = hip::hipGraphLaunch(x, r.s);
                }
                "standin_graph_leftovers" => {
                    let r = raw();
                    begin(r.s, GLOBAL);
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let _x = instantiate(g);
                    ok(hip::hipStreamDestroy(r.s), "destroy");
                    // The graph and its executable graph are left on purpose.
                }
                other => panic!("unknown case {other}"),
            }
        }
    }
}
