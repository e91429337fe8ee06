//! Bad input: every misuse gets a specific, documented
//! error and nothing panics. docs/reliability.md lists each case and its error.

use memgov::host::{HostConfig, HostContext};
use memgov::{
    Alloc, BudgetScope, ContextConfig, ContextHandle, ContextName, ContextOperation, ContextState,
    ForeignObject, Governor, GovernorError, ProviderContextPinError, Reserve, RetireError, Role,
};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn ctx_with(
    config: ContextConfig,
) -> (
    Governor<HostContext>,
    ContextHandle<HostContext>,
    memgov::BackendProbe,
) {
    let gov = Governor::new();
    let host = HostContext::new(HostConfig {
        capacity: 1 << 30,
        ..HostConfig::default()
    })
    .unwrap();
    let probe = host.probe();
    let ctx = gov.register(host, config);
    (gov, ctx, probe)
}

fn past() -> Instant {
    Instant::now()
        .checked_sub(Duration::from_millis(5))
        .unwrap_or_else(Instant::now)
}

#[test]
fn zero_byte_allocation_is_refused() {
    let (_g, ctx, _p) = ctx_with(ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    let e = ctx.allocate(&s, Alloc::new(0, Role::Weights)).unwrap_err();
    assert!(
        matches!(
            e,
            GovernorError::ZeroSized {
                role: Role::Weights,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("zero-byte"), "{e}");
    assert_eq!(
        ctx.snapshot().pins.total(),
        1,
        "the refused allocation holds no pin"
    );
}

#[test]
fn enormous_allocation_is_refused_with_numbers() {
    // Unlimited context budget: the device refuses, with its numbers.
    let (_g, ctx, _p) = ctx_with(ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    let e = ctx
        .allocate(&s, Alloc::new(u64::MAX, Role::KvCache))
        .unwrap_err();
    let b = e
        .budget()
        .unwrap_or_else(|| panic!("expected BudgetExceeded, got {e:?}"));
    assert_eq!(b.scope, BudgetScope::Device);
    assert_eq!(b.requested, u64::MAX);
    // With a budget: the budget refuses first, without touching the device.
    let (_g2, ctx2, _p2) = ctx_with(ContextConfig::new().budget(1 << 20));
    let s2 = ctx2.create_stream("s").unwrap();
    let e = ctx2
        .allocate(&s2, Alloc::new(u64::MAX, Role::KvCache))
        .unwrap_err();
    let b = e.budget().unwrap();
    assert_eq!(
        (b.scope.clone(), b.limit, b.available),
        (BudgetScope::Context, 1 << 20, 1 << 20)
    );
    // The charged total never overflowed.
    assert_eq!(ctx2.snapshot().charged, 0);
}

#[test]
fn over_budget_reports_every_number() {
    let (_g, ctx, _p) = ctx_with(ContextConfig::new().label("llm").budget(10_000));
    let s = ctx.create_stream("s").unwrap();
    let _a = ctx.allocate(&s, Alloc::new(6_000, Role::Weights)).unwrap();
    let e = ctx
        .allocate(&s, Alloc::new(5_000, Role::Activation))
        .unwrap_err();
    let b = e.budget().unwrap();
    assert_eq!(
        (b.requested, b.live, b.pending, b.limit, b.available),
        (5_000, 6_000, 0, 10_000, 4_000)
    );
    let msg = e.to_string();
    for needle in [
        "cannot admit 4.9 KiB (5000 bytes) of",
        "5.9 KiB (6000 bytes) live",
        "9.8 KiB (10000 bytes) limit",
        "3.9 KiB (4000 bytes) available",
        "llm",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from {msg}");
    }
}

#[test]
fn out_of_bounds_writes_and_reads() {
    let (_g, ctx, _p) = ctx_with(ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    let b = ctx.allocate(&s, Alloc::new(100, Role::Workspace)).unwrap();
    for (offset, len) in [
        (0u64, 101usize),
        (100, 1),
        (u64::MAX, 1),
        (u64::MAX - 1, 4),
        (50, 51),
    ] {
        let e = b.write(offset, &vec![1u8; len]).unwrap_err();
        assert!(
            matches!(e, GovernorError::OutOfBounds { op: "write", offset: o, len: l, size: 100, .. } if o == offset && l == len as u64),
            "{e:?}"
        );
        let mut dst = vec![0u8; len];
        let e = b.read(offset, &mut dst).unwrap_err();
        assert!(
            matches!(
                e,
                GovernorError::OutOfBounds {
                    op: "read",
                    size: 100,
                    ..
                }
            ),
            "{e:?}"
        );
    }
    assert_eq!(
        b.write(50, &[0u8; 2048]).unwrap_err().to_string(),
        format!(
            "context {}: write of 2.0 KiB (2048 bytes) at offset 50 is out of bounds of a \
             100 bytes buffer; keep offset + len <= 100",
            ctx.name()
        )
    );
    // The edges are fine, including empty accesses at the end.
    b.write(99, &[7]).unwrap();
    b.write(100, &[]).unwrap();
    let mut one = [0u8];
    b.read(99, &mut one).unwrap();
    assert_eq!(one, [7]);
}

#[test]
fn release_on_a_stream_of_another_context_returns_the_buffer() {
    let gov = Governor::new();
    let a = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new(),
    );
    let b = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new(),
    );
    let sa = a.create_stream("a").unwrap();
    let sb = b.create_stream("b").unwrap();
    let buf = a.allocate(&sa, Alloc::new(64, Role::Other)).unwrap();
    let err = buf.release_on(&sb).unwrap_err();
    assert!(
        matches!(err.error, GovernorError::WrongContext { .. }),
        "{:?}",
        err.error
    );
    let buf = err.buffer.expect("the buffer comes back, still live");
    assert_eq!(a.snapshot().total().live_bytes, 64);
    // Allocating on another context's stream is refused the same way.
    assert!(matches!(
        a.allocate(&sb, Alloc::new(64, Role::Other)),
        Err(GovernorError::WrongContext { .. })
    ));
    buf.release_on(&sa).unwrap();
}

/// Each operation that takes a stream names itself, the context it works in,
/// the stream it was handed and that stream's context, and the way out that
/// fits it.
#[test]
fn wrong_context_names_the_operation_and_what_was_passed() {
    let gov = Governor::new();
    let host = || HostContext::new(HostConfig::default()).unwrap();
    let a = gov.register(host(), ContextConfig::new().label("a"));
    let b = gov.register(host(), ContextConfig::new().label("b"));
    let sa = a.create_stream("main").unwrap();
    let sb = b.create_stream("decode").unwrap();
    let (ia, ib) = (a.name(), b.name());
    assert_eq!(ia.to_string(), format!("{} 'a'", a.id()));
    let expect = |operation, context: &ContextName| GovernorError::WrongContext {
        operation,
        context: context.clone(),
        passed: ForeignObject::Stream {
            label: "decode".into(),
        },
        passed_context: ib.clone(),
    };

    let e = a.allocate(&sb, Alloc::new(64, Role::Other)).unwrap_err();
    assert_eq!(e, expect(ContextOperation::Allocate, &ia));
    assert_eq!(
        e.to_string(),
        format!(
            "allocate on context {ia} was passed stream 'decode' of context {ib}; \
             allocate on a stream of context {ia} (ContextHandle::create_stream)"
        )
    );

    let mut buf = a.allocate(&sa, Alloc::new(64, Role::Other)).unwrap();
    let e = buf.record_stream(&sb).unwrap_err();
    assert_eq!(e, expect(ContextOperation::RecordStream, &ia));
    assert_eq!(
        e.to_string(),
        format!(
            "record_stream on a buffer of context {ia} was passed stream 'decode' of context {ib}; \
             record only streams of context {ia}; nothing was recorded"
        )
    );

    let e = buf.release_on(&sb).unwrap_err();
    assert_eq!(e.error, expect(ContextOperation::ReleaseOn, &ia));
    assert_eq!(
        e.error.to_string(),
        format!(
            "release_on of a buffer of context {ia} was passed stream 'decode' of context {ib}; \
             release it on a stream of context {ia}; the buffer is handed back unchanged in \
             ReleaseError::buffer"
        )
    );
    let buf = e.buffer.expect("the buffer comes back");

    // Migrating into `a` with `b`'s stream: the context is the target's.
    let e = a.migrate(&sb, vec![buf]).unwrap_err();
    assert_eq!(e.error, expect(ContextOperation::Migrate, &ia));
    assert_eq!(
        e.error.to_string(),
        format!(
            "migrate into context {ia} was passed stream 'decode' of context {ib}; \
             copy on a stream of the target context {ia}; every source buffer is handed back \
             in MigrateError::buffers"
        )
    );
    assert!(
        e.to_string()
            .starts_with("moving buffer 1 of 1 (64 bytes of "),
        "{e}"
    );
    let mut buffers = e.buffers;
    buffers.pop().unwrap().release_on(&sa).unwrap();
}

#[test]
fn release_on_a_stream_of_a_terminated_context() {
    let gov = Governor::new();
    let a = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new(),
    );
    let b = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new(),
    );
    let sa = a.create_stream("a").unwrap();
    let sb = b.create_stream("b").unwrap();
    let buf = a.allocate(&sa, Alloc::new(64, Role::Other)).unwrap();
    // Context b is force-retired and terminated while its stream handle lives.
    let report = b
        .retire()
        .force(Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert!(report.forced);
    assert_eq!(b.lifecycle(), ContextState::Terminated);
    let err = buf.release_on(&sb).unwrap_err();
    assert!(
        matches!(err.error, GovernorError::WrongContext { .. }),
        "{:?}",
        err.error
    );
    // And b's own stream is unusable with a clear error.
    assert!(matches!(
        sb.synchronize(),
        Err(GovernorError::Reclaimed { .. })
    ));
    assert!(matches!(
        b.allocate(&sb, Alloc::new(1, Role::Other)),
        Err(GovernorError::Pin {
            refusal: ProviderContextPinError::ContextUnavailable(_),
            ..
        })
    ));
    err.buffer.unwrap().release_on(&sa).unwrap();
}

#[test]
fn operations_on_a_lost_context() {
    let (_g, ctx, probe) = ctx_with(ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    let b = ctx.allocate(&s, Alloc::new(4096, Role::Weights)).unwrap();
    assert!(ctx.mark_lost("ECC error (test)"));
    assert!(
        !ctx.mark_lost("again"),
        "marking lost twice reports it was already lost"
    );
    assert_eq!(ctx.lifecycle(), ContextState::Lost);
    let lost = |e: &GovernorError| matches!(e, GovernorError::DeviceLost { reason, .. } if reason.contains("ECC"));
    assert!(lost(
        &ctx.allocate(&s, Alloc::new(1, Role::Other)).unwrap_err()
    ));
    assert!(lost(&ctx.create_stream("t").unwrap_err()));
    assert!(lost(&b.write(0, &[1]).unwrap_err()));
    assert!(lost(&b.read(0, &mut [0]).unwrap_err()));
    assert!(lost(&s.synchronize().unwrap_err()));
    assert!(matches!(
        ctx.pin(),
        Err(ProviderContextPinError::ContextUnavailable(_))
    ));
    assert!(matches!(
        ctx.pin_source(None).pin(),
        Err(ProviderContextPinError::ContextUnavailable(_))
    ));
    // Releasing on a lost device settles at once without calling it.
    b.release_on(&s).unwrap();
    drop(s);
    let report = ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
    assert!(report.lost);
    assert_eq!(report.settled_lost, 1);
    assert_eq!(probe.violations(), 0);
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn pin_count_at_its_maximum() {
    let (_g, ctx, _p) = ctx_with(ContextConfig::new().max_pins(3));
    let s = ctx.create_stream("s").unwrap(); // pin 1
    let b = ctx.allocate(&s, Alloc::new(8, Role::Other)).unwrap(); // pin 2
    let source = ctx.pin_source(Some("plugin"));
    let p = source.pin().unwrap(); // pin 3: at the maximum
    assert!(matches!(
        source.pin(),
        Err(ProviderContextPinError::PinCountOverflow(_))
    ));
    assert!(matches!(
        ctx.pin(),
        Err(ProviderContextPinError::PinCountOverflow(_))
    ));
    assert!(matches!(
        ctx.allocate(&s, Alloc::new(8, Role::Other)),
        Err(GovernorError::Pin {
            refusal: ProviderContextPinError::PinCountOverflow(_),
            ..
        })
    ));
    assert!(matches!(
        ctx.create_stream("t"),
        Err(GovernorError::Pin {
            refusal: ProviderContextPinError::PinCountOverflow(_),
            ..
        })
    ));
    assert_eq!(
        ctx.snapshot().pins.total(),
        3,
        "refusals did not wrap or leak the count"
    );
    drop(p);
    let p = ctx.pin().unwrap();
    drop((p, b, s));
    ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
}

#[test]
fn maximum_pins_outside_1_to_2_pow_63_minus_1_is_refused_at_configuration() {
    for bad in [0u64, 1 << 63, u64::MAX] {
        let r = std::panic::catch_unwind(|| ContextConfig::new().max_pins(bad));
        assert!(
            r.is_err(),
            "max_pins({bad}) must be refused (documented panic)"
        );
    }
    let _ = ContextConfig::new().max_pins((1 << 63) - 1);
}

#[test]
fn deadline_in_the_past() {
    let (_g, ctx, _p) = ctx_with(ContextConfig::new().label("busy"));
    let s = ctx.create_stream("decode").unwrap();
    let b = ctx.allocate(&s, Alloc::new(512, Role::KvCache)).unwrap();
    let h = ctx.retire();
    let t = Instant::now();
    let e = h.wait(past()).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "a past deadline checks once without blocking"
    );
    let RetireError::Outstanding {
        outstanding,
        context,
        ..
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(context.label(), "busy");
    let text = e.to_string();
    assert!(
        text.contains("1 stream") && text.contains("held by 'decode'") && text.contains("kv-cache"),
        "{text}"
    );
    assert!(!outstanding.is_empty());
    // Waiting again is allowed, and works once the holders are gone.
    drop((b, s));
    h.wait_timeout(Duration::from_secs(5)).unwrap();
    // A past deadline on a terminated context returns the report at once.
    h.wait(past()).unwrap();
    h.force(past()).unwrap();
}

#[test]
#[cfg_attr(
    miri,
    ignore = "50 rounds of 5 threads plus host stream workers: 75% of this file's time under Miri (minutes); force_racing_allocate_release_and_streams and the governor tests' concurrent retire run the same race under Miri, loom checks every interleaving"
)]
fn concurrent_retire_from_several_threads() {
    for _ in 0..50 {
        let (_g, ctx, probe) = ctx_with(ContextConfig::new());
        let s = ctx.create_stream("s").unwrap();
        let bufs: Vec<_> = (0..8)
            .map(|_| {
                ctx.allocate(&s, Alloc::new(1024, Role::Activation))
                    .unwrap()
            })
            .collect();
        let barrier = Arc::new(Barrier::new(5));
        let mut hs = Vec::new();
        for t in 0..4 {
            let (ctx, barrier) = (ctx.clone(), barrier.clone());
            hs.push(std::thread::spawn(move || {
                barrier.wait();
                let h = ctx.retire();
                if t == 3 {
                    h.force(Instant::now() + Duration::from_secs(10))
                } else {
                    h.wait_timeout(Duration::from_secs(10))
                }
            }));
        }
        barrier.wait();
        drop(bufs);
        drop(s);
        let reports: Vec<_> = hs
            .into_iter()
            .map(|h| h.join().expect("no panic").expect("every retirer finishes"))
            .collect();
        assert!(
            reports.windows(2).all(|w| w[0] == w[1]),
            "every retirer gets the same report"
        );
        assert_eq!(probe.teardowns(), 1, "destroy exactly once");
        assert_eq!(probe.violations(), 0, "{:?}", probe.violation_log());
        let snap = ctx.snapshot();
        assert_eq!((snap.charged, snap.pins.total()), (0, 0));
    }
}

/// Force racing allocations, releases, stream creation and drops on other
/// threads: every pin is accounted once (no pin revoked and released, none
/// leaked), so force always finishes and leaves nothing charged.
#[test]
fn force_racing_allocate_release_and_streams() {
    let mut rounds = 0;
    let deadline = Instant::now() + Duration::from_secs(8);
    while rounds < 400 && Instant::now() < deadline {
        rounds += 1;
        let (_g, ctx, probe) = ctx_with(ContextConfig::new());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hs: Vec<_> = (0..2)
            .map(|t| {
                let (ctx, stop) = (ctx.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let Ok(s) = ctx.create_stream(format!("s{t}")) else {
                            break;
                        };
                        for _ in 0..4 {
                            match ctx.allocate(&s, Alloc::new(64, Role::Activation)) {
                                Ok(b) => drop(b),
                                Err(_) => break,
                            }
                        }
                    }
                })
            })
            .collect();
        while ctx.snapshot().counters.allocations < 8 {
            std::thread::yield_now();
        }
        let r = ctx.retire().force(Instant::now() + Duration::from_secs(5));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for h in hs {
            h.join().expect("no panic");
        }
        let report = r.unwrap_or_else(|e| panic!("round {rounds}: force did not finish: {e}"));
        assert!(report.forced);
        let snap = ctx.snapshot();
        assert_eq!(
            (snap.charged, snap.pins.total()),
            (0, 0),
            "round {rounds}: {:?}",
            snap.pins
        );
        assert_eq!(probe.violations(), 0, "{:?}", probe.violation_log());
        assert_eq!(probe.teardowns(), 1);
    }
    println!("force race: {rounds} rounds");
}

