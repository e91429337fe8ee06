//! The block cache (`ContextConfig::cache`), on the host backend: hits make
//! no backend call, blocks never move to another stream, cached bytes are
//! charged but not live, pressure empties the cache before any responder is
//! asked, and trim, retire, force, device loss and stream drop free it.

use memgov::host::{HostConfig, HostContext};
use memgov::{
    Admission, Alloc, BackendProbe, CacheConfig, ContextConfig, ContextHandle, ContextSnapshot,
    Governor, Role,
};
use memgov_conformance::{WatchLog, Watched};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

type Backend = Watched<HostContext>;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn context(
    gov: &Governor<Backend>,
    config: ContextConfig,
) -> (ContextHandle<Backend>, Arc<WatchLog>, BackendProbe) {
    let host = HostContext::new(HostConfig::default()).unwrap();
    let probe = host.probe();
    let device = Watched::new(host);
    let log = device.log();
    (gov.register(device, config), log, probe)
}

fn cached(limit: u64) -> ContextConfig {
    ContextConfig::new().cache(CacheConfig::new(limit))
}

fn calls(log: &WatchLog) -> u64 {
    log.calls.load(Ordering::SeqCst)
}

fn frees(log: &WatchLog) -> u64 {
    log.frees_queued.load(Ordering::SeqCst)
}

fn live(s: &ContextSnapshot) -> u64 {
    s.total().live_bytes
}

fn pending(s: &ContextSnapshot) -> u64 {
    s.total().pending_bytes
}

/// Every charged byte is live, cached or pending (no quarantine here).
fn assert_books(s: &ContextSnapshot) {
    assert_eq!(
        s.charged,
        live(s)
            + s.cache.cached_bytes
            + pending(s)
            + s.total().quarantined_bytes
            + s.awaiting_teardown,
        "{s:?}"
    );
}

/// [`assert_books`] once the context's queued frees have settled: the host
/// backend retires them on its own thread, and a snapshot reads its
/// counters one after another, so while a free settles `charged` and
/// `pending` can come from either side of it. Fails if they do not settle
/// within ten seconds.
fn assert_books_settled(ctx: &ContextHandle<Backend>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = ctx.snapshot();
        let c = s.counters;
        if c.releases_queued == c.retired + c.abandoned + c.settled_lost {
            // Settled now; a snapshot taken after this one reads the same.
            let s = ctx.snapshot();
            if s.counters == c {
                return assert_books(&s);
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "queued frees did not settle in 10 s: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_same_stream_hit_makes_no_backend_call() {
    let gov = Governor::new();
    let (ctx, log, probe) = context(&gov, cached(MIB));
    let s = ctx.create_stream("s").unwrap();
    let a = ctx.allocate(&s, Alloc::new(1000, Role::Workspace)).unwrap();
    assert_eq!(
        (a.len(), a.charged()),
        (1000, 1024),
        "charged its class, as long as was asked"
    );
    assert!(
        matches!(
            a.write(999, &[1, 2]),
            Err(memgov::GovernorError::OutOfBounds { size: 1000, .. })
        ),
        "bounded by the request, not by the class it was rounded to"
    );
    drop(a);
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.cache.cached_bytes, snap.cache.cached_count),
        (1024, 1)
    );
    assert_eq!(snap.cache.by_class, vec![(1024, 1)]);
    assert_eq!((live(&snap), snap.charged), (0, 1024));
    assert_books(&snap);
    assert_eq!(frees(&log), 0, "kept, not freed");

    let before = calls(&log);
    let b = ctx.allocate(&s, Alloc::new(900, Role::KvCache)).unwrap();
    assert_eq!(calls(&log), before, "a hit calls nothing on the backend");
    assert_eq!(probe.live_allocations(), 1);
    let snap = ctx.snapshot();
    assert_eq!((snap.cache.cached_bytes, snap.cache.hits), (0, 1));
    // The block is live under the role it was handed to now.
    assert_eq!(snap.role(Role::KvCache).live_bytes, 1024);
    assert_eq!(snap.role(Role::Workspace).live_bytes, 0);
    assert_books(&snap);
    // A request of another class is not served by it.
    drop(b);
    let c = ctx.allocate(&s, Alloc::new(2048, Role::Workspace)).unwrap();
    assert_eq!(probe.live_allocations(), 2);
    drop(c);
    assert_eq!(ctx.snapshot().cache.cached_count, 2);
}

