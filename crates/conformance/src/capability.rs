//! Conformance cases for the capabilities of `memgov_backend::capability`:
//! what every backend declaring a virtual-memory arena, sleep and wake, or
//! graph capture must do, written once over the traits.
//!
//! The factory makes a context with an arena of at least 64 granules of
//! address space and a limit of at least 16 granules. Each case makes its
//! own context, tears it down, and returns a description of what it saw or
//! the first thing that was wrong.
//!
//! A backend's test runs them with its own factory, as the CUDA backend's
//! `tests/arena.rs` does:
//!
//! ```text
//! for (name, outcome) in run_arena_cases(|| CudaContext::new(config_with_arena())) {
//!     outcome.unwrap_or_else(|e| panic!("{name}: {e}"));
//! }
//! ```

use memgov::backend::capability::{
    ArenaBackend, CaptureBackend, CaptureConfig, CaptureMode, CapturedGraph, PoolCapture,
    PoolExhausted, SleepWake, VirtualArena,
};
use memgov::{Alloc, BackendError, BackendErrorKind, ContextConfig, DeviceContext, Governor, Role};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One case's outcome: what it checked, or what went wrong.
pub type CaseResult = Result<String, String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

fn be(what: &str) -> impl Fn(BackendError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(131)
                .wrapping_add(seed.wrapping_mul(7)) as u8
        })
        .collect()
}

fn open<C: ArenaBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> Result<(C, C::Arena), String> {
    let ctx = factory().map_err(be("open a context with an arena"))?;
    let arena = ctx
        .arena()
        .ok_or("the factory made a context without an arena")?;
    Ok((ctx, arena))
}

