//! Teardown: the wake-up from the last retirement to `RetireHandle::wait`
//! returning, against a bare Mutex + Condvar hand-off; and draining 100,000
//! and 1,000,000 pending releases with a waiter waiting.
//!
//! Smoke run (CI): `cargo bench --bench teardown -- --test`.

use criterion::{criterion_group, criterion_main, Criterion};
use std::time::Duration;

/// The same wake-up and drain `memgov bench` measures.
#[path = "../src/bench/teardown.rs"]
mod teardown;

fn wakeup(c: &mut Criterion) {
    let mut g = c.benchmark_group("wakeup");
    g.sample_size(20);
    g.bench_function("baseline: Mutex + Condvar hand-off", |b| {
        b.iter_custom(|n| (0..n).map(|_| teardown::wakeup_bare()).sum())
    });
    g.bench_function("last retirement -> wait returns", |b| {
        b.iter_custom(|n| (0..n).map(|_| teardown::wakeup_governed()).sum())
    });
    g.finish();
}

fn drain(c: &mut Criterion) {
    let mut g = c.benchmark_group("drain");
    g.sample_size(10);
    for n in [100_000usize, 1_000_000] {
        g.bench_function(format!("{n} pending releases"), |b| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| Duration::from_secs_f64(teardown::drain_once(n) / 1e3))
                    .sum()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, wakeup, drain);
criterion_main!(benches);
