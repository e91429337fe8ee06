//! ONNX Runtime on governed memory: the numbers, the accounting back at zero,
//! retire while a tensor is alive, a budget below the model's need, and two
//! sessions on two contexts with one moved to a third.
//!
//! Needs the ONNX Runtime library (`ORT_DYLIB_PATH`); without it every test
//! prints `skipped: <why>` and passes. `scripts/ci/60-onnxruntime.sh` fetches
//! it so that CI runs them for real.

use memgov::host::{HostConfig, HostContext};
use memgov::{
    Alloc, ContextConfig, ContextHandle, Governor, GovernorError, PinKind, RetireError, Role,
};
use memgov_onnxruntime::{
    environment, ConvTranspose, Error, GovernedAllocator, MatMulAdd, HOLDER, PAD,
};
use ort::environment::Environment;
use ort::session::Session;
use ort::value::{DynValue, Tensor};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// One environment per process (ONNX Runtime's rule), and one CPU allocator
/// registered on it at a time: the tests take turns.
fn env() -> Option<(&'static Environment, MutexGuard<'static, ()>)> {
    static ENV: OnceLock<Result<Environment, String>> = OnceLock::new();
    static TURN: Mutex<()> = Mutex::new(());
    match ENV.get_or_init(environment) {
        Ok(env) => Some((env, TURN.lock().unwrap_or_else(|e| e.into_inner()))),
        Err(why) => {
            println!("skipped: {why}");
            None
        }
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn context(gov: &Governor<HostContext>, label: &str, budget: u64) -> ContextHandle<HostContext> {
    gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new().label(label).budget(budget),
    )
}

fn session(
    env: &Environment,
    alloc: &GovernedAllocator<HostContext>,
    model: &MatMulAdd,
) -> Result<Session, memgov_onnxruntime::Error> {
    alloc.strict(|| {
        Session::builder(env)?
            .with_env_allocators()?
            .with_intra_threads(1)?
            .commit_from_memory(&model.to_onnx())
    })
}

fn run(session: &mut Session, model: &MatMulAdd, rows: usize) -> (Vec<f32>, DynValue) {
    let x = Tensor::from_array(([rows, model.k], model.input(rows))).unwrap();
    let mut outputs = session.run(ort::inputs!["X" => x]).unwrap();
    let y = outputs.remove("Y").unwrap();
    let (shape, data) = y.try_extract_tensor::<f32>().unwrap();
    assert_eq!(**shape, [rows as i64, model.n as i64]);
    (data.to_vec(), y)
}

#[test]
fn a_session_runs_on_governed_memory_and_every_byte_comes_back() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "cpu0", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(3, 4);
    let mut s = session(env, &alloc, &model).unwrap();
    for rows in [2, 5, 1] {
        let (y, _value) = run(&mut s, &model, rows);
        assert_eq!(y, model.reference(&model.input(rows)), "{rows} rows");
    }
    let stats = alloc.stats();
    assert!(
        stats.allocations > 0,
        "ONNX Runtime allocated through memgov: {stats:?}"
    );
    assert_eq!(stats.overdrafts, 0, "{stats:?}");
    let snap = ctx.snapshot();
    assert!(snap.counters.allocations >= stats.allocations, "{snap:?}");
    assert!(snap.peak > 0);

    drop(s);
    drop(alloc);
    let report = ctx.retire().wait(soon()).unwrap();
    assert!(report.backend_result.is_ok() && !report.forced && !report.lost);
    assert_eq!(report.abandoned_releases + report.reclaimed_buffers, 0);
    assert_eq!(report.retired_releases, stats.allocations);
    let end = ctx.snapshot();
    assert_eq!(end.charged, 0);
    assert_eq!(end.total(), Default::default());
}

