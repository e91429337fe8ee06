//! Graph capture on the HIP backend's arena: the cases HIP shares with
//! CUDA (`backends/cases/capture.rs`, the capability cases among them,
//! instantiated here through the `vendor` module), and HIP's own: a map on
//! another thread waiting for the capture, a runtime without the graph calls, graph
//! capture on a governed context, graphs left at exit, and the stand-in
//! runtime's stream capture rules called raw (`memgov::hip::raw`), each
//! with a planted violation.
//!
//! Every case runs in a child process (this binary re-executed with
//! `MEMGOV_HIP_CAPTURE_CHILD` set): the stand-in reads its knobs once per
//! process and aborts the process on a violation. Without the stand-in
//! every test prints `skipped: ...` and passes.
//!
//! `MEMGOV_CAPTURE_REPLAYS` sets how many times the captured graph is
//! launched under churn (default 1000).

#[path = "../../cases/capture.rs"]
mod cases;
#[macro_use]
mod common;
capture_table!();

use memgov::{BackendErrorKind, DeviceContext};

const CHILD: &str = "MEMGOV_HIP_CAPTURE_CHILD";

pub(crate) use common::{aborts, child, passes, BANNER, EXIT_CHECK, LATENCY, SEED};

// HIP's own tests (`own` below): a map on another thread, the governed
// capture, a runtime without the graph calls, and graphs left at exit.

#[test]
fn a_map_on_another_thread_waits_for_the_capture_to_end() {
    passes("map_waits", &[(EXIT_CHECK, "1")]);
}
#[test]
fn a_governed_capture_charges_its_pool_until_the_graph_is_destroyed() {
    passes("governed_pool_charged", &[(EXIT_CHECK, "1")]);
}
/// A ROCm with the virtual memory calls but without the graph calls: the
/// stand-in built without its `graph.c`. A capture is `Unsupported`,
/// naming the first missing symbol; the arena still works.
#[test]
fn a_runtime_lacking_the_capture_calls_makes_capture_unsupported() {
    common::passes_on_partial_stand_in("hip-without-graphs", &["vmm.c"], "no_graphs");
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

common::child_process::child_entry!(CHILD, cases::run, own::run);

/// HIP's own cases: a map on another thread, the governed capture, a
/// runtime without the graph calls, and graphs left at exit.
mod own {
    use super::*;
    use crate::cases::{
        arena_context, governed_capture, governed_capture_refused, pattern, release, retire_clean,
        MIB,
    };
    use crate::vendor::raw::{begin, end, instantiate, ok, raw, stream_destroy, GLOBAL};
    use crate::vendor::stats;
    use memgov::hip::{CaptureConfig, CaptureMode};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

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

    /// A capture on a governed HIP context (`memgov::capture`, which
    /// `memgov::hip_capture` re-exports): a 64 MiB pool charged to the
    /// budget from before the capture begins (seen from inside the
    /// recording) while the graph lives, 0 after destroy; a pool over budget refused with no capture begun; a pool
    /// too large to round refused with nothing charged.
    fn governed_pool_charged() {
        use memgov::{ContextConfig, Governor, GovernorError};
        let gov = Governor::new();
        let ctx = gov.register(
            arena_context(256 * MIB),
            ContextConfig::new().label("captured").budget(96 * MIB),
        );
        let s = ctx.create_stream("s").expect("stream");
        let (mut graph, out) = governed_capture(&ctx, &s, 64 * MIB);
        graph.launch(&s).expect("launch");
        assert_eq!(
            graph.read_output(out).expect("read"),
            pattern(5, MIB as usize)
        );
        // A second pool over what the first left of the budget: refused by
        // the governor, no capture begun.
        let e = governed_capture_refused(&ctx, &s, 64 * MIB);
        assert!(matches!(e, GovernorError::BudgetExceeded(_)), "{e}");
        let e = governed_capture_refused(&ctx, &s, u64::MAX);
        assert!(e.to_string().contains("64-bit limit"), "{e}");
        assert_eq!(ctx.snapshot().charged, 64 * MIB, "nothing more charged");
        graph.destroy().expect("destroy");
        assert!(graph.is_destroyed());
        assert_eq!(ctx.snapshot().charged, 0, "the pool's charge came back");
        drop((graph, s));
        retire_clean(&ctx);
        println!(
            "governed capture on HIP: 64 MiB pool charged while its graph lived, 0 after destroy"
        );
    }

    pub(super) fn run(case: &str) {
        // SAFETY: raw runtime calls on the stand-in, each valid or the
        // violation the case plants on purpose; the stand-in aborts before
        // anything undefined happens.
        unsafe {
            match case {
                "governed_pool_charged" => governed_pool_charged(),
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
                "standin_graph_leftovers" => {
                    let r = raw();
                    begin(r.s, GLOBAL);
                    let (e, g) = end(r.s);
                    ok(e, "end");
                    let _x = instantiate(g);
                    ok(stream_destroy(r.s), "destroy");
                    // The graph and its executable graph are left on purpose.
                }
                other => panic!("unknown case {other}"),
            }
        }
    }
}