#[test]
fn a_block_is_never_reused_on_another_stream() {
    let gov = Governor::new();
    let (ctx, log, probe) = context(&gov, cached(MIB));
    let a = ctx.create_stream("a").unwrap();
    let b = ctx.create_stream("b").unwrap();
    drop(
        ctx.allocate(&a, Alloc::new(4 * KIB, Role::Workspace))
            .unwrap(),
    );
    assert_eq!(ctx.snapshot().cache.cached_count, 1);
    // The same class on another stream: a fresh backend allocation, and the
    // block stays where it was freed.
    let before = calls(&log);
    let on_b = ctx
        .allocate(&b, Alloc::new(4 * KIB, Role::Workspace))
        .unwrap();
    assert!(calls(&log) > before);
    assert_eq!(probe.live_allocations(), 2);
    assert_eq!(ctx.snapshot().cache.cached_count, 1);
    // Released on another stream: an ordinary stream-ordered free.
    on_b.release_on(&a).unwrap();
    assert_eq!(frees(&log), 1);
    assert_eq!(ctx.snapshot().cache.cached_count, 1);
    // Used on another stream: an ordinary free, ordered after that stream.
    let mut used = ctx
        .allocate(&a, Alloc::new(8 * KIB, Role::Workspace))
        .unwrap();
    used.record_stream(&b).unwrap();
    drop(used);
    assert_eq!(frees(&log), 2);
    assert_eq!(log.orderings.load(Ordering::SeqCst), 2);
    let snap = ctx.snapshot();
    assert_eq!(snap.cache.by_class, vec![(4 * KIB, 1)]);
    assert_books_settled(&ctx);
    drop((a, b));
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(probe.violations(), 0, "{:?}", probe.violation_log());
}

#[test]
fn the_cache_keeps_no_more_than_its_limit() {
    let gov = Governor::new();
    let (ctx, log, _) = context(&gov, cached(8 * KIB));
    let s = ctx.create_stream("s").unwrap();
    let t = ctx.create_stream("t").unwrap();
    let x = ctx.allocate(&s, Alloc::new(6 * KIB, Role::Other)).unwrap();
    let y = ctx.allocate(&s, Alloc::new(4 * KIB, Role::Other)).unwrap();
    let z = ctx.allocate(&t, Alloc::new(4 * KIB, Role::Other)).unwrap();
    drop(x);
    // 6 + 4 KiB would pass 8 KiB: the stream's oldest block makes room.
    drop(y);
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.cache.by_class.clone(), frees(&log)),
        (vec![(4 * KIB, 1)], 1)
    );
    assert_eq!(snap.cache.evicted, 6 * KIB);
    // Another stream's blocks are not evicted for this one: freed itself.
    let w = ctx.allocate(&t, Alloc::new(6 * KIB, Role::Other)).unwrap();
    drop(w);
    drop(z);
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.cache.by_class.clone(), frees(&log)),
        (vec![(4 * KIB, 2)], 2)
    );
    assert_books_settled(&ctx);
    // Larger than a block the cache keeps: its own size, never cached.
    let (ctx2, log2, _) = context(
        &gov,
        ContextConfig::new().cache(CacheConfig::new(MIB).max_block(64 * KIB)),
    );
    let s2 = ctx2.create_stream("s").unwrap();
    let big = ctx2
        .allocate(&s2, Alloc::new(100 * KIB + 1, Role::Other))
        .unwrap();
    assert_eq!((big.len(), big.charged()), (100 * KIB + 1, 100 * KIB + 1));
    drop(big);
    assert_eq!((ctx2.snapshot().cache.cached_bytes, frees(&log2)), (0, 1));
}