#[test]
fn retire_waits_for_a_live_output_and_names_onnxruntime() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "cpu0", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(3, 4);
    let mut s = session(env, &alloc, &model).unwrap();
    let (y, output) = run(&mut s, &model, 2);
    assert_eq!(y, model.reference(&model.input(2)));
    drop(s);

    let retire = ctx.retire();
    let e = retire
        .wait(Instant::now() + Duration::from_millis(20))
        .unwrap_err();
    let RetireError::Outstanding { outstanding, .. } = &e else {
        panic!("{e}")
    };
    assert!(
        outstanding
            .items
            .iter()
            .any(|i| i.kind == PinKind::External && i.holder.as_deref() == Some(HOLDER)),
        "the registration pin is named: {e}"
    );
    assert!(e.to_string().contains("'onnxruntime'"), "{e}");

    // Unregistered, but the output tensor still holds governed memory.
    drop(alloc);
    let e = retire
        .wait(Instant::now() + Duration::from_millis(20))
        .unwrap_err();
    let RetireError::Outstanding { outstanding, .. } = &e else {
        panic!("{e}")
    };
    assert!(
        outstanding.items.iter().any(|i| i.kind == PinKind::Buffer),
        "{e}"
    );
    assert!(
        e.to_string().contains("'onnxruntime'"),
        "the stream is named: {e}"
    );

    // The tensor's data is still readable while the retire waits.
    assert_eq!(output.try_extract_tensor::<f32>().unwrap().1, y.as_slice());
    drop(output);
    let report = retire.wait(soon()).unwrap();
    assert_eq!(report.reclaimed_buffers, 0);
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn a_budget_below_the_need_fails_creation_cleanly_or_overdraws_a_run() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    // W alone is 256 KiB.
    let model = MatMulAdd::new(256, 256);

    // Too small to load: creation fails with ONNX Runtime's error, no crash.
    let small = context(&gov, "small", 64 << 10);
    let alloc = GovernedAllocator::register(env, &small, Role::Weights).unwrap();
    let Err(e) = session(env, &alloc, &model) else {
        panic!("a 64 KiB budget cannot load 256 KiB of weights");
    };
    let stats = alloc.stats();
    assert!(stats.refusals >= 1, "{stats:?}");
    assert!(
        alloc
            .last_refusal()
            .is_some_and(|m| m.contains("cannot admit") && m.contains("(65536 bytes) limit")),
        "{:?}",
        alloc.last_refusal()
    );
    println!("creation over budget: {e}");
    drop(alloc);
    small.retire().wait(soon()).unwrap();
    assert_eq!(small.snapshot().charged, 0);

    // Room to load but not to run: the run completes on overdrafts, reported,
    // and the context never goes over its budget.
    let probe_ctx = context(&gov, "probe", 64 << 20);
    let alloc = GovernedAllocator::register(env, &probe_ctx, Role::Weights).unwrap();
    let s = session(env, &alloc, &model).unwrap();
    let loaded = probe_ctx.snapshot().charged;
    drop((s, alloc));
    probe_ctx.retire().wait(soon()).unwrap();

    let tight = context(&gov, "tight", loaded + 1024);
    let alloc = GovernedAllocator::register(env, &tight, Role::Weights).unwrap();
    let mut s = session(env, &alloc, &model).unwrap();
    let (y, output) = run(&mut s, &model, 64);
    assert_eq!(y, model.reference(&model.input(64)));
    let stats = alloc.stats();
    assert!(
        stats.overdrafts > 0 && stats.overdraft_bytes > 0,
        "{stats:?}"
    );
    assert!(tight.snapshot().peak <= loaded + 1024);
    drop((output, s));
    let stats = alloc.stats();
    assert_eq!(
        stats.live_bytes, 0,
        "overdrafts are returned too: {stats:?}"
    );
    assert_eq!(stats.frees, stats.allocations);
    drop(alloc);
    tight.retire().wait(soon()).unwrap();
    assert_eq!(tight.snapshot().charged, 0);
}

