//! Graph capture on the CUDA backend's arena: the cases CUDA shares with
//! HIP (`backends/cases/capture.rs`, the capability cases among them,
//! instantiated here through the `vendor` module), and CUDA's own: graph
//! capture on a governed context (`capture/governed.rs`), and the stand-in driver's
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
#[macro_use]
mod common;
capture_table!();
#[path = "capture/governed.rs"]
mod governed;

const CHILD: &str = "MEMGOV_CAPTURE_CHILD";

use common::{passes, EXIT_CHECK, LATENCY, SEED};

// CUDA's own tests (`own` below): graph capture on a governed context.

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

common::child_process::child_entry!(CHILD, cases::run, own::run);

/// CUDA's own cases: the governed capture.
mod own {
    pub(super) fn run(case: &str) {
        match case {
            "governed_pool_charged" => crate::governed::pool_charged(),
            "governed_pool_over_budget" => crate::governed::pool_over_budget(),
            "governed_teardown_waits" => crate::governed::teardown_waits_for_live_graph(),
            "governed_no_graph_memory" => crate::governed::no_graph_memory_nodes(),
            "governed_graph_memory" => crate::governed::graph_memory_charged(),
            "governed_churn" => crate::governed::governed_churn(),
            other => panic!("unknown case {other}"),
        }
    }
}