/// Free `memory` stream-ordered and wait until its release has retired.
fn release<C: DeviceContext>(ctx: &C, s: &C::Stream, memory: C::Memory) -> Result<(), String> {
    let retired = Arc::new(AtomicU64::new(0));
    let r = retired.clone();
    ctx.free_async(
        s,
        memory,
        memgov::RetireSignal::from_fn(move |_| {
            r.store(1, Ordering::SeqCst);
        }),
    )
    .map_err(|(_, _, e)| format!("free_async: {e}"))?;
    ctx.synchronize(s).map_err(be("synchronize"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while retired.load(Ordering::SeqCst) == 0 {
        ensure!(
            Instant::now() < deadline,
            "a release did not retire in 10 s"
        );
        std::thread::yield_now();
    }
    Ok(())
}

fn close<C: DeviceContext>(ctx: C, streams: Vec<C::Stream>) -> Result<(), String> {
    for s in streams {
        ctx.destroy_stream(s).map_err(be("destroy_stream"))?;
    }
    ctx.teardown(false).map_err(be("teardown"))
}

/// Makes a context with an arena.
pub type Factory<'a, C> = &'a dyn Fn() -> Result<C, BackendError>;

/// An arena case: given the factory, what it checked or what went wrong.
pub type ArenaCase<C> = fn(Factory<'_, C>) -> CaseResult;

/// A capture case: given the factory and the count of driver allocations
/// made while a capture is under way.
pub type CaptureCase<C> = fn(Factory<'_, C>, &dyn Fn() -> u64) -> CaseResult;

/// The arena cases, by name.
pub fn arena_cases<C: ArenaBackend>() -> Vec<(&'static str, ArenaCase<C>)> {
    vec![
        (
            "arena_addresses_stable_across_growth",
            addresses_stable_across_growth::<C>,
        ),
        (
            "arena_charges_mapped_bytes_not_reserved",
            mapped_bytes_charged_not_reserved::<C>,
        ),
        (
            "arena_trim_gives_back_whole_granules",
            trim_whole_granules::<C>,
        ),
        (
            "sleep_wake_restores_bytes_at_the_same_addresses",
            sleep_wake_restores::<C>,
        ),
        (
            "sleep_wake_of_a_set_leaves_the_others_usable",
            sleep_wake_set::<C>,
        ),
        (
            "governed_partial_wake_leaves_the_kv_cache_asleep",
            governed_partial_wake::<C>,
        ),
        (
            "governed_sleep_charges_host_copies_to_the_pinned_tier",
            governed_host_copies::<C>,
        ),
    ]
}

/// Run every arena case on contexts from `factory`.
pub fn run_arena_cases<C: ArenaBackend>(
    factory: impl Fn() -> Result<C, BackendError>,
) -> Vec<(&'static str, CaseResult)> {
    arena_cases::<C>()
        .into_iter()
        .map(|(name, case)| (name, case(&factory)))
        .collect()
}

/// What a tool (`memgov check`) says a backend offers, shown rather than
/// claimed: each capability is "yes" only once one of its cases ran here on
/// a context from `factory` (an arena of at least 64 granules of address
/// space and 16 of limit).
///
/// * `"arena"`: maps granules as allocations grow, writes and reads back,
///   addresses kept (`arena_addresses_stable_across_growth`);
/// * `"sleep_wake"`: writes, sleeps (every granule released), wakes, reads
///   every byte back at the same address
///   (`sleep_wake_restores_bytes_at_the_same_addresses`);
/// * `"capture_gate"`: captures copies into a pool, launches the graph,
///   compares what it read back, destroys it
///   (`capture_allocates_without_driver_allocation`, without counting the
///   driver's allocations).
///
/// A capability whose case fails is `Err` with what went wrong; the two
/// that need an arena are `Err("no arena: ...")` when the arena's did.
pub fn probe_capabilities<C: CaptureBackend>(
    factory: impl Fn() -> Result<C, BackendError>,
) -> Vec<(&'static str, CaseResult)> {
    let arena = addresses_stable_across_growth(&factory);
    let (sleep_wake, capture) = match &arena {
        Ok(_) => (
            sleep_wake_restores(&factory),
            capture_without_driver_allocation(&factory, &|| 0),
        ),
        Err(why) => (
            Err(format!("no arena: {why}")),
            Err(format!("no arena: {why}")),
        ),
    };
    vec![
        ("arena", arena),
        ("sleep_wake", sleep_wake),
        ("capture_gate", capture),
    ]
}

/// A small allocation keeps its address and its bytes while the arena
/// grows by many granules around it; large allocations are contiguous and
/// do not overlap.
fn addresses_stable_across_growth<C: ArenaBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    let first = ctx.allocate(&s, 4096).map_err(be("allocate"))?;
    let at = ctx.device_address(&first);
    ctx.write(&s, &first, 0, &pattern(1, 4096))
        .map_err(be("write"))?;
    let mapped_before = arena.usage().mapped;
    let mut big = Vec::new();
    for i in 0..4u64 {
        let len = 2 * g + 4096;
        let m = ctx.allocate(&s, len).map_err(be("allocate 2 granules"))?;
        ctx.write(&s, &m, len - 4096, &pattern(10 + i, 4096))
            .map_err(be("write at the end of a large allocation"))?;
        big.push((ctx.device_address(&m), len, m));
    }
    let grown = arena.usage().mapped;
    ensure!(
        grown >= mapped_before + 8 * g,
        "the arena mapped {grown} B after 4 allocations of 2 granules and a bit, from {mapped_before} B"
    );
    ensure!(
        ctx.device_address(&first) == at,
        "the first allocation moved"
    );
    let mut back = vec![0u8; 4096];
    ctx.read(&s, &first, 0, &mut back).map_err(be("read"))?;
    ensure!(
        back == pattern(1, 4096),
        "the first allocation's bytes changed while the arena grew"
    );
    let mut ranges: Vec<(u64, u64)> = big.iter().map(|(a, l, _)| (*a, *l)).collect();
    ranges.push((at, 4096));
    ranges.sort();
    for w in ranges.windows(2) {
        ensure!(w[0].0 + w[0].1 <= w[1].0, "allocations overlap: {:x?}", w);
    }
    for (i, (_, len, m)) in big.iter().enumerate() {
        ctx.read(&s, m, len - 4096, &mut back).map_err(be("read"))?;
        ensure!(
            back == pattern(10 + i as u64, 4096),
            "large allocation {i} lost its bytes"
        );
    }
    for (_, _, m) in big {
        release(&ctx, &s, m)?;
    }
    release(&ctx, &s, first)?;
    close(ctx, vec![s])?;
    Ok(format!(
        "grew {} granules, addresses and bytes kept",
        (grown - mapped_before) / g
    ))
}

/// The arena's limit counts mapped granules, never the reservation; a
/// governor budget far smaller than the reservation admits allocations,
/// charged their own bytes; a map past the limit is refused with
/// `OutOfMemory` and maps nothing.
fn mapped_bytes_charged_not_reserved<C: ArenaBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let u = arena.usage();
    let g = u.granule;
    ensure!(u.mapped == 0, "a fresh arena maps {} B", u.mapped);
    ensure!(
        u.reserved >= 64 * g,
        "the factory reserved {} B, fewer than 64 granules",
        u.reserved
    );
    arena.set_limit(4 * g);
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let a = ctx.allocate(&s, 3 * g).map_err(be("allocate 3 granules"))?;
    let refused = ctx.allocate(&s, 2 * g);
    let mapped = arena.usage().mapped;
    let outcome = match refused {
        Ok(m) => {
            release(&ctx, &s, m)?;
            Err("a map past the arena's limit of 4 granules was admitted".to_owned())
        }
        Err(e) if e.kind == BackendErrorKind::OutOfMemory => Ok(()),
        Err(e) => Err(format!("refused, but not OutOfMemory: {e}")),
    };
    release(&ctx, &s, a)?;
    outcome?;
    ensure!(
        mapped == 3 * g,
        "after a refusal the arena maps {mapped} B, not 3 granules"
    );
    arena.trim().map_err(be("trim"))?;
    arena.set_limit(u64::MAX);
    close(ctx, vec![s])?;

    // Governed: a budget of 8 granules under a reservation of 64 or more.
    let (ctx, arena) = open(factory)?;
    let gov = Governor::new();
    let h = gov.register(ctx, ContextConfig::new().budget(8 * g));
    let s = h.create_stream("s").map_err(|e| e.to_string())?;
    let b = h
        .allocate(&s, Alloc::new(6 * g, Role::Activation))
        .map_err(|e| format!("6 granules under a budget of 8: {e}"))?;
    let (charged, usage) = (h.snapshot().charged, arena.usage());
    ensure!(charged == 6 * g, "charged {charged} B for 6 granules");
    ensure!(
        usage.mapped >= charged && usage.reserved > 8 * g,
        "mapped {} B, reserved {} B",
        usage.mapped,
        usage.reserved
    );
    drop((b, s));
    h.retire()
        .wait(Instant::now() + Duration::from_secs(10))
        .map_err(|e| e.to_string())?
        .backend_result
        .map_err(be("teardown"))?;
    Ok(format!(
        "limit 4 granules of {} reserved: 3 mapped, 2 more refused; governed: {} B charged, {} B reserved",
        u.reserved / g,
        charged,
        usage.reserved
    ))
}

/// A trim gives back whole cached granules, and nothing in use.
fn trim_whole_granules<C: ArenaBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    let keep = ctx.allocate(&s, 4096).map_err(be("allocate"))?;
    ctx.write(&s, &keep, 0, &pattern(3, 4096))
        .map_err(be("write"))?;
    let gone = ctx.allocate(&s, 3 * g).map_err(be("allocate"))?;
    release(&ctx, &s, gone)?;
    let before = arena.usage();
    let freed = arena.trim().map_err(be("trim"))?;
    let after = arena.usage();
    ensure!(
        freed > 0 && freed % g == 0,
        "a trim gave back {freed} B, not whole granules"
    );
    ensure!(
        after.mapped == before.mapped - freed && after.cached == 0,
        "after a trim of {freed} B: mapped {} B (from {} B), cached {} B",
        after.mapped,
        before.mapped,
        after.cached
    );
    let mut back = vec![0u8; 4096];
    ctx.read(&s, &keep, 0, &mut back).map_err(be("read"))?;
    ensure!(back == pattern(3, 4096), "a trim touched memory in use");
    release(&ctx, &s, keep)?;
    close(ctx, vec![s])?;
    Ok(format!("trimmed {} granules", freed / g))
}

/// Sleep releases every granule and keeps the addresses; wake maps them
/// again and every byte is back.
fn sleep_wake_restores<C: ArenaBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    let len = g + g / 2;
    let mut held = Vec::new();
    for i in 0..3u64 {
        let m = ctx.allocate(&s, len).map_err(be("allocate"))?;
        ctx.write(&s, &m, 0, &pattern(20 + i, len as usize))
            .map_err(be("write"))?;
        held.push((ctx.device_address(&m), m));
    }
    let report = arena.sleep(true).map_err(be("sleep"))?;
    let asleep = arena.usage();
    ensure!(
        asleep.mapped == 0,
        "asleep, the arena still maps {} B",
        asleep.mapped
    );
    ensure!(
        report.released > 0 && report.offloaded > 0,
        "sleep reported {report:?}"
    );
    let mapped = arena.wake().map_err(be("wake"))?;
    ensure!(
        mapped == asleep.asleep,
        "wake mapped {mapped} B of {} B asleep",
        asleep.asleep
    );
    let mut back = vec![0u8; len as usize];
    for (i, (at, m)) in held.iter().enumerate() {
        ensure!(ctx.device_address(m) == *at, "allocation {i} moved");
        ctx.read(&s, m, 0, &mut back).map_err(be("read"))?;
        ensure!(
            back == pattern(20 + i as u64, len as usize),
            "allocation {i}: bytes not restored"
        );
    }
    for (_, m) in held {
        release(&ctx, &s, m)?;
    }
    close(ctx, vec![s])?;
    Ok(format!(
        "{} B released and restored at the same addresses",
        report.released
    ))
}

