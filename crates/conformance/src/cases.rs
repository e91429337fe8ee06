//! The conformance cases. Each returns an [`Outcome`]; checks carry the
//! numbers they saw.

use super::{unavailable_reason, Case, Outcome, SuiteOptions, WatchLog, Watched};
use memgov::{
    Admission, Alloc, BackendError, BackendErrorKind, ContextConfig, ContextHandle, ContextState,
    DeviceContext, Governor, GovernorError, PinKind, ProviderContextPinError, RetireError, Role,
    Tier,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a case gets: the backend's factory and the suite's options.
struct Factory<'a, C> {
    make: &'a dyn Fn() -> Result<C, BackendError>,
    options: &'a SuiteOptions,
}

impl<C> Clone for Factory<'_, C> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<C> Copy for Factory<'_, C> {}

impl<C> Factory<'_, C> {
    /// A fresh backend context, for checks made on the backend directly.
    fn open(&self) -> Result<C, BackendError> {
        (self.make)()
    }

    /// `config` with the suite's options applied (the block cache).
    fn config(&self, config: ContextConfig) -> ContextConfig {
        self.options.apply(config)
    }
}
type W<C> = Watched<C>;

/// Internal result: `Err(Outcome)` short-circuits with a failure or a skip.
type R = Result<(), Outcome>;

macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(Outcome::Failed(format!($($fmt)+)));
        }
    };
}

macro_rules! ok {
    ($e:expr, $what:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return Err(Outcome::Failed(format!("{} failed: {}", $what, e))),
        }
    };
}

const LONG: Duration = Duration::from_secs(30);

pub(super) fn all<C: DeviceContext>() -> Vec<Case<C>> {
    macro_rules! case {
        ($name:ident) => {
            Case {
                name: stringify!($name),
                run: |make, options| into_outcome($name::<C>(Factory { make, options })),
            }
        };
    }
    // The one list of cases is `for_each_conformance_case!`.
    macro_rules! case_list {
        ([] $($name:ident),* $(,)?) => {
            vec![$(case!($name)),*]
        };
    }
    crate::for_each_conformance_case!([case_list])
}

fn into_outcome(r: R) -> Outcome {
    match r {
        Ok(()) => Outcome::Passed,
        Err(o) => o,
    }
}

struct Setup<C: DeviceContext> {
    _gov: Governor<W<C>>,
    ctx: ContextHandle<W<C>>,
    log: Arc<WatchLog>,
    /// Whether the context keeps freed blocks in its block cache.
    cached: bool,
}

impl<C: DeviceContext> Setup<C> {
    /// Give back every block the cache keeps, as stream-ordered frees, so
    /// that counts of the backend's frees cover every release (nothing
    /// when the cache is off). Returns the bytes given back.
    fn empty_cache(&self) -> u64 {
        self.ctx.trim_cache(u64::MAX)
    }
}

fn setup<C: DeviceContext>(f: Factory<'_, C>, config: ContextConfig) -> Result<Setup<C>, Outcome> {
    let backend = match f.open() {
        Ok(b) => b,
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            return Err(Outcome::Skipped(unavailable_reason(&e)))
        }
        Err(e) => return Err(Outcome::Failed(format!("factory failed: {e}"))),
    };
    let watched = Watched::new(backend);
    let log = watched.log();
    let gov = Governor::new();
    let ctx = gov.register(watched, f.config(config));
    Ok(Setup {
        _gov: gov,
        ctx,
        log,
        cached: f.options.cache.is_some(),
    })
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32) as u8)
        .collect()
}

/// Retire and wait; check teardown happened once with nothing in flight.
fn finish<C: DeviceContext>(s: &Setup<C>) -> Result<memgov::TeardownReport, Outcome> {
    let report = ok!(s.ctx.retire().wait(Instant::now() + LONG), "retire().wait");
    check_clean_teardown(&s.log)?;
    ok!(report.backend_result.clone(), "backend teardown");
    Ok(report)
}

fn check_clean_teardown(log: &WatchLog) -> R {
    use std::sync::atomic::Ordering::SeqCst;
    check!(
        log.teardowns.load(SeqCst) == 1,
        "teardown ran {} times, expected once ({})",
        log.teardowns.load(SeqCst),
        log.summary()
    );
    if !log.teardown_lost.load(SeqCst) {
        check!(
            log.unsettled_at_teardown.load(SeqCst) == 0,
            "teardown began with frees in flight ({})",
            log.summary()
        );
    }
    check!(
        log.settled_after_teardown.load(SeqCst) == 0,
        "signals settled after teardown ({})",
        log.summary()
    );
    Ok(())
}

fn write_read_round_trip<C: DeviceContext>(f: Factory<'_, C>) -> R {
    let s = setup(f, ContextConfig::new().label("round-trip"))?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    let len = (1 << 20) + 3;
    let buf = ok!(
        s.ctx
            .allocate(&stream, Alloc::new(len as u64, Role::Weights)),
        "allocate 1 MiB + 3 B"
    );
    let data = pattern(7, len);
    ok!(buf.write(0, &data), "write 1 MiB + 3 B");
    let mut back = vec![0u8; len];
    ok!(buf.read(0, &mut back), "read 1 MiB + 3 B");
    let first_bad = data.iter().zip(&back).position(|(a, b)| a != b);
    check!(
        first_bad.is_none(),
        "read back differs from written data at byte {:?}",
        first_bad
    );
    let patch = pattern(99, 100);
    ok!(buf.write(4097, &patch), "write 100 B at offset 4097");
    let mut small = vec![0u8; 102];
    ok!(buf.read(4096, &mut small), "read 102 B at offset 4096");
    check!(
        small[0] == data[4096] && small[101] == data[4197],
        "bytes around a patch changed"
    );
    check!(small[1..101] == patch[..], "patched range reads back wrong");
    let oob = buf.write(len as u64 - 1, &[1, 2]);
    check!(
        matches!(oob, Err(GovernorError::OutOfBounds { .. })),
        "out-of-bounds write gave {:?}",
        oob
    );
    drop(buf);
    drop(stream);
    finish(&s)?;
    Ok(())
}