#[test]
fn pressure_empties_the_cache_before_any_responder_is_asked() {
    let gov = Governor::new();
    let (ctx, log, _) = context(&gov, cached(16 * MIB).budget(4 * MIB));
    let order = Arc::new(Mutex::new(Vec::<String>::new()));
    let weak = ctx.clone();
    let seen = order.clone();
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |req| {
        let snap = weak.snapshot();
        seen.lock().unwrap().push(format!(
            "responder: cached {} released {} shortfall {}",
            snap.cache.cached_bytes, snap.cache.pressure_released, req.shortfall
        ));
        0
    });
    let a = ctx.create_stream("a").unwrap();
    let b = ctx.create_stream("b").unwrap();
    drop(ctx.allocate(&a, Alloc::new(MIB, Role::Workspace)).unwrap());
    let held = ctx
        .allocate(&b, Alloc::new(3 * MIB, Role::Weights))
        .unwrap();
    assert_eq!(ctx.snapshot().cache.cached_bytes, MIB);
    // 3 MiB live + 1 MiB cached: 2 MiB more cannot fit even with the cache
    // empty, so the responder is asked, and it must find the cache empty.
    let err = ctx
        .allocate(&b, Alloc::new(2 * MIB, Role::Workspace))
        .unwrap_err();
    assert!(err.budget().is_some(), "{err}");
    // (The shortfall depends on whether the freed block has retired yet.)
    let order = order.lock().unwrap();
    assert_eq!(order.len(), 1, "{order:?}");
    assert!(
        order[0].starts_with(&format!("responder: cached 0 released {MIB} ")),
        "{order:?}"
    );
    assert_eq!(frees(&log), 1, "the cached block was freed stream-ordered");
    let snap = ctx.snapshot();
    assert_eq!(snap.cache.pressure_released, MIB);
    assert_books_settled(&ctx);
    drop(held);
}

#[test]
fn a_refusal_is_served_by_the_cache_without_asking_a_responder() {
    let gov = Governor::new();
    let (ctx, _, _) = context(
        &gov,
        cached(16 * MIB)
            .budget(4 * MIB)
            .admission(Admission::WaitForPending {
                timeout: Duration::from_secs(10),
            }),
    );
    let asked = Arc::new(Mutex::new(0u32));
    let n = asked.clone();
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
        *n.lock().unwrap() += 1;
        0
    });
    let a = ctx.create_stream("a").unwrap();
    let b = ctx.create_stream("b").unwrap();
    drop(
        ctx.allocate(&a, Alloc::new(3 * MIB, Role::Workspace))
            .unwrap(),
    );
    assert_eq!(ctx.snapshot().cache.cached_bytes, 3 * MIB);
    // Only the cached block stands in the way: released, waited for, done.
    let x = ctx
        .allocate(&b, Alloc::new(2 * MIB, Role::Workspace))
        .unwrap();
    assert_eq!(*asked.lock().unwrap(), 0);
    let snap = ctx.snapshot();
    assert_eq!(snap.cache.cached_bytes, 0);
    assert_eq!(snap.cache.pressure_released, 3 * MIB);
    drop(x);
}

#[test]
fn trim_releases_largest_first_and_returns_the_bytes() {
    let gov = Governor::new();
    let (ctx, log, _) = context(&gov, cached(16 * MIB));
    let s = ctx.create_stream("s").unwrap();
    let t = ctx.create_stream("t").unwrap();
    let bufs = [
        ctx.allocate(&s, Alloc::new(KIB, Role::Other)).unwrap(),
        ctx.allocate(&s, Alloc::new(2 * KIB, Role::Other)).unwrap(),
        ctx.allocate(&t, Alloc::new(MIB, Role::Other)).unwrap(),
    ];
    drop(bufs);
    assert_eq!(ctx.snapshot().cache.cached_bytes, MIB + 3 * KIB);
    assert_eq!(ctx.trim_cache(1), MIB);
    assert_eq!(ctx.trim_cache(u64::MAX), 3 * KIB);
    assert_eq!(ctx.trim_cache(u64::MAX), 0);
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.cache.cached_bytes, snap.cache.trimmed),
        (0, MIB + 3 * KIB)
    );
    assert_eq!(frees(&log), 3);
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
    // Off: nothing to trim.
    let (plain, _, _) = context(&gov, ContextConfig::new());
    assert_eq!(plain.trim_cache(u64::MAX), 0);
    assert!(!plain.snapshot().cache.enabled);
}

/// A context with blocks cached on two streams whose handles are still held.
fn with_cached_blocks(
    gov: &Governor<Backend>,
) -> (
    ContextHandle<Backend>,
    Arc<WatchLog>,
    BackendProbe,
    [memgov::GovernedStream<Backend>; 2],
) {
    let (ctx, log, probe) = context(gov, cached(16 * MIB));
    let s = ctx.create_stream("s").unwrap();
    let t = ctx.create_stream("t").unwrap();
    drop(
        ctx.allocate(&s, Alloc::new(64 * KIB, Role::Workspace))
            .unwrap(),
    );
    drop(
        ctx.allocate(&t, Alloc::new(2 * MIB, Role::KvCache))
            .unwrap(),
    );
    assert_eq!(ctx.snapshot().cache.cached_count, 2);
    (ctx, log, probe, [s, t])
}