/// A set of allocations sleeps alone: its granules are released, another
/// allocation stays usable, a copy to the set is refused, a second sleep
/// releases nothing, and the wake restores every byte at the same address.
fn sleep_wake_set<C: ArenaBackend>(factory: Factory<'_, C>) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    // First fit: `set` takes granules 0 and 1 whole, `other` starts at 2.
    let set = ctx.allocate(&s, 2 * g).map_err(be("allocate"))?;
    let other = ctx.allocate(&s, g).map_err(be("allocate"))?;
    let (ps, po) = (pattern(90, 2 * g as usize), pattern(91, g as usize));
    ctx.write(&s, &set, 0, &ps).map_err(be("write"))?;
    ctx.write(&s, &other, 0, &po).map_err(be("write"))?;
    let at = ctx.device_address(&set);
    let mapped = arena.usage().mapped;
    let report = arena
        .sleep_ranges(&[at], true)
        .map_err(be("sleep_ranges"))?;
    ensure!(
        report.released == 2 * g,
        "sleep_ranges released {} B of the set's 2 granules",
        report.released
    );
    ensure!(
        arena.usage().mapped == mapped - 2 * g,
        "the set's granules are still counted mapped"
    );
    let mut back = vec![0u8; g as usize];
    ctx.read(&s, &other, 0, &mut back)
        .map_err(be("read the awake allocation"))?;
    ensure!(back == po, "the awake allocation's bytes changed");
    ctx.write(&s, &other, 0, &po)
        .map_err(be("write the awake allocation"))?;
    match ctx.write(&s, &set, 0, &[0; 16]) {
        Err(e) if e.kind == BackendErrorKind::InvalidArgument => {}
        Err(e) => return Err(format!("a copy to a sleeping set: {e}")),
        Ok(()) => return Err("a copy to a sleeping set was accepted".into()),
    }
    let again = arena
        .sleep_ranges(&[at], true)
        .map_err(be("sleep_ranges again"))?;
    ensure!(
        again.released == 0,
        "a second sleep released {} B",
        again.released
    );
    let woke = arena.wake_ranges(&[at]).map_err(be("wake_ranges"))?;
    ensure!(woke == 2 * g, "wake_ranges mapped {woke} B");
    ensure!(ctx.device_address(&set) == at, "the set moved");
    let mut back = vec![0u8; 2 * g as usize];
    ctx.read(&s, &set, 0, &mut back).map_err(be("read"))?;
    ensure!(back == ps, "the set's bytes were not restored");
    release(&ctx, &s, set)?;
    release(&ctx, &s, other)?;
    close(ctx, vec![s])?;
    Ok(format!(
        "{} B of a set slept and woke, the other allocation untouched",
        report.released
    ))
}