fn stream_order<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::Ordering::SeqCst;
    let s = setup(f, ContextConfig::new().label("stream-order"))?;
    let stream = ok!(s.ctx.create_stream("ordered"), "create_stream");
    for round in 0..8u8 {
        let len = 256 * 1024;
        let a = ok!(
            s.ctx
                .allocate(&stream, Alloc::new(len as u64, Role::Activation)),
            "allocate"
        );
        let data = pattern(round, len);
        ok!(a.write(0, &data), "write");
        // Ordered after the write on the same stream, with no synchronize.
        let mut back = vec![0u8; len];
        ok!(a.read(0, &mut back), "read");
        check!(
            back == data,
            "round {round}: a read ordered after a write did not see it"
        );
        // With the cache on, the block is kept on its stream and every
        // later round gets it back: the backend frees nothing until the
        // cache is emptied.
        let frees = |rounds: u64| if s.cached { 0 } else { rounds };
        let before = s.log.retired.load(SeqCst);
        check!(
            before == frees(round as u64),
            "round {round}: {before} frees retired before this one was queued"
        );
        drop(a); // the free is queued behind the write and the read
        ok!(stream.synchronize(), "synchronize");
        let after = s.log.retired.load(SeqCst);
        check!(
            after == frees(round as u64 + 1),
            "round {round}: synchronize returned with {after} of {} frees retired",
            frees(round as u64 + 1)
        );
    }
    if s.cached {
        let allocations = s.log.allocations.load(SeqCst);
        check!(
            allocations == 1,
            "8 rounds of one size on one stream with the cache on: {allocations} backend allocations, expected 1"
        );
        let trimmed = s.empty_cache();
        check!(
            trimmed == 256 * 1024,
            "emptying the cache gave back {trimmed} B, expected the one 256 KiB block"
        );
        ok!(stream.synchronize(), "synchronize after emptying the cache");
        let retired = s.log.retired.load(SeqCst);
        check!(
            retired == 1,
            "after emptying the cache and synchronize: {retired} frees retired, expected 1"
        );
    }
    let snap = s.ctx.snapshot();
    check!(
        snap.total().pending_count == 0 && snap.charged == 0,
        "after synchronize: {:?} pending, {} B charged",
        snap.total(),
        snap.charged
    );
    drop(stream);
    finish(&s)?;
    Ok(())
}

fn every_signal_fires_once<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    // Through the governor.
    let s = setup(f, ContextConfig::new().label("signals"))?;
    let a = ok!(s.ctx.create_stream("a"), "create_stream a");
    let b = ok!(s.ctx.create_stream("b"), "create_stream b");
    let mut bufs = Vec::new();
    for i in 0..64u64 {
        let st = if i % 2 == 0 { &a } else { &b };
        bufs.push(ok!(
            s.ctx
                .allocate(st, Alloc::new(512 + i * 97, Role::ALL[(i % 5) as usize])),
            "allocate"
        ));
    }
    for (i, buf) in bufs.into_iter().enumerate().rev() {
        if i % 3 == 0 {
            let other = if i % 2 == 0 { &b } else { &a };
            if let Err(e) = buf.release_on(other) {
                return Err(Outcome::Failed(format!(
                    "release_on another stream of the same context: {e}"
                )));
            }
        } else {
            drop(buf);
        }
    }
    if s.cached {
        // The 42 dropped on their own stream are kept; the 22 released on
        // the other stream are freed. Emptied, the cache frees the 42 too.
        let kept = s.ctx.snapshot().cache.cached_count;
        check!(
            kept == 42,
            "the cache keeps {kept} blocks, expected the 42 released on their own stream"
        );
        s.empty_cache();
    }
    ok!(a.synchronize(), "synchronize a");
    ok!(b.synchronize(), "synchronize b");
    let snap = s.ctx.snapshot();
    check!(
        snap.counters.retired == 64,
        "governor saw {} of 64 retirements ({})",
        snap.counters.retired,
        s.log.summary()
    );
    check!(
        snap.counters.abandoned == 0,
        "{} signals abandoned on a healthy device",
        snap.counters.abandoned
    );
    check!(
        s.log.retired.load(SeqCst) == 64 && s.log.abandoned.load(SeqCst) == 0,
        "backend fired: {}",
        s.log.summary()
    );
    check!(
        snap.charged == 0 && snap.total().pending_bytes == 0,
        "{} B still charged after every release retired",
        snap.charged
    );
    drop((a, b));
    finish(&s)?;

    // Directly on the backend: each signal settles exactly once.
    let backend = match f.open() {
        Ok(b) => b,
        Err(e) => return Err(Outcome::Failed(format!("factory failed: {e}"))),
    };
    let stream = ok!(backend.create_stream(), "raw create_stream");
    let fired: Arc<Vec<AtomicU32>> = Arc::new((0..16).map(|_| AtomicU32::new(0)).collect());
    for i in 0..16usize {
        let m = ok!(backend.allocate(&stream, 4096), "raw allocate");
        let fired = fired.clone();
        let sig = memgov::RetireSignal::from_fn(move |o| {
            fired[i].fetch_add(
                if o == memgov::RetireOutcome::Retired {
                    1
                } else {
                    100
                },
                SeqCst,
            );
        });
        if let Err((_, _, e)) = backend.free_async(&stream, m, sig) {
            return Err(Outcome::Failed(format!("raw free_async refused: {e}")));
        }
    }
    ok!(backend.synchronize(&stream), "raw synchronize");
    let counts: Vec<u32> = fired.iter().map(|c| c.load(SeqCst)).collect();
    check!(
        counts.iter().all(|&c| c == 1),
        "per-signal settle counts after synchronize (1 = retired once, 100 = abandoned): {:?}",
        counts
    );
    ok!(backend.destroy_stream(stream), "raw destroy_stream");
    ok!(backend.teardown(false), "raw teardown");
    let counts: Vec<u32> = fired.iter().map(|c| c.load(SeqCst)).collect();
    check!(
        counts.iter().all(|&c| c == 1),
        "a signal settled again after teardown: {:?}",
        counts
    );
    Ok(())
}

