//! Arena cases under a driver that refuses one call, and on the thread of a
//! capture, written once over the capability traits and run on each
//! backend's stand-in (whose fault knob fails the named entry point):
//!
//! * a granule quarantined while an allocation sleeps on it (its release
//!   refused) is never handed out again, and copies to the allocation are
//!   refused, before and after a wake;
//! * a granule whose release was refused counts against the arena's limit
//!   until teardown gives it back;
//! * a sleep whose page-locked copy cannot be allocated is refused with
//!   nothing released, and the arena stays awake and usable;
//! * the capturing thread's own allocation over the limit is refused rather
//!   than unmapping (which would invalidate its capture), and the capture
//!   ends valid;
//! * a release that retires while its set's wake maps the granule frees its
//!   range once: no two allocations overlap after, none is lost (the wake
//!   is held inside the driver's map by the stand-in's pause knob, the
//!   interleaving forced), and when that wake then fails, the range stays
//!   out of the allocator until a wake succeeds;
//! * the capturing thread's allocation landing in a granule another thread
//!   is mapping (held at the gate by that capture) is refused at once
//!   instead of waiting for it (which would never end).
//!
//! Each case opens its context from the factory (an arena of at least 64
//! granules of address space), tears it down, and checks the driver holds
//! nothing after.

use crate::capability::{DriverHeld, SetFault};
use memgov::backend::capability::{
    ArenaBackend, CaptureBackend, CaptureConfig, CaptureMode, CapturedGraph, PoolCapture,
    SleepWake, VirtualArena,
};
use memgov::{BackendError, BackendErrorKind, DeviceContext, RetireSignal};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
                .wrapping_mul(167)
                .wrapping_add(seed.wrapping_mul(13)) as u8
        })
        .collect()
}

/// What the cases need of the backend besides the traits: its context
/// factory, the stand-in's fault knob, what the driver holds, the names of
/// its entry points, and the bytes its arena is mapping now.
pub struct Driver<'a, C: ArenaBackend> {
    /// Makes a context with an arena.
    pub factory: &'a dyn Fn() -> Result<C, BackendError>,
    /// Fails the `n`th call of an entry point from now on (`None`: none).
    pub fail: &'a SetFault,
    /// What the driver holds for the process.
    pub held: &'a dyn Fn() -> DriverHeld,
    /// The entry point releasing a physical handle (`cuMemRelease`).
    pub release: &'a str,
    /// The entry point allocating page-locked host memory (`cuMemHostAlloc`).
    pub host_alloc: &'a str,
    /// Hold the `n`th call of an entry point from now on (the map entry
    /// point only) until [`resume`](Self::resume) (`None`: none).
    pub pause: &'a SetFault,
    /// Whether a call is held by [`pause`](Self::pause).
    pub paused: &'a dyn Fn() -> bool,
    /// Let the held call go on.
    pub resume: &'a dyn Fn(),
    /// The entry point mapping a handle (`cuMemMap`).
    pub map: &'a str,
    /// The bytes `arena` is mapping now (granules a thread marked and is
    /// creating and mapping: its snapshot's `mapping`).
    pub mapping: &'a (dyn Fn(&C::Arena) -> u64 + Sync),
}

/// Free `memory` stream-ordered and wait until its release has retired.
fn release<C: DeviceContext>(ctx: &C, s: &C::Stream, memory: C::Memory) -> Result<(), String> {
    let retired = Arc::new(AtomicU64::new(0));
    let r = retired.clone();
    ctx.free_async(
        s,
        memory,
        RetireSignal::from_fn(move |_| {
            r.store(1, Ordering::SeqCst);
        }),
    )
    .map_err(|(_, _, e)| format!("free_async: {e}"))?;
    ctx.synchronize(s).map_err(be("synchronize"))?;
    ensure!(
        retired.load(Ordering::SeqCst) == 1,
        "a release had not retired once its stream was synchronized"
    );
    Ok(())
}

fn close<C: DeviceContext>(
    ctx: C,
    s: C::Stream,
    held: &dyn Fn() -> DriverHeld,
) -> Result<(), String> {
    ctx.destroy_stream(s).map_err(be("destroy_stream"))?;
    ctx.teardown(false).map_err(be("teardown"))?;
    let left = held();
    ensure!(
        left == DriverHeld::default(),
        "after teardown the driver still holds {left:?}"
    );
    Ok(())
}