#[test]
fn host_backend_refuses_zero_capacity() {
    let e = HostContext::new(HostConfig {
        capacity: 0,
        ..HostConfig::default()
    })
    .unwrap_err();
    assert_eq!(e.kind, memgov::BackendErrorKind::InvalidArgument);
}

/// Every error a governed operation returns names its context by identity
/// and label, so a line in a log says which model or device it is about.
/// Each variant is provoked for real, on a context labelled after the case.
#[test]
fn every_error_names_its_context_label() {
    use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
    use memgov::null::NullContext;

    fn names(e: &GovernorError, ctx: &ContextName) {
        let text = e.to_string();
        assert_eq!(e.context(), ctx, "{e:?}");
        assert!(
            text.contains(&format!("context {ctx}")),
            "'{text}' does not name the context {ctx}"
        );
        assert!(
            text.contains(&format!("{} '{}'", ctx.id(), ctx.label())),
            "'{text}' does not carry the label '{}'",
            ctx.label()
        );
    }
    let gov = Governor::new();
    let host = || HostContext::new(HostConfig::default()).unwrap();

    let a = gov.register(host(), ContextConfig::new().label("vision").budget(4096));
    let name = a.name();
    assert_eq!(name.label(), "vision");
    let s = a.create_stream("main").unwrap();
    names(
        &a.allocate(&s, Alloc::new(0, Role::Other)).unwrap_err(),
        &name,
    ); // ZeroSized
    names(
        &a.allocate(&s, Alloc::new(8192, Role::Other)).unwrap_err(),
        &name,
    ); // BudgetExceeded
    let b = a.allocate(&s, Alloc::new(64, Role::Other)).unwrap();
    names(&b.write(60, &[0; 8]).unwrap_err(), &name); // OutOfBounds
    let r = a.reserve(Reserve::new(128, "request-1")).unwrap();
    names(
        &r.allocate(&s, Alloc::new(256, Role::KvCache)).unwrap_err(),
        &name,
    ); // ReservationExhausted
    let other = gov.register(host(), ContextConfig::new().label("other"));
    let so = other.create_stream("o").unwrap();
    names(
        &a.allocate(&so, Alloc::new(64, Role::Other)).unwrap_err(),
        &name,
    ); // WrongContext
    drop((b, r, so, other));

    // Pin refusals: too many pins, then a retiring context.
    let p = gov.register(host(), ContextConfig::new().label("pinned").max_pins(2));
    let ps = p.create_stream("s").unwrap();
    let hold = p.pin().unwrap();
    let err = p.allocate(&ps, Alloc::new(64, Role::Other)).unwrap_err();
    assert!(matches!(err, GovernorError::Pin { .. }), "{err}");
    names(&err, &p.name());
    drop(hold);
    let retiring = p.retire();
    let err = p.allocate(&ps, Alloc::new(64, Role::Other)).unwrap_err();
    assert!(
        err.to_string().contains("no longer accepting work"),
        "{err}"
    );
    names(&err, &p.name());
    drop(ps);
    retiring.wait_timeout(Duration::from_secs(10)).unwrap();

    // A backend error, then device loss, through the fault injector.
    let backend = FaultInjecting::new(
        NullContext::deferred(4),
        FaultPlan::new().nth(Operation::Write, 1, Fault::Error).nth(
            Operation::Write,
            2,
            Fault::DeviceLost,
        ),
    );
    let fgov = Governor::new();
    let f = fgov.register(backend, ContextConfig::new().label("faulty"));
    let fs = f.create_stream("s").unwrap();
    let fb = f.allocate(&fs, Alloc::new(64, Role::Other)).unwrap();
    let err = fb.write(0, b"x").unwrap_err();
    assert!(matches!(err, GovernorError::Backend { .. }), "{err}");
    names(&err, &f.name());
    let err = fb.write(0, b"x").unwrap_err();
    assert!(matches!(err, GovernorError::DeviceLost { .. }), "{err}");
    names(&err, &f.name());
    drop((fb, fs));

    // A buffer of a force-retired context: Reclaimed.
    let g = gov.register(host(), ContextConfig::new().label("forced"));
    let gs = g.create_stream("s").unwrap();
    let gb = g.allocate(&gs, Alloc::new(64, Role::Other)).unwrap();
    let handle = g.retire();
    handle.force(Instant::now()).unwrap();
    let err = gb.write(0, b"x").unwrap_err();
    assert!(matches!(err, GovernorError::Reclaimed { .. }), "{err}");
    names(&err, &g.name());

    // A retire that times out.
    let h = gov.register(host(), ContextConfig::new().label("busy-model"));
    let hs = h.create_stream("s").unwrap();
    let e = h.retire().wait(Instant::now()).unwrap_err();
    assert!(
        e.to_string().starts_with(&format!("context {}", h.name())),
        "{e}"
    );
    drop(hs);
}