fn teardown_once_after_drain<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::Ordering::SeqCst;
    let s = setup(f, ContextConfig::new().label("teardown"))?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    s.log.hold_retirements(true);
    for i in 0..8 {
        let b = ok!(
            s.ctx
                .allocate(&stream, Alloc::new(4096 * (i + 1), Role::Workspace)),
            "allocate"
        );
        drop(b);
    }
    // With the cache on, the eight are kept: freed now, so that their frees
    // have run (and their retirements are held) once `stream` is
    // synchronized.
    s.empty_cache();
    ok!(stream.synchronize(), "synchronize");
    drop(stream);
    let handle = s.ctx.retire();
    check!(
        s.ctx.lifecycle() == ContextState::Retiring,
        "lifecycle after retire: {:?}",
        s.ctx.lifecycle()
    );
    let early = handle.try_finish();
    check!(
        early.is_err(),
        "try_finish succeeded with {} releases not yet retired",
        s.log.held()
    );
    check!(
        s.log.teardowns.load(SeqCst) == 0,
        "teardown ran before pending releases retired"
    );
    let released = s.log.release_held();
    check!(released == 8, "{released} of 8 retirements were held");
    let report = ok!(handle.wait(Instant::now() + LONG), "wait after drain");
    check_clean_teardown(&s.log)?;
    check!(
        report.retired_releases == 8,
        "report counts {} retired releases, expected 8",
        report.retired_releases
    );
    let again = ok!(handle.wait(Instant::now()), "second wait");
    check!(again == report, "second wait returned a different report");
    let third = ok!(s.ctx.retire().try_finish(), "try_finish after termination");
    check!(
        third == report,
        "a later retire handle returned a different report"
    );
    check!(
        s.log.teardowns.load(SeqCst) == 1,
        "teardown ran {} times",
        s.log.teardowns.load(SeqCst)
    );
    check!(
        s.ctx.lifecycle() == ContextState::Terminated,
        "lifecycle after teardown: {:?}",
        s.ctx.lifecycle()
    );
    Ok(())
}

fn retiring_refuses_new_work<C: DeviceContext>(f: Factory<'_, C>) -> R {
    let s = setup(f, ContextConfig::new().label("refuse"))?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    let live = ok!(
        s.ctx.allocate(&stream, Alloc::new(8192, Role::KvCache)),
        "allocate live"
    );
    let pending = ok!(
        s.ctx.allocate(&stream, Alloc::new(4096, Role::Activation)),
        "allocate pending"
    );
    let source = s.ctx.pin_source(Some("plugin"));
    s.log.hold_retirements(true);
    drop(pending);
    let handle = s.ctx.retire();
    let id = s.ctx.id();
    let unavailable = GovernorError::Pin {
        context: memgov::ContextName::new(id, s.ctx.label()),
        refusal: ProviderContextPinError::ContextUnavailable(id),
        retired_by: Some(memgov::RetiredBy::Retire),
    };
    let alloc = s.ctx.allocate(&stream, Alloc::new(4096, Role::KvCache));
    check!(
        alloc.as_ref().err() == Some(&unavailable),
        "allocate on a retiring context gave {:?}",
        alloc.map(|_| ())
    );
    let st = s.ctx.create_stream("late");
    check!(
        st.as_ref().err() == Some(&unavailable),
        "create_stream on a retiring context gave {:?}",
        st.map(|_| ())
    );
    let pin = source.pin();
    check!(
        matches!(pin, Err(ProviderContextPinError::ContextUnavailable(x)) if x == id),
        "pin_source().pin() on a retiring context gave {:?}",
        pin
    );
    check!(
        s.ctx.pin().is_err(),
        "borrowed pin on a retiring context succeeded"
    );
    // Existing holders still work and still release.
    ok!(
        live.write(0, b"still usable"),
        "write to a live buffer while retiring"
    );
    drop(live);
    s.log.hold_retirements(false);
    s.log.release_held();
    ok!(stream.synchronize(), "synchronize while retiring");
    drop(stream);
    let report = ok!(handle.wait(Instant::now() + LONG), "wait");
    check_clean_teardown(&s.log)?;
    check!(
        report.retired_releases == 2,
        "{} of 2 releases retired",
        report.retired_releases
    );
    Ok(())
}

fn retire_waits_for_pending<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::Ordering::SeqCst;
    let s = setup(f, ContextConfig::new().label("wait"))?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    s.log.hold_retirements(true);
    // Four live at once, then released: four frees queued (with the cache
    // on, four blocks kept, and freed by emptying it), all of them run once
    // `stream` is synchronized.
    let mut bufs = Vec::new();
    for _ in 0..4 {
        bufs.push(ok!(
            s.ctx.allocate(&stream, Alloc::new(65536, Role::Activation)),
            "allocate"
        ));
    }
    drop(bufs);
    s.empty_cache();
    ok!(stream.synchronize(), "synchronize");
    drop(stream);
    let handle = s.ctx.retire();
    let log = s.log.clone();
    let delay = Duration::from_millis(150);
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(delay);
        log.release_held()
    });
    let start = Instant::now();
    let report = ok!(handle.wait(Instant::now() + LONG), "wait");
    let waited = start.elapsed();
    let released = releaser.join().unwrap_or(0);
    check!(released == 4, "{released} of 4 retirements were held");
    check!(
        waited >= delay - Duration::from_millis(20),
        "wait returned after {waited:?}, before the releases retired ({delay:?})"
    );
    check!(
        report.retired_releases == 4,
        "{} of 4 releases retired",
        report.retired_releases
    );
    check!(
        s.log.teardowns.load(SeqCst) == 1,
        "teardown ran {} times",
        s.log.teardowns.load(SeqCst)
    );
    check_clean_teardown(&s.log)?;
    Ok(())
}