/// The cases, by name.
pub type Case<C> = fn(&Driver<'_, C>) -> CaseResult;

/// Every case, by name.
pub fn cases<C: CaptureBackend>() -> Vec<(&'static str, Case<C>)> {
    vec![
        (
            "quarantined_granule_in_use_stays_out_of_the_allocator",
            quarantined_in_use::<C>,
        ),
        (
            "refused_release_counts_against_the_limit",
            refused_release_counted::<C>,
        ),
        (
            "sleep_whose_copy_fails_leaves_the_arena_awake",
            copy_fails::<C>,
        ),
        (
            "capturing_thread_over_the_limit_is_refused_not_trimmed",
            own_capture_over_limit::<C>,
        ),
        (
            "release_retiring_during_its_set_s_wake_frees_its_range_once",
            release_during_wake::<C>,
        ),
        (
            "release_retiring_during_a_failed_wake_stays_out_of_the_allocator",
            release_during_failed_wake::<C>,
        ),
        (
            "capturing_thread_is_refused_not_left_waiting_for_a_granule_being_mapped",
            own_capture_never_waits::<C>,
        ),
    ]
}

/// Run the case `name` (each in a process of its own: a case whose check
/// fails may leave the driver's fault set, or the stand-in may stop the
/// process on a contract violation).
pub fn run<C: CaptureBackend>(d: &Driver<'_, C>, name: &str) -> CaseResult {
    let (_, case) = cases::<C>()
        .into_iter()
        .find(|(n, _)| *n == name)
        .ok_or_else(|| format!("no arena fault case {name}"))?;
    let r = case(d);
    (d.fail)(None);
    r
}

fn quarantined_in_use<C: CaptureBackend>(d: &Driver<'_, C>) -> CaseResult {
    let ctx = (d.factory)().map_err(be("open"))?;
    let arena = ctx.arena().ok_or("no arena")?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    let p = ctx.allocate(&s, g).map_err(be("allocate p"))?;
    let q = ctx.allocate(&s, g).map_err(be("allocate q"))?;
    let (at_p, at_q) = (ctx.device_address(&p), ctx.device_address(&q));
    ctx.write(&s, &q, 0, &pattern(2, 4096))
        .map_err(be("write q"))?;
    (d.fail)(Some((d.release, 1)));
    let e = arena
        .sleep_ranges(&[at_p], true)
        .err()
        .ok_or("the sleep succeeded though its release was refused")?;
    (d.fail)(None);
    ensure!(e.message.contains("quarantined"), "the sleep's error: {e}");
    ensure!(
        arena.usage().quarantined == 1,
        "quarantined: {:?}",
        arena.usage()
    );
    // p's memory is gone: copies refused, also after a wake.
    let e = ctx
        .write(&s, &p, 0, &[1; 16])
        .err()
        .ok_or("a write to the allocation on the unmapped quarantined granule went ahead")?;
    ensure!(
        e.message.contains("quarantined"),
        "the write's refusal: {e}"
    );
    arena.wake().map_err(be("wake"))?;
    ensure!(
        ctx.write(&s, &p, 0, &[1; 16]).is_err(),
        "after the wake, a write to the allocation on the quarantined granule went ahead"
    );
    release(&ctx, &s, p)?;
    // Four more granules' worth: none on p's granule, each written and
    // read back.
    let mut more = Vec::new();
    for i in 0..8u64 {
        let m = ctx.allocate(&s, g / 2).map_err(be("allocate"))?;
        let at = ctx.device_address(&m);
        ensure!(
            at + g / 2 <= at_p || at >= at_p + g,
            "allocation {i} at {at:#x} lies on the quarantined granule at {at_p:#x}"
        );
        ctx.write(&s, &m, 0, &pattern(10 + i, 4096))
            .map_err(be("write"))?;
        more.push(m);
    }
    let mut back = vec![0u8; 4096];
    for (i, m) in more.iter().enumerate() {
        ctx.read(&s, m, 0, &mut back).map_err(be("read"))?;
        ensure!(
            back == pattern(10 + i as u64, 4096),
            "allocation {i} lost its bytes"
        );
    }
    ctx.read(&s, &q, 0, &mut back).map_err(be("read q"))?;
    ensure!(back == pattern(2, 4096), "q at {at_q:#x} lost its bytes");
    for m in more {
        release(&ctx, &s, m)?;
    }
    release(&ctx, &s, q)?;
    close(ctx, s, d.held)?;
    Ok("the quarantined granule stayed out; copies to its allocation refused".into())
}

fn refused_release_counted<C: CaptureBackend>(d: &Driver<'_, C>) -> CaseResult {
    let ctx = (d.factory)().map_err(be("open"))?;
    let arena = ctx.arena().ok_or("no arena")?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    arena.set_limit(4 * g);
    let mut ms = Vec::new();
    for _ in 0..4 {
        ms.push(ctx.allocate(&s, g).map_err(be("allocate"))?);
    }
    for m in ms.drain(..) {
        release(&ctx, &s, m)?;
    }
    (d.fail)(Some((d.release, 1)));
    let e = arena
        .trim()
        .err()
        .ok_or("the trim succeeded though a release was refused")?;
    (d.fail)(None);
    ensure!(e.message.contains("quarantined"), "the trim's error: {e}");
    loop {
        match ctx.allocate(&s, g) {
            Ok(m) => ms.push(m),
            Err(e) if e.kind == BackendErrorKind::OutOfMemory => break,
            Err(e) => return Err(format!("allocate: {e}")),
        }
        ensure!(ms.len() <= 4, "more than 4 granules admitted");
    }
    let handles = (d.held)().handles;
    ensure!(
        ms.len() == 3 && handles == 4,
        "{} granule(s) admitted under a 4-granule limit while the driver still holds the \
         unreleased one; the driver holds {handles} handle(s)",
        ms.len()
    );
    for m in ms {
        release(&ctx, &s, m)?;
    }
    close(ctx, s, d.held)?;
    Ok("3 granules admitted beside the unreleased one under a 4-granule limit".into())
}

fn copy_fails<C: CaptureBackend>(d: &Driver<'_, C>) -> CaseResult {
    let ctx = (d.factory)().map_err(be("open"))?;
    let arena = ctx.arena().ok_or("no arena")?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    let m = ctx.allocate(&s, 3 * g).map_err(be("allocate"))?;
    let data = pattern(5, (3 * g) as usize);
    ctx.write(&s, &m, 0, &data).map_err(be("write"))?;
    let before = (d.held)();
    (d.fail)(Some((d.host_alloc, 2)));
    let e = arena
        .sleep(true)
        .err()
        .ok_or("the sleep succeeded though its second copy's host memory was refused")?;
    (d.fail)(None);
    ensure!(e.message.contains(d.host_alloc), "the sleep's error: {e}");
    let u = arena.usage();
    ensure!(
        u.asleep == 0 && u.mapped == 3 * g,
        "after the refused sleep: {u:?}"
    );
    ensure!(
        (d.held)() == before,
        "the refused sleep changed what the driver holds: {:?}, was {before:?}",
        (d.held)()
    );
    // Awake: copies go ahead, the bytes are there.
    ctx.write(&s, &m, 0, &data[..4096])
        .map_err(be("a write after the refused sleep"))?;
    let mut back = vec![0u8; data.len()];
    ctx.read(&s, &m, 0, &mut back).map_err(be("read"))?;
    ensure!(back == data, "the bytes changed");
    arena.sleep(true).map_err(be("a later sleep"))?;
    ensure!(
        arena.wake().map_err(be("wake"))? == 3 * g,
        "the wake mapped a different size"
    );
    ctx.read(&s, &m, 0, &mut back)
        .map_err(be("read after the wake"))?;
    ensure!(back == data, "the bytes did not survive the later sleep");
    release(&ctx, &s, m)?;
    close(ctx, s, d.held)?;
    Ok("refused with nothing released, awake and usable, then slept and woke".into())
}

fn own_capture_over_limit<C: CaptureBackend>(d: &Driver<'_, C>) -> CaseResult {
    let ctx = (d.factory)().map_err(be("open"))?;
    let arena = ctx.arena().ok_or("no arena")?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    arena.set_limit(2 * g);
    // Granule 0 in use with 256 B free at its end (for the pool); granule 1
    // cached.
    let a = ctx.allocate(&s, g - 256).map_err(be("allocate a"))?;
    let pad = ctx.allocate(&s, 256).map_err(be("allocate pad"))?;
    let b = ctx.allocate(&s, g).map_err(be("allocate b"))?;
    release(&ctx, &s, pad)?;
    release(&ctx, &s, b)?;
    ensure!(
        arena.usage().cached == g,
        "granule 1 cached: {:?}",
        arena.usage()
    );
    let config = CaptureConfig {
        pool_bytes: 256,
        mode: CaptureMode::Global,
    };
    let mut cap = ctx.begin_capture(&s, config).map_err(be("begin_capture"))?;
    let buf = cap
        .allocate(256)
        .map_err(|e| format!("allocate in capture: {e}"))?;
    cap.upload(&buf, 0, pattern(7, 256)).map_err(be("upload"))?;
    // Two granules past granule 0: over the limit, so granule 1 would be
    // trimmed, unmapping during this thread's own capture.
    let e = ctx
        .allocate(&s, 2 * g)
        .err()
        .ok_or("an allocation over the limit went ahead during the thread's own capture")?;
    ensure!(
        e.kind == BackendErrorKind::InvalidArgument && e.message.contains("capture"),
        "the refusal: {e}"
    );
    let out = cap.download(&buf, 0, 256).map_err(be("download"))?;
    let mut graph = cap.end().map_err(be("end: the capture was invalidated"))?;
    graph.launch(&s).map_err(be("launch"))?;
    let got = graph.read_output(out).map_err(be("read_output"))?;
    ensure!(got == pattern(7, 256), "the graph's copy differs");
    let u = arena.usage();
    ensure!(
        u.quarantined == 0 && u.cached == g,
        "the cached granule was touched during the capture: {u:?}"
    );
    graph.destroy().map_err(be("destroy"))?;
    ensure!(
        arena.trim().map_err(be("trim"))? == g,
        "the trim after the capture"
    );
    release(&ctx, &s, a)?;
    close(ctx, s, d.held)?;
    Ok("refused at once; the capture ended valid and its graph ran".into())
}

/// Spin (yielding) until `what` holds: a forced interleaving's wait for a
/// thread to reach its point.
fn until(what: impl Fn() -> bool) {
    while !what() {
        std::thread::yield_now();
    }
}

fn global(pool_bytes: u64) -> CaptureConfig {
    CaptureConfig {
        pool_bytes,
        mode: CaptureMode::Global,
    }
}

/// Allocate `bytes` until the arena refuses (`OutOfMemory`), each checked
/// against `live` for overlap and written; returns how many fit.
fn fill<C: ArenaBackend>(
    ctx: &C,
    s: &C::Stream,
    bytes: u64,
    live: &mut Vec<(u64, u64, C::Memory)>,
) -> Result<usize, String> {
    let mut n = 0;
    loop {
        let m = match ctx.allocate(s, bytes) {
            Ok(m) => m,
            Err(e) if e.kind == BackendErrorKind::OutOfMemory => return Ok(n),
            Err(e) => return Err(format!("allocate: {e}")),
        };
        let at = ctx.device_address(&m);
        let len = bytes.next_multiple_of(256);
        for (q, l, _) in live.iter() {
            ensure!(
                at + len <= *q || q + l <= at,
                "{at:#x}+{len:#x} overlaps the live allocation {q:#x}+{l:#x}"
            );
        }
        ctx.write(s, &m, 0, &pattern(at, 16)).map_err(be("write"))?;
        live.push((at, len, m));
        n += 1;
    }
}

fn release_during_wake<C: CaptureBackend>(d: &Driver<'_, C>) -> CaseResult {
    let ctx = Arc::new((d.factory)().map_err(be("open"))?);
    let arena = ctx.arena().ok_or("no arena")?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let u = arena.usage();
    let g = u.granule;
    // The reservation, not the limit, bounds the fill below.
    arena.set_limit(u.reserved);
    let p = ctx.allocate(&s, g / 2).map_err(be("allocate p"))?;
    let q = ctx.allocate(&s, g / 2).map_err(be("allocate q"))?;
    let (at_p, at_q) = (ctx.device_address(&p), ctx.device_address(&q));
    ensure!(
        at_q == at_p + g / 2 && at_p % g == 0,
        "p at {at_p:#x} and q at {at_q:#x} do not share a granule"
    );
    ctx.write(&s, &p, 0, &pattern(3, 4096))
        .map_err(be("write p"))?;
    arena
        .sleep_ranges(&[at_p, at_q], true)
        .map_err(be("sleep p and q"))?;
    // The wake's map of the granule is held inside the driver.
    (d.pause)(Some((d.map, 1)));
    let waker = {
        let arena = arena.clone();
        std::thread::spawn(move || arena.wake_ranges(&[at_p]))
    };
    until(d.paused);
    (d.pause)(None);
    // q's release retires now, while the wake maps its granule.
    let retired = Arc::new(AtomicU64::new(0));
    let r = retired.clone();
    ctx.free_async(
        &s,
        q,
        RetireSignal::from_fn(move |_| {
            r.store(1, Ordering::SeqCst);
        }),
    )
    .map_err(|(_, _, e)| format!("free_async: {e}"))?;
    until(|| retired.load(Ordering::SeqCst) == 1);
    (d.resume)();
    let woke = waker
        .join()
        .map_err(|_| "the waking thread panicked")?
        .map_err(be("wake p"))?;
    ensure!(woke == g, "the wake mapped {woke} B, not one granule");
    let mut back = vec![0u8; 4096];
    ctx.read(&s, &p, 0, &mut back).map_err(be("read p"))?;
    ensure!(back == pattern(3, 4096), "p lost its bytes");
    // Every half granule of the reservation but p's, once.
    let mut live = vec![(at_p, g / 2, p)];
    let n = fill(&*ctx, &s, g / 2, &mut live)?;
    let want = (u.reserved / (g / 2) - 1) as usize;
    ensure!(n == want, "{n} half granules fit beside p, not {want}");
    for (_, _, m) in live {
        release(&*ctx, &s, m)?;
    }
    let ctx = Arc::into_inner(ctx).ok_or("the context is still shared")?;
    close(ctx, s, d.held)?;
    Ok(format!(
        "q's range freed once: {n} half granules fit beside p"
    ))
}

fn own_capture_never_waits<C: CaptureBackend>(d: &Driver<'_, C>) -> CaseResult {
    let ctx = Arc::new((d.factory)().map_err(be("open"))?);
    let arena = ctx.arena().ok_or("no arena")?;
    let s = Arc::new(ctx.create_stream().map_err(be("create_stream"))?);
    let t = ctx.create_stream().map_err(be("create_stream"))?;
    let g = arena.usage().granule;
    // The capture's pool takes granule 0 before the capture begins.
    let cap = ctx
        .begin_capture(&t, global(256))
        .map_err(be("begin_capture"))?;
    // Another thread's allocation maps granule 1 and waits at the gate for
    // this capture to end.
    let other = {
        let (ctx, s) = (ctx.clone(), s.clone());
        std::thread::spawn(move || ctx.allocate(&s, g))
    };
    until(|| (d.mapping)(&arena) > 0);
    // This thread's allocation lands in granule 1, being mapped: refused at
    // once. Waiting would never end (the other thread waits for this
    // capture): a watchdog stops the process if it has not returned in 60 s
    // (only a deadlock takes that long; no timing is asserted).
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if rx.recv_timeout(std::time::Duration::from_secs(60)).is_err() {
            eprintln!(
                "deadlock: the capturing thread's allocation waited 60 s for a granule that \
                 another thread maps once the capture ends"
            );
            std::process::exit(101);
        }
    });
    let outcome = ctx.allocate(&s, 256);
    let _ = tx.send(());
    let _ = watchdog.join();
    let e = match outcome {
        Ok(m) => {
            let at = ctx.device_address(&m);
            return Err(format!(
                "the capturing thread's allocation went ahead at {at:#x} while granule 1 was \
                 being mapped"
            ));
        }
        Err(e) => e,
    };
    ensure!(
        e.kind == BackendErrorKind::InvalidArgument && e.message.contains("capture"),
        "the refusal: {e}"
    );
    let graph = cap.end().map_err(be("end capture: invalidated"))?;
    let m = other
        .join()
        .map_err(|_| "the other thread panicked")?
        .map_err(be("the other thread's allocation"))?;
    graph.destroy().map_err(be("destroy"))?;
    release(&*ctx, &s, m)?;
    ctx.destroy_stream(t).map_err(be("destroy_stream"))?;
    let s = Arc::into_inner(s).ok_or("the stream is still shared")?;
    let ctx = Arc::into_inner(ctx).ok_or("the context is still shared")?;
    close(ctx, s, d.held)?;
    Ok("refused at once; the other thread mapped after the capture ended".into())
}

