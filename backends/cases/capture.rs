//! Graph capture on a backend's arena (a pool reserved before capture, the
//! process-wide gate, graphs pinning their pools), and the stand-in's stream
//! capture rules, each with a planted violation: the cases the CUDA and HIP
//! backends share, written once against the `vendor` module of the test
//! binary that includes this file (see `README.md` beside it).
//!
//! Every case runs in a child process (the test binary re-executed with the
//! vendor's child variable set): the stand-in reads its knobs once per
//! process and aborts the process on a violation. Without the stand-in
//! every test prints `skipped: ...` and passes. The stand-in cases
//! (`standin_*`) call the driver raw, through the vendor's `raw` module.
//!
//! `MEMGOV_CAPTURE_REPLAYS` sets how many times the captured graph is
//! launched under churn (default 1000).

use crate::vendor::{
    self, aborts, capture_gate, fault_cells, passes, stats, Arena, ArenaConfig, CaptureConfig,
    CaptureMode, Config, Context, Memory, PoolExhausted, Stream, BACKEND, BEGIN_CAPTURE_ENTRY,
    CHURN_SEEDS, DESTROY_CAPTURING_ABORT, END_CAPTURE_ENTRY, EXIT_CHECK, GRAPH_LAUNCH_ENTRY,
    HTOD_ENTRY, LATENCY, LAUNCH_FREED_ABORT, MAKE_CURRENT_ENTRY, SEED,
};
use memgov::{BackendErrorKind, DeviceContext, RetireSignal};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) const MIB: u64 = 1 << 20;
/// A granule of the stand-ins' virtual memory (both vendors': 2 MiB).
pub(crate) const G: usize = 2 << 20;

/// Declares, in a vendor's `vendor` module, what these cases assert of the
/// vendor, from a table: `backend`, the name a typed refusal carries
/// (`BACKEND`); `make_current`, the call that makes the context (or
/// device) current before a capture ends (`MAKE_CURRENT_ENTRY`); `htod`
/// and `graph_launch`, the enqueue of a write and of a graph launch
/// (`HTOD_ENTRY`, `GRAPH_LAUNCH_ENTRY`); `begin_capture` and `end_capture`,
/// the entry points whose fault cells the capture runs
/// (`BEGIN_CAPTURE_ENTRY`, `END_CAPTURE_ENTRY`); the stand-in's abort
/// messages for the planted violations, a capturing stream destroyed and
/// a graph launched after its memory was freed
/// (`DESTROY_CAPTURING_ABORT`, `LAUNCH_FREED_ABORT`); and `churn_seeds`,
/// the latency seeds the replay under churn runs with (`CHURN_SEEDS`).
macro_rules! capture_vendor {
    (
        backend: $backend:literal,
        make_current: $make_current:literal,
        htod: $htod:literal,
        graph_launch: $graph_launch:literal,
        begin_capture: $begin:literal,
        end_capture: $end:literal,
        destroy_capturing_abort: $destroy:literal,
        launch_freed_abort: $freed:literal,
        churn_seeds: [$($seed:literal),* $(,)?] $(,)?
    ) => {
        pub const BACKEND: &str = $backend;
        pub const MAKE_CURRENT_ENTRY: &str = $make_current;
        pub const HTOD_ENTRY: &std::ffi::CStr = $htod;
        pub const GRAPH_LAUNCH_ENTRY: &std::ffi::CStr = $graph_launch;
        pub const BEGIN_CAPTURE_ENTRY: &str = $begin;
        pub const END_CAPTURE_ENTRY: &str = $end;
        pub const DESTROY_CAPTURING_ABORT: &str = $destroy;
        pub const LAUNCH_FREED_ABORT: &str = $freed;
        pub const CHURN_SEEDS: &[&str] = &[$($seed),*];
    };
}
pub(crate) use capture_vendor;