fn deadline_error_names_outstanding<C: DeviceContext>(f: Factory<'_, C>) -> R {
    let s = setup(f, ContextConfig::new().label("deadline"))?;
    let stream = ok!(s.ctx.create_stream("decode"), "create_stream");
    let kv = ok!(
        s.ctx.allocate(&stream, Alloc::new(8192, Role::KvCache)),
        "allocate kv"
    );
    let source = s.ctx.pin_source(Some("plugin-x"));
    let ext = ok!(source.pin(), "external pin");
    s.log.hold_retirements(true);
    drop(ok!(
        s.ctx.allocate(&stream, Alloc::new(4096, Role::Weights)),
        "allocate weights"
    ));
    ok!(stream.synchronize(), "synchronize");
    let handle = s.ctx.retire();
    let start = Instant::now();
    let err = match handle.wait(Instant::now() + Duration::from_millis(50)) {
        Ok(_) => {
            return Err(Outcome::Failed(
                "wait succeeded with a live buffer, a stream and an external pin outstanding"
                    .into(),
            ))
        }
        Err(e) => e,
    };
    check!(
        start.elapsed() >= Duration::from_millis(45),
        "wait gave up after {:?}, before its deadline",
        start.elapsed()
    );
    let RetireError::Outstanding { outstanding, .. } = &err else {
        return Err(Outcome::Failed(format!(
            "wait before the deadline failed otherwise: {err}"
        )));
    };
    let has = |kind: PinKind, role: Option<Role>, count: u64, bytes: u64, holder: Option<&str>| {
        outstanding.items.iter().any(|i| {
            i.kind == kind
                && i.role == role
                && i.count == count
                && i.bytes == bytes
                && i.holder.as_deref() == holder
        })
    };
    check!(
        has(PinKind::Stream, None, 1, 0, Some("decode")),
        "stream 'decode' not listed: {outstanding}"
    );
    check!(
        has(PinKind::Buffer, Some(Role::KvCache), 1, 8192, None),
        "kv-cache buffer not listed: {outstanding}"
    );
    check!(
        has(PinKind::PendingRelease, Some(Role::Weights), 1, 4096, None),
        "pending weights release not listed: {outstanding}"
    );
    check!(
        has(PinKind::External, None, 1, 0, Some("plugin-x")),
        "external pin 'plugin-x' not listed: {outstanding}"
    );
    let msg = err.to_string();
    for needle in ["plugin-x", "decode", "kv-cache", "8192", "4096", "force()"] {
        check!(
            msg.contains(needle),
            "deadline message lacks '{needle}': {msg}"
        );
    }
    // Waitable again once the holders let go.
    drop((kv, ext, stream));
    s.log.hold_retirements(false);
    s.log.release_held();
    let report = ok!(handle.wait(Instant::now() + LONG), "second wait");
    check_clean_teardown(&s.log)?;
    check!(
        report.retired_releases == 2,
        "{} of 2 releases retired",
        report.retired_releases
    );
    Ok(())
}

fn budget_exhaustion_error<C: DeviceContext>(f: Factory<'_, C>) -> R {
    const MIB: u64 = 1 << 20;
    let s = setup(f, ContextConfig::new().label("budget").budget(MIB))?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    let a = ok!(
        s.ctx
            .allocate(&stream, Alloc::new(768 * 1024, Role::Weights)),
        "allocate 768 KiB"
    );
    let refused = s
        .ctx
        .allocate(&stream, Alloc::new(512 * 1024, Role::Activation));
    let Err(GovernorError::BudgetExceeded(b)) = &refused else {
        return Err(Outcome::Failed(format!(
            "over-budget allocation gave {:?}",
            refused.map(|_| ())
        )));
    };
    check!(
        b.requested == 512 * 1024
            && b.live == 768 * 1024
            && b.pending == 0
            && b.limit == MIB
            && b.available == 256 * 1024
            && b.role == Role::Activation,
        "budget numbers wrong: {b:?}"
    );
    let msg = refused
        .as_ref()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    for needle in [
        "524288",
        "786432",
        "1048576",
        "262144",
        "activation",
        "raise the budget",
    ] {
        check!(
            msg.contains(needle),
            "budget message lacks '{needle}': {msg}"
        );
    }
    // Pending bytes count until they retire. (Asked on another stream: a
    // backend with stream-ordered reuse credits them to its own stream.)
    let other = ok!(s.ctx.create_stream("other"), "create_stream");
    s.log.hold_retirements(true);
    drop(a);
    ok!(stream.synchronize(), "synchronize");
    let refused = s
        .ctx
        .allocate(&other, Alloc::new(512 * 1024, Role::Activation));
    let Err(GovernorError::BudgetExceeded(b)) = &refused else {
        return Err(Outcome::Failed(format!(
            "allocation while 768 KiB pend gave {:?}",
            refused.map(|_| ())
        )));
    };
    check!(
        b.pending == 768 * 1024 && b.live == 0,
        "pending not counted: {b:?}"
    );
    // With the cache on, `a` was kept until the refusal gave it back just
    // now: its free was queued then, and has run once `stream` is
    // synchronized, so that its retirement is among those released.
    ok!(stream.synchronize(), "synchronize after the refusal");
    s.log.hold_retirements(false);
    s.log.release_held();
    let c = ok!(
        s.ctx
            .allocate(&stream, Alloc::new(512 * 1024, Role::Activation)),
        "allocate after the release retired"
    );
    drop(c);
    drop((stream, other));
    finish(&s)?;

    // Waiting for pending releases instead of failing.
    let s = setup(
        f,
        ContextConfig::new()
            .label("budget-wait")
            .budget(MIB)
            .admission(Admission::WaitForPending { timeout: LONG }),
    )?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    let other = ok!(s.ctx.create_stream("other"), "create_stream");
    s.log.hold_retirements(true);
    drop(ok!(
        s.ctx.allocate(&other, Alloc::new(MIB, Role::Weights)),
        "allocate 1 MiB"
    ));
    ok!(other.synchronize(), "synchronize");
    let log = s.log.clone();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        log.release_held()
    });
    let start = Instant::now();
    let b = ok!(
        s.ctx.allocate(&stream, Alloc::new(MIB, Role::Weights)),
        "allocate that waits for the pending release"
    );
    let waited = start.elapsed();
    let _ = releaser.join();
    check!(
        waited >= Duration::from_millis(80),
        "allocation returned after {waited:?}, before the release retired"
    );
    check!(
        s.ctx.snapshot().counters.admission_waits >= 1,
        "no admission wait counted"
    );
    drop(b);
    drop((stream, other));
    s.log.hold_retirements(false);
    s.log.release_held();
    finish(&s)?;
    Ok(())
}

