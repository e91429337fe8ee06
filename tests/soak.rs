//! Soak: allocate / release cycles over several threads and
//! streams, with random retires and device swaps (a fresh context per epoch),
//! on the host backend, under a counting global allocator.
//!
//! After every teardown: the governor's accounting is at zero, the simulated
//! device holds no memory, no contract violation was seen, and the process
//! heap (bookkeeping memory) is back to exactly its level before the epoch —
//! nothing grows over time.
//!
//! * CI (short): `cargo test --release --test soak -- --nocapture`
//!   (`SOAK_CYCLES`, default 1 000 000, about 2 s).
//! * Long: `scripts/soak-long.sh` (`SOAK_CYCLES=10000000`).

use memgov::fault::SplitMix64 as Rng;
use memgov::host::{HostConfig, HostContext};
use memgov::{
    Admission, Alloc, ContextConfig, Governor, GovernorError, ProviderContextPinError, Role,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Counts live heap bytes and allocations of the whole process.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees are ours; the counters are plain
// atomics and never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as our caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as our caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (we only hand
        // out System's pointers).
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as our caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> i64 {
    LIVE.load(Ordering::SeqCst)
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct EpochResult {
    cycles: u64,
    retired_early: bool,
    heap_after: i64,
}

/// One device: register, hammer from `threads` threads × `streams` streams
/// each, maybe retire in the middle, tear down, check that nothing is left.
fn epoch(
    gov: &Governor<HostContext>,
    ordinal: u32,
    quota: u64,
    threads: usize,
    rng: &mut Rng,
) -> EpochResult {
    let host = HostContext::new(HostConfig {
        capacity: 1 << 30,
        ordinal,
        ..HostConfig::default()
    })
    .unwrap();
    let probe = host.probe();
    let ctx = gov.register(
        host,
        ContextConfig::new()
            .label(format!("soak-{ordinal}"))
            .budget(32 << 20)
            .admission(Admission::WaitForPending {
                timeout: Duration::from_secs(30),
            }),
    );
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let per_thread = quota.div_ceil(threads as u64);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (ctx, done, stop) = (ctx.clone(), done.clone(), stop.clone());
            let seed = rng.next_u64();
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed);
                let streams: Vec<_> = match (0..2)
                    .map(|i| ctx.create_stream(format!("t{t}s{i}")))
                    .collect()
                {
                    Ok(s) => s,
                    Err(e) => {
                        // Only a retire that came first may stop us here.
                        assert!(
                            stop.load(Ordering::Relaxed),
                            "create_stream failed on a live context: {e}"
                        );
                        return;
                    }
                };
                let mut held = Vec::with_capacity(8);
                let mut n = 0;
                while n < per_thread && !stop.load(Ordering::Relaxed) {
                    let s = &streams[(rng.next_u64() % 2) as usize];
                    let bytes = 64 + rng.next_u64() % (64 << 10);
                    let role = Role::ALL[(rng.next_u64() % 5) as usize];
                    match ctx.allocate(s, Alloc::new(bytes, role)) {
                        Ok(b) => {
                            if rng.next_u64() % 16 == 0 {
                                b.write(0, &n.to_le_bytes()).unwrap();
                            }
                            held.push(b);
                        }
                        Err(GovernorError::Pin {
                            refusal: ProviderContextPinError::ContextUnavailable(_),
                            ..
                        }) if stop.load(Ordering::Relaxed) => break,
                        Err(e) => panic!("soak allocation failed: {e}"),
                    }
                    // Release: sometimes on the other stream, sometimes a few at once.
                    if held.len() > (rng.next_u64() % 8) as usize {
                        for b in held.drain(..) {
                            if rng.next_u64() % 4 == 0 {
                                let other = &streams[(rng.next_u64() % 2) as usize];
                                b.release_on(other).unwrap();
                            } else {
                                drop(b);
                            }
                        }
                    }
                    n += 1;
                }
                drop(held);
                done.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    // A random retire in the middle of one epoch in four.
    let retired_early = rng.next_u64() % 4 == 0;
    let h = if retired_early {
        std::thread::sleep(Duration::from_micros(rng.next_u64() % 20_000));
        stop.store(true, Ordering::Relaxed);
        let h = ctx.retire();
        for j in handles {
            j.join().expect("soak thread panicked");
        }
        h
    } else {
        for j in handles {
            j.join().expect("soak thread panicked");
        }
        ctx.retire()
    };
    let report = h
        .wait_timeout(Duration::from_secs(60))
        .expect("teardown after the soak epoch");
    assert!(report.backend_result.is_ok());
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
    // One teardown, no memory or stream left on the device, no violation.
    if let Err(why) = probe.check_clean_teardown() {
        panic!("host backend after teardown: {why}");
    }
    drop((ctx, h, probe));
    assert_eq!(
        gov.prune_terminated(),
        1,
        "the terminated context leaves the registry"
    );
    EpochResult {
        cycles: done.load(Ordering::Relaxed),
        retired_early,
        heap_after: live(),
    }
}

#[test]
fn soak_host() {
    // The only test in this binary: another test running concurrently would
    // move the process-wide heap counter.
    println!(
        "soak: host backend here; the lavapipe soak is tests/soak_vulkan.rs (feature `vulkan`)"
    );
    let target = env("SOAK_CYCLES", 1_000_000);
    let threads = env("SOAK_THREADS", 2) as usize;
    let mut rng = Rng::new(env("SOAK_SEED", 0x5eed));
    let gov = Governor::new();
    // Warm-up: std's lazily allocated statics (thread registry, stdout, ...)
    // settle during the first epochs (a one-time 83 B here); the baseline is
    // the heap after the first measured teardown, and every later teardown
    // must return to it exactly.
    let before = live();
    epoch(&gov, 0, 2_000, threads, &mut rng);
    let warm = epoch(&gov, 0, 2_000, threads, &mut rng);
    let baseline = warm.heap_after;
    let one_time = baseline - before;
    let start = Instant::now();
    let (mut cycles, mut epochs, mut early) = (0u64, 0u64, 0u64);
    let mut worst = 0i64;
    let allocs_before = ALLOCS.load(Ordering::Relaxed);
    while cycles < target {
        let quota = (target - cycles).min(20_000 + rng.next_u64() % 40_000);
        let r = epoch(&gov, (epochs % 2 + 1) as u32, quota, threads, &mut rng);
        cycles += r.cycles;
        epochs += 1;
        early += r.retired_early as u64;
        let diff = r.heap_after - baseline;
        worst = worst.max(diff.abs());
        assert_eq!(
            diff, 0,
            "heap after teardown of epoch {epochs} differs from the baseline by {diff} B: bookkeeping leaked or grew"
        );
        if r.cycles == 0 && !r.retired_early {
            panic!("an epoch made no progress");
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "soak: host: {cycles} allocate/release cycles, {threads} threads x 2 streams, {epochs} device swaps ({early} retired mid-run), \
         {:.1} s ({:.0} cycles/s), {} heap allocations; after every teardown: 0 B on the device, {} B heap difference from the baseline (one-time warm-up: {} B)",
        secs,
        cycles as f64 / secs,
        ALLOCS.load(Ordering::Relaxed) - allocs_before,
        worst,
        one_time
    );
}
