//! Governed allocate + stream-ordered free against raw `hipMallocAsync` /
//! `hipFreeAsync` on the same stream. Prints the ratio; on the stand-in
//! library (CI) the figure is labelled a stand-in figure: it measures the
//! governor against the stand-in's host queue, not an AMD GPU.
//!
//! `cargo bench -p memgov-cli --features hip --bench hip_cycle` (with the
//! stand-in: `LD_LIBRARY_PATH=$(backends/stand-ins/build.sh hip)`)

use criterion::{criterion_group, criterion_main, Criterion};
use memgov::{BackendErrorKind, Execution};

#[path = "../src/bench/cycle.rs"]
mod cycle;
#[path = "../src/bench/hip.rs"]
mod hip_row;

use hip_row::{cycle_ratio, Cycles, CYCLE_BYTES};

fn available() -> Option<Execution> {
    match Cycles::new() {
        Ok(c) => {
            let how = c.execution();
            c.finish().expect("bench teardown");
            Some(how)
        }
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            eprintln!("skipped: {}", e.message);
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn cycle(c: &mut Criterion) {
    let Some(how) = available() else { return };
    let label = if how == Execution::StandIn {
        " (stand-in figure, not an AMD GPU)"
    } else {
        ""
    };
    let mut group = c.benchmark_group(format!("hip_cycle_{}KiB", CYCLE_BYTES >> 10));
    let mut cycles = Cycles::new().expect("bench setup");
    group.bench_function("governed", |b| {
        b.iter(|| cycles.governed().expect("governed cycle"))
    });
    group.bench_function("raw_hipMallocAsync_hipFreeAsync", |b| {
        b.iter(|| cycles.raw().expect("raw cycle"))
    });
    cycles.finish().expect("bench teardown");
    group.finish();
    let (g, r) = cycle_ratio(5000).expect("cycle_ratio");
    println!(
        "hip cycle (interleaved, 5000 each, {how}){label}: governed {g} ns, raw {r} ns, ratio {:.3}",
        g as f64 / r as f64
    );
}

criterion_group!(benches, cycle);
criterion_main!(benches);