fn device_loss_settles_without_device<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::Ordering::SeqCst;
    let s = setup(f, ContextConfig::new().label("lost"))?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    let bufs: Vec<_> = (0..3)
        .map(|_| s.ctx.allocate(&stream, Alloc::new(4096, Role::KvCache)))
        .collect::<Result<_, _>>()
        .map_err(|e| Outcome::Failed(format!("allocate: {e}")))?;
    s.log.hold_retirements(true);
    let mut bufs = bufs.into_iter();
    drop(bufs.next());
    drop(bufs.next());
    ok!(stream.synchronize(), "synchronize");
    let last = bufs.next().expect("three buffers");
    check!(
        s.ctx.mark_lost("conformance: simulated loss"),
        "mark_lost returned false on a healthy context"
    );
    check!(!s.ctx.mark_lost("again"), "mark_lost returned true twice");
    check!(
        s.ctx.lifecycle() == ContextState::Lost,
        "lifecycle after loss: {:?}",
        s.ctx.lifecycle()
    );
    drop(last); // settles without calling the device
    let alloc = s.ctx.allocate(&stream, Alloc::new(4096, Role::KvCache));
    check!(
        matches!(alloc, Err(GovernorError::DeviceLost { .. })),
        "allocate on a lost context gave {:?}",
        alloc.map(|_| ())
    );
    drop(stream);
    let report = ok!(
        s.ctx.retire().wait(Instant::now() + LONG),
        "wait on a lost context with releases pending"
    );
    check!(report.lost, "report does not say lost");
    check!(
        s.log.teardown_lost.load(SeqCst),
        "teardown was not told the device is lost"
    );
    check!(
        s.log.device_calls_after_loss.load(SeqCst) == 0,
        "{} device calls after loss ({})",
        s.log.device_calls_after_loss.load(SeqCst),
        s.log.summary()
    );
    check_clean_teardown(&s.log)?;
    let snap = s.ctx.snapshot();
    check!(
        snap.total().pending_count == 0 && snap.charged == 0,
        "after lost teardown: {:?}, {} B charged",
        snap.total(),
        snap.charged
    );
    // The two released before the loss are pending frees, abandoned by the
    // lost device; with the cache on they are kept blocks instead, which
    // the loss settles without the device, like the live one.
    let (lost, abandoned) = if s.cached { (3, 0) } else { (1, 2) };
    check!(
        snap.counters.settled_lost == lost,
        "{} buffers settled as lost, expected {lost}",
        snap.counters.settled_lost
    );
    check!(
        snap.counters.abandoned == abandoned,
        "{} pending releases abandoned, expected {abandoned}",
        snap.counters.abandoned
    );
    Ok(())
}

fn force_reclaims_live<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::Ordering::SeqCst;
    let s = setup(f, ContextConfig::new().label("force"))?;
    let stream = ok!(s.ctx.create_stream("main"), "create_stream");
    let bufs: Vec<_> = (0..3)
        .map(|_| s.ctx.allocate(&stream, Alloc::new(65536, Role::Weights)))
        .collect::<Result<_, _>>()
        .map_err(|e| Outcome::Failed(format!("allocate: {e}")))?;
    drop(ok!(
        s.ctx.allocate(&stream, Alloc::new(4096, Role::Activation)),
        "allocate"
    ));
    let handle = s.ctx.retire();
    check!(
        handle
            .wait(Instant::now() + Duration::from_millis(20))
            .is_err(),
        "wait succeeded with live buffers"
    );
    let report = ok!(handle.force(Instant::now() + LONG), "force");
    check!(
        report.forced && report.reclaimed_buffers == 3,
        "force report: {report:?}"
    );
    check_clean_teardown(&s.log)?;
    let snap = s.ctx.snapshot();
    check!(
        snap.charged == 0 && snap.total().live_count == 0,
        "after force: {} B charged, {:?}",
        snap.charged,
        snap.total()
    );
    let calls = s.log.calls.load(SeqCst);
    let w = bufs[0].write(0, b"x");
    check!(
        matches!(w, Err(GovernorError::Reclaimed { .. })),
        "write to a reclaimed buffer gave {:?}",
        w
    );
    drop(bufs);
    drop(stream);
    check!(
        s.log.calls.load(SeqCst) == calls,
        "dropping reclaimed buffers and streams called the backend"
    );
    check!(
        s.ctx.lifecycle() == ContextState::Terminated,
        "lifecycle after force: {:?}",
        s.ctx.lifecycle()
    );
    Ok(())
}

fn concurrent_streams<C: DeviceContext>(f: Factory<'_, C>) -> R {
    let s = setup(f, ContextConfig::new().label("concurrent"))?;
    let shared = ok!(s.ctx.create_stream("shared"), "create_stream");
    const THREADS: usize = 4;
    const ITERS: usize = 150;
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let ctx = s.ctx.clone();
                let shared = shared.clone();
                scope.spawn(move || -> Result<u64, String> {
                    let own = ctx
                        .create_stream(format!("thread-{t}"))
                        .map_err(|e| e.to_string())?;
                    let mut live = Vec::new();
                    let mut n = 0u64;
                    for i in 0..ITERS {
                        let len = 64 + ((i * 7919 + t * 104729) % 65536);
                        let st = if i % 4 == 0 { &shared } else { &own };
                        let b = ctx
                            .allocate(st, Alloc::new(len as u64, Role::ALL[i % 5]))
                            .map_err(|e| e.to_string())?;
                        n += 1;
                        let data = pattern((t * 31 + i) as u8, len.min(4096));
                        b.write(0, &data).map_err(|e| e.to_string())?;
                        let mut back = vec![0u8; data.len()];
                        b.read(0, &mut back).map_err(|e| e.to_string())?;
                        if back != data {
                            return Err(format!("thread {t} iteration {i}: data corrupted"));
                        }
                        live.push(b);
                        if live.len() > 4 {
                            let victim = live.remove(i % live.len());
                            if i % 3 == 0 {
                                victim
                                    .release_on(&shared)
                                    .map_err(|e| e.error.to_string())?;
                            } else {
                                drop(victim);
                            }
                        }
                    }
                    Ok(n)
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| match h.join() {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some("worker thread panicked".into()),
            })
            .collect()
    });
    check!(failures.is_empty(), "worker failures: {failures:?}");
    drop(shared);
    let report = finish(&s)?;
    // Every block the backend allocated is freed once: one per allocation,
    // or with the cache on one per block the cache did not hand back out.
    let allocated = s.log.allocations.load(std::sync::atomic::Ordering::SeqCst);
    let expected = if s.cached {
        allocated
    } else {
        (THREADS * ITERS) as u64
    };
    check!(
        allocated == expected && report.retired_releases == expected,
        "{} of {expected} releases retired ({allocated} backend allocations)",
        report.retired_releases
    );
    let snap = s.ctx.snapshot();
    check!(
        snap.charged == 0 && snap.total() == Default::default(),
        "after teardown: {} B charged, {:?}",
        snap.charged,
        snap.total()
    );
    Ok(())
}

