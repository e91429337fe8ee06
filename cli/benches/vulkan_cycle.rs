//! Governed allocate + write + stream-ordered free against the same cycle in
//! raw ash + gpu-allocator, validation off. Prints the ratio (target <= 1.3).
//!
//! `cargo bench --features vulkan --bench vulkan_cycle`

use criterion::{criterion_group, criterion_main, Criterion};
use memgov::BackendErrorKind;

/// The Vulkan row of `memgov bench`.
#[path = "../src/bench/cycle.rs"]
mod cycle;
#[path = "../src/bench/vulkan.rs"]
mod vulkan;

use vulkan::{cycle_ratio, GovernedCycle, RawCycle, CYCLE_BYTES, CYCLE_WRITE};

fn available() -> bool {
    match RawCycle::new() {
        Ok(r) => {
            let _ = r.finish();
            true
        }
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            eprintln!("skipped: no Vulkan loader/ICD ({})", e.message);
            false
        }
        Err(e) => panic!("{e}"),
    }
}

fn cycle(c: &mut Criterion) {
    if !available() {
        return;
    }
    let mut group = c.benchmark_group(format!(
        "vulkan_cycle_{}KiB_alloc_{}KiB_write",
        CYCLE_BYTES >> 10,
        CYCLE_WRITE >> 10
    ));
    let mut governed = GovernedCycle::new().expect("governed setup");
    group.bench_function("governed", |b| {
        b.iter(|| governed.cycle().expect("governed cycle"))
    });
    governed.finish().expect("governed teardown");
    let mut raw = RawCycle::new().expect("raw setup");
    group.bench_function("raw_ash_gpu_allocator", |b| {
        b.iter(|| raw.cycle().expect("raw cycle"))
    });
    raw.finish().expect("raw teardown");
    group.finish();
    let (g, r) = cycle_ratio(5000).expect("cycle_ratio");
    println!("vulkan cycle (interleaved, 5000 each): governed {g} ns, raw {r} ns, ratio {:.3} (target <= 1.3)", g as f64 / r as f64);
}

criterion_group!(benches, cycle);
criterion_main!(benches);