#[test]
fn retire_flushes_the_cache_and_teardown_runs() {
    let gov = Governor::new();
    let (ctx, log, probe, streams) = with_cached_blocks(&gov);
    let retire = ctx.retire();
    let snap = ctx.snapshot();
    assert_eq!(snap.cache.cached_count, 0, "flushed when retire began");
    assert_eq!(frees(&log), 2);
    assert_books_settled(&ctx);
    drop(streams);
    let report = retire.wait(soon()).unwrap();
    assert_eq!(report.retired_releases, 2);
    probe.check_clean_teardown().unwrap();
}

#[test]
fn force_flushes_the_cache_and_teardown_runs() {
    let gov = Governor::new();
    let (ctx, log, probe, streams) = with_cached_blocks(&gov);
    // The stream handles are held: force revokes them, and the cached
    // blocks were freed when retire began, before force closed the gate.
    let report = ctx.retire().force(soon()).unwrap();
    assert_eq!(frees(&log), 2);
    assert_eq!(report.retired_releases, 2);
    assert_eq!(
        ctx.snapshot().counters.reclaimed,
        0,
        "nothing cached was left live"
    );
    drop(streams);
    probe.check_clean_teardown().unwrap();
}

#[test]
fn device_loss_flushes_the_cache_and_teardown_runs() {
    let gov = Governor::new();
    let (ctx, log, probe, streams) = with_cached_blocks(&gov);
    assert!(ctx.mark_lost("test"));
    let snap = ctx.snapshot();
    assert_eq!(snap.cache.cached_count, 0);
    assert_eq!(snap.counters.settled_lost, 2);
    assert_eq!(frees(&log), 0, "nothing is freed on a lost device");
    // A lost context caches nothing more.
    drop(streams);
    let report = ctx.retire().wait(soon()).unwrap();
    assert!(report.lost);
    assert!(probe.torn_down());
}

#[test]
fn dropping_a_stream_frees_its_cached_blocks() {
    let gov = Governor::new();
    let (ctx, log, probe, [s, t]) = with_cached_blocks(&gov);
    drop(s);
    let snap = ctx.snapshot();
    assert_eq!(snap.cache.by_class, vec![(2 * MIB, 1)]);
    assert_eq!(frees(&log), 1);
    drop(t);
    assert_eq!(ctx.snapshot().cache.cached_count, 0);
    assert_eq!(probe.live_streams(), 0);
    ctx.retire().wait(soon()).unwrap();
    probe.check_clean_teardown().unwrap();
}

/// A trace does not turn the cache off: the release is kept, not freed
/// (its timeline records it as cached; see tests/timeline.rs).
#[test]
fn a_traced_context_caches_like_any_other() {
    let gov = Governor::new();
    let trace = memgov::trace::Trace::new();
    let (ctx, log, _) = context(&gov, cached(MIB).trace(&trace));
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(KIB, Role::Other)).unwrap());
    assert_eq!((ctx.snapshot().cache.cached_count, frees(&log)), (1, 0));
}

/// A workload of varying sizes (sequence lengths drawn per request, two
/// buffers per layer, as a transformer's activations and MLP scratch):
/// returns (peak of the bytes the application asked for, the context's
/// `peak` (live + cached), backend allocations, cache hits).
fn varying_workload(config: ContextConfig) -> (u64, u64, u64, u64) {
    let gov = Governor::new();
    let (ctx, log, _) = context(&gov, config);
    let s = ctx.create_stream("s").unwrap();
    let (mut seed, mut asked, mut asked_peak) = (0x2545_f491_u64, 0u64, 0u64);
    for _request in 0..200 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let seq = 1 + (seed >> 33) % 512;
        let mut carry = None;
        for _layer in 0..8 {
            let (a_bytes, b_bytes) = (seq * 4096 * 2, seq * 4096 * 8);
            let a = ctx
                .allocate(&s, Alloc::new(a_bytes, Role::Workspace))
                .unwrap();
            asked += a_bytes;
            asked_peak = asked_peak.max(asked);
            let b = ctx
                .allocate(&s, Alloc::new(b_bytes, Role::Workspace))
                .unwrap();
            asked += b_bytes;
            asked_peak = asked_peak.max(asked);
            drop(a);
            asked -= a_bytes;
            if let Some((old, bytes)) = carry.replace((b, b_bytes)) {
                drop(old);
                asked -= bytes;
            }
        }
        if let Some((old, bytes)) = carry.take() {
            drop(old);
            asked -= bytes;
        }
        // The end of a run: its frees execute.
        s.synchronize().unwrap();
    }
    s.synchronize().unwrap();
    let snap = ctx.snapshot();
    assert!(snap.peak_exact);
    drop(log);
    (
        asked_peak,
        snap.peak,
        snap.counters.allocations,
        snap.cache.hits,
    )
}

