//! Fault-injection matrix: every backend operation × every
//! fault kind, on every backend present, through `FaultInjecting<C>`.
//!
//! Each cell registers a fresh context `Watched<FaultInjecting<C>>`, arms one
//! fault on the first call of one operation, and runs a script that calls
//! every operation (memory_info, create_stream, allocate, write, read,
//! synchronize, free_async by release_on and by drop, destroy_stream, and
//! teardown through retire / force). A cell survives when:
//!
//! * nothing panics;
//! * the fault was really injected;
//! * the faulted operation came back with the specific error the fault means
//!   (`Backend`, `BudgetExceeded` of the device, `DeviceLost`, a failed
//!   teardown result, an abandoned release, or — for a delay — success);
//! * teardown ran exactly once and the context terminated;
//! * accounting is consistent: nothing charged, no pins, every queued release
//!   settled (retired or abandoned) exactly once;
//! * the backend's own bookkeeping is clean: its `BackendProbe` saw one
//!   teardown, no contract violation, and nothing left allocated or open.
//!
//! The five operations that act on a buffer (allocate, free_async, write,
//! read, order_after) run again with the buffers in pinned host memory,
//! whose tier must be back at zero too.
//!
//! The whole matrix runs twice: as is, and with the block cache on in every
//! cell's context (`fault_matrix_with`), where released blocks are kept and
//! then given back by a trim and by retire.
//!
//! The backends are every entry of `memgov::any::BACKENDS`, opened through
//! `AnyContext`; one compiled out of this build prints why it was skipped.
//! `MEMGOV_FAULT_MATRIX_BACKENDS=cuda` (a comma-separated list of backend
//! names) runs the named backends only, and fails when one of them is not
//! compiled in or cannot be opened: the suite builds one binary with every
//! backend and runs each backend's rows in its own step.
//!
//! The matrix itself is library code, [`memgov_conformance::fault_matrix`],
//! so a backend in another crate runs it too.
//!
//! `cargo test --release -p memgov --test fault_matrix -- --nocapture` prints
//! the table that docs/reliability.md publishes.

use memgov::any::{AnyContext, BACKENDS};
use memgov_conformance::{fault_matrix_with, FaultMatrix, LeakCheck, SuiteOptions};

fn report(m: &FaultMatrix) {
    println!("\n{m}");
    let failures = m.failures();
    assert!(
        failures.is_empty(),
        "{} of {} cells failed:\n{}",
        failures.len(),
        m.cells.len(),
        failures.join("\n")
    );
    assert_eq!(
        m.cells.len(),
        (memgov::fault::Operation::ALL.len() + 5) * 4 + 3,
        "({} operations + 5 on pinned host buffers) × 4 faults + drop-signal on each \
         free_async row + panicking pressure responder",
        memgov::fault::Operation::ALL.len()
    );
    assert_eq!(m.cells.len(), FaultMatrix::expected_cells());
}

/// A fresh context of `kind` whose leak check is its probe's.
fn probed(kind: memgov::any::BackendKind) -> Option<(AnyContext, LeakCheck)> {
    let ctx = match AnyContext::open(kind) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{kind} unavailable: {e}");
            return None;
        }
    };
    let probe = ctx.probe();
    Some((
        ctx,
        Box::new(move || {
            probe
                .check_clean_teardown()
                .map_err(|why| format!("{kind} backend after teardown: {why}"))
        }),
    ))
}

#[test]
fn fault_matrix_every_backend() {
    every_backend(&SuiteOptions::new());
}

/// The matrix again with the block cache on in every cell's context.
#[test]
fn fault_matrix_every_backend_with_the_block_cache() {
    every_backend(&SuiteOptions::new().cache(memgov::CacheConfig::new(64 << 20)));
}

/// The backends `MEMGOV_FAULT_MATRIX_BACKENDS` names, or `None` (every one).
fn selected() -> Option<Vec<String>> {
    let list = std::env::var("MEMGOV_FAULT_MATRIX_BACKENDS").ok()?;
    let names: Vec<String> = list
        .split(',')
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect();
    for name in &names {
        assert!(
            BACKENDS.iter().any(|e| e.name == name.as_str()),
            "MEMGOV_FAULT_MATRIX_BACKENDS names {name:?}, which is not a memgov backend \
             (one of {:?})",
            BACKENDS.iter().map(|e| e.name).collect::<Vec<_>>()
        );
    }
    Some(names)
}

fn every_backend(options: &SuiteOptions) {
    let only = selected();
    let mut ran = Vec::new();
    for entry in BACKENDS {
        if let Some(only) = &only {
            if !only.iter().any(|n| n == entry.name) {
                continue;
            }
        }
        let Some(kind) = entry.kind else {
            println!(
                "skipped: {}: {}",
                entry.name,
                entry.not_compiled_in().unwrap_or_default()
            );
            continue;
        };
        match fault_matrix_with(entry.name, options, || probed(kind)) {
            Some(m) => {
                report(&m);
                ran.push(entry.name);
            }
            None => println!("skipped: {}: no device could be opened here", entry.name),
        }
    }
    match only {
        // A backend named on purpose that did not run is a failure, not a skip.
        Some(only) => assert!(
            only.iter().all(|n| ran.contains(&n.as_str())),
            "MEMGOV_FAULT_MATRIX_BACKENDS={only:?}, but only {ran:?} ran (see the lines above)"
        ),
        None => assert!(
            ran.contains(&"host") && ran.contains(&"null"),
            "the host and null backends are always present; ran {ran:?}"
        ),
    }
}