/// A governor (kept while the context is used: dropping it retires its
/// contexts), a context registered with it, its arena's handle and a
/// stream.
type Governed<C> = (
    Governor<C>,
    memgov::ContextHandle<C>,
    <C as ArenaBackend>::Arena,
    memgov::GovernedStream<C>,
);

fn governed<C: ArenaBackend>(
    factory: Factory<'_, C>,
    config: ContextConfig,
) -> Result<Governed<C>, String> {
    let (ctx, arena) = open(factory)?;
    let gov = Governor::new();
    let h = gov.register(ctx, config);
    let s = h.create_stream("s").map_err(|e| e.to_string())?;
    Ok((gov, h, arena, s))
}

fn address<C: ArenaBackend>(
    h: &memgov::ContextHandle<C>,
    b: &memgov::DeviceBuffer<C>,
) -> Result<u64, String> {
    let m = b.raw().ok_or("a buffer with no memory")?;
    h.with_backend(|c| c.device_address(m))
        .map_err(|e| e.to_string())
}

/// Retire a governed context and check its teardown.
fn retire_governed<C: ArenaBackend>(h: memgov::ContextHandle<C>) -> Result<(), String> {
    h.retire()
        .wait(Instant::now() + Duration::from_secs(10))
        .map_err(|e| e.to_string())?
        .backend_result
        .map_err(be("teardown"))
}

/// A copy the arena must refuse because the memory sleeps.
fn refused_asleep(what: &str, r: Result<(), memgov::GovernorError>) -> Result<(), String> {
    match r {
        Err(memgov::GovernorError::Backend { source, .. })
            if source.kind == BackendErrorKind::InvalidArgument =>
        {
            Ok(())
        }
        Err(e) => Err(format!("{what}: refused, but not as asleep: {e}")),
        Ok(()) => Err(format!("{what}: accepted while its memory sleeps")),
    }
}

/// vLLM's sleep and wake through the governor: the weights (their contents
/// kept) and the KV cache (discarded) put to sleep together, the weights
/// woken alone, the KV cache later. In between the books and the snapshot
/// say the KV cache sleeps, with its bytes suspended; copies to and from
/// it are refused as asleep; a new KV allocation lands outside its
/// sleeping range; then its own wake succeeds and it is usable.
fn governed_partial_wake<C: ArenaBackend>(factory: Factory<'_, C>) -> CaseResult {
    use memgov::SleepState;
    let (_gov, h, arena, s) = governed(factory, ContextConfig::new().label("llm"))?;
    let g = arena.usage().granule;
    let ge = |what: &'static str| move |e: memgov::GovernorError| format!("{what}: {e}");
    // First fit: the weights take granules 0 and 1, the KV cache 2 and 3.
    let weights = h
        .allocate(&s, Alloc::new(2 * g, Role::Weights))
        .map_err(ge("allocate the weights"))?;
    let kv = h
        .allocate(&s, Alloc::new(2 * g, Role::KvCache))
        .map_err(ge("allocate the KV cache"))?;
    let (pw, pk) = (pattern(60, 2 * g as usize), pattern(61, 2 * g as usize));
    weights.write(0, &pw).map_err(ge("write the weights"))?;
    kv.write(0, &pk).map_err(ge("write the KV cache"))?;
    let (at_w, at_k) = (address(&h, &weights)?, address(&h, &kv)?);
    let slept = h
        .sleep_with(&[Role::Weights, Role::KvCache], |_| {
            let kept = arena.sleep_ranges(&[at_w], true)?;
            let discarded = arena.sleep_ranges(&[at_k], false)?;
            Ok((kept, discarded))
        })
        .map_err(ge("sleep the weights and the KV cache"))?;
    ensure!(
        slept.suspended == 4 * g && slept.backend.0.offloaded == 2 * g,
        "slept {slept:?}"
    );
    ensure!(
        slept.backend.1.offloaded == 0 && slept.backend.1.released == 2 * g,
        "the KV cache's sleep {:?}",
        slept.backend.1
    );

    ensure!(
        sleep_copies(&h).0 == 2 * g,
        "the weights' host copies: {:?} charged to the pinned host tier, not {} B",
        sleep_copies(&h),
        2 * g
    );
    let woken = h
        .wake_with(&[Role::Weights], |_| arena.wake_ranges(&[at_w]))
        .map_err(ge("wake the weights"))?;
    ensure!(
        sleep_copies(&h) == (0, 0),
        "the weights' wake left {:?} of host copies charged",
        sleep_copies(&h)
    );
    ensure!(
        woken.resumed == 2 * g && woken.backend == 2 * g,
        "the weights' wake: {woken:?}"
    );
    let snap = h.snapshot();
    ensure!(
        snap.sleep == SleepState::Asleep
            && snap.role(Role::KvCache).asleep
            && !snap.role(Role::Weights).asleep,
        "after waking the weights the snapshot says sleep {}, weights asleep {}, KV cache asleep {}",
        snap.sleep,
        snap.role(Role::Weights).asleep,
        snap.role(Role::KvCache).asleep
    );
    ensure!(
        snap.role(Role::KvCache).suspended_bytes == 2 * g && snap.charged == 2 * g,
        "the KV cache's bytes are not suspended alone: {} B suspended, {} B charged",
        snap.role(Role::KvCache).suspended_bytes,
        snap.charged
    );
    ensure!(
        h.sleeping_roles() == [Role::KvCache],
        "sleeping roles {:?}",
        h.sleeping_roles()
    );
    ensure!(
        arena.usage().asleep == 2 * g,
        "the arena has {} B asleep, not the KV cache's 2 granules",
        arena.usage().asleep
    );
    // The weights are back, at the same address, and usable.
    let mut back = vec![0u8; 2 * g as usize];
    weights.read(0, &mut back).map_err(ge("read the weights"))?;
    ensure!(back == pw, "the weights' bytes were not restored");
    ensure!(address(&h, &weights)? == at_w, "the weights moved");
    weights.write(0, &pk).map_err(ge("reload the weights"))?;
    // The KV cache still sleeps: copies are refused as asleep.
    refused_asleep("a write to the sleeping KV cache", kv.write(0, &[1; 64]))?;
    refused_asleep("a read of the sleeping KV cache", kv.read(0, &mut [0; 64]))?;
    // A new KV block never lands in the sleeping range.
    let block = h
        .allocate(&s, Alloc::new(g, Role::KvCache))
        .map_err(ge("a KV block while the KV cache sleeps"))?;
    let at_b = address(&h, &block)?;
    ensure!(
        at_b + g <= at_k || at_b >= at_k + 2 * g,
        "a KV block at {at_b:#x} overlaps the sleeping KV cache at {at_k:#x}"
    );
    block
        .write(0, &[7; 64])
        .map_err(ge("write the new block"))?;

    let woken = h
        .wake_with(&[Role::KvCache], |_| arena.wake_ranges(&[at_k]))
        .map_err(ge("wake the KV cache"))?;
    ensure!(woken.resumed == 2 * g, "the KV cache's wake: {woken:?}");
    ensure!(
        h.sleep_state() == SleepState::Awake && arena.usage().asleep == 0,
        "after both wakes: {}, {} B asleep",
        h.sleep_state(),
        arena.usage().asleep
    );
    kv.write(0, &pk).map_err(ge("write the woken KV cache"))?;
    kv.read(0, &mut back)
        .map_err(ge("read the woken KV cache"))?;
    ensure!(
        back == pk,
        "the woken KV cache does not hold what was written"
    );
    ensure!(address(&h, &kv)? == at_k, "the KV cache moved");
    h.check_books().map_err(|e| e.to_string())?;
    drop((weights, kv, block, s));
    retire_governed(h)?;
    Ok(format!(
        "{} B of weights woke alone, the KV cache's {} B slept on, refused copies, then woke",
        2 * g,
        2 * g
    ))
}