/// A release on a stream other than the buffer's own, and a buffer recorded
/// on other streams, are ordered after those streams' work; and the backend's
/// `order_after` really orders: a free queued on `b` after `order_after(b, a)`
/// retires after every free queued on `a` before it.
fn cross_stream_release_is_ordered<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    let s = setup(f, ContextConfig::new().label("cross-stream"))?;
    let a = ok!(s.ctx.create_stream("a"), "create_stream a");
    let b = ok!(s.ctx.create_stream("b"), "create_stream b");
    let c = ok!(s.ctx.create_stream("c"), "create_stream c");
    let orderings = || s.log.orderings.load(SeqCst);

    // Released on its own stream: nothing to order.
    let own = ok!(
        s.ctx.allocate(&a, Alloc::new(4096, Role::Activation)),
        "allocate on a"
    );
    ok!(own.write(0, &pattern(1, 4096)), "write on a");
    drop(own);
    check!(
        orderings() == 0,
        "a release on the buffer's own stream asked for {} orderings",
        orderings()
    );

    // Released on another stream: ordered after its own.
    let moved = ok!(
        s.ctx.allocate(&a, Alloc::new(4096, Role::Activation)),
        "allocate on a"
    );
    ok!(moved.write(0, &pattern(2, 4096)), "write on a");
    if let Err(e) = moved.release_on(&b) {
        return Err(Outcome::Failed(format!("release_on b: {e}")));
    }
    check!(
        orderings() == 1,
        "release_on another stream asked for {} orderings, expected 1",
        orderings()
    );

    // Recorded on b and c (twice, and its own stream once: no effect),
    // dropped on its own stream: ordered after b and c.
    let mut shared = ok!(
        s.ctx.allocate(&a, Alloc::new(8192, Role::KvCache)),
        "allocate on a"
    );
    ok!(shared.record_stream(&b), "record_stream b");
    ok!(shared.record_stream(&c), "record_stream c");
    ok!(shared.record_stream(&b), "record_stream b again");
    ok!(shared.record_stream(&a), "record_stream of its own stream");
    let labels: Vec<&str> = shared.recorded_streams().collect();
    check!(
        labels == ["b", "c"],
        "recorded streams read {labels:?}, expected [\"b\", \"c\"]"
    );
    drop(shared);
    check!(
        orderings() == 3,
        "a buffer recorded on 2 other streams asked for {} orderings in all, expected 3",
        orderings()
    );

    // Recorded on c, released on b: ordered after a and c.
    let mut both = ok!(
        s.ctx.allocate(&a, Alloc::new(4096, Role::Workspace)),
        "allocate on a"
    );
    ok!(both.record_stream(&c), "record_stream c");
    if let Err(e) = both.release_on(&b) {
        return Err(Outcome::Failed(format!(
            "release_on b after record_stream c: {e}"
        )));
    }
    check!(
        orderings() == 5,
        "release_on b of a buffer recorded on c asked for {} orderings in all, expected 5",
        orderings()
    );

    // A stream of another context cannot be recorded.
    let other = setup(f, ContextConfig::new().label("cross-stream-other"))?;
    let foreign = ok!(
        other.ctx.create_stream("foreign"),
        "create_stream on the other context"
    );
    let mut mine = ok!(
        s.ctx.allocate(&a, Alloc::new(4096, Role::Activation)),
        "allocate on a"
    );
    let refused = mine.record_stream(&foreign);
    check!(
        matches!(refused, Err(GovernorError::WrongContext { .. })),
        "record_stream of another context's stream gave {refused:?}"
    );
    drop((mine, foreign));
    finish(&other)?;

    // Five buffers, each freed once. With the cache on, `moved` reused the
    // block `own` left on `a` (so four backend allocations), and `mine` is
    // kept until the cache is emptied.
    s.empty_cache();
    for st in [&a, &b, &c] {
        ok!(st.synchronize(), "synchronize");
    }
    let expected = if s.cached { 4 } else { 5 };
    let allocated = s.log.allocations.load(SeqCst);
    let snap = s.ctx.snapshot();
    check!(
        allocated == expected
            && snap.counters.retired == expected
            && snap.charged == 0
            && snap.quarantine.is_empty(),
        "after every release: {} of {expected} retired ({allocated} backend allocations), {} B charged, {} quarantined ({})",
        snap.counters.retired,
        snap.charged,
        snap.quarantine.len(),
        s.log.summary()
    );
    drop((a, b, c));
    finish(&s)?;

    // Directly on the backend: a free on `b` queued after `order_after(b, a)`
    // retires after every free queued on `a` before it.
    let backend = match f.open() {
        Ok(b) => b,
        Err(e) => return Err(Outcome::Failed(format!("factory failed: {e}"))),
    };
    let sa = ok!(backend.create_stream(), "raw create_stream a");
    let sb = ok!(backend.create_stream(), "raw create_stream b");
    let clock = Arc::new(AtomicU64::new(1));
    let stamp = |slot: Arc<AtomicU64>| {
        let clock = clock.clone();
        memgov::RetireSignal::from_fn(move |o| {
            if o == memgov::RetireOutcome::Retired {
                slot.store(clock.fetch_add(1, SeqCst), SeqCst);
            }
        })
    };
    let on_a: Vec<Arc<AtomicU64>> = (0..8).map(|_| Arc::new(AtomicU64::new(0))).collect();
    for slot in &on_a {
        let m = ok!(backend.allocate(&sa, 64 << 10), "raw allocate on a");
        if let Err((_, _, e)) = backend.free_async(&sa, m, stamp(slot.clone())) {
            return Err(Outcome::Failed(format!("raw free_async on a: {e}")));
        }
    }
    ok!(backend.order_after(&sb, &sa), "raw order_after(b, a)");
    let on_b = Arc::new(AtomicU64::new(0));
    let m = ok!(backend.allocate(&sb, 4096), "raw allocate on b");
    if let Err((_, _, e)) = backend.free_async(&sb, m, stamp(on_b.clone())) {
        return Err(Outcome::Failed(format!("raw free_async on b: {e}")));
    }
    ok!(backend.synchronize(&sb), "raw synchronize b");
    ok!(backend.synchronize(&sa), "raw synchronize a");
    let a_stamps: Vec<u64> = on_a.iter().map(|s| s.load(SeqCst)).collect();
    let b_stamp = on_b.load(SeqCst);
    check!(
        a_stamps.iter().all(|&t| t != 0) && b_stamp != 0,
        "frees did not all retire after synchronize: a {a_stamps:?}, b {b_stamp}"
    );
    check!(
        a_stamps.iter().all(|&t| t < b_stamp),
        "the free on b retired at {b_stamp}, before frees queued on a ahead of order_after(b, a) (retired at {a_stamps:?})"
    );
    ok!(backend.destroy_stream(sa), "raw destroy_stream a");
    ok!(backend.destroy_stream(sb), "raw destroy_stream b");
    ok!(backend.teardown(false), "raw teardown");
    Ok(())
}