#[test]
fn the_cache_peak_stays_within_a_quarter_of_the_live_peak() {
    let (asked, uncached_peak, uncached_calls, _) = varying_workload(ContextConfig::new());
    assert_eq!(
        uncached_peak, asked,
        "without the cache the peak is what was asked"
    );
    // A cache limited to an eighth of the live peak: its peak is the live
    // peak (rounded to classes) plus what it keeps, the oldest blocks making
    // room for new ones.
    let (asked2, cached_peak, cached_calls, hits) = varying_workload(
        ContextConfig::new().cache(CacheConfig::new(asked / 8).max_block(64 * MIB)),
    );
    assert_eq!(asked, asked2);
    println!(
        "varying workload: live peak {asked} B, uncached peak {uncached_peak} B ({uncached_calls} backend allocations), cached peak {cached_peak} B = {:.3}x ({cached_calls} backend allocations, {hits} cache hits)",
        cached_peak as f64 / asked as f64
    );
    assert!(
        cached_peak as f64 <= 1.25 * asked as f64,
        "cached peak {cached_peak} over 1.25x the live peak {asked}"
    );
    assert!(
        cached_calls < uncached_calls,
        "{cached_calls} vs {uncached_calls}"
    );
    // A cache as large as the live peak: every size of a run is reused; the
    // peak is bounded by the live peak plus the cache's limit, not 1.25x.
    let (_, big_peak, big_calls, big_hits) =
        varying_workload(ContextConfig::new().cache(CacheConfig::new(asked).max_block(64 * MIB)));
    println!(
        "varying workload, cache limit = live peak: peak {big_peak} B = {:.3}x ({big_calls} backend allocations, {big_hits} cache hits)",
        big_peak as f64 / asked as f64
    );
    assert!(big_peak <= uncached_peak.div_ceil(8) * 9 + asked);
}

#[test]
fn a_refused_free_of_a_cached_block_is_quarantined_and_teardown_runs() {
    use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
    let host = HostContext::new(HostConfig::default()).unwrap();
    let probe = host.probe();
    let backend = FaultInjecting::new(
        host,
        FaultPlan::new().nth(Operation::FreeAsync, 1, Fault::Error),
    );
    let gov = Governor::new();
    let ctx = gov.register(backend, cached(MIB));
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(2 * KIB, Role::Other)).unwrap());
    assert_eq!(ctx.snapshot().cache.cached_bytes, 2 * KIB);
    // The cache's free is refused: the block is quarantined, as a buffer's
    // would be, and stays charged until teardown.
    assert_eq!(ctx.trim_cache(u64::MAX), 2 * KIB);
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.cache.cached_bytes, snap.total().quarantined_bytes),
        (0, 2 * KIB)
    );
    assert_eq!(snap.charged, snap.total().quarantined_bytes);
    drop(s);
    let report = ctx.retire().wait(soon()).unwrap();
    assert_eq!(report.quarantined_bytes, 2 * KIB);
    assert_eq!(ctx.snapshot().charged, 0);
    probe.check_clean_teardown().unwrap();
}

