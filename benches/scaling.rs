//! Two threads on two streams of one context against one thread, null
//! backend. The figure is the wall time for every thread to finish `iters`
//! cycles each; throughput scaling is `2 * one / two`.
//!
//! Smoke run (CI): `cargo bench --bench scaling -- --test`.

use criterion::{criterion_group, criterion_main, Criterion};
use memgov::null::NullContext;
use memgov::{Alloc, ContextConfig, GovernedStream, Governor, Role};
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

fn run(ctx: &memgov::ContextHandle<NullContext>, stream: &GovernedStream<NullContext>, n: u64) {
    for _ in 0..n {
        drop(black_box(ctx.allocate(
            stream,
            Alloc::new(black_box(4096), Role::Activation),
        )));
    }
}

fn scaling(c: &mut Criterion) {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new().budget(1 << 40));
    let streams = [
        ctx.create_stream("a").unwrap(),
        ctx.create_stream("b").unwrap(),
    ];
    let mut g = c.benchmark_group("scaling");
    g.bench_function("one thread, n cycles", |b| {
        b.iter_custom(|n| {
            let t = Instant::now();
            run(&ctx, &streams[0], n);
            t.elapsed()
        })
    });
    g.bench_function("two threads, n cycles each", |b| {
        b.iter_custom(|n| {
            let barrier = Barrier::new(2);
            let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
                let hs: Vec<_> = streams
                    .iter()
                    .map(|st| {
                        let (barrier, ctx) = (&barrier, &ctx);
                        s.spawn(move || {
                            barrier.wait();
                            let t = Instant::now();
                            run(ctx, st, n);
                            (t, Instant::now())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let start = spans.iter().map(|s| s.0).min().unwrap();
            let end = spans.iter().map(|s| s.1).max().unwrap();
            end.duration_since(start).max(Duration::from_nanos(1))
        })
    });
    g.finish();
}

criterion_group!(benches, scaling);
criterion_main!(benches);