/// The bytes of sleep's host copies charged to the pinned host tier.
fn sleep_copies<C: ArenaBackend>(h: &memgov::ContextHandle<C>) -> (u64, u64) {
    let t = h
        .snapshot()
        .tier(memgov::Tier::PinnedHost)
        .expect("a pinned host tier");
    (t.sleep_copies, t.charged)
}

/// The page-locked host copies a governed sleep keeps are charged to the
/// context's pinned host tier: refused, with nothing slept, when the tier
/// cannot hold them; shown in the snapshot while asleep; given back by the
/// wake.
fn governed_host_copies<C: ArenaBackend>(factory: Factory<'_, C>) -> CaseResult {
    use memgov::{GovernorError, SleepState, Tier};
    let g = open(factory).and_then(|(ctx, arena)| {
        let g = arena.usage().granule;
        close(ctx, vec![])?;
        Ok(g)
    })?;
    let set = 4 * g;
    // One granule short of the copies.
    let config = ContextConfig::new()
        .label("llm")
        .tier_budget(Tier::PinnedHost, set - g);
    let (_gov, h, arena, s) = governed(factory, config)?;
    let ge = |what: &'static str| move |e: GovernorError| format!("{what}: {e}");
    let weights = h
        .allocate(&s, Alloc::new(set, Role::Weights))
        .map_err(ge("allocate the weights"))?;
    let data = pattern(70, set as usize);
    weights.write(0, &data).map_err(ge("write the weights"))?;
    let at = address(&h, &weights)?;
    let (mapped, charged) = (arena.usage().mapped, h.snapshot().charged);

    let refused = h.sleep_with(&[], |_| arena.sleep(true));
    match &refused {
        Err(e) => match e.budget() {
            Some(b) if b.scope == memgov::BudgetScope::Tier(Tier::PinnedHost) => ensure!(
                b.requested == set && b.limit == set - g,
                "the refusal's numbers: {e}"
            ),
            _ => return Err(format!("refused, but not by the pinned host tier: {e}")),
        },
        Ok(slept) => {
            return Err(format!(
                "a sleep keeping {set} B under a pinned host tier of {} B was admitted: {slept:?}",
                set - g
            ))
        }
    }
    let usage = arena.usage();
    ensure!(
        h.sleep_state() == SleepState::Awake && usage.asleep == 0 && usage.mapped == mapped,
        "after the refusal: {}, {} B asleep, {} B mapped of {mapped} B",
        h.sleep_state(),
        usage.asleep,
        usage.mapped
    );
    ensure!(
        sleep_copies(&h) == (0, 0) && h.snapshot().charged == charged,
        "after the refusal the books hold {:?} of host copies and {} B charged",
        sleep_copies(&h),
        h.snapshot().charged
    );
    let mut back = vec![0u8; set as usize];
    weights
        .read(0, &mut back)
        .map_err(ge("read the weights after the refused sleep"))?;
    ensure!(
        back == data && address(&h, &weights)? == at,
        "the weights changed or moved after the refused sleep"
    );

    // With room for them, the copies are charged while asleep.
    h.set_budget(Tier::PinnedHost, set);
    let slept = h
        .sleep_with(&[], |_| arena.sleep(true))
        .map_err(ge("sleep with room for the copies"))?;
    ensure!(
        slept.backend.offloaded == set,
        "the sleep kept {} B",
        slept.backend.offloaded
    );
    ensure!(
        sleep_copies(&h) == (set, set),
        "asleep, the pinned host tier holds {:?} (host copies, charged), not {set} B",
        sleep_copies(&h)
    );
    h.check_books().map_err(|e| e.to_string())?;
    h.wake_with(&[], |_| arena.wake()).map_err(ge("wake"))?;
    ensure!(
        sleep_copies(&h) == (0, 0),
        "after the wake the pinned host tier holds {:?}",
        sleep_copies(&h)
    );
    weights
        .read(0, &mut back)
        .map_err(ge("read the woken weights"))?;
    ensure!(back == data, "the woken weights' bytes were not restored");
    h.check_books().map_err(|e| e.to_string())?;
    // Torn down asleep: the backend frees the copies, the tier gets their
    // charge back.
    h.sleep_with(&[], |_| arena.sleep(true))
        .map_err(ge("sleep before the teardown"))?;
    ensure!(
        sleep_copies(&h).0 == set,
        "asleep again: {:?}",
        sleep_copies(&h)
    );
    drop((weights, s));
    let probe = h.clone();
    retire_governed(h)?;
    ensure!(
        sleep_copies(&probe) == (0, 0),
        "after a teardown while asleep the pinned host tier holds {:?}",
        sleep_copies(&probe)
    );
    Ok(format!(
        "{set} B of host copies refused under a {} B pinned host tier with nothing slept, then charged while asleep and given back by the wake and by a teardown while asleep",
        set - g
    ))
}