fn release_during_failed_wake<C: CaptureBackend>(d: &Driver<'_, C>) -> CaseResult {
    let ctx = Arc::new((d.factory)().map_err(be("open"))?);
    let arena = ctx.arena().ok_or("no arena")?;
    let s = ctx.create_stream().map_err(be("create_stream"))?;
    let u = arena.usage();
    let g = u.granule;
    arena.set_limit(u.reserved);
    // p and q share granule 0; r is granule 1.
    let p = ctx.allocate(&s, g / 2).map_err(be("allocate p"))?;
    let q = ctx.allocate(&s, g / 2).map_err(be("allocate q"))?;
    let r = ctx.allocate(&s, g).map_err(be("allocate r"))?;
    let (at_p, at_q, at_r) = (
        ctx.device_address(&p),
        ctx.device_address(&q),
        ctx.device_address(&r),
    );
    ensure!(
        at_q == at_p + g / 2 && at_r == at_p + g && at_p % g == 0,
        "p {at_p:#x}, q {at_q:#x}, r {at_r:#x}: not granules 0 and 1"
    );
    ctx.write(&s, &p, 0, &pattern(4, 4096))
        .map_err(be("write p"))?;
    arena
        .sleep_ranges(&[at_p, at_q, at_r], true)
        .map_err(be("sleep the set"))?;
    // The wake maps granule 0 (held while q retires), then fails at
    // granule 1's map.
    (d.fail)(Some((d.map, 2)));
    (d.pause)(Some((d.map, 1)));
    let waker = {
        let arena = arena.clone();
        std::thread::spawn(move || arena.wake_ranges(&[at_p, at_r]))
    };
    until(d.paused);
    (d.pause)(None);
    let retired = Arc::new(AtomicU64::new(0));
    let rt = retired.clone();
    ctx.free_async(
        &s,
        q,
        RetireSignal::from_fn(move |_| {
            rt.store(1, Ordering::SeqCst);
        }),
    )
    .map_err(|(_, _, e)| format!("free_async: {e}"))?;
    until(|| retired.load(Ordering::SeqCst) == 1);
    (d.resume)();
    let failed = waker.join().map_err(|_| "the waking thread panicked")?;
    (d.fail)(None);
    let e = failed
        .err()
        .ok_or("the wake succeeded though granule 1's map failed")?;
    ensure!(e.message.contains(d.map), "the wake's error: {e}");
    ensure!(
        arena.usage().asleep == 2 * g,
        "the set sleeps still: {:?}",
        arena.usage()
    );
    // Nothing lands in the sleeping granules (each allocation is written: a
    // write to unmapped memory stops a stand-in): every half granule but
    // granules 0 and 1.
    let mut live = Vec::new();
    let n = fill(&*ctx, &s, g / 2, &mut live)?;
    let want = (u.reserved / (g / 2) - 4) as usize;
    ensure!(
        n == want,
        "{n} half granules fit outside the set, not {want}"
    );
    for (_, _, m) in live.drain(..) {
        release(&*ctx, &s, m)?;
    }
    ensure!(
        arena
            .wake_ranges(&[at_p, at_r])
            .map_err(be("the second wake"))?
            == 2 * g,
        "the second wake mapped a different size"
    );
    let mut back = vec![0u8; 4096];
    ctx.read(&s, &p, 0, &mut back).map_err(be("read p"))?;
    ensure!(back == pattern(4, 4096), "p lost its bytes");
    // q's half granule comes back once.
    live.push((at_p, g / 2, p));
    live.push((at_r, g, r));
    let n = fill(&*ctx, &s, g / 2, &mut live)?;
    ensure!(
        n == want + 1,
        "{n} half granules fit after the wake, not {}",
        want + 1
    );
    for (_, _, m) in live {
        release(&*ctx, &s, m)?;
    }
    let ctx = Arc::into_inner(ctx).ok_or("the context is still shared")?;
    close(ctx, s, d.held)?;
    Ok(format!(
        "q's range stayed out through the failed wake; {n} half granules fit after the second"
    ))
}