/// Raw handles that are not this context's, or offsets outside the
/// allocation, are refused by the backend's safe methods with
/// `InvalidArgument` before any driver call, and hand back what they took:
/// the driver would otherwise free another context's memory, use a stream of
/// another context, or copy outside any allocation.
///
/// (A second free and a stream used after `destroy_stream` cannot be written
/// against the trait in safe code: both calls take their handle by value.
/// Backends whose handles can be rebuilt from raw values test those in their
/// own suites.)
fn raw_misuse_is_refused<C: DeviceContext>(f: Factory<'_, C>) -> R {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    let make = || match f.open() {
        Ok(b) => Ok(b),
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            Err(Outcome::Skipped(unavailable_reason(&e)))
        }
        Err(e) => Err(Outcome::Failed(format!("factory failed: {e}"))),
    };
    let one = make()?;
    let two = make()?;
    let s1 = ok!(one.create_stream(), "create_stream on context one");
    let s2 = ok!(two.create_stream(), "create_stream on context two");
    let m1 = ok!(one.allocate(&s1, 4096), "allocate on context one");
    let m2 = ok!(two.allocate(&s2, 4096), "allocate on context two");
    let invalid = |what: &str, r: Result<(), BackendError>| -> R {
        match r {
            Err(e) if e.kind == BackendErrorKind::InvalidArgument => Ok(()),
            Err(e) => Err(Outcome::Failed(format!(
                "{what}: refused as {:?}, expected InvalidArgument: {e}",
                e.kind
            ))),
            Ok(()) => Err(Outcome::Failed(format!("{what}: accepted"))),
        }
    };
    let mut buf = [0u8; 16];
    invalid(
        "write of another context's memory",
        one.write(&s1, &m2, 0, &[1; 16]),
    )?;
    invalid(
        "read of another context's memory",
        one.read(&s1, &m2, 0, &mut buf),
    )?;
    invalid(
        "write on another context's stream",
        one.write(&s2, &m1, 0, &[1; 16]),
    )?;
    invalid(
        "read on another context's stream",
        one.read(&s2, &m1, 0, &mut buf),
    )?;
    invalid(
        "synchronize of another context's stream",
        one.synchronize(&s2),
    )?;
    invalid(
        "order_after on another context's stream",
        one.order_after(&s1, &s2),
    )?;
    invalid(
        "order_after of another context's stream",
        one.order_after(&s2, &s1),
    )?;
    invalid(
        "allocate on another context's stream",
        one.allocate(&s2, 4096).map(drop),
    )?;
    invalid("write past the end", one.write(&s1, &m1, 4090, &[1; 16]))?;
    invalid("read past the end", one.read(&s1, &m1, 4096, &mut buf[..1]))?;
    invalid(
        "write at an offset that overflows",
        one.write(&s1, &m1, u64::MAX - 4, &[1; 16]),
    )?;
    invalid(
        "read at an offset that overflows",
        one.read(&s1, &m1, u64::MAX, &mut buf),
    )?;

    // Frees: refused, with the memory and an unfired signal handed back.
    let settled = Arc::new(AtomicU32::new(0));
    let signal = || {
        let settled = settled.clone();
        memgov::RetireSignal::from_fn(move |_| {
            settled.fetch_add(1, SeqCst);
        })
    };
    let (m2, back) = match one.free_async(&s1, m2, signal()) {
        Ok(()) => {
            return Err(Outcome::Failed(
                "free_async of another context's memory: accepted".into(),
            ))
        }
        Err((m, sig, e)) => {
            invalid("free_async of another context's memory", Err(e))?;
            (m, sig)
        }
    };
    drop(back);
    let (m1, back) = match one.free_async(&s2, m1, signal()) {
        Ok(()) => {
            return Err(Outcome::Failed(
                "free_async on another context's stream: accepted".into(),
            ))
        }
        Err((m, sig, e)) => {
            invalid("free_async on another context's stream", Err(e))?;
            (m, sig)
        }
    };
    drop(back);
    check!(
        settled.load(SeqCst) == 2,
        "refused frees' signals settled {} times (2 dropped by this case)",
        settled.load(SeqCst)
    );

    // What was handed back is still good on its own context.
    ok!(one.write(&s1, &m1, 0, &[7; 16]), "write after the refusals");
    ok!(one.read(&s1, &m1, 0, &mut buf), "read after the refusals");
    for (ctx, st, m) in [(&one, &s1, m1), (&two, &s2, m2)] {
        if let Err((_, _, e)) = ctx.free_async(st, m, memgov::RetireSignal::from_fn(|_| {})) {
            return Err(Outcome::Failed(format!(
                "free_async on its own context after the refusals: {e}"
            )));
        }
        ok!(ctx.synchronize(st), "synchronize");
    }
    ok!(one.destroy_stream(s1), "destroy_stream one");
    ok!(two.destroy_stream(s2), "destroy_stream two");
    ok!(one.teardown(false), "teardown one");
    ok!(two.teardown(false), "teardown two");
    Ok(())
}

/// A pinned host allocation, or the skip of a backend without the tier.
fn allocate_pinned<C: DeviceContext>(
    s: &Setup<C>,
    stream: &memgov::GovernedStream<W<C>>,
    bytes: u64,
) -> Result<memgov::DeviceBuffer<W<C>>, Outcome> {
    match s.ctx.allocate(
        stream,
        Alloc::new(bytes, Role::Other).tier(Tier::PinnedHost),
    ) {
        Ok(b) => Ok(b),
        Err(GovernorError::Backend { source, .. })
            if source.kind == BackendErrorKind::Unsupported =>
        {
            Err(Outcome::Skipped(format!("no pinned host tier: {source}")))
        }
        Err(e) => Err(Outcome::Failed(format!(
            "allocate {bytes} B of pinned host memory failed: {e}"
        ))),
    }
}