/// The capture cases, by name. `driver_allocations` counts the driver
/// allocations made while a capture is under way (the stand-in's counter).
pub fn capture_cases<C: CaptureBackend>() -> Vec<(&'static str, CaptureCase<C>)> {
    vec![
        (
            "capture_allocates_without_driver_allocation",
            capture_without_driver_allocation::<C>,
        ),
        (
            "capture_pool_exhausted_is_a_typed_refusal",
            pool_exhausted::<C>,
        ),
        ("capture_defers_trims_to_its_end", trims_deferred::<C>),
    ]
}

/// Run every capture case on contexts from `factory`.
pub fn run_capture_cases<C: CaptureBackend>(
    factory: impl Fn() -> Result<C, BackendError>,
    driver_allocations: impl Fn() -> u64,
) -> Vec<(&'static str, CaseResult)> {
    capture_cases::<C>()
        .into_iter()
        .map(|(name, case)| (name, case(&factory, &driver_allocations)))
        .collect()
}

fn config(pool_bytes: u64) -> CaptureConfig {
    CaptureConfig {
        pool_bytes,
        mode: CaptureMode::Global,
    }
}

/// Allocations during capture carve the pool: no driver allocation between
/// begin and end; the graph replays the recorded copies; destroying it gives
/// the pool back.
fn capture_without_driver_allocation<C: CaptureBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
    driver_allocations: &dyn Fn() -> u64,
) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let mut cap = ctx
        .begin_capture(&s, config(1 << 20))
        .map_err(be("begin_capture"))?;
    let before = driver_allocations();
    let mut outs = Vec::new();
    for i in 0..3u64 {
        let b = cap
            .allocate(64 << 10)
            .map_err(|e| format!("allocate: {e}"))?;
        cap.upload(&b, 0, pattern(30 + i, 64 << 10))
            .map_err(be("upload"))?;
        outs.push(cap.download(&b, 0, 64 << 10).map_err(be("download"))?);
    }
    let during = driver_allocations() - before;
    let mut graph = cap.end().map_err(be("end"))?;
    ensure!(
        during == 0,
        "{during} driver allocation(s) during the capture"
    );
    for _ in 0..3 {
        graph.launch(&s).map_err(be("launch"))?;
    }
    for (i, slot) in outs.into_iter().enumerate() {
        let got = graph.read_output(slot).map_err(be("read_output"))?;
        ensure!(
            got == pattern(30 + i as u64, 64 << 10),
            "download {i} differs"
        );
    }
    let (used, pool) = graph.pool_usage();
    ensure!(
        (used, pool) == (192 << 10, 1 << 20),
        "pool usage {used} of {pool}"
    );
    ensure!(
        arena.usage().in_use >= pool,
        "the graph's pool is not held by the arena"
    );
    graph.destroy().map_err(be("destroy"))?;
    ensure!(
        arena.usage().in_use == 0,
        "the pool did not go back to the arena"
    );
    close(ctx, vec![s])?;
    Ok("3 allocations carved, 0 driver allocations, 3 replays".into())
}

