//! What the CUDA test files that run their cases in child processes on the
//! stand-in share: whether the stand-in is loaded, and running a case in a
//! child that must pass or must be stopped by the stand-in.

#![allow(dead_code)]

#[path = "../../../stand-ins/support/child.rs"]
pub mod child_process;

use memgov::cuda::{CudaConfig, CudaContext};
use memgov::BackendErrorKind;

pub const LATENCY: &str = "MEMGOV_STANDIN_CUDA_LATENCY_US";
pub const SEED: &str = "MEMGOV_STANDIN_CUDA_LATENCY_SEED";
pub const EXIT_CHECK: &str = "MEMGOV_STANDIN_CUDA_EXIT_CHECK";
pub const BANNER: &str = "memgov libcuda stand-in: contract violation:";

/// Whether the stand-in is what the loader finds (after printing why not).
pub fn on_stand_in() -> bool {
    match CudaContext::new(CudaConfig::default()) {
        Ok(ctx) => {
            let stand_in = ctx.is_stand_in();
            memgov::DeviceContext::teardown(ctx, false).expect("teardown");
            if !stand_in {
                println!("skipped: needs the stand-in libcuda (this is real hardware)");
            }
            stand_in
        }
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            println!("skipped: {}", e.message);
            false
        }
        Err(e) => panic!("CudaContext::new failed: {e}"),
    }
}

/// Case `case` run in a child (the test binary again, with `child_var`
/// naming the case), on the stand-in only. A latency without a seed gets
/// an empty seed, so that the parent's seed does not leak into the child.
pub fn child(child_var: &str, case: &str, env: &[(&str, &str)]) -> Option<child_process::ChildRun> {
    if !on_stand_in() {
        return None;
    }
    let mut env = env.to_vec();
    if env.iter().any(|(k, _)| *k == LATENCY) && !env.iter().any(|(k, _)| *k == SEED) {
        env.push((SEED, ""));
    }
    Some(child_process::run(child_var, case, &env))
}

/// The child ran case `case` to its end.
pub fn passes(child_var: &str, case: &str, env: &[(&str, &str)]) {
    if let Some(run) = child(child_var, case, env) {
        print!("{}", run.stdout);
        child_process::assert_passed(case, &run, &format!("child {case}: ok"));
    }
}

/// The stand-in stopped the child with the contract violation `what`.
pub fn aborts(child_var: &str, case: &str, env: &[(&str, &str)], what: &str) {
    if let Some(run) = child(child_var, case, env) {
        child_process::assert_aborted(case, &run, BANNER, what, &format!("child {case}: ok"));
    }
}
