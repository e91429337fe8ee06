//! Governed allocate + stream-ordered free against raw cudarc
//! `cuMemAllocAsync` / `cuMemFreeAsync` on the same kind of stream. Prints the
//! ratio (target on a GPU: <= 1.05). On memgov's stand-in driver the figure
//! is printed and labelled as a stand-in figure: it measures host threads.
//!
//! `cargo bench --features cuda --bench cuda_cycle`

use criterion::{criterion_group, criterion_main, Criterion};
use memgov::BackendErrorKind;

#[path = "../src/bench/cuda.rs"]
mod cuda_row;
#[path = "../src/bench/cycle.rs"]
mod cycle;

fn cycle(c: &mut Criterion) {
    let stand_in = match cuda_row::stand_in() {
        Ok(s) => s,
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            println!("skipped: no CUDA driver ({})", e.message);
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let label = if stand_in {
        "stand-in figure (memgov's libcuda stand-in on host threads, not a GPU)"
    } else {
        "GPU"
    };
    // One criterion measurement of the whole interleaved comparison, so that
    // `cargo bench` tracks it over time.
    let mut group = c.benchmark_group("cuda_cycle");
    group.sample_size(10);
    group.bench_function("cycle_ratio_200", |b| {
        b.iter(|| cuda_row::cycle_ratio(200).expect("cycle_ratio"))
    });
    group.finish();
    let (g, r) = cuda_row::cycle_ratio(5000).expect("cycle_ratio");
    println!(
        "cuda cycle ({label}; interleaved, 5000 each, {} KiB): governed {g} ns, raw {r} ns, ratio {:.3} (target on a GPU <= 1.05)",
        cuda_row::CYCLE_BYTES >> 10,
        g as f64 / r.max(1) as f64
    );
}

criterion_group!(benches, cycle);
criterion_main!(benches);