#[test]
fn two_sessions_on_two_contexts_and_one_moves_to_a_third() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let (a, b, c) = (
        context(&gov, "gpu-a", 64 << 20),
        context(&gov, "gpu-b", 64 << 20),
        context(&gov, "gpu-c", 64 << 20),
    );
    let model = MatMulAdd::new(16, 8);
    let rows = 4;

    // One CPU allocator is registered at a time; a session keeps the one it
    // was created with after it is unregistered.
    let alloc_a = GovernedAllocator::register(env, &a, Role::Activation).unwrap();
    let mut sa = session(env, &alloc_a, &model).unwrap();
    alloc_a.unregister().unwrap();
    let alloc_b = GovernedAllocator::register(env, &b, Role::Activation).unwrap();
    let mut sb = session(env, &alloc_b, &model).unwrap();
    alloc_b.unregister().unwrap();

    // The runtime keeps its input batch on the device, next to the session.
    let stream_a = a.create_stream("inputs").unwrap();
    let x = model.input(rows);
    let x_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let batch = a
        .allocate(
            &stream_a,
            Alloc::new(x_bytes.len() as u64, Role::Activation),
        )
        .unwrap();
    batch.write(0, &x_bytes).unwrap();

    let expected = model.reference(&x);
    assert_eq!(run(&mut sa, &model, rows).0, expected);
    assert_eq!(run(&mut sb, &model, rows).0, expected);
    let a_before = alloc_a.stats().allocations;
    assert!(a_before > 0 && alloc_b.stats().allocations > 0);

    // Mid-way, move A's work to C: the session is rebuilt there, the batch
    // moves with its data, and A retires once the old session is gone.
    let alloc_c = GovernedAllocator::register(env, &c, Role::Activation).unwrap();
    let mut sc = session(env, &alloc_c, &model).unwrap();
    let stream_c = c.create_stream("inputs").unwrap();
    let moved = c.migrate(&stream_c, vec![batch]).unwrap();
    let mut back = vec![0u8; x_bytes.len()];
    moved[0].read(0, &mut back).unwrap();
    assert_eq!(back, x_bytes);
    let x_moved: Vec<f32> = back
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let xt = Tensor::from_array(([rows, model.k], x_moved)).unwrap();
    let mut outputs = sc.run(ort::inputs!["X" => xt]).unwrap();
    let (_, y) = outputs["Y"].try_extract_tensor::<f32>().unwrap();
    assert_eq!(y, expected.as_slice());
    outputs.remove("Y");
    drop(outputs);

    drop(sa);
    drop(alloc_a);
    drop(stream_a);
    let report = a.retire().wait(soon()).unwrap();
    assert!(report.retired_releases > a_before, "{report:?}");
    assert_eq!(a.snapshot().charged, 0);

    // B was never disturbed.
    assert_eq!(run(&mut sb, &model, rows).0, expected);

    drop((sb, sc, moved, stream_c));
    drop((alloc_b, alloc_c));
    for ctx in [&b, &c] {
        let r = ctx.retire().wait(soon()).unwrap();
        assert!(r.backend_result.is_ok() && r.reclaimed_buffers == 0);
    }
    assert_eq!(gov.snapshot().total(), Default::default());
}

#[test]
fn a_session_that_outlives_its_allocator_keeps_running_on_overdrafts() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "cpu0", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(8, 8);
    let mut s = session(env, &alloc, &model).unwrap();
    let loaded = ctx.snapshot().charged;
    assert!(loaded > 0, "initializers are governed");
    let stats = alloc.stats();
    drop(alloc);

    // The session still holds governed memory, so the retire waits, and
    // runs keep working: new allocations are overdrafts, not nulls.
    let retire = ctx.retire();
    let (y, output) = run(&mut s, &model, 3);
    assert_eq!(y, model.reference(&model.input(3)));
    drop(output);
    assert!(retire
        .wait(Instant::now() + Duration::from_millis(20))
        .is_err());
    drop(s);
    let report = retire.wait(soon()).unwrap();
    assert_eq!(
        report.retired_releases,
        stats.allocations - stats.frees + stats.frees
    );
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn weights_live_in_governed_memory_and_onnx_runtime_reads_them_in_place() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "cpu0", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(16, 8);
    let mut s = alloc
        .session(env, &model.to_onnx(), |b| {
            Ok(b.with_intra_threads(1)?.with_prepacking(false)?)
        })
        .unwrap();
    let w_bytes = (16 * 8 * 4) as u64;
    let b_bytes = 8 * 4;
    assert_eq!(s.governed_weights(), 2);
    assert_eq!(s.governed_weight_bytes(), w_bytes + b_bytes + 2 * PAD);
    assert_eq!(s.outside_weight_bytes(), 0);
    let snap = ctx.snapshot();
    assert_eq!(
        snap.role(Role::Weights).live_bytes,
        w_bytes + b_bytes + 2 * PAD
    );
    assert_eq!(snap.outside_bytes, 0);

    let rows = 3;
    let expected = model.reference(&model.input(rows));
    assert_eq!(run(&mut s, &model, rows).0, expected);

    // Change B in the governed buffer: the next run sees it, so ONNX
    // Runtime reads the governed copy, not one of its own.
    let plus_one: Vec<u8> = model
        .b
        .iter()
        .flat_map(|v| (v + 1.0).to_le_bytes())
        .collect();
    s.weight_buffer(1).unwrap().write(0, &plus_one).unwrap();
    let shifted: Vec<f32> = expected.iter().map(|y| y + 1.0).collect();
    assert_eq!(run(&mut s, &model, rows).0, shifted);

    drop(s);
    assert_eq!(ctx.snapshot().role(Role::Weights).live_bytes, 0);
    drop(alloc);
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