fn pinned_host_tier<C: DeviceContext>(f: Factory<'_, C>) -> R {
    const MIB: u64 = 1 << 20;
    let s = setup(
        f,
        ContextConfig::new()
            .label("pinned")
            .budget(MIB)
            .tier_budget(Tier::PinnedHost, 2 * MIB),
    )?;
    let stream = ok!(s.ctx.create_stream("copy"), "create_stream");
    // Twice the device budget: pinned bytes are not charged to it.
    let pinned = allocate_pinned(&s, &stream, 2 * MIB)?;
    check!(
        pinned.tier() == Tier::PinnedHost,
        "buffer tier {}",
        pinned.tier()
    );
    let data = pattern(23, 2 * MIB as usize);
    ok!(pinned.write(0, &data), "write 2 MiB of pinned host memory");
    let patch = pattern(5, 77);
    ok!(pinned.write(MIB + 1, &patch), "write 77 B at 1 MiB + 1");
    let mut back = vec![0u8; 2 * MIB as usize];
    ok!(
        pinned.read(0, &mut back),
        "read 2 MiB of pinned host memory"
    );
    check!(
        back[..MIB as usize + 1] == data[..MIB as usize + 1]
            && back[MIB as usize + 1..MIB as usize + 78] == patch[..]
            && back[MIB as usize + 78..] == data[MIB as usize + 78..],
        "pinned host memory read back differs from what was written"
    );
    let snap = s.ctx.snapshot();
    let (Some(device), Some(host)) = (snap.tier(Tier::Device), snap.tier(Tier::PinnedHost)) else {
        return Err(Outcome::Failed(format!(
            "snapshot lacks a tier: {:?}",
            snap.by_tier
        )));
    };
    check!(
        host.live_bytes == 2 * MIB && host.charged == 2 * MIB && host.limit == 2 * MIB,
        "pinned tier numbers wrong: {host:?}"
    );
    check!(
        device.charged == 0 && device.live_bytes == 0 && snap.charged == 0,
        "pinned bytes on the device budget: {device:?}, charged {}",
        snap.charged
    );
    // The pinned tier is full; its refusal names it, with its numbers.
    let refused = s.ctx.allocate(
        &stream,
        Alloc::new(4096, Role::Other).tier(Tier::PinnedHost),
    );
    let Err(GovernorError::BudgetExceeded(b)) = &refused else {
        return Err(Outcome::Failed(format!(
            "allocation over the pinned tier's limit gave {:?}",
            refused.map(|_| ())
        )));
    };
    check!(
        b.scope == memgov::BudgetScope::Tier(Tier::PinnedHost)
            && b.live == 2 * MIB
            && b.limit == 2 * MIB
            && b.available == 0,
        "pinned refusal numbers wrong: {b:?}"
    );
    let msg = refused.err().map(|e| e.to_string()).unwrap_or_default();
    check!(
        msg.contains("pinned-host tier budget") && msg.contains("ContextConfig::tier_budget"),
        "refusal does not name the tier and its way out: {msg}"
    );
    // The device tier keeps all of its room.
    let device_buf = ok!(
        s.ctx.allocate(&stream, Alloc::new(MIB, Role::Weights)),
        "allocate the whole device budget beside 2 MiB pinned"
    );
    drop((pinned, device_buf));
    drop(stream);
    finish(&s)?;
    let host = s.ctx.snapshot().tier(Tier::PinnedHost);
    check!(
        host.is_some_and(|h| h.charged == 0 && h.live_bytes == 0 && h.pending_bytes == 0),
        "pinned bytes left after teardown: {host:?}"
    );
    Ok(())
}

fn pinned_host_release_is_stream_ordered<C: DeviceContext>(f: Factory<'_, C>) -> R {
    const MIB: u64 = 1 << 20;
    let s = setup(
        f,
        ContextConfig::new()
            .label("pinned-release")
            .tier_budget(Tier::PinnedHost, MIB),
    )?;
    let stream = ok!(s.ctx.create_stream("copy"), "create_stream");
    // `synchronize` returns once the signals of the stream's frees have
    // fired: pinned host frees too, though a driver may run them off the
    // stream.
    let first = allocate_pinned(&s, &stream, MIB)?;
    ok!(
        first.write(0, &pattern(1, 4096)),
        "write 4 KiB of pinned host memory"
    );
    drop(first);
    ok!(stream.synchronize(), "synchronize");
    let host = s.ctx.snapshot().tier(Tier::PinnedHost);
    check!(
        host.is_some_and(|h| h.pending_bytes == 0 && h.charged == 0),
        "a pinned release still pends after synchronize: {host:?}"
    );
    let staging = allocate_pinned(&s, &stream, MIB)?;
    // A copy queued on the stream, then the release behind it: the free
    // must not run before the copy (the stand-ins report one that does).
    ok!(
        staging.write(0, &pattern(3, MIB as usize)),
        "write 1 MiB of pinned host memory"
    );
    s.log.hold_retirements(true);
    drop(staging);
    ok!(stream.synchronize(), "synchronize");
    let host = s.ctx.snapshot().tier(Tier::PinnedHost);
    check!(
        host.is_some_and(|h| h.pending_bytes == MIB && h.charged == MIB && h.live_bytes == 0),
        "the unretired release is not pending in the pinned tier: {host:?}"
    );
    // Its bytes count against the tier until the free has executed.
    let refused = s
        .ctx
        .allocate(&stream, Alloc::new(MIB, Role::Other).tier(Tier::PinnedHost));
    check!(
        matches!(&refused, Err(GovernorError::BudgetExceeded(b)) if b.pending == MIB),
        "allocation while 1 MiB pinned pends gave {:?}",
        refused.map(|_| ())
    );
    drop(stream);
    // Teardown waits for the pinned release's pin.
    let handle = s.ctx.retire();
    let log = s.log.clone();
    let delay = Duration::from_millis(100);
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(delay);
        log.release_held()
    });
    let start = Instant::now();
    let report = ok!(handle.wait(Instant::now() + LONG), "wait");
    let waited = start.elapsed();
    let released = releaser.join().unwrap_or(0);
    check!(released == 1, "{released} of 1 retirement was held");
    check!(
        waited >= delay - Duration::from_millis(20),
        "teardown after {waited:?}, before the pinned release retired ({delay:?})"
    );
    check!(
        report.retired_releases == 2,
        "{} of 2 releases retired",
        report.retired_releases
    );
    check_clean_teardown(&s.log)?;
    let host = s.ctx.snapshot().tier(Tier::PinnedHost);
    check!(
        host.is_some_and(|h| h.charged == 0 && h.pending_bytes == 0),
        "pinned bytes left after teardown: {host:?}"
    );
    Ok(())
}
