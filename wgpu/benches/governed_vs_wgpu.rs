//! The workload (a 128 x 128 tiled matmul, dispatch and wait) on governed
//! buffers against the same workload on wgpu's own allocator, on one wgpu
//! device in the same run; and buffer create + drop, governed against
//! wgpu's. Validation off. Prints both ratios (targets: workload <= 1.05).
//!
//! `cargo bench --bench governed_vs_wgpu`. Without `--bench` (`cargo test
//! --bench governed_vs_wgpu`, as CI runs it, or `-- --test`) criterion runs
//! each function once and the interleaved loops are short: a check that it
//! runs and that both allocators agree, not a measurement.

use criterion::{criterion_group, criterion_main, Criterion};
use memgov::vulkan::VulkanContext;
use memgov::{Governor, Role};
use std::hint::black_box;
use std::time::{Duration, Instant};

#[path = "../tests/common/mod.rs"]
mod common;

use common::{Alloc, Matmul};

const N: u32 = 128;
const BUFFER: u64 = 256 << 10;

fn wait(device: &wgpu::Device) {
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
}

fn desc() -> wgpu::BufferDescriptor<'static> {
    wgpu::BufferDescriptor {
        label: Some("bench"),
        size: BUFFER,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    }
}

/// Alternate `a` and `b` in rounds of `per` calls; total time of each.
fn interleaved(
    rounds: u32,
    per: u32,
    mut a: impl FnMut(),
    mut b: impl FnMut(),
) -> (Duration, Duration) {
    let (mut ta, mut tb) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..per {
            a();
        }
        ta += t.elapsed();
        let t = Instant::now();
        for _ in 0..per {
            b();
        }
        tb += t.elapsed();
    }
    (ta, tb)
}

fn bench(c: &mut Criterion) {
    let gov: Governor<VulkanContext> = Governor::new();
    let Some(dev) = common::open_with(&gov, "bench", 1 << 30, false) else {
        return;
    };
    let args: Vec<String> = std::env::args().collect();
    let test_mode = !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--test");
    let (device, queue) = (dev.device(), dev.queue());
    let own = Matmul::new(device, queue, &Alloc::Wgpu, N).expect("wgpu's");
    let governed = Matmul::new(device, queue, &Alloc::Governed(&dev), N).expect("governed");
    assert!(
        own.run(device, queue) == governed.run(device, queue),
        "results differ"
    );

    let mut group = c.benchmark_group(format!("matmul_{N}"));
    group.bench_function("wgpu_allocator", |b| {
        b.iter(|| {
            own.dispatch(device, queue);
            wait(device);
        })
    });
    group.bench_function("governed", |b| {
        b.iter(|| {
            governed.dispatch(device, queue);
            wait(device);
        })
    });
    group.finish();

    let mut group = c.benchmark_group(format!("buffer_create_drop_{}KiB", BUFFER >> 10));
    group.bench_function("wgpu_allocator", |b| {
        b.iter(|| drop(black_box(device.create_buffer(&desc()))))
    });
    group.bench_function("governed", |b| {
        b.iter(|| {
            drop(black_box(
                dev.create_buffer(&desc(), Role::Activation)
                    .expect("create"),
            ))
        })
    });
    group.finish();

    let (rounds, per) = if test_mode { (2, 2) } else { (40, 10) };
    let (tw, tg) = interleaved(
        rounds,
        per,
        || {
            own.dispatch(device, queue);
            wait(device);
        },
        || {
            governed.dispatch(device, queue);
            wait(device);
        },
    );
    println!(
        "matmul {N}x{N} (interleaved, {} each): wgpu's allocator {:.1} us, governed {:.1} us, ratio {:.3} (target <= 1.05)",
        rounds * per,
        tw.as_secs_f64() * 1e6 / f64::from(rounds * per),
        tg.as_secs_f64() * 1e6 / f64::from(rounds * per),
        tg.as_secs_f64() / tw.as_secs_f64()
    );
    let (rounds, per) = if test_mode { (2, 2) } else { (40, 50) };
    let (tw, tg) = interleaved(
        rounds,
        per,
        || drop(black_box(device.create_buffer(&desc()))),
        || {
            drop(black_box(
                dev.create_buffer(&desc(), Role::Activation)
                    .expect("create"),
            ))
        },
    );
    println!(
        "buffer create + drop {} KiB (interleaved, {} each): wgpu's allocator {:.1} us, governed {:.1} us, ratio {:.3}",
        BUFFER >> 10,
        rounds * per,
        tw.as_secs_f64() * 1e6 / f64::from(rounds * per),
        tg.as_secs_f64() * 1e6 / f64::from(rounds * per),
        tg.as_secs_f64() / tw.as_secs_f64()
    );
    drop((own, governed));
    dev.retire(
        Instant::now() + Duration::from_secs(60),
        memgov_wgpu::RetireMode::Wait,
    )
    .expect("retire");
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