/// The capability cases of `memgov_conformance` on capture, the driver
/// allocations during a capture counted by the stand-in, with the exit
/// check on.
#[test]
fn capability_capture_cases_pass_on_the_arena() {
    passes("capability_capture", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_graph_with_allocations_replays_while_another_thread_allocates_trims_and_releases() {
    for seed in CHURN_SEEDS {
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
fn a_map_on_the_capturing_thread_is_refused_not_invalidating() {
    passes("own_thread_map", &[(EXIT_CHECK, "1")]);
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

#[test]
fn fault_matrix_cells_begin_and_end_capture_at_each_position() {
    fault_cells(&[(BEGIN_CAPTURE_ENTRY, 2), (END_CAPTURE_ENTRY, 2)]);
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
    aborts("standin_destroy_capturing", &[], DESTROY_CAPTURING_ABORT);
}

#[test]
fn negative_launch_of_a_graph_copying_into_freed_memory_aborts() {
    aborts("standin_launch_freed", &[], LAUNCH_FREED_ABORT);
}

#[test]
fn negative_launch_of_a_graph_copying_into_unmapped_memory_aborts() {
    aborts("standin_launch_unmapped", &[], "that is not mapped");
}

/// In the child: runs the shared case `case`; false when it is not one of
/// these (the vendor's own cases then).
pub(crate) fn run(case: &str) -> bool {
    match case {
        "capability_capture" => memgov_conformance::capability::report_cases(
            memgov_conformance::capability::run_capture_cases(
                crate::common::capability_factory,
                || stats()[2],
            ),
        ),
        "fault_cells" => crate::common::fault_cells_child(),
        "replay_under_churn" => replay_under_churn(),
        "pool_exhausted" => pool_exhausted(),
        "own_thread_map" => own_thread_map(),
        "page_locked_waits" => page_locked_waits(),
        "end_fails_live" => end_fails_live(),
        "huge_pool" => huge_pool(),
        "launch_asleep" => launch_asleep(),
        "paused_enqueue_sleep" => paused_enqueue_sleep(),
        "launch_sleep_race" => launch_sleep_race(),
        "trim_deferred" => trim_deferred(),
        "sleep_waits" => sleep_waits(),
        "teardown_live_graph" => teardown_live_graph(),
        other => return standin::run(other),
    }
    true
}

pub(crate) fn arena_context(limit: u64) -> Context {
    Context::new(Config {
        arena: Some(ArenaConfig {
            reserve_bytes: 1 << 30,
            limit_bytes: limit,
        }),
        ..Config::default()
    })
    .expect("a context with an arena")
}

/// A capture with a 1 MiB governed pool in `mode`: what most cases begin.
fn one_mib_pool(mode: CaptureMode) -> CaptureConfig {
    CaptureConfig {
        pool_bytes: MIB,
        mode,
    }
}

/// A governed capture (`memgov::capture`) on `ctx`, nothing else charged
/// to it, with a pool of `pool` bytes in global mode: the recording sees
/// the pool charged before the capture began and listed as the context's
/// only reservation, allocates 1 MiB of the pool, uploads a pattern and
/// downloads it; after the capture the pool stays charged while the graph
/// lives, 1 MiB of it used. The graph and the download's output slot.
pub(crate) fn governed_capture(
    ctx: &memgov::ContextHandle<Context>,
    s: &memgov::GovernedStream<Context>,
    pool: u64,
) -> (
    memgov::capture::GovernedGraph<Context>,
    memgov::capture::SlotOf<Context>,
) {
    use memgov::capture::{CaptureExt, POOL_LABEL};
    let watcher = ctx.clone();
    let config = CaptureConfig {
        pool_bytes: pool,
        mode: CaptureMode::Global,
    };
    let (graph, out) = ctx
        .capture(s, config, |cap| {
            let during = watcher.snapshot();
            assert_eq!(during.charged, pool, "charged before capture began");
            assert_eq!(during.reservations.len(), 1);
            assert_eq!(during.reservations[0].label, POOL_LABEL);
            let a = cap.allocate(MIB)?;
            cap.upload(&a, 0, pattern(5, MIB as usize))?;
            cap.download(&a, 0, MIB as usize)
        })
        .expect("capture");
    assert_eq!(
        ctx.snapshot().charged,
        pool,
        "charged while the graph lives"
    );
    assert_eq!(graph.pool_usage(), (MIB, pool));
    (graph, out)
}

/// A governed capture on `ctx` with a pool of `pool` bytes that the
/// governor refuses before anything is recorded and before any capture is
/// begun in the driver (the stand-in's captures begun stay put). The
/// refusal.
pub(crate) fn governed_capture_refused(
    ctx: &memgov::ContextHandle<Context>,
    s: &memgov::GovernedStream<Context>,
    pool: u64,
) -> memgov::GovernorError {
    use memgov::capture::CaptureExt;
    let before = stats()[0];
    let config = CaptureConfig {
        pool_bytes: pool,
        mode: CaptureMode::Global,
    };
    let e = ctx
        .capture(s, config, |_| -> Result<(), memgov::BackendError> {
            panic!("the recording must not run")
        })
        .expect_err("the governor refuses the pool");
    assert_eq!(stats()[0], before, "no {BEGIN_CAPTURE_ENTRY}: {e}");
    e
}

/// Retires the governed context `ctx` (within 10 s) and checks that the
/// backend's teardown was clean.
pub(crate) fn retire_clean(ctx: &memgov::ContextHandle<Context>) {
    ctx.retire()
        .wait(std::time::Instant::now() + std::time::Duration::from_secs(10))
        .expect("retire")
        .backend_result
        .expect("clean teardown");
}

pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

pub(crate) fn release(ctx: &Context, s: &Stream, m: Memory, retired: &Arc<AtomicU64>) {
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
    let arena: Arena = ctx.arena().expect("arena");
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
    // the gate it waits for the end; without, the driver would refuse
    // it and invalidate the capture.
    // (A churn thread already held at the gate, by a trim that found no
    // capture and then a map or unmap that found this one, starts no
    // round until the end: that counts too.)
    let gate = capture_gate();
    while started.load(Ordering::SeqCst) < at_begin + 1 && gate.waiting() == 0 {
        std::thread::yield_now();
    }
    std::thread::sleep(std::time::Duration::from_millis(30));
    let during = stats();
    let mut graph = cap.end().expect("end capture: not invalidated");
    assert_eq!(during[1], before[1], "no capture invalidated");
    assert_eq!(
        during[2], before[2],
        "no driver allocation while the capture was under way"
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
         0 invalidated, 0 driver allocations during the capture"
    );
}

fn pool_exhausted() {
    let ctx = arena_context(64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let mut cap = ctx
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
        .expect("begin");
    let a = cap.allocate(768 << 10).expect("fits");
    let refused = cap.allocate(512 << 10).expect_err("does not fit");
    assert_eq!(
        refused,
        PoolExhausted {
            backend: BACKEND,
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
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
        .expect("begin");
    // Needs granules beyond the pool's: refused by the gate, not by
    // the driver.
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

/// A second context's page-locked allocation, and the free thread's
/// page-locked free (`cuMemFreeHost`, `hipHostFree`) of its release, on
/// other threads while a global-mode capture is under way: both wait at
/// the gate until the capture ends (the driver forbids them during the
/// capture and would invalidate it), then complete.
fn page_locked_waits() {
    use memgov::Tier;
    let ctx = arena_context(64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let other = Arc::new(Context::new(Config::default()).expect("a second context"));
    let os = Arc::new(other.create_stream().expect("stream"));
    let kept = other
        .allocate_in(&os, 4096, Tier::PinnedHost)
        .expect("page-locked, before the capture");
    let gate = capture_gate();
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
    assert_eq!(m.tier(), Tier::PinnedHost);
    graph.destroy().expect("destroy");
    // The free: the free thread's page-locked free waits for the end.
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

/// An end (or a drop) whose context cannot be made current
/// ([`MAKE_CURRENT_ENTRY`] refused) never reaches the end of the
/// capture in the driver: the driver still captures, so the gate keeps another context's
/// page-locked allocation waiting (it would invalidate the global
/// capture). The context's teardown ends the capture and opens the
/// gate; the allocation then runs and nothing was invalidated.
fn end_fails_live() {
    use memgov::Tier;
    let gate = capture_gate();
    for via_drop in [false, true] {
        let ctx = arena_context(64 * MIB);
        let s = ctx.create_stream().expect("stream");
        let other = Arc::new(Context::new(Config::default()).expect("a second context"));
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
        vendor::fail_entry(Some((MAKE_CURRENT_ENTRY, 1)));
        if via_drop {
            drop(cap);
        } else {
            let e = cap
                .end()
                .expect_err("the context could not be made current");
            assert!(e.message.contains(MAKE_CURRENT_ENTRY), "{e}");
        }
        vendor::fail_entry(None);
        assert!(
            gate.capturing(),
            "the driver still captures (drop: {via_drop}): the gate keeps it"
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
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
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
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
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
fn pause_next(entry: &std::ffi::CStr) {
    vendor::pause_entry(Some((entry.to_str().expect("an ASCII name"), 1)));
}

fn paused() -> bool {
    vendor::entry_paused()
}

fn resume() {
    vendor::resume_entry();
    vendor::pause_entry(None);
}

/// A write and a graph launch each held by the stand-in at the entry of
/// their enqueue ([`HTOD_ENTRY`], [`GRAPH_LAUNCH_ENTRY`]), after their
/// awake check; a sleep asked for then waits for them (seen waiting),
/// so the work lands on mapped memory; the sleep then runs, and after
/// the wake every byte is back.
fn paused_enqueue_sleep() {
    let ctx = Arc::new(arena_context(64 * MIB));
    let arena = ctx.arena().expect("arena");
    let s = Arc::new(ctx.create_stream().expect("stream"));
    let m = Arc::new(ctx.allocate(&s, 4096).expect("buffer"));
    let mut cap = ctx
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
        .expect("begin");
    let a = cap.allocate(4096).expect("a");
    cap.upload(&a, 0, pattern(9, 4096)).expect("upload");
    let out = cap.download(&a, 0, 4096).expect("download");
    let graph = Arc::new(std::sync::Mutex::new(cap.end().expect("end")));
    for entry in [HTOD_ENTRY, GRAPH_LAUNCH_ENTRY] {
        pause_next(entry);
        let work = {
            let (ctx, s, m, graph) = (ctx.clone(), s.clone(), m.clone(), graph.clone());
            let write = entry == HTOD_ENTRY;
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
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
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
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
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
        .begin_capture(&s, one_mib_pool(CaptureMode::Global))
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
        .begin_capture(&s, one_mib_pool(CaptureMode::ThreadLocal))
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
    // Destroyed by teardown already: nothing left to do, no driver call.
    graph.destroy().expect("destroy after teardown");
}

/// The stand-in's stream capture rules, driven by raw driver calls (the
/// vendor's `raw` module): each case checks a rule or plants a violation
/// the stand-in must abort on.
mod standin {
    use crate::vendor::raw::{
        alloc, begin, capture_info, create_handle, dtoh, end, exec_destroy, free_async,
        graph_destroy, host_alloc, host_free, htod, instantiate, launch, map, mem_release, query,
        raw, reserve, set_access, stream_destroy, sync, unmap, Raw, RawStream, ACTIVE, G, GLOBAL,
        INVALIDATED, LOCAL, NONE, RELAXED, STATUS_INVALIDATED, UNSUPPORTED, WRONG_THREAD,
    };
    use crate::vendor::{raw::ok, stats};

    /// A raw handle the closure of another thread may carry.
    #[derive(Clone, Copy)]
    struct Carry<T>(T);
    // SAFETY: driver handles, used on the other thread only through
    // `on_other_thread` (which makes current there what the vendor's calls
    // need).
    unsafe impl<T> Send for Carry<T> {}

    /// `f` run on another thread with `r`'s stream, after the vendor's
    /// `raw::enter` made current there what its calls need.
    fn on_other_thread<R: Send + 'static>(
        r: &Raw,
        f: impl FnOnce(RawStream) -> R + Send + 'static,
    ) -> R {
        let enter = crate::vendor::raw::enter(r);
        let s = Carry(r.s);
        std::thread::spawn(move || {
            let s = s;
            enter();
            f(s.0)
        })
        .join()
        .expect("thread")
    }

    /// In the child: runs the raw case `case`; false when it is not one of
    /// these.
    pub(super) fn run(case: &str) -> bool {
        // SAFETY: raw driver calls on the stand-in, each valid or the
        // violation the case plants on purpose; the stand-in aborts before
        // anything undefined happens.
        unsafe {
            match case {
                "standin_records" => {
                    let r = raw();
                    let d = alloc(&r, 4096);
                    let mut src = vec![1u8; 4096];
                    let mut dst = vec![0u8; 4096];
                    begin(r.s, GLOBAL);
                    let (st, id) = capture_info(r.s);
                    assert_eq!(st, ACTIVE);
                    assert_ne!(id, 0, "a capture id");
                    ok(htod(d, &src, r.s), "h2d");
                    ok(dtoh(&mut dst, d, r.s), "d2h");
                    // Recorded, not executed.
                    assert_eq!(dst, vec![0u8; 4096]);
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    assert_eq!(capture_info(r.s).0, NONE);
                    let x = instantiate(g);
                    ok(graph_destroy(g), "graph destroy");
                    for v in [5u8, 6, 7] {
                        src.fill(v);
                        ok(launch(x, r.s), "launch");
                        ok(sync(r.s), "sync");
                        assert_eq!(dst, vec![v; 4096], "launch replays the copies");
                    }
                    ok(exec_destroy(x), "exec destroy");
                    ok(free_async(d, r.s), "free");
                    ok(sync(r.s), "sync");
                    ok(stream_destroy(r.s), "destroy");
                }
                "standin_sync_invalidates" => {
                    let r = raw();
                    for conflicting in [0, 1] {
                        begin(r.s, RELAXED);
                        let got = if conflicting == 0 {
                            sync(r.s)
                        } else {
                            query(r.s)
                        };
                        assert_eq!(got, UNSUPPORTED);
                        assert_eq!(capture_info(r.s).0, STATUS_INVALIDATED);
                        let (e, g) = end(r.s);
                        assert_eq!(e, INVALIDATED);
                        assert!(g.is_null());
                        assert_eq!(capture_info(r.s).0, NONE);
                    }
                    assert_eq!(stats()[1], 2);
                    ok(stream_destroy(r.s), "destroy");
                }
                "standin_modes" => {
                    let r = raw();
                    // Global: another thread's physical allocation is
                    // prohibited and invalidates the capture.
                    begin(r.s, GLOBAL);
                    let (c, _) = on_other_thread(&r, |_| Carry(create_handle())).0;
                    assert_eq!(c, UNSUPPORTED, "global, other thread");
                    let (e, _) = end(r.s);
                    assert_eq!(e, INVALIDATED);
                    // Thread-local: another thread's is allowed, this
                    // thread's is not.
                    begin(r.s, LOCAL);
                    let (c, h) = on_other_thread(&r, |_| Carry(create_handle())).0;
                    ok(c, "thread-local, other thread");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    ok(graph_destroy(g), "graph destroy");
                    ok(mem_release(h), "release");
                    begin(r.s, LOCAL);
                    assert_eq!(create_handle().0, UNSUPPORTED, "thread-local, own thread");
                    assert_eq!(end(r.s).0, INVALIDATED);
                    // Relaxed: allowed on the capturing thread, and the
                    // capture may end on another thread.
                    begin(r.s, RELAXED);
                    let (c, h) = create_handle();
                    ok(c, "relaxed, own thread");
                    let g = on_other_thread(&r, |s| {
                        let (e, g) = end(s);
                        ok(e, "relaxed ends on another thread");
                        Carry(g)
                    });
                    ok(graph_destroy(g.0), "graph destroy");
                    ok(mem_release(h), "release");
                    // Global ends only on its own thread.
                    begin(r.s, GLOBAL);
                    let e = on_other_thread(&r, |s| end(s).0);
                    assert_eq!(e, WRONG_THREAD);
                    let (e, g) = end(r.s);
                    ok(e, "end on the capturing thread");
                    ok(graph_destroy(g), "graph destroy");
                    // Driver allocations made while a capture was under way:
                    // the prohibited and the allowed ones.
                    assert_eq!(stats()[2], 4);
                    ok(stream_destroy(r.s), "destroy");
                }
                "standin_page_locked" => {
                    // CUDA's documentation of CU_STREAM_CAPTURE_MODE_GLOBAL
                    // (and HIP's hipStreamCaptureModeGlobal, the same):
                    // potentially unsafe API calls (page-locked allocation
                    // and free among them) are prohibited on every thread
                    // while a global capture is under way; the call fails
                    // and the capture is invalidated.
                    let r = raw();
                    let before = stats();
                    let mut kept = std::ptr::null_mut();
                    ok(host_alloc(&mut kept, 4096), "host alloc");
                    let kept = Carry(kept);
                    begin(r.s, GLOBAL);
                    let c = on_other_thread(&r, |_| {
                        let mut p = std::ptr::null_mut();
                        host_alloc(&mut p, 4096)
                    });
                    assert_eq!(
                        c, UNSUPPORTED,
                        "page-locked allocation, global, other thread"
                    );
                    let (e, g) = end(r.s);
                    assert_eq!(e, INVALIDATED);
                    assert!(g.is_null());
                    begin(r.s, GLOBAL);
                    let c = on_other_thread(&r, move |_| {
                        let kept = kept;
                        host_free(kept.0)
                    });
                    assert_eq!(c, UNSUPPORTED, "page-locked free, global, other thread");
                    assert_eq!(end(r.s).0, INVALIDATED);
                    // Thread-local: another thread's are allowed.
                    begin(r.s, LOCAL);
                    let c = on_other_thread(&r, move |_| {
                        let kept = kept;
                        host_free(kept.0)
                    });
                    ok(c, "page-locked free, thread-local, other thread");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    ok(graph_destroy(g), "graph destroy");
                    assert_eq!(stats()[1] - before[1], 2, "two captures invalidated");
                    ok(stream_destroy(r.s), "destroy");
                }
                "standin_destroy_capturing" => {
                    let r = raw();
                    begin(r.s, GLOBAL);
                    // Planted: destroyed before the capture ended.
                    let _ = stream_destroy(r.s);
                }
                "standin_launch_freed" => {
                    let r = raw();
                    let d = alloc(&r, 4096);
                    let src = vec![1u8; 4096];
                    begin(r.s, GLOBAL);
                    ok(htod(d, &src, r.s), "h2d");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let x = instantiate(g);
                    ok(free_async(d, r.s), "free");
                    ok(sync(r.s), "sync");
                    // Planted: the graph's copy targets freed memory.
                    let _ = launch(x, r.s);
                }
                "standin_launch_unmapped" => {
                    let r = raw();
                    let base = reserve(G);
                    let (c, h) = create_handle();
                    ok(c, "create");
                    ok(map(base, G, h), "map");
                    ok(set_access(base, G), "access");
                    let src = vec![1u8; 4096];
                    begin(r.s, GLOBAL);
                    ok(htod(base, &src, r.s), "h2d");
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let x = instantiate(g);
                    ok(unmap(base, G), "unmap");
                    ok(mem_release(h), "release");
                    // Planted: the graph's copy targets unmapped memory.
                    let _ = launch(x, r.s);
                }
                _ => return false,
            }
        }
        true
    }
}