/// Running out of the pool is `PoolExhausted` with the numbers, and the
/// capture is still valid.
fn pool_exhausted<C: CaptureBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
    _driver_allocations: &dyn Fn() -> u64,
) -> CaseResult {
    let (ctx, _arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let mut cap = ctx
        .begin_capture(&s, config(1 << 20))
        .map_err(be("begin_capture"))?;
    let a = cap
        .allocate(768 << 10)
        .map_err(|e| format!("allocate: {e}"))?;
    let refused = cap.allocate(512 << 10);
    let Err(PoolExhausted {
        requested,
        free,
        pool,
        ..
    }) = refused
    else {
        return Err("512 KiB carved from a pool with 256 KiB left".into());
    };
    ensure!(
        (requested, free, pool) == (512 << 10, 256 << 10, 1 << 20),
        "PoolExhausted says {requested} asked, {free} free of {pool}"
    );
    ensure!(cap.pool_free() == 256 << 10, "the refusal changed the pool");
    cap.upload(&a, 0, pattern(40, 4096))
        .map_err(be("upload after the refusal"))?;
    let out = cap.download(&a, 0, 4096).map_err(be("download"))?;
    let mut graph = cap
        .end()
        .map_err(be("end: the capture must still be valid"))?;
    graph.launch(&s).map_err(be("launch"))?;
    let got = graph.read_output(out).map_err(be("read_output"))?;
    ensure!(got == pattern(40, 4096), "the graph's copy differs");
    graph.destroy().map_err(be("destroy"))?;
    close(ctx, vec![s])?;
    Ok("refused with 256 KiB free of 1 MiB; the capture ended and replayed".into())
}

/// A trim during a capture returns 0 and unmaps nothing; the capture's end
/// runs it.
fn trims_deferred<C: CaptureBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
    _driver_allocations: &dyn Fn() -> u64,
) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    let m = ctx.allocate(&s, 3 * g).map_err(be("allocate"))?;
    release(&ctx, &s, m)?;
    let cap = ctx
        .begin_capture(&s, config(4096))
        .map_err(be("begin_capture"))?;
    // The pool took at most one of the 3 granules released.
    let cached = arena.usage().cached;
    ensure!(
        cached >= 2 * g,
        "{cached} B cached after releasing 3 granules and taking a pool"
    );
    let trimmed = arena.trim().map_err(be("trim during capture"))?;
    ensure!(
        trimmed == 0,
        "a trim during a capture gave back {trimmed} B"
    );
    ensure!(
        arena.usage().cached == cached,
        "a trim during a capture unmapped granules"
    );
    let graph = cap.end().map_err(be("end"))?;
    let after = arena.usage().cached;
    ensure!(
        after < cached,
        "the capture's end did not run the deferred trim ({after} B cached)"
    );
    graph.destroy().map_err(be("destroy"))?;
    close(ctx, vec![s])?;
    Ok(format!(
        "{} B trim deferred to the end of the capture",
        cached - after
    ))
}

/// Print each capability case's outcome (`capability case NAME: ok: ...`,
/// the line CI greps for); panic on the first that failed.
pub fn report_cases(results: Vec<(&'static str, CaseResult)>) {
    for (name, outcome) in results {
        match outcome {
            Ok(line) => println!("capability case {name}: ok: {line}"),
            Err(e) => panic!("capability case {name}: {e}"),
        }
    }
}

/// What [`fault_cell`] answers when the injected fault was never hit: its
/// position is past the workload's last call of the entry point.
pub const NEVER_HIT: &str = "the injected fault was never hit";

/// Sets the driver's injected fault: the `n`th call of the named entry
/// point from now on fails (`None`: no fault).
pub type SetFault = dyn Fn(Option<(&str, u64)>);

/// The fault cells of every entry point in `list` (`name:min,name:min`),
/// failing it at every position from the first until the workload makes
/// fewer calls than that; at least `min` positions must exist. `fail` sets
/// the driver's fault (the `n`th call of the entry point from now on;
/// `None`: no fault), e.g. through a stand-in's run-time hook. Each cell
/// opens and tears down its own context and checks the driver holds
/// nothing after. Returns a line per cell and per entry point.
pub fn run_fault_cells<C: CaptureBackend>(
    list: &str,
    fail: &SetFault,
    factory: &dyn Fn() -> Result<C, BackendError>,
    held: &dyn Fn() -> DriverHeld,
) -> Result<Vec<String>, String> {
    let mut lines = Vec::new();
    let mut cells = 0;
    for item in list.split(',') {
        let (entry, min) = item
            .split_once(':')
            .ok_or_else(|| format!("{item}: expected <entry point>:<positions>"))?;
        let min: u64 = min
            .parse()
            .map_err(|_| format!("{item}: the positions are not a number"))?;
        let mut n = 1;
        loop {
            fail(Some((entry, n)));
            let outcome = fault_cell(factory, held, entry);
            fail(None);
            match outcome {
                Ok(line) => lines.push(format!("fault cell {entry}:{n}: {line}")),
                Err(e) if e.contains(NEVER_HIT) => {
                    ensure!(
                        n > min,
                        "{entry} is called only {} time(s) by the fault cell's workload, fewer \
                         than {min}",
                        n - 1
                    );
                    lines.push(format!(
                        "fault cells {entry}: positions 1 to {} all survived",
                        n - 1
                    ));
                    break;
                }
                Err(e) => return Err(format!("fault cell {entry}:{n}: {e}")),
            }
            cells += 1;
            n += 1;
        }
    }
    lines.push(format!("{cells} fault cells survived"));
    Ok(lines)
}

/// What the driver holds for the process, as a stand-in driver counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DriverHeld {
    /// Address reservations.
    pub reservations: u64,
    /// Physical allocation handles not released (or released but mapped).
    pub handles: u64,
    /// Bytes mapped into reservations.
    pub mapped_bytes: u64,
}

