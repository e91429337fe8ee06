//! The shorter soak on lavapipe: allocate / release cycles
//! over two threads × two streams on a Vulkan context with the Khronos
//! validation layer on, and a device swap (a fresh `VulkanContext`) per epoch.
//!
//! After every teardown: the governor's accounting is at zero, the backend
//! holds no allocation and no stream, teardown ran once, every free retired,
//! and the layer reported nothing. (The process heap is not compared here:
//! the driver and the layer keep caches of their own across devices; the host
//! soak in `tests/soak.rs` checks the governor's bookkeeping to the byte.)
//!
//! `cargo test --release --features vulkan --test soak_vulkan -- --nocapture`
//! (`SOAK_VK_CYCLES`, default 100 000).

use memgov::vulkan::{VulkanConfig, VulkanContext};
use memgov::{Admission, Alloc, ContextConfig, Governor, Role};
use std::time::{Duration, Instant};

#[test]
fn soak_lavapipe() {
    let target: u64 = std::env::var("SOAK_VK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let config = match VulkanContext::new(VulkanConfig::validated()) {
        Ok(c) => {
            use memgov::DeviceContext;
            let _ = c.teardown(false);
            VulkanConfig::validated()
        }
        Err(e) => {
            eprintln!(
                "skipped: lavapipe soak: {}",
                memgov_conformance::unavailable_reason(&e)
            );
            return;
        }
    };
    let gov: Governor<VulkanContext> = Governor::new();
    let start = Instant::now();
    let (mut cycles, mut epochs) = (0u64, 0u32);
    while cycles < target {
        let quota = (target - cycles).min(5_000);
        let backend = VulkanContext::new(config.clone()).expect("Vulkan context");
        let probe = backend.probe();
        let ctx = gov.register(
            backend,
            ContextConfig::new()
                .label(format!("soak-vk-{epochs}"))
                .budget(64 << 20)
                .admission(Admission::WaitForPending {
                    timeout: Duration::from_secs(60),
                }),
        );
        let per_thread = quota / 2;
        std::thread::scope(|sc| {
            for t in 0..2u64 {
                let ctx = &ctx;
                sc.spawn(move || {
                    let streams = [
                        ctx.create_stream(format!("t{t}a")).unwrap(),
                        ctx.create_stream(format!("t{t}b")).unwrap(),
                    ];
                    let mut held = Vec::new();
                    for i in 0..per_thread {
                        let s = &streams[(i % 2) as usize];
                        let bytes = 256 + (i * 7919 + t * 104_729) % (256 << 10);
                        let b = ctx
                            .allocate(s, Alloc::new(bytes, Role::ALL[(i % 5) as usize]))
                            .expect("allocate");
                        if i % 8 == 0 {
                            b.write(0, &i.to_le_bytes()).expect("write");
                        }
                        held.push(b);
                        if held.len() > 4 {
                            let victim = held.remove(0);
                            if i % 3 == 0 {
                                victim
                                    .release_on(&streams[((i + 1) % 2) as usize])
                                    .expect("release_on");
                            } else {
                                drop(victim);
                            }
                        }
                    }
                });
            }
        });
        cycles += per_thread * 2;
        let report = ctx
            .retire()
            .wait_timeout(Duration::from_secs(120))
            .expect("teardown");
        assert!(report.backend_result.is_ok(), "{report:?}");
        let snap = ctx.snapshot();
        assert_eq!(
            (snap.charged, snap.pins.total()),
            (0, 0),
            "accounting after teardown: {snap:?}"
        );
        assert_eq!(snap.total(), Default::default());
        assert_eq!(
            snap.counters.releases_queued, snap.counters.retired,
            "every release retired"
        );
        // One teardown, nothing left on the device, no contract violation
        // (every validation warning or error counts as one).
        if let Err(why) = probe.check_clean_teardown() {
            panic!("vulkan backend after teardown: {why}");
        }
        assert_eq!(gov.prune_terminated(), 1);
        epochs += 1;
    }
    println!(
        "soak: vulkan (lavapipe, validation on): {cycles} allocate/release cycles, 2 threads x 2 streams, {epochs} device swaps, {:.1} s; after every teardown: 0 B charged, 0 allocations and 0 streams on the device, 0 validation messages",
        start.elapsed().as_secs_f64()
    );
}