/// With attribution on, a session's governed initializers are counted at
/// `onnxruntime weights` and what ONNX Runtime allocates through the
/// allocator while running at `onnxruntime allocator`: no row names this
/// crate's own lines.
#[test]
fn a_sessions_memory_is_counted_at_the_glues_sites() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .label("sites")
            .budget(64 << 20)
            .attribution(true),
    );
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(16, 8);
    let mut s = alloc
        .session(env, &model.to_onnx(), |b| {
            Ok(b.with_env_allocators()?
                .with_intra_threads(1)?
                .with_prepacking(false)?)
        })
        .unwrap();
    let (_, y) = run(&mut s, &model, 3);
    let sites = ctx.snapshot().sites;
    let row = |name: &str| sites.iter().find(|r| r.site == name);
    let weights = row(memgov_onnxruntime::WEIGHTS_SITE)
        .unwrap_or_else(|| panic!("no weights row: {sites:#?}"));
    assert_eq!(weights.live_count, 2, "{weights:?}");
    assert_eq!(weights.live_bytes, (16 * 8 * 4 + 8 * 4) as u64 + 2 * PAD);
    let allocator = row(memgov_onnxruntime::ALLOCATOR_SITE)
        .unwrap_or_else(|| panic!("no allocator row: {sites:#?}"));
    assert!(allocator.allocations > 0, "{allocator:?}");
    assert_eq!(
        (
            memgov_onnxruntime::WEIGHTS_SITE,
            memgov_onnxruntime::ALLOCATOR_SITE
        ),
        ("onnxruntime weights", "onnxruntime allocator")
    );
    assert_eq!(sites.len(), 2, "{sites:#?}");
    drop((y, s));
    drop(alloc);
    ctx.retire().wait(soon()).unwrap();
}