/// One fault-matrix cell for the capabilities: a workload that maps and
/// unmaps (allocations growing the arena, a release and trim, a sleep and
/// wake, two captures with their graphs, a final trim), run while the
/// driver fails one call (the caller injects it, e.g. the stand-in's
/// `MEMGOV_STANDIN_CUDA_FAIL_ENTRY`). Checked:
///
/// * after every step, every granule is either mapped (the driver's mapped
///   bytes are the arena's) or released, or quarantined: the driver's
///   handles are the mapped granules plus at most the quarantined ones;
/// * every failure is a typed error to its caller, and one that left
///   memory behind says "quarantined" and shows in the arena's usage; a
///   failed allocation is `OutOfMemory` (the arena's own limit, or the
///   driver's code for a failed physical allocation) or names the failing
///   `entry` point, whose own code it carries (a driver's reference may
///   list no out-of-memory code for a map);
/// * the context tears down clean, and the driver holds nothing after;
/// * the fault was hit (some step failed).
///
/// `held` reads what the driver holds; a handle released twice is the
/// driver's (stand-in's) to catch.
pub fn fault_cell<C: CaptureBackend>(
    factory: &dyn Fn() -> Result<C, BackendError>,
    held: &dyn Fn() -> DriverHeld,
    entry: &str,
) -> CaseResult {
    let (ctx, arena) = open(factory)?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    let mut failed: Vec<String> = Vec::new();
    let check = |step: &str| -> Result<(), String> {
        let (u, d) = (arena.usage(), held());
        ensure!(
            d.mapped_bytes == u.mapped,
            "after {step}: the driver maps {} B, the arena counts {} B mapped ({u:?})",
            d.mapped_bytes,
            u.mapped
        );
        let granules = u.mapped / g;
        ensure!(
            d.handles >= granules && d.handles <= granules + u.quarantined as u64,
            "after {step}: the driver holds {} handle(s) for {granules} mapped granule(s) and {} \
             quarantined ({u:?})",
            d.handles,
            u.quarantined
        );
        Ok(())
    };
    let note = |step: &str, e: &BackendError, failed: &mut Vec<String>| -> Result<(), String> {
        let u = arena.usage();
        if e.message.contains("quarantined") {
            ensure!(
                u.quarantined > 0,
                "{step} says it quarantined memory, but the arena lists none: {e}"
            );
        }
        failed.push(format!("{step}: {:?}", e.kind));
        Ok(())
    };

    // Growth: three allocations of two granules and a bit.
    let mut bufs = Vec::new();
    for i in 0..3u64 {
        match ctx.allocate(&s, 2 * g + 4096) {
            Ok(m) => {
                ctx.write(&s, &m, 0, &pattern(50 + i, 4096))
                    .map_err(be("write"))?;
                bufs.push((i, m));
            }
            Err(e) => {
                ensure!(
                    e.kind == BackendErrorKind::OutOfMemory || e.message.contains(entry),
                    "a failed allocation is neither OutOfMemory nor names the failing {entry}: {e}"
                );
                note("allocate", &e, &mut failed)?;
            }
        }
        check("allocate")?;
    }
    // A release, then a trim.
    if !bufs.is_empty() {
        let (_, m) = bufs.remove(0);
        release(&ctx, &s, m)?;
    }
    if let Err(e) = arena.trim() {
        note("trim", &e, &mut failed)?;
    }
    check("trim")?;
    // Sleep and wake (a wake refused half-way is tried again: the fault
    // fires once).
    let mut slept_clean = true;
    match arena.sleep(true) {
        Ok(_) => {}
        Err(e) => {
            slept_clean = false;
            note("sleep", &e, &mut failed)?;
        }
    }
    check("sleep")?;
    if let Err(e) = arena.wake() {
        slept_clean = false;
        note("wake", &e, &mut failed)?;
        check("failed wake")?;
        arena.wake().map_err(be("the second wake"))?;
    }
    check("wake")?;
    if slept_clean {
        let mut back = vec![0u8; 4096];
        for (i, m) in &bufs {
            ctx.read(&s, m, 0, &mut back).map_err(be("read"))?;
            ensure!(
                back == pattern(50 + i, 4096),
                "allocation {i}: bytes not restored"
            );
        }
    }
    // Two captures.
    for round in 0..2u64 {
        let mut cap = match ctx.begin_capture(&s, config(64 << 10)) {
            Ok(c) => c,
            Err(e) => {
                note("begin_capture", &e, &mut failed)?;
                check("begin_capture")?;
                continue;
            }
        };
        let b = cap
            .allocate(4096)
            .map_err(|e| format!("allocate in capture: {e}"))?;
        cap.upload(&b, 0, pattern(60 + round, 4096))
            .map_err(be("upload"))?;
        let out = cap.download(&b, 0, 4096).map_err(be("download"))?;
        match cap.end() {
            Ok(mut graph) => {
                graph.launch(&s).map_err(be("launch"))?;
                let got = graph.read_output(out).map_err(be("read_output"))?;
                ensure!(
                    got == pattern(60 + round, 4096),
                    "capture {round}: the copy differs"
                );
                graph.destroy().map_err(be("destroy"))?;
            }
            Err(e) => note("end_capture", &e, &mut failed)?,
        }
        check("capture")?;
    }
    for (_, m) in bufs {
        release(&ctx, &s, m)?;
    }
    if let Err(e) = arena.trim() {
        note("final trim", &e, &mut failed)?;
    }
    check("final trim")?;
    let quarantined = arena.usage().quarantined;
    close(ctx, vec![s])?;
    let left = held();
    ensure!(
        left == DriverHeld::default(),
        "after a clean teardown the driver still holds {left:?}"
    );
    ensure!(!failed.is_empty(), "{NEVER_HIT}");
    Ok(format!(
        "failed: {}; {quarantined} granule(s) quarantined until teardown; torn down clean, nothing held",
        failed.join(", ")
    ))
}
