//! The arena's bench rows: a governed allocate + release cycle on an arena
//! context against the same cycle on a pool context (memgov's default), in
//! the same run, interleaved; and the time to put 1 GiB to sleep (contents
//! kept in page-locked host memory) and wake it. On memgov's stand-in driver
//! the figures are labelled as stand-in figures: they measure host threads,
//! not a GPU (target on the stand-in: a ratio of at most 1.1).
//!
//! `cargo bench -p memgov-cuda --bench arena` (with `-- --test`: one short
//! pass, and a 64 MiB sleep set).

use criterion::{criterion_group, criterion_main, Criterion};
use memgov::cuda::{ArenaConfig, CudaConfig, CudaContext};
use memgov::{
    Alloc, BackendErrorKind, ContextConfig, ContextHandle, GovernedStream, Governor, Role,
};
use std::time::{Duration, Instant};

const CYCLE_BYTES: u64 = 64 << 10;
const SYNC_EVERY: u32 = 256;

struct Cycle {
    _gov: Governor<CudaContext>,
    handle: ContextHandle<CudaContext>,
    stream: GovernedStream<CudaContext>,
    n: u32,
}

impl Cycle {
    fn new(arena: bool) -> Result<Self, memgov::BackendError> {
        let ctx = CudaContext::new(CudaConfig {
            arena: arena.then_some(ArenaConfig {
                reserve_bytes: 1 << 30,
                limit_bytes: 256 << 20,
            }),
            ..CudaConfig::default()
        })?;
        let gov = Governor::new();
        let handle = gov.register(ctx, ContextConfig::new().label("bench"));
        let stream = handle.create_stream("bench").expect("stream");
        Ok(Self {
            _gov: gov,
            handle,
            stream,
            n: 0,
        })
    }

    fn cycle(&mut self) {
        let buf = self
            .handle
            .allocate(&self.stream, Alloc::new(CYCLE_BYTES, Role::Activation))
            .expect("allocate");
        drop(buf);
        self.n += 1;
        if self.n % SYNC_EVERY == 0 {
            self.stream.synchronize().expect("synchronize");
        }
    }

    fn finish(self) {
        self.stream.synchronize().expect("synchronize");
        drop(self.stream);
        self.handle
            .retire()
            .wait_timeout(Duration::from_secs(30))
            .expect("retire");
    }
}

/// Nanoseconds per cycle, arena and pool, `n` cycles each, interleaved in
/// blocks of 64 so that both see the same machine.
fn ratio(n: u32) -> (u64, u64) {
    let (mut arena, mut pool) = (
        Cycle::new(true).expect("arena"),
        Cycle::new(false).expect("pool"),
    );
    let (mut ta, mut tp) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..n / 64 {
        let t = Instant::now();
        (0..64).for_each(|_| arena.cycle());
        ta += t.elapsed();
        let t = Instant::now();
        (0..64).for_each(|_| pool.cycle());
        tp += t.elapsed();
    }
    arena.finish();
    pool.finish();
    let per = |d: Duration| (d.as_nanos() / u128::from(n.max(64) / 64 * 64)) as u64;
    (per(ta), per(tp))
}

/// Seconds to sleep and to wake `bytes` held in 64 MiB allocations.
fn sleep_wake(bytes: u64) -> (f64, f64) {
    let ctx = CudaContext::new(CudaConfig {
        arena: Some(ArenaConfig {
            reserve_bytes: bytes + (64 << 20),
            limit_bytes: bytes + (64 << 20),
        }),
        ..CudaConfig::default()
    })
    .expect("arena context");
    let arena = ctx.arena().expect("an arena");
    let gov = Governor::new();
    let handle = gov.register(ctx, ContextConfig::new().label("sleep"));
    let s = handle.create_stream("s").expect("stream");
    let held: Vec<_> = (0..bytes / (64 << 20))
        .map(|_| {
            handle
                .allocate(&s, Alloc::new(64 << 20, Role::Weights))
                .expect("allocate")
        })
        .collect();
    let t = Instant::now();
    arena.sleep(true).expect("sleep");
    let slept = t.elapsed().as_secs_f64();
    let t = Instant::now();
    arena.wake().expect("wake");
    let woke = t.elapsed().as_secs_f64();
    drop(held);
    s.synchronize().expect("synchronize");
    drop(s);
    handle
        .retire()
        .wait_timeout(Duration::from_secs(30))
        .expect("retire");
    (slept, woke)
}

fn rows(c: &mut Criterion) {
    let stand_in = match CudaContext::new(CudaConfig::default()) {
        Ok(ctx) => {
            let s = ctx.is_stand_in();
            memgov::DeviceContext::teardown(ctx, false).expect("teardown");
            s
        }
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
    let smoke = std::env::args().any(|a| a == "--test");
    let mut group = c.benchmark_group("cuda_arena");
    group.sample_size(10);
    group.bench_function("arena_vs_pool_256", |b| b.iter(|| ratio(256)));
    group.finish();
    let n = if smoke { 512 } else { 5120 };
    let (a, p) = ratio(n);
    println!(
        "cuda arena cycle ({label}; interleaved, {n} each, {} KiB): arena {a} ns, pool {p} ns, ratio {:.3} (target on the stand-in <= 1.1)",
        CYCLE_BYTES >> 10,
        a as f64 / p.max(1) as f64
    );
    let bytes: u64 = if smoke { 64 << 20 } else { 1 << 30 };
    let (slept, woke) = sleep_wake(bytes);
    println!(
        "cuda arena sleep/wake ({label}; {} MiB, contents kept in page-locked host memory): sleep {slept:.3} s, wake {woke:.3} s",
        bytes >> 20
    );
}

criterion_group!(benches, rows);
criterion_main!(benches);