#[test]
fn six_mib_of_weights_do_not_load_under_a_one_mib_budget() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    // W is 1024 × 1536 floats: 6 MiB.
    let model = MatMulAdd::new(1024, 1536);
    let bytes = model.to_onnx();
    let budget = 1 << 20;

    // Through `strict` alone the weights stay in ONNX Runtime's heap: with
    // prepacking off nothing of them is charged and the session loads.
    let ctx = context(&gov, "plain", budget);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let s = alloc
        .strict(|| {
            Session::builder(env)?
                .with_env_allocators()?
                .with_prepacking(false)?
                .commit_from_memory(&bytes)
        })
        .unwrap();
    assert!(ctx.snapshot().charged < budget);
    drop((s, alloc));
    ctx.retire().wait(soon()).unwrap();

    // Through `session` they are governed, and refused.
    let ctx = context(&gov, "governed", budget);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let e = alloc
        .session(env, &bytes, |b| Ok(b.with_prepacking(false)?))
        .unwrap_err();
    let Error::Governor(GovernorError::BudgetExceeded(refusal)) = &e else {
        panic!("the governor refuses the weights: {e:?}");
    };
    assert_eq!(refusal.requested, 1024 * 1536 * 4 + PAD, "{e}");
    assert_eq!(ctx.snapshot().charged, 0, "nothing stays charged");
    drop(alloc);
    ctx.retire().wait(soon()).unwrap();

    // With room, all 6 MiB are charged to weights while the session lives.
    let ctx = context(&gov, "roomy", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let s = alloc
        .session(env, &bytes, |b| Ok(b.with_prepacking(false)?))
        .unwrap();
    assert!(ctx.snapshot().role(Role::Weights).live_bytes >= 1024 * 1536 * 4);
    drop((s, alloc));
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn a_creation_refusal_is_the_governors_error_and_nothing_stays_charged() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "tiny", 1024);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Weights).unwrap();
    let conv = ConvTranspose {
        c: 8,
        m: 8,
        k: 3,
        hw: 8,
    };
    let e = alloc
        .strict(|| {
            Session::builder(env)?
                .with_env_allocators()?
                .commit_from_memory(&conv.to_onnx())
        })
        .unwrap_err();
    assert!(
        matches!(&e, Error::Governor(GovernorError::BudgetExceeded(_))),
        "{e:?}"
    );
    assert!(e.to_string().contains("(1024 bytes) limit"), "{e}");
    let stats = alloc.stats();
    assert!(
        stats.refusals >= 1 && stats.overdrafts >= stats.refusals,
        "{stats:?}"
    );
    assert_eq!(stats.live_bytes, 0, "the session was dropped: {stats:?}");
    drop(alloc);
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn a_constant_nodes_value_is_governed_and_read_in_place_too() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "cpu0", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(4, 8);
    let bytes = model.to_onnx_constant_bias();
    let weights = memgov_onnxruntime::weights(&bytes).unwrap();
    assert_eq!(
        (weights[0].name.as_str(), weights[0].kind),
        ("B", memgov_onnxruntime::WeightKind::Constant)
    );
    let mut s = alloc
        .session(env, &bytes, |b| Ok(b.with_intra_threads(1)?))
        .unwrap();
    assert_eq!((s.governed_weights(), s.outside_weight_bytes()), (2, 0));
    let expected = model.reference(&model.input(2));
    assert_eq!(run(&mut s, &model, 2).0, expected);
    let plus_one: Vec<u8> = model
        .b
        .iter()
        .flat_map(|v| (v + 1.0).to_le_bytes())
        .collect();
    s.weight_buffer(0).unwrap().write(0, &plus_one).unwrap();
    let shifted: Vec<f32> = expected.iter().map(|y| y + 1.0).collect();
    assert_eq!(run(&mut s, &model, 2).0, shifted);
    drop((s, alloc));
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn an_initializer_of_an_if_branch_is_governed_and_read_in_place_too() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "cpu0", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(4, 8);
    let bytes = model.to_onnx_bias_in_branches();
    let weights = memgov_onnxruntime::weights(&bytes).unwrap();
    let names: Vec<_> = weights
        .iter()
        .map(|w| (w.name.as_str(), w.in_subgraph))
        .collect();
    assert_eq!(names, [("B_then", true), ("B_else", true), ("W", false)]);
    let mut s = alloc.session(env, &bytes, Ok).unwrap();
    assert_eq!((s.governed_weights(), s.outside_weight_bytes()), (3, 0));
    let rows = 2;
    let branch = |s: &mut memgov_onnxruntime::GovernedSession<HostContext>, c: bool| {
        let x = Tensor::from_array(([rows, model.k], model.input(rows))).unwrap();
        let c = Tensor::from_array(((), vec![c])).unwrap();
        let out = s.run(ort::inputs!["X" => x, "C" => c]).unwrap();
        out["Y"].try_extract_tensor::<f32>().unwrap().1.to_vec()
    };
    let then_y = model.reference(&model.input(rows));
    assert_eq!(branch(&mut s, true), then_y);
    let else_y = branch(&mut s, false);

    // B of the `then` branch changed in its governed buffer: that branch
    // sees it, the other does not.
    let plus_one: Vec<u8> = model
        .b
        .iter()
        .flat_map(|v| (v + 1.0).to_le_bytes())
        .collect();
    s.weight_buffer(0).unwrap().write(0, &plus_one).unwrap();
    let shifted: Vec<f32> = then_y.iter().map(|y| y + 1.0).collect();
    assert_eq!(branch(&mut s, true), shifted);
    assert_eq!(branch(&mut s, false), else_y);
    drop((s, alloc));
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn weights_left_outside_are_reported_on_the_context_while_the_session_lives() {
    let Some((env, _turn)) = env() else { return };
    let gov = Governor::new();
    let ctx = context(&gov, "cpu0", 64 << 20);
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let model = MatMulAdd::new(4, 8);
    // Both branches' biases under one name (a name of the same length, so
    // the file stays well-formed): `AddInitializer` matches by name, so
    // neither can be placed, and both stay in ONNX Runtime's heap.
    let mut bytes = model.to_onnx_bias_in_branches();
    let at = bytes
        .windows(6)
        .position(|w| w == b"B_else")
        .expect("the else branch's bias");
    bytes[at..at + 6].copy_from_slice(b"B_then");
    let at = bytes.windows(6).position(|w| w == b"B_else").unwrap();
    bytes[at..at + 6].copy_from_slice(b"B_then");
    assert!(!bytes.windows(6).any(|w| w == b"B_else"));

    let s = alloc.session(env, &bytes, Ok).unwrap();
    let bias = (model.n * 4) as u64;
    assert_eq!(s.governed_weights(), 1, "W only");
    assert_eq!(s.outside_weight_bytes(), 2 * bias);
    let snap = ctx.snapshot();
    assert_eq!(snap.outside_bytes, 2 * bias);
    assert_eq!(
        snap.role(Role::Weights).live_bytes,
        (model.k * model.n * 4) as u64 + PAD
    );
    drop(s);
    assert_eq!(ctx.snapshot().outside_bytes, 0, "gone with the session");
    drop(alloc);
    ctx.retire().wait(soon()).unwrap();
}