#[test]
fn a_device_refusal_takes_the_cache_before_the_responders() {
    use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
    let host = HostContext::new(HostConfig::default()).unwrap();
    // The first allocation succeeds, the second is refused by the "device".
    let backend = FaultInjecting::new(
        host,
        FaultPlan::new().nth(Operation::Allocate, 2, Fault::OutOfMemory),
    );
    let gov = Governor::new();
    let ctx = gov.register(backend, cached(16 * MIB));
    let asked = Arc::new(Mutex::new(0u32));
    let n = asked.clone();
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
        *n.lock().unwrap() += 1;
        0
    });
    let a = ctx.create_stream("a").unwrap();
    let b = ctx.create_stream("b").unwrap();
    drop(ctx.allocate(&a, Alloc::new(MIB, Role::Other)).unwrap());
    let x = ctx.allocate(&b, Alloc::new(MIB, Role::Other)).unwrap();
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.cache.pressure_released, snap.cache.cached_bytes),
        (MIB, 0)
    );
    assert_eq!(*asked.lock().unwrap(), 0, "the cache's release was enough");
    drop(x);
}

/// The cache keeps device memory only: a pinned host buffer is freed
/// stream-ordered when released, never cached, and a device allocation of
/// its size is never served with it.
#[test]
fn pinned_host_buffers_are_never_cached() {
    let gov = Governor::new();
    let (ctx, log, _probe) = context(&gov, cached(MIB).tier_budget(memgov::Tier::PinnedHost, MIB));
    let s = ctx.create_stream("s").unwrap();
    let pinned = ctx
        .allocate(
            &s,
            Alloc::new(4 * KIB, Role::KvCache).tier(memgov::Tier::PinnedHost),
        )
        .unwrap();
    assert_eq!(
        pinned.len(),
        4 * KIB,
        "no size class outside the device tier"
    );
    let freed = frees(&log);
    drop(pinned);
    assert_eq!(
        frees(&log),
        freed + 1,
        "a pinned release is a free, not a put"
    );
    s.synchronize().unwrap();
    assert_eq!(ctx.snapshot().cache.cached_count, 0);
    let before = calls(&log);
    let device = ctx
        .allocate(&s, Alloc::new(4 * KIB, Role::KvCache))
        .unwrap();
    assert_eq!(device.tier(), memgov::Tier::Device);
    assert!(calls(&log) > before, "a miss: the backend allocated");
    drop(device);
    assert_eq!(
        ctx.snapshot().cache.cached_count,
        1,
        "device blocks are kept"
    );
    assert_books(&ctx.snapshot());
}

/// A refusal by the device's shared budget takes back the block caches of
/// every context on the device before any pressure responder is asked, and
/// what they free admits the allocation.
#[test]
fn a_shared_refusal_empties_other_contexts_caches_before_responders() {
    let gov = Governor::new();
    let gpu0 = memgov::SharedBudget::new("gpu0", 4 * MIB);
    let (a, _, _) = context(&gov, cached(4 * MIB).shared_budget(gpu0.clone()));
    let (b, _, _) = context(
        &gov,
        ContextConfig::new()
            .shared_budget(gpu0.clone())
            .admission(Admission::WaitForPending {
                timeout: Duration::from_secs(10),
            }),
    );
    let asked = Arc::new(Mutex::new(Vec::new()));
    for (ctx, name) in [(&a, "a"), (&b, "b")] {
        let asked = asked.clone();
        ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
            asked.lock().unwrap().push(name);
            0
        });
    }
    let sa = a.create_stream("a").unwrap();
    let blocks: Vec<_> = (0..3)
        .map(|_| a.allocate(&sa, Alloc::new(MIB, Role::Activation)).unwrap())
        .collect();
    drop(blocks);
    assert_eq!(a.snapshot().cache.cached_bytes, 3 * MIB);
    let sb = b.create_stream("b").unwrap();
    let big = b.allocate(&sb, Alloc::new(2 * MIB, Role::Weights)).unwrap();
    assert!(
        asked.lock().unwrap().is_empty(),
        "responders asked: {:?}",
        asked.lock().unwrap()
    );
    // The frees the pressure queued on `sa` may still be settling: the
    // books balance once the stream has run them (a snapshot reads its
    // counters one after another, not at one instant).
    sa.synchronize().unwrap();
    let snap = a.snapshot();
    assert!(snap.cache.pressure_released >= MIB, "{:?}", snap.cache);
    assert_books(&snap);
    drop(big);
    sb.synchronize().unwrap();
    a.trim_cache(u64::MAX);
    sa.synchronize().unwrap();
    assert_eq!((a.snapshot().cache.cached_bytes, gpu0.charged()), (0, 0));
}
