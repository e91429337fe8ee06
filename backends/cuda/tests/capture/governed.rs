//! Capture on a governed context (`memgov::cuda_capture`): the pool charged
//! to the budget before the capture begins and until the graph is
//! destroyed, a pool over budget refused with nothing begun, teardown held
//! by a live graph. Run as children of `capture.rs`'s tests.

use super::cases::{arena_context, pattern, stats, MIB};
use memgov::cuda::{CaptureConfig, CaptureMode, CudaContext};
use memgov::cuda_capture::{CaptureExt, POOL_LABEL};
use memgov::{BudgetScope, ContextConfig, ContextHandle, Governor, GovernorError, Role};
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
    let watcher = ctx.clone();
    let (mut graph, out) = ctx
        .capture(&s, config(4 * MIB), |cap| {
            let during = watcher.snapshot();
            assert_eq!(during.charged, 4 * MIB, "charged before capture began");
            assert_eq!(during.reservations.len(), 1);
            assert_eq!(during.reservations[0].label, POOL_LABEL);
            let a = cap.allocate(MIB)?;
            cap.upload(&a, 0, pattern(5, MIB as usize))?;
            cap.download(&a, 0, MIB as usize)
        })
        .expect("capture");
    assert_eq!(
        ctx.snapshot().charged,
        4 * MIB,
        "charged while the graph lives"
    );
    assert_eq!(graph.pool_usage(), (MIB, 4 * MIB));
    assert_eq!(
        graph.graph_memory_bytes(),
        0,
        "memgov's capture makes no graph memory"
    );
    let other = ctx
        .allocate(&s, 8 * MIB, Role::Activation)
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
        .allocate(&s, 60 * MIB, Role::Activation)
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
    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(10))
        .expect("retire");
    report.backend_result.expect("clean teardown");
    println!("governed capture: 4 MiB pool charged from before begin to destroy");
}

/// A pool that does not fit the budget is the governor's BudgetExceeded,
/// and no driver capture call was made (nothing begun, no arena memory).
pub fn pool_over_budget() {
    let (_gov, ctx) = governed(8 * MIB);
    let s = ctx.create_stream("s").expect("stream");
    let _held = ctx.allocate(&s, 6 * MIB, Role::Weights).expect("weights");
    let before = stats();
    let e = ctx
        .capture(
            &s,
            config(4 * MIB),
            |_| -> Result<(), memgov::BackendError> { panic!("the recording must not run") },
        )
        .expect_err("over budget");
    let GovernorError::BudgetExceeded(b) = &e else {
        panic!("expected BudgetExceeded, got {e}");
    };
    assert_eq!(
        (b.scope.clone(), b.requested),
        (BudgetScope::Context, 4 * MIB),
        "{e}"
    );
    assert_eq!(stats()[0], before[0], "no cuStreamBeginCapture_v2");
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
    ctx.retire()
        .wait(Instant::now() + Duration::from_secs(10))
        .expect("retire")
        .backend_result
        .expect("clean teardown");
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
