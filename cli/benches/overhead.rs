//! Criterion benches of the governor's cost against the floor: each group
//! has its baseline next to its figures (see `docs/performance.md`; the same
//! measurements, as ratios, come from `memgov bench`).
//!
//! Smoke run (CI): `cargo bench --bench overhead -- --test`.

use criterion::{criterion_group, criterion_main, Criterion};
use memgov::host::{HostConfig, HostContext};
use memgov::null::NullContext;
use memgov::{Alloc, ContextConfig, DeviceContext, Governor, RetireSignal, Role};
use std::hint::black_box;
use std::sync::Arc;

/// The contract's floors (shared with `memgov bench`).
#[allow(dead_code)]
#[path = "../src/bench/floor.rs"]
mod floor;
use floor::FloorPin;

fn pins(c: &mut Criterion) {
    let mut g = c.benchmark_group("pin");
    let arc = Arc::new(0u64);
    g.bench_function("baseline: Arc::clone + drop", |b| {
        b.iter(|| drop(black_box(Arc::clone(black_box(&arc)))))
    });
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new());
    g.bench_function("ContextHandle::pin + drop", |b| {
        b.iter(|| drop(black_box(ctx.pin())))
    });
    let source = ctx.pin_source(Some("bench"));
    g.bench_function("pin_source().pin() (Box<dyn>) + drop", |b| {
        b.iter(|| drop(black_box(source.pin())))
    });
    // The contract's own floor: a boxed pin that keeps an `Arc` alive.
    let context = source.context();
    g.bench_function("floor: Box::new + Arc::clone + drops (Box<dyn>)", |b| {
        b.iter(|| drop(black_box(FloorPin::boxed(black_box(&arc), context))))
    });
    g.finish();
}

fn null_cycle(c: &mut Criterion) {
    let mut g = c.benchmark_group("null-cycle");
    let arc = Arc::new(0u64);
    g.bench_function("baseline: Arc::clone + drop", |b| {
        b.iter(|| drop(black_box(Arc::clone(black_box(&arc)))))
    });
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new().budget(1 << 40));
    let stream = ctx.create_stream("bench").unwrap();
    g.bench_function("governed allocate + release (null backend)", |b| {
        b.iter(|| {
            drop(black_box(ctx.allocate(
                &stream,
                Alloc::new(black_box(4096), Role::Activation),
            )))
        })
    });
    // The same with call-site attribution on (target: at most 1.15x of the
    // cycle above).
    let attributed = gov.register(
        NullContext::new(),
        ContextConfig::new().budget(1 << 40).attribution(true),
    );
    let attributed_stream = attributed.create_stream("bench").unwrap();
    g.bench_function(
        "governed allocate + release, attribution on (null backend)",
        |b| {
            b.iter(|| {
                drop(black_box(attributed.allocate(
                    &attributed_stream,
                    Alloc::new(black_box(4096), Role::Activation),
                )))
            })
        },
    );
    g.finish();
}

fn host_cycle(c: &mut Criterion) {
    // Batches of 256 cycles and one synchronize, so that both sides pay for
    // the frees they queued; the figure is per batch.
    const BATCH: usize = 256;
    let mut g = c.benchmark_group("host-cycle");
    let raw = HostContext::new(HostConfig::default()).unwrap();
    let rs = raw.create_stream().unwrap();
    g.bench_function(
        "baseline: raw allocate + free_async x256 + synchronize",
        |b| {
            b.iter(|| {
                for _ in 0..BATCH {
                    let m = raw.allocate(&rs, black_box(4096)).unwrap();
                    assert!(raw
                        .free_async(&rs, m, RetireSignal::from_fn(|_| {}))
                        .is_ok());
                }
                raw.synchronize(&rs).unwrap();
            })
        },
    );
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new(),
    );
    let stream = ctx.create_stream("bench").unwrap();
    g.bench_function("governed allocate + release x256 + synchronize", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                drop(black_box(ctx.allocate(
                    &stream,
                    Alloc::new(black_box(4096), Role::Activation),
                )));
            }
            stream.synchronize().unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, pins, null_cycle, host_cycle);
criterion_main!(benches);
