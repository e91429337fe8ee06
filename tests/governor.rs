//! The governor's policies, tested directly on the host backend: budgets
//! (per context and shared), pressure responders, deadline errors,
//! quarantine, device loss (declared and detected), pin refusal after retire,
//! pin overflow, concurrent retire, the async wait, and snapshots.

use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
use memgov::host::{HostConfig, HostContext, HostControls};
use memgov::null::NullContext;
use memgov::{
    Admission, Alloc, BackendError, BackendProbe, BudgetScope, ContextConfig, ContextHandle,
    ContextOperation, ContextState, DeviceContext, DeviceDescription, ForeignObject, Governor,
    GovernorError, MemoryInfo, PinKind, ProviderContextPinError, ReservationUsage, Reserve,
    RetireError, RetireSignal, Role, SharedBudget, Tier, Tuning,
};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// A host context's probe and fault knobs, kept together by these tests.
struct HostProbe {
    probe: BackendProbe,
    controls: HostControls,
}

impl HostProbe {
    fn of(c: &HostContext) -> Self {
        Self {
            probe: c.probe(),
            controls: c.controls(),
        }
    }
}

impl std::ops::Deref for HostProbe {
    type Target = BackendProbe;
    fn deref(&self) -> &BackendProbe {
        &self.probe
    }
}

fn host(capacity: u64) -> (HostContext, HostProbe) {
    let c = HostContext::new(HostConfig {
        capacity,
        ..HostConfig::default()
    })
    .unwrap();
    let p = HostProbe::of(&c);
    (c, p)
}

fn slow_host(delay: Duration) -> (HostContext, HostProbe) {
    let c = HostContext::new(HostConfig {
        op_delay: delay,
        ..HostConfig::default()
    })
    .unwrap();
    let p = HostProbe::of(&c);
    (c, p)
}

fn register(
    gov: &Governor<HostContext>,
    cfg: ContextConfig,
) -> (ContextHandle<HostContext>, HostProbe) {
    let (c, p) = host(1 << 30);
    (gov.register(c, cfg), p)
}

#[test]
fn shared_budget_limits_contexts_together() {
    let gov = Governor::new();
    let gpu0 = SharedBudget::new("gpu0", 3 * MIB);
    let (a, _) = register(
        &gov,
        ContextConfig::new()
            .label("a")
            .budget(2 * MIB)
            .shared_budget(gpu0.clone()),
    );
    let (b, _) = register(
        &gov,
        ContextConfig::new()
            .label("b")
            .budget(2 * MIB)
            .shared_budget(gpu0.clone()),
    );
    let sa = a.create_stream("s").unwrap();
    let sb = b.create_stream("s").unwrap();
    let x = a.allocate(&sa, Alloc::new(2 * MIB, Role::Weights)).unwrap();
    // b's own budget has room, the device's does not.
    let err = b
        .allocate(&sb, Alloc::new(2 * MIB, Role::Weights))
        .unwrap_err();
    let e = err.budget().expect("budget refusal");
    assert_eq!(e.scope, BudgetScope::Shared("gpu0".into()));
    assert_eq!(
        (e.requested, e.limit, e.available, e.live),
        (2 * MIB, 3 * MIB, MIB, 2 * MIB)
    );
    assert!(err.to_string().contains("shared budget 'gpu0'"), "{err}");
    // The context budget refuses first when it is the tighter one.
    let err = a.allocate(&sa, Alloc::new(MIB, Role::Weights)).unwrap_err();
    assert_eq!(err.budget().unwrap().scope, BudgetScope::Context);
    let y = b.allocate(&sb, Alloc::new(MIB, Role::Weights)).unwrap();
    assert_eq!(gpu0.charged(), 3 * MIB);
    drop((x, y));
    sa.synchronize().unwrap();
    sb.synchronize().unwrap();
    assert_eq!(gpu0.charged(), 0);
}

#[test]
fn pressure_responder_is_asked_once_then_retry() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("p").budget(4 * MIB));
    let s = ctx.create_stream("s").unwrap();
    let cache = Arc::new(std::sync::Mutex::new(vec![
        ctx.allocate(&s, Alloc::new(2 * MIB, Role::KvCache))
            .unwrap(),
        ctx.allocate(&s, Alloc::new(2 * MIB, Role::KvCache))
            .unwrap(),
    ]));
    let calls = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (c2, calls2, s2, r2) = (cache.clone(), calls.clone(), s.clone(), requests.clone());
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |req| {
        calls2.fetch_add(1, Ordering::SeqCst);
        r2.lock().unwrap().push(*req);
        let victim = c2.lock().unwrap().pop();
        let freed = victim.as_ref().map_or(0, |v| v.len());
        drop(victim);
        // Fail-fast admission retries at once; make the release retire first.
        s2.synchronize().unwrap();
        freed
    });
    let a = ctx
        .allocate(&s, Alloc::new(2 * MIB, Role::Activation))
        .expect("responder made room");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let first = requests.lock().unwrap()[0];
    assert_eq!(
        (first.requested, first.shortfall, first.role),
        (2 * MIB, 2 * MIB, Role::Activation)
    );
    // A responder that cannot help: one call, one retry, then the error says so.
    let err = ctx
        .allocate(&s, Alloc::new(3 * MIB, Role::Activation))
        .unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let second = requests.lock().unwrap()[1];
    assert_eq!(
        (second.requested, second.shortfall),
        (3 * MIB, 3 * MIB),
        "4 MiB charged + 3 MiB asked - 4 MiB limit"
    );
    let b = err.budget().unwrap();
    assert_eq!(b.reclaimed_by_responders, 2 * MIB, "{err}");
    assert!(
        err.to_string()
            .contains("pressure responders gave back 2.0 MiB (2097152 bytes)"),
        "{err}"
    );
    assert_eq!(ctx.snapshot().counters.pressure_calls, 2);
    drop(a);
}

#[test]
fn retiring_drops_pressure_responders_and_what_they_hold() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("r"));
    let s = ctx.create_stream("s").unwrap();
    let held = ctx.allocate(&s, Alloc::new(MIB, Role::KvCache)).unwrap();
    let stream = s.clone();
    // A responder that keeps a stream and a buffer of its own context: a
    // cycle through the context's record that only retiring can break.
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
        let _ = (&held, &stream);
        0
    });
    drop(s);
    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(5))
        .expect("retiring dropped the responder, its stream and its buffer");
    assert_eq!(report.retired_releases, 1);
}

#[test]
fn wait_for_pending_gives_up_at_its_timeout_with_numbers() {
    let gov = Governor::new();
    // The release's retirement is held until the end: the wait can only
    // time out, however the threads are scheduled.
    let device = memgov_conformance::Watched::new(slow_host(Duration::ZERO).0);
    let log = device.log();
    log.hold_retirements(true);
    let ctx = gov.register(
        device,
        ContextConfig::new()
            .budget(MIB)
            .admission(Admission::WaitForPending {
                timeout: Duration::from_millis(60),
            }),
    );
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap());
    let start = Instant::now();
    let err = ctx
        .allocate(&s, Alloc::new(MIB, Role::Weights))
        .unwrap_err();
    let waited = start.elapsed();
    let b = err.budget().unwrap();
    assert!(
        waited >= Duration::from_millis(55),
        "gave up after {waited:?}"
    );
    assert!(b.waited >= Duration::from_millis(55), "{b:?}");
    assert_eq!((b.pending, b.live), (MIB, 0));
    assert!(err.to_string().contains("after waiting"), "{err}");
    s.synchronize().unwrap();
    log.hold_retirements(false);
    assert_eq!(log.release_held(), 1);
    assert!(ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).is_ok());
}

/// A refusal speaks of waiting only when the allocation waited: never
/// under `FailFast`, not under `WaitForPending` when nothing was pending to
/// wait for, and with the time waited when it did wait.
#[test]
fn a_refusal_says_it_waited_only_when_it_did_under_each_admission_mode() {
    let refuse = |admission: Admission, pending: bool| {
        let gov = Governor::new();
        let device = memgov_conformance::Watched::new(slow_host(Duration::ZERO).0);
        let log = device.log();
        log.hold_retirements(true);
        let ctx = gov.register(
            device,
            ContextConfig::new().budget(MIB).admission(admission),
        );
        let s = ctx.create_stream("s").unwrap();
        let held = ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap();
        // Either the budget is held live (nothing pending to wait for) or
        // by a release whose retirement is held until the refusal.
        let live = if pending {
            drop(held);
            None
        } else {
            Some(held)
        };
        let err = ctx
            .allocate(&s, Alloc::new(MIB, Role::Weights))
            .unwrap_err();
        let b = err.budget().unwrap().clone();
        drop(live);
        s.synchronize().unwrap();
        log.hold_retirements(false);
        log.release_held();
        (b, err.to_string())
    };
    let wait = Admission::WaitForPending {
        timeout: Duration::from_millis(30),
    };
    for (mode, admission, pending) in [
        ("FailFast, held live", Admission::FailFast, false),
        ("FailFast, held pending", Admission::FailFast, true),
        ("WaitForPending, held live", wait, false),
    ] {
        let (b, msg) = refuse(admission, pending);
        assert_eq!(b.waited, Duration::ZERO, "{mode}: {b:?}");
        assert!(!msg.contains("waiting"), "{mode}: {msg}");
        assert!(msg.contains("cannot admit 1.0 MiB"), "{mode}: {msg}");
    }
    let (b, msg) = refuse(wait, true);
    assert!(b.waited >= Duration::from_millis(30), "{b:?}");
    assert!(msg.contains("after waiting"), "{msg}");
}

#[test]
fn a_request_over_a_limit_is_refused_at_once_without_waiting_or_asking() {
    let gov = Governor::new();
    let gpu0 = SharedBudget::new("gpu0", 3 * MIB);
    // A release held pending for the whole test: an admission that waited
    // for it would wait out the full 10 s timeout.
    let device = memgov_conformance::Watched::new(host(8 * MIB).0);
    let log = device.log();
    log.hold_retirements(true);
    let ctx = gov.register(
        device,
        ContextConfig::new()
            .budget(4 * MIB)
            .shared_budget(gpu0.clone())
            .admission(Admission::WaitForPending {
                timeout: Duration::from_secs(10),
            }),
    );
    let asked = Arc::new(AtomicU64::new(0));
    let asked2 = asked.clone();
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
        asked2.fetch_add(1, Ordering::Relaxed);
        0
    });
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap());
    // Over the context's limit, over the shared one, and over the device's
    // memory (both budgets raised past it).
    let cases = [
        (u64::MAX, BudgetScope::Context, 4 * MIB),
        (4 * MIB + 1, BudgetScope::Context, 4 * MIB),
        (3 * MIB + 1, BudgetScope::Shared("gpu0".into()), 3 * MIB),
    ];
    for (bytes, scope, limit) in cases {
        let err = ctx
            .allocate(&s, Alloc::new(bytes, Role::Weights))
            .unwrap_err();
        let b = err.budget().expect("budget refusal");
        assert_eq!((&b.scope, b.limit, b.requested), (&scope, limit, bytes));
        assert_eq!(b.waited, Duration::ZERO, "{err}");
        // The release is still pending: nothing waited for it.
        assert_eq!(b.pending, MIB, "{err}");
        let msg = err.to_string();
        assert!(msg.contains("can never fit"), "{msg}");
        assert!(
            msg.contains("raise the budget or split the allocation"),
            "{msg}"
        );
    }
    ctx.set_budget(Tier::Device, u64::MAX);
    gpu0.set_limit(u64::MAX);
    let err = ctx
        .allocate(&s, Alloc::new(8 * MIB + 1, Role::Weights))
        .unwrap_err();
    let b = err.budget().expect("budget refusal");
    assert_eq!(
        (&b.scope, b.limit, b.pending, b.waited),
        (&BudgetScope::Device, 8 * MIB, MIB, Duration::ZERO)
    );
    assert!(err.to_string().contains("can never fit"), "{err}");
    let snap = ctx.snapshot();
    assert_eq!(
        (
            snap.counters.admission_waits,
            snap.counters.pressure_calls,
            snap.counters.admission_refusals,
            asked.load(Ordering::Relaxed),
        ),
        (0, 0, 4, 0)
    );
    // The backend hands the release's retirement over from its worker
    // thread; it stays parked until fired here.
    eventually("the release's retirement parked", || log.held() == 1);
    log.hold_retirements(false);
    assert_eq!(log.release_held(), 1);
}

/// `ReleaseError::buffer` is `Some` exactly when nothing happened (another
/// context's stream): the buffer comes back live and charged. Once the
/// buffer was let go (the context forced) it is `None`, and the error says
/// where the memory went.
#[test]
fn a_release_error_hands_the_buffer_back_only_when_nothing_happened() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("mine"));
    let (other, _) = register(&gov, ContextConfig::new().label("other"));
    let (s, t) = (
        ctx.create_stream("s").unwrap(),
        other.create_stream("t").unwrap(),
    );
    let b = ctx.allocate(&s, Alloc::new(KIB, Role::Weights)).unwrap();
    let err = b.release_on(&t).unwrap_err();
    assert!(
        matches!(err.error, GovernorError::WrongContext { .. }),
        "{err}"
    );
    let b = err.buffer.expect("nothing happened: the buffer comes back");
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.role(Role::Weights).live_bytes, snap.charged),
        (KIB, KIB),
        "still live and charged"
    );
    ctx.retire().force(soon()).unwrap();
    let err = b.release_on(&s).unwrap_err();
    assert!(
        matches!(err.error, GovernorError::Reclaimed { .. }),
        "{err}"
    );
    assert!(err.buffer.is_none(), "reclaimed with the context: gone");
}

#[test]
fn quarantine_keeps_refused_memory_charged_until_termination() {
    let gov = Governor::new();
    let (ctx, probe) = register(&gov, ContextConfig::new().label("q").budget(8 * MIB));
    let s = ctx.create_stream("s").unwrap();
    let a = ctx
        .allocate(&s, Alloc::new(3 * MIB, Role::Activation))
        .unwrap();
    let b = ctx.allocate(&s, Alloc::new(MIB, Role::Workspace)).unwrap();
    probe.controls.refuse_next_frees(1);
    let err = a.release_on(&s).unwrap_err();
    assert!(err.buffer.is_none());
    assert!(matches!(err.error, GovernorError::Backend { .. }), "{err}");
    drop(b);
    s.synchronize().unwrap();
    let snap = ctx.snapshot();
    assert_eq!(snap.role(Role::Activation).quarantined_bytes, 3 * MIB);
    assert_eq!(snap.role(Role::Activation).quarantined_count, 1);
    assert_eq!(snap.charged, 3 * MIB, "quarantined memory stays charged");
    assert_eq!(snap.quarantine.len(), 1);
    assert!(
        snap.quarantine[0].reason.contains("free refused"),
        "{:?}",
        snap.quarantine
    );
    assert_eq!(snap.counters.quarantined, 1);
    // It does not hold the context: retire completes and frees it.
    drop(s);
    let report = ctx.retire().wait(soon()).unwrap();
    assert_eq!(report.quarantined_bytes, 3 * MIB);
    let snap = ctx.snapshot();
    assert_eq!((snap.charged, snap.total().quarantined_bytes), (0, 0));
    assert_eq!(probe.violations(), 0);
    assert_eq!(probe.used_bytes(), 0);
}

#[test]
fn backend_reported_loss_marks_the_context_lost() {
    // The null backend parks the free's signal (no clock involved: it stays
    // pending until retired by hand, which never happens here), and the
    // fault injector makes the backend itself report loss on the first write.
    let null = NullContext::deferred(4);
    let (probe, parked) = (null.probe(), null.controls());
    let backend = FaultInjecting::new(
        null,
        FaultPlan::new().nth(Operation::Write, 1, Fault::DeviceLost),
    );
    let faults = backend.control();
    let gov = Governor::new();
    let ctx = gov.register(backend, ContextConfig::new().label("l"));
    let s = ctx.create_stream("s").unwrap();
    let live = ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap();
    drop(ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap()); // parked: pending
    assert_eq!(parked.parked_count(), 1);
    let err = live.write(0, b"x").unwrap_err();
    assert!(matches!(err, GovernorError::DeviceLost { .. }), "{err}");
    assert!(faults.is_lost());
    assert_eq!(ctx.lifecycle(), ContextState::Lost);
    assert!(ctx.snapshot().lost_reason.unwrap().contains("lost"));
    let err = ctx
        .allocate(&s, Alloc::new(MIB, Role::Weights))
        .unwrap_err();
    assert!(matches!(err, GovernorError::DeviceLost { .. }), "{err}");
    assert!(err.to_string().contains("register a new one"), "{err}");
    assert!(matches!(
        ctx.pin_source(None).pin(),
        Err(ProviderContextPinError::ContextUnavailable(_))
    ));
    drop((live, s));
    let report = ctx.retire().wait(soon()).unwrap();
    assert!(report.lost);
    let snap = ctx.snapshot();
    assert_eq!(snap.charged, 0);
    assert_eq!(snap.counters.settled_lost, 1);
    assert_eq!(
        snap.counters.abandoned, 1,
        "the pending free was given up, not executed"
    );
    assert_eq!(
        probe.frees_retired(),
        0,
        "no free executed on the lost device"
    );
    assert_eq!(probe.violations(), 0);
    assert_eq!(
        parked.parked_count(),
        0,
        "teardown dropped the parked signal"
    );
    assert!(probe.torn_down());
}

#[test]
fn a_loss_first_seen_by_the_backends_teardown_is_reported_as_lost() {
    // The context is healthy until its teardown, whose first call the driver
    // answers with a device-lost error (a sticky error nobody had seen).
    let (backend, _probe) = host(64 * MIB);
    let backend = FaultInjecting::new(
        backend,
        FaultPlan::new().nth(Operation::Teardown, 1, Fault::DeviceLost),
    );
    let gov = Governor::new();
    let ctx = gov.register(backend, ContextConfig::new().label("l"));
    let s = ctx.create_stream("s").unwrap();
    ctx.allocate(&s, Alloc::new(MIB, Role::Weights))
        .unwrap()
        .release_on(&s)
        .unwrap();
    drop(s);
    assert_eq!(ctx.lifecycle(), ContextState::Active);
    let report = ctx.retire().wait(soon()).unwrap();
    assert!(
        matches!(&report.backend_result, Err(e) if e.is_device_lost()),
        "{report:?}"
    );
    assert!(
        report.lost,
        "the report must say the device was lost: {report:?}"
    );
    assert!(report.lost_in_teardown, "{report:?}");
    assert_eq!(report.retired_releases, 1);
    assert_eq!(ctx.snapshot().charged, 0);

    // A loss declared before teardown is not one the teardown found.
    let (backend, _probe) = host(64 * MIB);
    let ctx = gov.register(
        FaultInjecting::new(backend, FaultPlan::new()),
        ContextConfig::new(),
    );
    assert!(ctx.mark_lost("test: declared by the caller"));
    let report = ctx.retire().wait(soon()).unwrap();
    assert!(report.lost && !report.lost_in_teardown, "{report:?}");
}

#[test]
fn pin_overflow_is_refused_not_wrapped() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().max_pins(3));
    let s = ctx.create_stream("s").unwrap(); // 1
    let p1 = ctx.pin().unwrap(); // 2
    let src = ctx.pin_source(Some("x"));
    let p2 = src.pin().unwrap(); // 3
    assert_eq!(
        src.pin().unwrap_err(),
        ProviderContextPinError::PinCountOverflow(ctx.id())
    );
    let err = ctx.allocate(&s, Alloc::new(4096, Role::Other)).unwrap_err();
    assert_eq!(
        err.pin_refusal(),
        Some(ProviderContextPinError::PinCountOverflow(ctx.id()))
    );
    assert!(err.to_string().contains("too many outstanding pins"));
    assert_eq!(ctx.snapshot().pins.total(), 3);
    drop(p1);
    let b = ctx.allocate(&s, Alloc::new(4096, Role::Other)).unwrap();
    drop((b, p2));
    s.synchronize().unwrap();
    assert_eq!(ctx.snapshot().pins.total(), 1);
}

#[test]
fn pins_refused_after_retire_and_existing_pins_hold_teardown() {
    let gov = Governor::new();
    let (ctx, probe) = register(&gov, ContextConfig::new().label("r"));
    let src = ctx.pin_source(Some("ep"));
    let held = src.pin().unwrap();
    assert_eq!(held.context(), ctx.id());
    let h = ctx.retire();
    assert_eq!(
        src.pin().unwrap_err(),
        ProviderContextPinError::ContextUnavailable(ctx.id())
    );
    assert!(ctx.pin().is_err());
    let err = h.try_finish().unwrap_err();
    let RetireError::Outstanding {
        outstanding,
        waited,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(*waited, Duration::ZERO);
    assert_eq!(outstanding.items.len(), 1);
    assert_eq!(outstanding.items[0].kind, PinKind::External);
    assert_eq!(outstanding.items[0].holder.as_deref(), Some("ep"));
    assert_eq!(probe.teardowns(), 0);
    drop(held);
    h.try_finish().unwrap();
    assert_eq!(probe.teardowns(), 1);
}

/// A refusal because the context retired says what retired it: the drop
/// of its `Governor` (which a caller may not know retires every context)
/// or `ContextHandle::retire`.
#[test]
fn a_refusal_after_retire_names_what_retired_the_context() {
    use memgov::RetiredBy;
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("outlived"));
    let s = ctx.create_stream("s").unwrap();
    drop(gov);
    let err = ctx
        .allocate(&s, Alloc::new(KIB, Role::Weights))
        .unwrap_err();
    assert!(
        matches!(
            err,
            GovernorError::Pin {
                refusal: ProviderContextPinError::ContextUnavailable(_),
                retired_by: Some(RetiredBy::GovernorDropped),
                ..
            }
        ),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("'outlived'") && text.contains("its Governor was dropped"),
        "{text}"
    );
    let err = ctx.create_stream("late").unwrap_err();
    assert!(
        err.to_string().contains("its Governor was dropped"),
        "{err}"
    );
    drop(s);

    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("retired"));
    let s = ctx.create_stream("s").unwrap();
    let retire = ctx.retire();
    let err = ctx
        .allocate(&s, Alloc::new(KIB, Role::Weights))
        .unwrap_err();
    assert!(
        matches!(
            err,
            GovernorError::Pin {
                retired_by: Some(RetiredBy::Retire),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("retired by ContextHandle::retire"),
        "{err}"
    );
    // A governor dropped after the retire does not rename it.
    drop(gov);
    let err = ctx
        .allocate(&s, Alloc::new(KIB, Role::Weights))
        .unwrap_err();
    assert!(
        err.to_string().contains("retired by ContextHandle::retire"),
        "{err}"
    );
    drop(s);
    retire.wait(soon()).unwrap();
}

/// A teardown report reads as one line for a log: what retired, what was
/// abandoned or reclaimed, what the backend said.
#[test]
fn a_teardown_report_displays_what_the_teardown_did() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("shown"));
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(KIB, Role::Weights)).unwrap());
    drop(s);
    let report = ctx.retire().wait(soon()).unwrap();
    let text = report.to_string();
    assert!(
        text.starts_with(&format!("context {} 'shown' torn down in ", ctx.id()))
            && text.contains(": 1 release retired; the backend's teardown returned Ok"),
        "{text}"
    );
    assert!(
        !text.contains("forced") && !text.contains("abandoned"),
        "{text}"
    );

    let gov = Governor::new();
    let (backend, arm) = Panicky::new(NullContext::new());
    let ctx = gov.register(backend, ContextConfig::new().label("forced"));
    let s = ctx.create_stream("s").unwrap();
    let held = [
        ctx.allocate(&s, Alloc::new(KIB, Role::Weights)).unwrap(),
        ctx.allocate(&s, Alloc::new(KIB, Role::KvCache)).unwrap(),
    ];
    arm.teardown.store(true, Ordering::SeqCst);
    let err = ctx.retire().force(soon()).unwrap_err();
    let RetireError::TeardownPanicked { report, .. } = &err else {
        panic!("{err}")
    };
    let text = report.as_deref().unwrap().to_string();
    assert!(
        text.contains("'forced' torn down in ")
            && text.contains(", forced: 0 releases retired, 2 live buffers reclaimed by force")
            && text.contains(
                "returned at teardown: 0 bytes quarantined, 2.0 KiB (2048 bytes) awaiting teardown"
            )
            && text.contains("the backend's teardown failed:")
            && text.contains("backend teardown panicked"),
        "{text}"
    );
    drop(held);
}

#[test]
fn concurrent_retire_tears_down_once() {
    let gov = Governor::new();
    let (c, probe) = slow_host(Duration::from_millis(5));
    let ctx = gov.register(c, ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    for _ in 0..20 {
        drop(ctx.allocate(&s, Alloc::new(4096, Role::Other)).unwrap());
    }
    drop(s);
    let reports: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|_| sc.spawn(|| ctx.retire().wait(soon()).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        reports.windows(2).all(|w| w[0] == w[1]),
        "every retirer gets the same report"
    );
    assert_eq!(reports[0].retired_releases, 20);
    assert_eq!(probe.teardowns(), 1);
    assert_eq!(probe.violations(), 0);
}

#[test]
fn release_on_a_stream_of_another_context_gives_the_buffer_back() {
    let gov = Governor::new();
    let (a, _) = register(&gov, ContextConfig::new().label("a"));
    let (b, _) = register(&gov, ContextConfig::new().label("b"));
    let sa = a.create_stream("sa").unwrap();
    let sb = b.create_stream("sb").unwrap();
    let buf = a.allocate(&sa, Alloc::new(4096, Role::Other)).unwrap();
    let err = buf.release_on(&sb).unwrap_err();
    assert_eq!(
        err.error,
        GovernorError::WrongContext {
            operation: ContextOperation::ReleaseOn,
            context: a.name(),
            passed: ForeignObject::Stream { label: "sb".into() },
            passed_context: b.name(),
        }
    );
    let buf = err.buffer.expect("buffer handed back");
    buf.write(0, b"still mine").unwrap();
    assert_eq!(a.snapshot().total().live_count, 1);
    buf.release_on(&sa).unwrap();
    let err = a.allocate(&sb, Alloc::new(4096, Role::Other)).unwrap_err();
    assert!(matches!(err, GovernorError::WrongContext { .. }), "{err}");
}

#[test]
fn async_finished_completes_when_the_last_release_retires() {
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::AtomicBool;
    use std::task::{Context, Poll, Wake, Waker};

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let gov = Governor::new();
    let (c, _) = slow_host(Duration::from_millis(30));
    let ctx = gov.register(c, ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(4096, Role::Other)).unwrap());
    let h = ctx.retire();
    let flag = Arc::new(Flag(AtomicBool::new(false)));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(h.finished());
    assert!(fut.as_mut().poll(&mut cx).is_pending());
    drop(s); // destroying the stream lets its queued free run first
             // No polling loop: sleep until the waker fires.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !flag.0.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "waker never fired");
        std::thread::sleep(Duration::from_millis(1));
    }
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(r) => assert_eq!(r.unwrap().retired_releases, 1),
        Poll::Pending => panic!("woken but not ready"),
    }
}

#[test]
fn snapshots_account_by_role_and_state() {
    let gov = Governor::new();
    // Frees park in the null backend until their stream synchronizes: the
    // pending state lasts exactly as long as the test needs, on any clock.
    let null = NullContext::deferred(4);
    let parked = null.controls();
    let ctx = gov.register(null, ContextConfig::new().label("snap").budget(64 * MIB));
    let s = ctx.create_stream("s").unwrap();
    let w = ctx
        .allocate(&s, Alloc::new(8 * MIB, Role::Weights))
        .unwrap();
    let k1 = ctx
        .allocate(&s, Alloc::new(2 * MIB, Role::KvCache))
        .unwrap();
    let k2 = ctx
        .allocate(&s, Alloc::new(2 * MIB, Role::KvCache))
        .unwrap();
    drop(k1); // parked: pending until `synchronize`
    assert_eq!(parked.parked_count(), 1);
    let snap = ctx.snapshot();
    assert_eq!(snap.role(Role::Weights).live_bytes, 8 * MIB);
    assert_eq!(snap.role(Role::KvCache).live_bytes, 2 * MIB);
    assert_eq!(snap.role(Role::KvCache).pending_bytes, 2 * MIB);
    assert_eq!(snap.charged, 12 * MIB);
    assert_eq!(snap.peak, 12 * MIB);
    assert_eq!(snap.pins.streams, 1);
    assert_eq!(snap.pins.buffers, 2);
    assert_eq!(snap.pins.pending_releases, 1);
    assert_eq!(snap.counters.allocations, 3);
    assert_eq!(snap.lifecycle, ContextState::Active);
    assert_eq!(snap.budget_limit, 64 * MIB);
    let all = gov.snapshot();
    assert_eq!(all.contexts.len(), 1);
    assert_eq!(all.total().live_bytes, 10 * MIB);
    drop((w, k2));
    s.synchronize().unwrap();
    assert_eq!(parked.parked_count(), 0);
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.charged, snap.peak, snap.counters.retired),
        (0, 12 * MIB, 3)
    );
}

#[test]
fn host_backend_reports_out_of_memory_like_a_driver() {
    let gov = Governor::new();
    let (c, _) = host(4 * MIB);
    let ctx = gov.register(c, ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    let a = ctx
        .allocate(&s, Alloc::new(3 * MIB, Role::Weights))
        .unwrap();
    let err = ctx
        .allocate(&s, Alloc::new(2 * MIB, Role::Weights))
        .unwrap_err();
    let b = err
        .budget()
        .expect("device refusal is reported with numbers");
    assert_eq!(b.scope, BudgetScope::Device);
    assert_eq!((b.requested, b.limit, b.available), (2 * MIB, 4 * MIB, MIB));
    // The driver's own words are kept.
    let driver = b.driver.as_ref().expect("the driver's error is kept");
    assert_eq!(driver.kind, memgov::BackendErrorKind::OutOfMemory);
    assert!(
        err.to_string()
            .contains("the driver said: host allocate failed"),
        "{err}"
    );
    drop(a);
}

#[test]
fn dropping_the_governor_and_every_holder_still_tears_down() {
    let (c, probe) = slow_host(Duration::from_millis(20));
    let gov = Governor::new();
    let ctx = gov.register(c, ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(64 * KIB, Role::Other)).unwrap());
    drop((s, ctx, gov));
    // The last pending release retires on the stream worker; teardown then
    // runs on a reaper thread, never on the worker itself.
    let deadline = Instant::now() + Duration::from_secs(10);
    while probe.teardowns() == 0 {
        assert!(Instant::now() < deadline, "context never torn down");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(probe.teardowns(), 1);
    assert_eq!(probe.violations(), 0);
}

#[test]
fn zero_sized_allocations_are_refused() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    let err = ctx.allocate(&s, Alloc::new(0, Role::Weights)).unwrap_err();
    assert_eq!(
        err,
        GovernorError::ZeroSized {
            context: ctx.name(),
            role: Role::Weights
        }
    );
    assert_eq!(
        ctx.snapshot().pins.total(),
        1,
        "a refused allocation leaves no pin behind"
    );
}

#[cfg(feature = "serde")]
#[test]
fn snapshots_serialize() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("json"));
    let s = ctx.create_stream("s").unwrap();
    let _b = ctx.allocate(&s, Alloc::new(4096, Role::KvCache)).unwrap();
    let json = serde_json::to_value(gov.snapshot()).unwrap();
    let c = &json["contexts"][0];
    assert_eq!(c["label"], "json");
    assert_eq!(c["lifecycle"], "active");
    assert_eq!(c["by_role"][1]["live_bytes"], 4096);
    assert_eq!(c["context"], ctx.id().to_string());
}

#[test]
fn force_races_with_allocations_and_releases_without_leaking_pins() {
    // The force lands 2 to 6 ms into the race (`round % 5`). Under Miri,
    // where each round takes seconds, five rounds give each of those five
    // points one round; natively, four each.
    let rounds = if cfg!(miri) { 5 } else { 20 };
    for round in 0..rounds {
        let gov = Governor::new();
        let (c, probe) = host(1 << 30);
        let ctx = gov.register(c, ContextConfig::new().label("race"));
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            for t in 0..3 {
                let ctx = &ctx;
                let stop = &stop;
                sc.spawn(move || {
                    let Ok(s) = ctx.create_stream(format!("t{t}")) else {
                        return;
                    };
                    let mut live = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        match ctx.allocate(&s, Alloc::new(4096, Role::Activation)) {
                            Ok(b) => {
                                let _ = b.write(0, b"data");
                                live.push(b);
                                if live.len() > 3 {
                                    drop(live.remove(0));
                                }
                            }
                            Err(_) => break,
                        }
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(2 + round % 5));
            let report = ctx
                .retire()
                .force(soon())
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert!(report.forced);
            stop.store(true, Ordering::Relaxed);
        });
        let snap = ctx.snapshot();
        assert_eq!(snap.lifecycle, ContextState::Terminated, "round {round}");
        assert_eq!(
            (snap.charged, snap.total().live_count, snap.pins.total()),
            (0, 0, 0),
            "round {round}: {snap:?}"
        );
        assert_eq!(probe.teardowns(), 1);
        assert_eq!(
            probe.violations(),
            0,
            "round {round}: {:?}",
            probe.violation_log()
        );
    }
}

#[test]
fn pending_bytes_on_a_stream_are_credited_where_the_backend_reuses_them() {
    use memgov::null::{NullConfig, NullContext};
    let backend = NullContext::with_config(NullConfig {
        deferred: true,
        stream_ordered_reuse: true,
        ..NullConfig::default()
    });
    let probe = backend.controls();
    let gov = Governor::new();
    let ctx = gov.register(backend, ContextConfig::new().budget(MIB));
    let a = ctx.create_stream("a").unwrap();
    let b = ctx.create_stream("b").unwrap();
    drop(ctx.allocate(&a, Alloc::new(MIB, Role::KvCache)).unwrap()); // parked: pending on `a`
    assert_eq!(ctx.snapshot().role(Role::KvCache).pending_bytes, MIB);
    // Another stream cannot reuse `a`'s pending free: refused with the numbers.
    let err = ctx
        .allocate(&b, Alloc::new(MIB, Role::KvCache))
        .unwrap_err();
    assert_eq!(
        err.budget().map(|e| (e.pending, e.available)),
        Some((MIB, 0)),
        "{err}"
    );
    // The same stream can: the pool hands the freed bytes to work ordered after the free.
    let again = ctx
        .allocate(&a, Alloc::new(MIB, Role::KvCache))
        .expect("credited on the same stream");
    assert_eq!(
        ctx.snapshot().charged,
        2 * MIB,
        "charged in full until the free retires"
    );
    assert_eq!(probe.retire_parked(), 1);
    assert_eq!(ctx.snapshot().charged, MIB);
    drop(again);
    probe.retire_parked();
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn a_pending_pinned_release_is_no_credit_for_device_memory() {
    use memgov::null::{NullConfig, NullContext};
    use memgov::Tier;
    // Stream-ordered reuse hands device memory freed on a stream to the
    // device allocations after it; a pinned host free returns no device
    // memory, so it must not be credited to them.
    let backend = NullContext::with_config(NullConfig {
        deferred: true,
        stream_ordered_reuse: true,
        ..NullConfig::default()
    });
    let probe = backend.controls();
    let gov = Governor::new();
    let ctx = gov.register(backend, ContextConfig::new().budget(MIB));
    let a = ctx.create_stream("a").unwrap();
    let device = ctx.allocate(&a, Alloc::new(MIB, Role::Weights)).unwrap();
    let pinned = ctx
        .allocate(&a, Alloc::new(MIB, Role::Other).tier(Tier::PinnedHost))
        .unwrap();
    assert_eq!(pinned.tier(), Tier::PinnedHost);
    drop(pinned); // parked: pending on `a`, in the pinned tier
    let snap = ctx.snapshot();
    let host = snap.tier(Tier::PinnedHost).unwrap();
    assert_eq!((host.pending_bytes, snap.charged), (MIB, MIB), "{snap:?}");
    // The device budget is full; the pending pinned MiB on the same stream
    // is no room for device memory.
    let err = ctx
        .allocate(&a, Alloc::new(4096, Role::Activation))
        .unwrap_err();
    assert_eq!(
        err.budget().map(|e| (e.live, e.pending, e.available)),
        Some((MIB, 0, 0)),
        "{err}"
    );
    assert_eq!(probe.retire_parked(), 1);
    drop(device);
    probe.retire_parked();
    let snap = ctx.snapshot();
    assert_eq!(snap.charged, 0);
    assert_eq!(snap.tier(Tier::PinnedHost).unwrap().charged, 0);
}

/// A `tracing` subscriber that records every event as `name=value` pairs
/// (the message included), for the tests that check which events fire.
#[cfg(feature = "tracing")]
mod events {
    use std::sync::{Arc, Mutex};
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    pub struct Recorder(pub Arc<Mutex<Vec<String>>>);

    struct Fields<'a>(&'a mut String);
    impl Visit for Fields<'_> {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!("{}={value:?} ", field.name()));
        }
    }

    impl Subscriber for Recorder {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, e: &Event<'_>) {
            let mut m = String::new();
            e.record(&mut Fields(&mut m));
            self.0.lock().unwrap().push(m);
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }
}

#[cfg(feature = "tracing")]
#[test]
fn tracing_events_for_retire_teardown_loss_and_quarantine() {
    use std::sync::Mutex;

    let seen = Arc::new(Mutex::new(Vec::new()));
    tracing::subscriber::with_default(events::Recorder(seen.clone()), || {
        let gov = Governor::new();
        let (ctx, probe) = register(&gov, ContextConfig::new());
        let s = ctx.create_stream("s").unwrap();
        let b = ctx.allocate(&s, Alloc::new(4096, Role::Other)).unwrap();
        probe.controls.refuse_next_frees(1);
        drop(b);
        ctx.mark_lost("test");
        drop(s);
        ctx.retire().wait(soon()).unwrap();
    });
    let seen = seen.lock().unwrap().join("\n");
    for needle in [
        "quarantined",
        "device lost",
        "retiring context",
        "torn down",
    ] {
        assert!(seen.contains(needle), "no '{needle}' event in:\n{seen}");
    }
}

// ---------------------------------------------------------------------------
// Liveness and accounting under panics, force, loss and background teardown.
// ---------------------------------------------------------------------------

/// Which operations of a [`Panicky`] backend panic, once each.
#[derive(Default)]
struct Arming {
    allocate: AtomicBool,
    create_stream: AtomicBool,
    destroy_stream: AtomicBool,
    free_async: AtomicBool,
    synchronize: AtomicBool,
    teardown: AtomicBool,
}

fn fire(flag: &AtomicBool, op: &str) {
    if flag.swap(false, Ordering::SeqCst) {
        panic!("backend {op} panicked");
    }
}

/// A backend whose armed operations panic (once each), as a buggy driver
/// binding or a plugin's backend might.
struct Panicky<C> {
    inner: C,
    arm: Arc<Arming>,
}

impl<C> Panicky<C> {
    fn new(inner: C) -> (Self, Arc<Arming>) {
        let arm = Arc::new(Arming::default());
        (
            Self {
                inner,
                arm: arm.clone(),
            },
            arm,
        )
    }
}

impl<C: DeviceContext> DeviceContext for Panicky<C> {
    type Stream = C::Stream;
    type Memory = C::Memory;
    fn describe(&self) -> DeviceDescription {
        self.inner.describe()
    }
    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.inner.memory_info()
    }
    fn create_stream(&self) -> Result<C::Stream, BackendError> {
        fire(&self.arm.create_stream, "create_stream");
        self.inner.create_stream()
    }
    fn destroy_stream(&self, s: C::Stream) -> Result<(), BackendError> {
        fire(&self.arm.destroy_stream, "destroy_stream");
        self.inner.destroy_stream(s)
    }
    fn allocate(&self, s: &C::Stream, bytes: u64) -> Result<C::Memory, BackendError> {
        fire(&self.arm.allocate, "allocate");
        self.inner.allocate(s, bytes)
    }
    fn free_async(
        &self,
        s: &C::Stream,
        m: C::Memory,
        r: RetireSignal,
    ) -> Result<(), (C::Memory, RetireSignal, BackendError)> {
        fire(&self.arm.free_async, "free_async");
        self.inner.free_async(s, m, r)
    }
    fn write(&self, s: &C::Stream, m: &C::Memory, o: u64, b: &[u8]) -> Result<(), BackendError> {
        self.inner.write(s, m, o, b)
    }
    fn read(&self, s: &C::Stream, m: &C::Memory, o: u64, b: &mut [u8]) -> Result<(), BackendError> {
        self.inner.read(s, m, o, b)
    }
    fn synchronize(&self, s: &C::Stream) -> Result<(), BackendError> {
        fire(&self.arm.synchronize, "synchronize");
        self.inner.synchronize(s)
    }
    fn device_lost(&self) {
        self.inner.device_lost()
    }
    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        fire(&self.arm.teardown, "teardown");
        self.inner.teardown(lost)
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_panicking_pressure_responder_reaches_the_caller_and_leaks_no_pin() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("panicky").budget(MIB));
    let s = ctx.create_stream("s").unwrap();
    let held = ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap();
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, |_| {
        panic!("responder failed")
    });
    let caught = catch_unwind(AssertUnwindSafe(|| {
        ctx.allocate(&s, Alloc::new(MIB, Role::Weights))
    }));
    let payload = caught.expect_err("the responder's panic reaches the caller of allocate");
    assert_eq!(panic_message(&*payload), "responder failed");
    let snap = ctx.snapshot();
    assert_eq!(
        (snap.charged, snap.pins.other, snap.counters.pressure_calls),
        (MIB, 0, 1),
        "the refused allocation left no charge and no pin behind"
    );
    drop((held, s));
    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(5))
        .expect("no pin leaked: the context tears down");
    assert_eq!(report.retired_releases, 1);
}

#[test]
fn a_backend_panicking_mid_call_leaks_no_pin_and_no_charge() {
    let gov = Governor::new();
    let (backend, arm) = Panicky::new(NullContext::new());
    let gpu0 = SharedBudget::new("gpu0", 8 * MIB);
    let ctx = gov.register(backend, ContextConfig::new().shared_budget(gpu0.clone()));
    arm.create_stream.store(true, Ordering::SeqCst);
    let p = catch_unwind(AssertUnwindSafe(|| ctx.create_stream("s"))).unwrap_err();
    assert_eq!(panic_message(&*p), "backend create_stream panicked");
    let s = ctx.create_stream("s").unwrap();
    arm.allocate.store(true, Ordering::SeqCst);
    let p = catch_unwind(AssertUnwindSafe(|| {
        ctx.allocate(&s, Alloc::new(MIB, Role::Weights))
    }))
    .unwrap_err();
    assert_eq!(panic_message(&*p), "backend allocate panicked");
    assert_eq!((gpu0.charged(), ctx.snapshot().charged), (0, 0));
    arm.free_async.store(true, Ordering::SeqCst);
    let b = ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap();
    let p = catch_unwind(AssertUnwindSafe(|| drop(b))).unwrap_err();
    assert_eq!(panic_message(&*p), "backend free_async panicked");
    arm.destroy_stream.store(true, Ordering::SeqCst);
    let p = catch_unwind(AssertUnwindSafe(|| drop(s))).unwrap_err();
    assert_eq!(panic_message(&*p), "backend destroy_stream panicked");
    let snap = ctx.snapshot();
    assert_eq!(snap.pins.total(), 0, "{:?}", snap.pins);
    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(5))
        .expect("every pin was released while unwinding");
    assert_eq!(report.abandoned_releases, 1, "the dropped signal settled");
    assert_eq!((gpu0.charged(), ctx.snapshot().charged), (0, 0));
}

#[test]
fn background_teardown_returns_quarantined_bytes_to_the_shared_budget() {
    let gpu0 = SharedBudget::new("gpu0", 8 * MIB);
    let (c, probe) = host(1 << 30);
    let gov = Governor::new();
    let ctx = gov.register(c, ContextConfig::new().shared_budget(gpu0.clone()));
    let s = ctx.create_stream("s").unwrap();
    let a = ctx
        .allocate(&s, Alloc::new(3 * MIB, Role::Activation))
        .unwrap();
    probe.controls.refuse_next_frees(1);
    assert!(a.release_on(&s).is_err());
    assert_eq!(
        gpu0.charged(),
        3 * MIB,
        "quarantined: charged until teardown"
    );
    // Nobody waits: the retire handle, the context handle and the governor go
    // first; the stream's drop lets the context tear down in the background.
    drop(ctx.retire());
    drop((ctx, gov));
    drop(s);
    eventually("background teardown", || probe.teardowns() == 1);
    eventually("quarantined bytes returned to the shared budget", || {
        gpu0.charged() == 0
    });
}

#[test]
fn force_returns_charges_once_teardown_has_freed_the_memory() {
    let gpu0 = SharedBudget::new("gpu0", 2 * MIB);
    let gov = Governor::new();
    let a = gov.register(
        NullContext::deferred(4),
        ContextConfig::new().label("a").shared_budget(gpu0.clone()),
    );
    let b_device = NullContext::deferred(4);
    let b_parked = b_device.controls();
    let b = gov.register(
        b_device,
        ContextConfig::new().label("b").shared_budget(gpu0.clone()),
    );
    let sa = a.create_stream("sa").unwrap();
    let live = a.allocate(&sa, Alloc::new(MIB, Role::Weights)).unwrap();
    let plugin = a.pin_source(Some("plugin")).pin().unwrap();
    let handle = a.retire();
    let err = handle
        .force(Instant::now() + Duration::from_millis(20))
        .unwrap_err();
    assert!(err.to_string().contains("external pin"), "{err}");
    // The reclaimed megabyte is still allocated on the device: it stays
    // charged until teardown frees it.
    assert_eq!(gpu0.charged(), MIB);
    let sb = b.create_stream("sb").unwrap();
    let refused = b
        .allocate(&sb, Alloc::new(2 * MIB, Role::Weights))
        .unwrap_err();
    assert!(
        matches!(
            refused.budget().map(|x| &x.scope),
            Some(BudgetScope::Shared(_))
        ),
        "{refused}"
    );
    drop(plugin);
    handle.wait(soon()).unwrap();
    assert_eq!(gpu0.charged(), 0);
    let fits = b.allocate(&sb, Alloc::new(2 * MIB, Role::Weights)).unwrap();
    drop((fits, live, sa, sb));
    b_parked.retire_parked();
    b.retire().wait(soon()).unwrap();
    assert_eq!(gpu0.charged(), 0);
}

#[test]
fn a_lost_device_keeps_its_bytes_charged_until_teardown() {
    let gpu0 = SharedBudget::new("gpu0", 8 * MIB);
    let gov = Governor::new();
    let null = NullContext::deferred(4);
    let probe = null.probe();
    let ctx = gov.register(null, ContextConfig::new().shared_budget(gpu0.clone()));
    let s = ctx.create_stream("s").unwrap();
    let live = ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap();
    drop(ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap()); // parked: pending
    assert!(ctx.mark_lost("test: device fell off the bus"));
    drop(live); // settles at once, without calling the device
    assert_eq!(
        gpu0.charged(),
        2 * MIB,
        "the device has neither megabyte back until the context is destroyed"
    );
    drop(s);
    let report = ctx.retire().wait(soon()).unwrap();
    assert!(report.lost);
    assert_eq!((report.settled_lost, report.abandoned_releases), (1, 1));
    assert_eq!((gpu0.charged(), ctx.snapshot().charged), (0, 0));
    assert_eq!(probe.frees_retired(), 0);
}

#[test]
fn retire_cuts_an_admission_wait_short() {
    let gov = Governor::new();
    let null = NullContext::deferred(4);
    let probe = null.controls();
    let ctx = gov.register(
        null,
        ContextConfig::new()
            .budget(MIB)
            .admission(Admission::WaitForPending {
                timeout: Duration::from_secs(60),
            }),
    );
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap()); // parked: pending
    let (tx, rx) = std::sync::mpsc::channel();
    let (c2, s2) = (ctx.clone(), s.clone());
    std::thread::spawn(move || {
        let _ = tx.send(c2.allocate(&s2, Alloc::new(MIB, Role::Weights)).map(|_| ()));
    });
    eventually("the allocation waits", || {
        ctx.snapshot().counters.admission_waits == 1
    });
    let handle = ctx.retire();
    let result = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("retire woke the admission waiter");
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            GovernorError::Pin {
                refusal: ProviderContextPinError::ContextUnavailable(_),
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("no longer accepting work"),
        "{err}"
    );
    assert_eq!(ctx.snapshot().pins.other, 0, "the waiter's pin is gone");
    drop(s);
    // Only the pending release holds the context now: force waits for it.
    probe.retire_parked();
    let report = handle
        .force(Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(report.retired_releases, 1);
}

#[test]
fn governor_snapshot_total_saturates() {
    let gov = Governor::new();
    let a = gov.register(NullContext::new(), ContextConfig::new());
    let b = gov.register(NullContext::new(), ContextConfig::new());
    let (sa, sb) = (a.create_stream("a").unwrap(), b.create_stream("b").unwrap());
    let x = a.allocate(&sa, Alloc::new(1 << 63, Role::Weights)).unwrap();
    let y = b.allocate(&sb, Alloc::new(1 << 63, Role::Weights)).unwrap();
    let total = gov.snapshot().total();
    assert_eq!((total.live_bytes, total.live_count), (u64::MAX, 2));
    drop((x, y, sa, sb));
}

/// Block on `f` on this thread, parked between polls: no polling loop.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// Every way of waiting for a teardown, each on a thread of its own with a
/// handle of its own, released together by a barrier once the context has
/// drained (so they race for the teardown): what each got, or `None` for a
/// waiter that did not answer (hung) or panicked.
fn race_every_waiter<C: DeviceContext>(
    ctx: &ContextHandle<C>,
) -> Vec<(
    &'static str,
    Option<Result<memgov::TeardownReport, RetireError>>,
)>
where
    C::Memory: Send,
{
    type Wait<C> = fn(&memgov::RetireHandle<C>) -> Result<memgov::TeardownReport, RetireError>;
    let waits: [(&str, Wait<C>); 6] = [
        ("wait(deadline)", |h| h.wait(soon())),
        ("wait(past deadline)", |h| h.wait(Instant::now())),
        ("wait_timeout", |h| h.wait_timeout(Duration::from_secs(20))),
        ("try_finish", |h| h.try_finish()),
        ("finished().await", |h| block_on(h.finished())),
        ("force", |h| h.force(soon())),
    ];
    let barrier = Arc::new(std::sync::Barrier::new(waits.len()));
    let mut answers = Vec::new();
    for (name, wait) in waits {
        let (handle, barrier) = (ctx.retire(), barrier.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            barrier.wait();
            let _ = tx.send(catch_unwind(AssertUnwindSafe(|| wait(&handle))).ok());
        });
        answers.push((name, rx));
    }
    answers
        .into_iter()
        .map(|(name, rx)| {
            (
                name,
                rx.recv_timeout(Duration::from_secs(10)).ok().flatten(),
            )
        })
        .collect()
}

/// A backend whose teardown panics: the context still terminates, and
/// every waiter, however it waits, is released with the same error naming
/// the backend's teardown; the report (kept on the record) says so too.
#[test]
fn a_panicking_backend_teardown_terminates_and_fails_every_waiter_alike() {
    for round in 0..25 {
        let gov = Governor::new();
        let (backend, arm) = Panicky::new(NullContext::new());
        arm.teardown.store(true, Ordering::SeqCst);
        let ctx = gov.register(backend, ContextConfig::new().label("t"));
        drop(ctx.create_stream("s").unwrap());
        let answers = race_every_waiter(&ctx);
        let mut seen = None;
        for (how, answer) in answers {
            let answer = answer.unwrap_or_else(|| panic!("round {round}: {how} never answered"));
            let err = answer.expect_err("a panicking teardown is an error");
            let RetireError::TeardownPanicked {
                step,
                message,
                report,
                ..
            } = &err
            else {
                panic!("round {round}: {how}: {err}");
            };
            assert_eq!(*step, memgov::TeardownStep::Backend, "{how}: {err}");
            assert!(
                message.contains("backend teardown panicked"),
                "{how}: {err}"
            );
            let text = err.to_string();
            assert!(
                text.contains("context #")
                    && text.contains("'t'")
                    && text.contains("the backend's teardown (DeviceContext::teardown) panicked"),
                "{how}: {text}"
            );
            let report = report.as_deref().expect("the accounting ran: a report");
            assert!(report.backend_result.is_err(), "{report:?}");
            assert_eq!(seen.get_or_insert_with(|| err.clone()), &err, "{how}");
        }
        assert_eq!(ctx.lifecycle(), ContextState::Terminated);
        let kept = ctx.teardown_report().expect("the report is kept");
        let err = kept.backend_result.unwrap_err();
        assert!(err.message.contains("teardown panicked"), "{err}");
        // A retire after the fact gets the same answer, at once.
        assert_eq!(ctx.retire().try_finish(), Err(seen.unwrap()));
    }
}

#[test]
fn a_governor_dropped_while_unwinding_still_retires_its_contexts() {
    let slot = std::sync::Mutex::new(None);
    let run = catch_unwind(AssertUnwindSafe(|| {
        let gov = Governor::new();
        let (first, arm) = Panicky::new(NullContext::new());
        arm.teardown.store(true, Ordering::SeqCst);
        let first = gov.register(first, ContextConfig::new().label("first"));
        let (second, _) = Panicky::new(NullContext::new());
        let second = gov.register(second, ContextConfig::new().label("second"));
        let stream = second.create_stream("kept").unwrap();
        *slot.lock().unwrap() = Some((first, second, stream));
        panic!("the runtime failed");
    }));
    assert_eq!(panic_message(&*run.unwrap_err()), "the runtime failed");
    let (first, second, stream) = slot.lock().unwrap().take().unwrap();
    assert_eq!(first.lifecycle(), ContextState::Terminated);
    assert_eq!(second.lifecycle(), ContextState::Retiring);
    drop(stream);
    eventually("the second context tears down", || {
        second.lifecycle() == ContextState::Terminated
    });
}

#[test]
fn background_teardown_keeps_its_report_on_the_record() {
    let gov = Governor::new();
    let null = NullContext::deferred(4);
    let probe = null.controls();
    let (backend, arm) = Panicky::new(null);
    arm.teardown.store(true, Ordering::SeqCst);
    let ctx = gov.register(backend, ContextConfig::new().label("bg"));
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap()); // parked: pending
    drop(ctx.retire()); // nobody waits
    drop(s);
    assert_eq!(
        ctx.lifecycle(),
        ContextState::Retiring,
        "a release is pending"
    );
    assert!(ctx.teardown_report().is_none());
    // The device reaches the free on this thread (a driver thread, for a
    // GPU): the teardown starts on a reaper thread, not here.
    probe.retire_parked();
    eventually("background teardown", || {
        ctx.lifecycle() == ContextState::Terminated
    });
    let report = ctx.teardown_report().expect("kept on the record");
    assert_eq!(report.retired_releases, 1);
    let err = report.backend_result.clone().unwrap_err();
    assert!(err.message.contains("teardown panicked"), "{err}");
    let snap = gov.snapshot();
    assert_eq!(snap.contexts[0].teardown.as_ref(), Some(&report));
}

#[test]
fn a_shared_budget_loses_every_context_on_its_device_at_once() {
    let gpu0 = SharedBudget::new("gpu0", 64 * MIB);
    let gov = Governor::new();
    let (a_dev, b_dev) = (NullContext::deferred(4), NullContext::deferred(4));
    let (pa, pb) = (a_dev.probe(), b_dev.probe());
    let a = gov.register(
        a_dev,
        ContextConfig::new().label("a").shared_budget(gpu0.clone()),
    );
    let b = gov.register(
        b_dev,
        ContextConfig::new().label("b").shared_budget(gpu0.clone()),
    );
    let (sa, sb) = (
        a.create_stream("sa").unwrap(),
        b.create_stream("sb").unwrap(),
    );
    drop(a.allocate(&sa, Alloc::new(MIB, Role::Weights)).unwrap()); // parked on a
    let live = b.allocate(&sb, Alloc::new(2 * MIB, Role::KvCache)).unwrap();
    assert_eq!((gpu0.charged(), gpu0.pending()), (3 * MIB, MIB));
    assert!(gpu0.mark_lost("Xid 79: GPU has fallen off the bus"));
    assert!(!gpu0.mark_lost("again"), "once");
    assert!(gpu0.is_lost());
    for ctx in [&a, &b] {
        assert_eq!(ctx.lifecycle(), ContextState::Lost);
        assert!(ctx.snapshot().lost_reason.unwrap().contains("Xid 79"));
    }
    let err = b.allocate(&sb, Alloc::new(MIB, Role::Weights)).unwrap_err();
    assert!(matches!(err, GovernorError::DeviceLost { .. }), "{err}");
    // A context registered on the lost device is lost from the start.
    let late = gov.register(
        NullContext::new(),
        ContextConfig::new()
            .label("late")
            .shared_budget(gpu0.clone()),
    );
    assert_eq!(late.lifecycle(), ContextState::Lost);
    drop((live, sa, sb));
    // Each settles its own releases as a context-level loss does.
    let ra = a.retire().wait(soon()).unwrap();
    let rb = b.retire().wait(soon()).unwrap();
    assert_eq!((ra.lost, ra.abandoned_releases), (true, 1));
    assert_eq!((rb.lost, rb.settled_lost), (true, 1));
    assert_eq!((pa.frees_retired(), pb.frees_retired()), (0, 0));
    assert_eq!(
        (gpu0.charged(), gpu0.pending(), gpu0.awaiting_teardown()),
        (0, 0, 0)
    );
}

#[test]
fn a_shared_budget_reports_what_its_charge_is_made_of() {
    let gpu0 = SharedBudget::new("gpu0", 64 * MIB);
    let gov = Governor::new();
    let null = NullContext::deferred(4);
    let probe = null.controls();
    let ctx = gov.register(null, ContextConfig::new().shared_budget(gpu0.clone()));
    let s = ctx.create_stream("s").unwrap();
    let live = ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap();
    drop(
        ctx.allocate(&s, Alloc::new(2 * MIB, Role::Weights))
            .unwrap(),
    );
    assert_eq!(
        (gpu0.charged(), gpu0.pending(), gpu0.quarantined()),
        (3 * MIB, 2 * MIB, 0)
    );
    let shown = format!("{gpu0:?}");
    assert!(shown.contains("pending: 2097152"), "{shown}");
    probe.retire_parked();
    assert_eq!((gpu0.charged(), gpu0.pending()), (MIB, 0));
    drop((live, s));
    // The null device parks every free until told: retire the last one so
    // that the context tears down (and nothing outlives the test).
    probe.retire_parked();
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(gpu0.charged(), 0);
}

#[test]
fn a_buffer_names_its_stream_and_can_be_released_on_it() {
    let gov = Governor::new();
    let (ctx, probe) = register(&gov, ContextConfig::new());
    let s = ctx.create_stream("decode").unwrap();
    let b = ctx.allocate(&s, Alloc::new(MIB, Role::KvCache)).unwrap();
    assert_eq!(b.stream_label(), "decode");
    let own = b.stream();
    assert_eq!(own.label(), "decode");
    probe.controls.refuse_next_frees(1);
    let err = b.release_on(&own).unwrap_err();
    assert!(
        matches!(err.error, GovernorError::Backend { .. }),
        "the refusal is an error here, not a silent quarantine: {err}"
    );
}

#[cfg(feature = "tracing")]
#[test]
fn background_teardown_emits_its_report_as_a_tracing_event() {
    use std::sync::Mutex;

    // Global: the teardown runs on a reaper thread, where a thread-local
    // default would not reach. Other tests' events are told apart by label.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let _ = tracing::subscriber::set_global_default(events::Recorder(seen.clone()));

    let gov = Governor::new();
    let (backend, arm) = Panicky::new(NullContext::new());
    arm.teardown.store(true, Ordering::SeqCst);
    let ctx = gov.register(backend, ContextConfig::new().label("bg-traced"));
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.retire());
    drop(s); // the last holder: a reaper tears down, nobody waits
    eventually("background teardown", || {
        ctx.lifecycle() == ContextState::Terminated
    });
    eventually("the teardown event", || {
        seen.lock().unwrap().iter().any(|m| {
            m.contains("bg-traced") && m.contains("torn down") && m.contains("teardown panicked")
        })
    });
}

/// Streams lease budget in chunks, yet admission and snapshots stay exact:
/// an idle stream's lease is taken back before another stream is refused,
/// the refusal carries the bytes charged to allocations (not leased ones),
/// and a snapshot never counts an idle lease.
#[test]
fn leased_budget_is_reclaimed_before_a_refusal() {
    for chunk in [0, 1, MIB, 2 * MIB, 64 * MIB] {
        let gov = Governor::new();
        let ctx = gov.register(
            NullContext::new(),
            ContextConfig::new()
                .label("leases")
                .budget(10 * MIB)
                .tuning(Tuning::new().lease_chunk(chunk)),
        );
        let a = ctx.create_stream("a").unwrap();
        let b = ctx.create_stream("b").unwrap();
        // Stream a allocates and frees: its settled bytes go back into its
        // lease, idle.
        for _ in 0..3 {
            drop(
                ctx.allocate(&a, Alloc::new(3 * MIB, Role::Activation))
                    .unwrap(),
            );
        }
        let held = ctx.allocate(&a, Alloc::new(MIB, Role::Weights)).unwrap();
        assert_eq!(ctx.snapshot().charged, MIB, "chunk {chunk}");
        // Stream b may take all the rest: a's idle lease is reclaimed.
        let big = ctx
            .allocate(&b, Alloc::new(9 * MIB, Role::KvCache))
            .unwrap_or_else(|e| panic!("chunk {chunk}: 9 MiB of the 9 MiB left refused: {e}"));
        assert_eq!(ctx.snapshot().charged, 10 * MIB, "chunk {chunk}");
        // And one byte more is refused, with the exact numbers.
        match ctx.allocate(&a, Alloc::new(1, Role::Other)) {
            Err(GovernorError::BudgetExceeded(e)) => {
                assert_eq!(
                    (e.live, e.limit, e.available, e.requested),
                    (10 * MIB, 10 * MIB, 0, 1),
                    "chunk {chunk}"
                );
            }
            other => panic!("chunk {chunk}: expected BudgetExceeded, got {other:?}"),
        }
        drop(big);
        // Lowering the limit takes effect on the next allocation even where
        // a stream holds a lease under the old one.
        ctx.set_budget(Tier::Device, 2 * MIB);
        assert!(
            ctx.allocate(&a, Alloc::new(MIB, Role::Other)).is_ok(),
            "chunk {chunk}"
        );
        assert!(
            matches!(
                ctx.allocate(&b, Alloc::new(MIB + 1, Role::Other)),
                Err(GovernorError::BudgetExceeded(_))
            ),
            "chunk {chunk}: allocated past a lowered limit out of a lease"
        );
        drop(held);
        assert_eq!(ctx.snapshot().charged, 0, "chunk {chunk}");
        assert!(ctx.snapshot().peak >= 10 * MIB, "chunk {chunk}");
        drop((a, b));
        let report = ctx.retire().wait(soon()).unwrap();
        assert!(report.backend_result.is_ok());
        assert_eq!(ctx.snapshot().charged, 0, "chunk {chunk}");
    }
}

/// Leases under concurrency: four threads on four streams, each holding at
/// most its quarter of the budget at any time, allocate and free in a tight
/// loop (some frees settle into the thread's lease, some are refused room
/// elsewhere). Since the allocations never exceed the limit together, no
/// allocation may be refused, however the leases are spread at that moment;
/// afterwards nothing is charged.
#[test]
fn concurrent_streams_are_never_refused_room_their_leases_hold() {
    const THREADS: u64 = 4;
    const EACH: u64 = 3 * MIB;
    let gov = Governor::new();
    let ctx = gov.register(
        NullContext::new(),
        ContextConfig::new()
            .label("lease-stress")
            .budget(THREADS * EACH),
    );
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let ctx = &ctx;
            s.spawn(move || {
                let stream = ctx.create_stream(format!("t{t}")).unwrap();
                // Under Miri a few dozen cycles exercise the same code paths
                // (each cycle costs milliseconds there).
                let cycles = if cfg!(miri) { 40 } else { 2_000u64 };
                for i in 0..cycles {
                    // Sizes that do not divide the chunk, so leases are
                    // refilled, kept and reclaimed in every combination.
                    let a = MIB + (i % 7) * 64 * KIB;
                    let first = ctx
                        .allocate(&stream, Alloc::new(a, Role::Activation))
                        .unwrap_or_else(|e| panic!("thread {t}, cycle {i}: {e}"));
                    let second = ctx
                        .allocate(&stream, Alloc::new(EACH - a, Role::KvCache))
                        .unwrap_or_else(|e| panic!("thread {t}, cycle {i}: {e}"));
                    drop((first, second));
                }
            });
        }
    });
    let snap = ctx.snapshot();
    assert_eq!(snap.charged, 0);
    assert!(
        snap.peak <= THREADS * EACH,
        "peak {} above the limit",
        snap.peak
    );
    assert_eq!(snap.counters.admission_refusals, 0);
}

#[test]
fn a_pin_source_object_formats_with_debug() {
    use memgov::ProviderContextPinSource;
    let gov = memgov::Governor::new();
    let ctx = gov.register(
        memgov::null::NullContext::new(),
        memgov::ContextConfig::new(),
    );
    let source = ctx.pin_source(Some("plugin-a"));
    let as_dyn: &dyn ProviderContextPinSource = &*source;
    let text = format!("{as_dyn:?}");
    assert!(text.contains("plugin-a"), "{text}");
    assert!(text.contains(&ctx.id().to_string()), "{text}");
}

#[test]
fn snapshot_debug_names_each_role() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().label("dbg"));
    let s = ctx.create_stream("s").unwrap();
    let _kv = ctx.allocate(&s, Alloc::new(4096, Role::KvCache)).unwrap();
    let text = format!("{:?}", ctx.snapshot());
    let by_role = &text[text.find("by_role: ").expect("a by_role field")..];
    assert!(
        by_role.starts_with("by_role: {Weights: RoleUsage {"),
        "the usage is keyed by role, not by index: {by_role}"
    );
    assert!(
        by_role.contains("KvCache: RoleUsage { live_bytes: 4096, live_count: 1,"),
        "{by_role}"
    );
    for role in ["Activation: ", "Workspace: ", "Other: "] {
        assert!(by_role.contains(role), "{role} missing from {by_role}");
    }
    assert!(text.contains("label: \"dbg\""), "{text}");
}

#[test]
fn a_trace_records_the_timeline_per_stream_and_role() {
    use memgov::trace::{EventKind, Trace};
    let trace = Trace::new();
    let gov = Governor::new();
    let ctx = gov.register(
        memgov::null::NullContext::new(),
        ContextConfig::new()
            .label("traced")
            .budget(64 << 10)
            .trace(&trace),
    );
    let a = ctx.create_stream("a").unwrap();
    let b = ctx.create_stream("b").unwrap();
    let w = ctx
        .allocate(&a, Alloc::new(32 << 10, Role::Weights))
        .unwrap();
    let act = ctx
        .allocate(&a, Alloc::new(16 << 10, Role::Activation))
        .unwrap();
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, |_| 0);
    assert!(ctx
        .allocate(&b, Alloc::new(32 << 10, Role::KvCache))
        .is_err());
    act.release_on(&b).map_err(|e| e.error).unwrap();
    drop(w);
    drop((a, b));
    ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();

    let events = trace.events();
    let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
    use EventKind::*;
    for k in [
        Registered,
        StreamCreated,
        Allocated,
        Pressure,
        Refused,
        MovedOut,
        MovedIn,
        Released,
        Retired,
        RetireBegun,
        TornDown,
    ] {
        assert!(kinds.contains(&k), "no {k:?} in {kinds:?}");
    }
    assert!(events.iter().all(|e| &*e.context == "traced"));
    let refused = events.iter().find(|e| e.kind == Refused).unwrap();
    assert_eq!(
        (refused.stream.as_deref(), refused.role, refused.bytes),
        (Some("b"), Some(Role::KvCache), 32 << 10)
    );
    assert!(
        refused.note.as_deref().unwrap_or("").contains("budget"),
        "{refused:?}"
    );
    // Every byte allocated was released and retired: live and pending end at zero.
    let sum =
        |k: EventKind| -> u64 { events.iter().filter(|e| e.kind == k).map(|e| e.bytes).sum() };
    assert_eq!(sum(Allocated), 48 << 10);
    assert_eq!(sum(Released), 48 << 10);
    assert_eq!(sum(Retired), 48 << 10);
    // The activation was retired on stream b, where it was released.
    assert!(events.iter().any(|e| e.kind == Retired
        && e.stream.as_deref() == Some("b")
        && e.role == Some(Role::Activation)));
    let json = trace.to_chrome_json();
    let last_live = &json[json.rfind(r#""name":"live bytes (context)""#).unwrap()..];
    assert!(
        last_live.contains(r#""weights":0,"kv-cache":0,"activation":0"#),
        "{last_live}"
    );
    assert!(json.contains(r#""name":"refused""#));
}

/// Every way a buffer is made and let go records one `Allocated` and one
/// `Released` event per buffer on the timeline (a buffer released without a
/// free that will retire is then `Abandoned`), so the timeline's live bytes
/// follow the books: plain allocations and allocations out of a
/// reservation, in each tier, released on their own stream or another, on a
/// lost device, reclaimed by force, and on a context with a block cache
/// (whose backend allocation is made once, then cached and reused, and
/// whose block ends as a trim of the cache, with its role, in place of a
/// release).
#[test]
fn every_allocation_path_records_one_allocated_and_one_released_event_per_buffer() {
    use memgov::trace::{EventKind, Trace};
    use memgov::CacheConfig;
    type Scenario = fn(&ContextHandle<HostContext>) -> Vec<memgov::DeviceBuffer<HostContext>>;
    let scenarios: [(&str, ContextConfig, Scenario, u64); 8] = [
        (
            "ContextHandle::allocate",
            ContextConfig::new(),
            |ctx| {
                let s = ctx.create_stream("s").unwrap();
                (1..=3)
                    .map(|i| {
                        ctx.allocate(&s, Alloc::new(i * KIB, Role::Weights))
                            .unwrap()
                    })
                    .collect()
            },
            6 * KIB,
        ),
        (
            "ContextHandle::allocate in the pinned tier",
            ContextConfig::new().tier_budget(Tier::PinnedHost, MIB),
            |ctx| {
                let s = ctx.create_stream("s").unwrap();
                (1..=2)
                    .map(|i| {
                        ctx.allocate(
                            &s,
                            Alloc::new(i * KIB, Role::KvCache).tier(Tier::PinnedHost),
                        )
                        .unwrap()
                    })
                    .collect()
            },
            3 * KIB,
        ),
        (
            "Reservation::allocate",
            ContextConfig::new(),
            |ctx| {
                let s = ctx.create_stream("s").unwrap();
                let r = ctx.reserve(Reserve::new(16 * KIB, "request")).unwrap();
                (1..=3)
                    .map(|i| r.allocate(&s, Alloc::new(i * KIB, Role::KvCache)).unwrap())
                    .collect()
            },
            6 * KIB,
        ),
        (
            "Reservation::allocate in the pinned tier",
            ContextConfig::new().tier_budget(Tier::PinnedHost, MIB),
            |ctx| {
                let s = ctx.create_stream("s").unwrap();
                let r = ctx
                    .reserve(Reserve::new(16 * KIB, "offload").tier(Tier::PinnedHost))
                    .unwrap();
                (1..=2)
                    .map(|i| r.allocate(&s, Alloc::new(i * KIB, Role::KvCache)).unwrap())
                    .collect()
            },
            3 * KIB,
        ),
        (
            "released on another stream",
            ContextConfig::new(),
            |ctx| {
                let (a, b) = (
                    ctx.create_stream("a").unwrap(),
                    ctx.create_stream("b").unwrap(),
                );
                let r = ctx.reserve(Reserve::new(16 * KIB, "request")).unwrap();
                let x = ctx.allocate(&a, Alloc::new(KIB, Role::Activation)).unwrap();
                let y = r.allocate(&a, Alloc::new(2 * KIB, Role::KvCache)).unwrap();
                x.release_on(&b).map_err(|e| e.error).unwrap();
                y.release_on(&b).map_err(|e| e.error).unwrap();
                Vec::new()
            },
            3 * KIB,
        ),
        (
            "released on a lost device",
            ContextConfig::new(),
            |ctx| {
                let s = ctx.create_stream("s").unwrap();
                let r = ctx.reserve(Reserve::new(16 * KIB, "request")).unwrap();
                let x = ctx.allocate(&s, Alloc::new(KIB, Role::Weights)).unwrap();
                let y = r.allocate(&s, Alloc::new(2 * KIB, Role::KvCache)).unwrap();
                assert!(ctx.mark_lost("planted"));
                vec![x, y]
            },
            3 * KIB,
        ),
        (
            "reclaimed by force",
            ContextConfig::new(),
            |ctx| {
                let s = ctx.create_stream("s").unwrap();
                let x = ctx.allocate(&s, Alloc::new(KIB, Role::Weights)).unwrap();
                let r = ctx.reserve(Reserve::new(16 * KIB, "request")).unwrap();
                let y = r.allocate(&s, Alloc::new(2 * KIB, Role::KvCache)).unwrap();
                drop(r);
                ctx.retire().force(soon()).unwrap();
                vec![x, y]
            },
            3 * KIB,
        ),
        (
            "with a block cache configured",
            ContextConfig::new().cache(CacheConfig::new(MIB)),
            |ctx| {
                let s = ctx.create_stream("s").unwrap();
                for _ in 0..3 {
                    drop(
                        ctx.allocate(&s, Alloc::new(4 * KIB, Role::Activation))
                            .unwrap(),
                    );
                }
                vec![ctx
                    .allocate(&s, Alloc::new(4 * KIB, Role::Activation))
                    .unwrap()]
            },
            4 * KIB,
        ),
    ];
    for (path, config, make, bytes) in scenarios {
        let trace = Trace::new();
        let gov = Governor::new();
        let (ctx, _) = register(&gov, config.label(path).trace(&trace));
        drop(make(&ctx));
        ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
        let events = trace.events();
        let of = |k: EventKind| events.iter().filter(move |e| e.kind == k);
        let made = of(EventKind::Allocated).count();
        assert!(made > 0, "{path}: nothing allocated");
        // A cached block's end is its trim (with a role; a process trim's
        // summary has none).
        let blocks = || of(EventKind::Trimmed).filter(|e| e.role.is_some());
        let freed = of(EventKind::Released).count() + blocks().count();
        assert_eq!(freed, made, "{path}: {events:#?}");
        let sum = |k| of(k).map(|e| e.bytes).sum::<u64>();
        assert_eq!(sum(EventKind::Allocated), bytes, "{path}: {events:#?}");
        let trimmed: u64 = blocks().map(|e| e.bytes).sum();
        assert_eq!(
            sum(EventKind::Released) + trimmed,
            bytes,
            "{path}: {events:#?}"
        );
        assert_eq!(
            sum(EventKind::Cached),
            sum(EventKind::Reused) + trimmed,
            "{path}: {events:#?}"
        );
        assert_eq!(
            sum(EventKind::Retired) + sum(EventKind::Abandoned),
            bytes,
            "{path}: {events:#?}"
        );
    }
}

#[test]
fn an_untraced_context_records_nothing() {
    use memgov::trace::Trace;
    let trace = Trace::new();
    let gov = Governor::new();
    let traced = gov.register(
        memgov::null::NullContext::new(),
        ContextConfig::new().trace(&trace),
    );
    let plain = gov.register(memgov::null::NullContext::new(), ContextConfig::new());
    let s = plain.create_stream("s").unwrap();
    drop(plain.allocate(&s, Alloc::new(64, Role::Other)).unwrap());
    assert!(trace
        .events()
        .iter()
        .all(|e| e.context.as_ref() == traced.snapshot().label));
}

#[test]
fn a_reservation_is_charged_once_and_allocates_without_charging_again() {
    let gov = Governor::new();
    let (ctx, _) = register(
        &gov,
        ContextConfig::new()
            .budget(4 * MIB)
            .tuning(Tuning::new().lease_chunk(0)),
    );
    let s = ctx.create_stream("s").unwrap();
    let r = ctx.reserve(Reserve::new(3 * MIB, "request-17")).unwrap();
    assert_eq!((r.left(), ctx.snapshot().charged), (3 * MIB, 3 * MIB));
    // The reserved bytes are charged: a plain allocation finds only 1 MiB.
    assert!(ctx
        .allocate(&s, Alloc::new(2 * MIB, Role::Weights))
        .is_err());
    let b = r.allocate(&s, Alloc::new(2 * MIB, Role::KvCache)).unwrap();
    assert_eq!((r.left(), ctx.snapshot().charged), (MIB, 3 * MIB));
    // More than is left: refused with the reservation's numbers, unchanged.
    let err = r
        .allocate(&s, Alloc::new(2 * MIB, Role::KvCache))
        .unwrap_err();
    assert!(
        matches!(&err, GovernorError::ReservationExhausted { label, requested, left, .. }
            if label == "request-17" && *requested == 2 * MIB && *left == MIB),
        "{err}"
    );
    assert!(
        err.to_string().contains("'request-17' has 1.0 MiB"),
        "{err}"
    );
    assert_eq!((r.left(), ctx.snapshot().charged), (MIB, 3 * MIB));
    // The buffer's release returns its bytes to the budget; the drop of
    // the reservation returns what is left, once.
    drop(b);
    s.synchronize().unwrap();
    assert_eq!(ctx.snapshot().charged, MIB);
    drop(r);
    assert_eq!(ctx.snapshot().charged, 0);
    let all = ctx
        .allocate(&s, Alloc::new(4 * MIB, Role::Weights))
        .unwrap();
    drop(all);
    s.synchronize().unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

/// An `Alloc` out of a reservation is made in the reservation's tier; one
/// that names another tier is refused with both tiers named, and nothing
/// leaves the reservation.
#[test]
fn an_alloc_naming_another_tier_than_its_reservation_is_refused() {
    let gov = Governor::new();
    let (ctx, _) = register(
        &gov,
        ContextConfig::new()
            .budget(4 * MIB)
            .tier_budget(Tier::PinnedHost, 4 * MIB),
    );
    let s = ctx.create_stream("s").unwrap();
    let r = ctx.reserve(Reserve::new(2 * MIB, "kv")).unwrap();
    let err = r
        .allocate(&s, Alloc::new(MIB, Role::KvCache).tier(Tier::PinnedHost))
        .unwrap_err();
    assert!(
        matches!(&err, GovernorError::WrongTier { label, reservation: Tier::Device, asked: Tier::PinnedHost, .. } if label == "kv"),
        "{err}"
    );
    assert!(err.to_string().contains("reserve in"), "{err}");
    assert_eq!(r.left(), 2 * MIB);
    assert_eq!(ctx.snapshot().tier(Tier::PinnedHost).unwrap().charged, 0);
    // Naming the reservation's own tier, or none, allocates out of it.
    let a = r
        .allocate(&s, Alloc::new(MIB, Role::KvCache).tier(Tier::Device))
        .unwrap();
    let b = r.allocate(&s, Alloc::new(MIB, Role::KvCache)).unwrap();
    assert_eq!(
        (a.tier(), b.tier(), r.left()),
        (Tier::Device, Tier::Device, 0)
    );
}

#[test]
fn reservations_show_in_snapshots_and_refusals_by_label() {
    let gov = Governor::new();
    let (ctx, _) = register(
        &gov,
        ContextConfig::new()
            .budget(8 * MIB)
            .tuning(Tuning::new().lease_chunk(0)),
    );
    let s = ctx.create_stream("s").unwrap();
    let big = ctx.reserve(Reserve::new(3 * MIB, "request-17")).unwrap();
    let small = ctx.reserve(Reserve::new(MIB, "request-18")).unwrap();
    let kv = big.allocate(&s, Alloc::new(MIB, Role::KvCache)).unwrap();
    let snap = ctx.snapshot();
    assert_eq!(snap.reserved, 3 * MIB);
    assert_eq!(
        snap.reservations,
        vec![
            ReservationUsage {
                label: "request-17".into(),
                tier: Tier::Device,
                left: 2 * MIB
            },
            ReservationUsage {
                label: "request-18".into(),
                tier: Tier::Device,
                left: MIB
            },
        ]
    );
    // The refusal tells live from reserved, and names who holds the
    // reserved bytes.
    let err = ctx
        .allocate(&s, Alloc::new(5 * MIB, Role::Weights))
        .unwrap_err();
    let b = err.budget().expect("a budget refusal");
    assert_eq!((b.live, b.reserved), (MIB, 3 * MIB));
    assert!(
        err.to_string().contains(
            "1.0 MiB (1048576 bytes) live + 3.0 MiB (3145728 bytes) reserved \
             (2.0 MiB (2097152 bytes) by 'request-17', 1.0 MiB (1048576 bytes) by 'request-18')"
        ),
        "{err}"
    );
    // Spent and dropped reservations leave the list.
    big.shrink(2 * MIB);
    drop(small);
    let snap = ctx.snapshot();
    assert_eq!((snap.reserved, snap.reservations.len()), (0, 0));
    drop((big, kv));
    s.synchronize().unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn a_reservation_in_the_pinned_tier_charges_only_that_tier() {
    let gov = Governor::new();
    let (ctx, _) = register(
        &gov,
        ContextConfig::new()
            .budget(4 * MIB)
            .tier_budget(Tier::PinnedHost, 2 * MIB),
    );
    let s = ctx.create_stream("offload").unwrap();
    let staging = ctx
        .reserve(Reserve::new(MIB + MIB / 2, "request-3 offload").tier(Tier::PinnedHost))
        .unwrap();
    assert_eq!(staging.tier(), Tier::PinnedHost);
    let snap = ctx.snapshot();
    // The device budget is untouched; the tier holds the reservation.
    assert_eq!((snap.charged, snap.reserved), (0, 0));
    let pinned = snap.tier(Tier::PinnedHost).unwrap();
    assert_eq!(
        (pinned.charged, pinned.reserved, pinned.live_bytes),
        (MIB + MIB / 2, MIB + MIB / 2, 0)
    );
    let block = staging
        .allocate(&s, Alloc::new(MIB, Role::KvCache))
        .unwrap();
    assert_eq!(block.tier(), Tier::PinnedHost);
    let pinned = ctx.snapshot().tier(Tier::PinnedHost).unwrap();
    assert_eq!(
        (pinned.charged, pinned.reserved, pinned.live_bytes),
        (MIB + MIB / 2, MIB / 2, MIB)
    );
    // The tier refuses what the reservation leaves no room for, naming it.
    let err = ctx
        .allocate(&s, Alloc::new(MIB, Role::KvCache).tier(Tier::PinnedHost))
        .unwrap_err();
    let b = err.budget().expect("a budget refusal");
    assert_eq!(b.scope, BudgetScope::Tier(Tier::PinnedHost));
    assert_eq!((b.live, b.reserved), (MIB, MIB / 2));
    assert!(err.to_string().contains("by 'request-3 offload'"), "{err}");
    // A grow the tier cannot hold changes nothing.
    assert!(staging.grow(MIB).is_err());
    assert_eq!(staging.left(), MIB / 2);
    drop(staging);
    drop(block);
    s.synchronize().unwrap();
    let pinned = ctx.snapshot().tier(Tier::PinnedHost).unwrap();
    assert_eq!(
        (pinned.charged, pinned.reserved, pinned.live_bytes),
        (0, 0, 0)
    );
}

#[test]
fn a_reservation_grows_transactionally_and_shrinks_unused_bytes() {
    let gov = Governor::new();
    let gpu0 = SharedBudget::new("gpu0", 3 * MIB);
    let (ctx, _) = register(
        &gov,
        ContextConfig::new()
            .budget(4 * MIB)
            .shared_budget(gpu0.clone()),
    );
    let r = ctx.reserve(Reserve::new(MIB, "r")).unwrap();
    r.grow(MIB).unwrap();
    assert_eq!((r.left(), gpu0.charged()), (2 * MIB, 2 * MIB));
    // The shared budget refuses: nothing changes anywhere.
    let err = r.grow(2 * MIB).unwrap_err();
    assert_eq!(
        err.budget().unwrap().scope,
        BudgetScope::Shared("gpu0".into())
    );
    assert_eq!(
        (r.left(), gpu0.charged(), ctx.snapshot().charged),
        (2 * MIB, 2 * MIB, 2 * MIB)
    );
    assert_eq!(r.shrink(MIB + KIB), MIB + KIB);
    assert_eq!(r.shrink(10 * MIB), MIB - KIB);
    assert_eq!((r.left(), gpu0.charged()), (0, 0));
    drop(r);
    assert_eq!((gpu0.charged(), ctx.snapshot().charged), (0, 0));
}

#[test]
fn reservations_and_plain_allocations_racing_never_over_admit() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().budget(8 * MIB));
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let ctx = ctx.clone();
            std::thread::spawn(move || {
                let s = ctx.create_stream("s").unwrap();
                let mut held = Vec::new();
                // Under Miri, 21 rounds: every request size (`i % 7`) meets
                // every grow step (`i % 3`) once, with the two threads
                // interleaved.
                let rounds = if cfg!(miri) { 21 } else { 400u64 };
                for i in 0..rounds {
                    let bytes = (i % 7 + 1) * 256 * KIB;
                    if t == 0 {
                        if let Ok(r) = ctx.reserve(Reserve::new(bytes, "r")) {
                            if let Ok(b) = r.allocate(&s, Alloc::new(bytes / 2, Role::KvCache)) {
                                held.push(b);
                            }
                            if i % 3 == 0 {
                                let _ = r.grow(bytes);
                            }
                        }
                    } else if let Ok(b) = ctx.allocate(&s, Alloc::new(bytes, Role::Weights)) {
                        held.push(b);
                    }
                    let charged = ctx.snapshot().charged;
                    assert!(charged <= 8 * MIB, "charged {charged}");
                    if held.len() > 4 {
                        held.remove(0);
                    }
                }
                drop(held);
                s.synchronize().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn retire_waits_for_a_live_reservation() {
    let gov = Governor::new();
    let (ctx, _) = register(&gov, ContextConfig::new().budget(4 * MIB));
    let r = ctx.reserve(Reserve::new(MIB, "held")).unwrap();
    let retiring = ctx.retire();
    assert!(ctx.reserve(Reserve::new(MIB, "late")).is_err());
    assert!(retiring.wait_timeout(Duration::from_millis(1)).is_err());
    drop(r);
    retiring.wait(soon()).unwrap();
}

// --- The budget tree: process → device → context. ---

/// A context on `device` holding `held` bytes, whose pressure responder of
/// `priority` gives them back (settled) and logs its label and the request.
#[allow(clippy::type_complexity)]
fn victim(
    gov: &Governor<HostContext>,
    device: &SharedBudget,
    label: &'static str,
    held: u64,
    priority: u32,
    log: &Arc<std::sync::Mutex<Vec<(&'static str, memgov::PressureRequest)>>>,
) -> ContextHandle<HostContext> {
    let (ctx, _) = register(
        gov,
        ContextConfig::new()
            .label(label)
            .shared_budget(device.clone()),
    );
    let s = ctx.create_stream("s").unwrap();
    let buffer = std::sync::Mutex::new(Some(
        ctx.allocate(&s, Alloc::new(held, Role::KvCache)).unwrap(),
    ));
    let log = log.clone();
    ctx.add_pressure_responder(priority, move |req| {
        log.lock().unwrap().push((label, *req));
        let freed = buffer.lock().unwrap().take().map_or(0, |b| b.len());
        s.synchronize().unwrap();
        freed
    });
    ctx
}

#[test]
fn a_device_refusal_asks_every_context_lowest_priority_first_and_stops_when_it_fits() {
    let gov = Governor::new();
    let gpu0 = SharedBudget::new("gpu0", 6 * MIB);
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    // Registered highest priority first: the order asked is the priority's.
    let _p2 = victim(&gov, &gpu0, "p2", 2 * MIB, 2, &log);
    let _p1 = victim(&gov, &gpu0, "p1", 2 * MIB, 1, &log);
    let _p0 = victim(&gov, &gpu0, "p0", 2 * MIB, 0, &log);
    let (r, _) = register(
        &gov,
        ContextConfig::new().label("r").shared_budget(gpu0.clone()),
    );
    let s = r.create_stream("s").unwrap();
    let a = r
        .allocate(&s, Alloc::new(2 * MIB, Role::Activation))
        .unwrap();
    let asked: Vec<_> = log.lock().unwrap().iter().map(|(l, _)| *l).collect();
    assert_eq!(asked, ["p0"], "the lowest priority was enough");
    let req = log.lock().unwrap()[0].1;
    assert_eq!(
        (req.context, req.level, req.requested, req.shortfall),
        (r.id(), memgov::PressureLevel::Shared, 2 * MIB, 2 * MIB)
    );
    // 4 MiB more: p0 has nothing left, p1 frees 2 MiB (not enough), p2 the rest.
    let b = r
        .allocate(&s, Alloc::new(4 * MIB, Role::Activation))
        .unwrap();
    let asked: Vec<_> = log.lock().unwrap().iter().map(|(l, _)| *l).collect();
    assert_eq!(asked, ["p0", "p0", "p1", "p2"]);
    assert_eq!(r.snapshot().counters.pressure_calls, 4);
    assert_eq!(gpu0.charged(), 6 * MIB);
    drop((a, b));
    s.synchronize().unwrap();
    assert_eq!(gpu0.charged(), 0);
}

#[test]
fn what_a_victim_frees_goes_to_the_requester_not_to_a_racing_allocation() {
    let gov = Governor::new();
    let gpu0 = SharedBudget::new("gpu0", 4 * MIB);
    let (victim, _) = register(
        &gov,
        ContextConfig::new().label("v").shared_budget(gpu0.clone()),
    );
    let (racer, _) = register(
        &gov,
        ContextConfig::new().label("x").shared_budget(gpu0.clone()),
    );
    let (r, _) = register(
        &gov,
        ContextConfig::new().label("r").shared_budget(gpu0.clone()),
    );
    let vs = victim.create_stream("s").unwrap();
    let held = std::sync::Mutex::new(vec![
        victim
            .allocate(&vs, Alloc::new(2 * MIB, Role::KvCache))
            .unwrap(),
        victim
            .allocate(&vs, Alloc::new(2 * MIB, Role::KvCache))
            .unwrap(),
    ]);
    let xs = racer.create_stream("s").unwrap();
    let raced = Arc::new(std::sync::Mutex::new(None));
    let raced2 = raced.clone();
    let busy = AtomicBool::new(false);
    victim.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
        // The racer's own refusal asks this responder too, from inside it:
        // it gives nothing then.
        if busy.swap(true, Ordering::SeqCst) {
            return 0;
        }
        let freed = held.lock().unwrap().pop().map_or(0, |b| b.len());
        vs.synchronize().unwrap();
        // Another context's allocation lands between the free and the
        // requester's retry: the freed bytes are the requester's.
        *raced2.lock().unwrap() = Some(racer.allocate(&xs, Alloc::new(MIB, Role::Other)));
        busy.store(false, Ordering::SeqCst);
        freed
    });
    let s = r.create_stream("s").unwrap();
    let a = r
        .allocate(&s, Alloc::new(2 * MIB, Role::Activation))
        .expect("the freed bytes went to the requester");
    let err = raced
        .lock()
        .unwrap()
        .take()
        .expect("the responder ran")
        .expect_err("the racing allocation found no room");
    assert_eq!(
        err.budget().unwrap().scope,
        BudgetScope::Shared("gpu0".into())
    );
    assert_eq!(gpu0.charged(), 4 * MIB, "2 MiB held + the 2 MiB admitted");
    drop(a);
}

#[test]
fn the_process_level_refuses_with_its_numbers_and_reclaims_across_its_devices() {
    let process = memgov::ProcessBudget::new("worker", 5 * MIB);
    let gpu0 = SharedBudget::with_parent("gpu0", 4 * MIB, &process);
    let gpu1 = SharedBudget::with_parent("gpu1", 4 * MIB, &process);
    let gov = Governor::new();
    let (a, _) = register(
        &gov,
        ContextConfig::new().label("a").shared_budget(gpu0.clone()),
    );
    let (b, _) = register(
        &gov,
        ContextConfig::new().label("b").shared_budget(gpu1.clone()),
    );
    let (sa, sb) = (a.create_stream("s").unwrap(), b.create_stream("s").unwrap());
    let x = a.allocate(&sa, Alloc::new(3 * MIB, Role::Weights)).unwrap();
    assert_eq!((gpu0.charged(), process.charged()), (3 * MIB, 3 * MIB));
    // gpu1 has room for 3 MiB, the process has 2 MiB.
    let err = b
        .allocate(&sb, Alloc::new(3 * MIB, Role::Weights))
        .unwrap_err();
    let e = err.budget().expect("budget refusal");
    assert_eq!(e.scope, BudgetScope::Process("worker".into()));
    assert_eq!(
        (e.requested, e.live, e.limit, e.available),
        (3 * MIB, 3 * MIB, 5 * MIB, 2 * MIB)
    );
    let msg = err.to_string();
    assert!(msg.contains("under the process budget 'worker'"), "{msg}");
    assert!(msg.contains("of a 5.0 MiB"), "{msg}");
    // Every level or none: the refusal left gpu1 and b uncharged.
    assert_eq!((gpu1.charged(), b.snapshot().charged), (0, 0));
    // A process refusal asks the contexts on the other device too.
    let x = std::sync::Mutex::new(Some(x));
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let asked2 = asked.clone();
    a.add_pressure_responder(0, move |req| {
        asked2.lock().unwrap().push(req.level);
        let freed = x.lock().unwrap().take().map_or(0, |b| b.len());
        sa.synchronize().unwrap();
        freed
    });
    // Over the process limit on its own: refused at once, named, and
    // nobody is asked.
    process.set_limit(3 * MIB);
    let err = b
        .allocate(&sb, Alloc::new(3 * MIB + 1, Role::Weights))
        .unwrap_err();
    assert_eq!(
        err.budget().unwrap().scope,
        BudgetScope::Process("worker".into())
    );
    assert!(err.to_string().contains("can never fit"), "{err}");
    assert!(asked.lock().unwrap().is_empty());
    process.set_limit(5 * MIB);
    let y = b.allocate(&sb, Alloc::new(3 * MIB, Role::Weights)).unwrap();
    assert_eq!(*asked.lock().unwrap(), [memgov::PressureLevel::Process]);
    assert_eq!(
        (gpu0.charged(), gpu1.charged(), process.charged()),
        (0, 3 * MIB, 3 * MIB)
    );
    drop(y);
    sb.synchronize().unwrap();
    assert_eq!(process.charged(), 0);
}

#[test]
fn outside_memory_at_each_level_is_charged_named_and_returned_once() {
    let process = memgov::ProcessBudget::new("worker", 8 * MIB);
    let gpu0 = SharedBudget::with_parent("gpu0", 6 * MIB, &process);
    let gov = Governor::new();
    let (ctx, _) = register(
        &gov,
        ContextConfig::new()
            .label("c")
            .budget(4 * MIB)
            .shared_budget(gpu0.clone()),
    );
    let s = ctx.create_stream("s").unwrap();
    let levels = || (ctx.snapshot().charged, gpu0.charged(), process.charged());
    // Context: 3 MiB of a runtime's weights leave 1 MiB of the 4.
    let weights = ctx.report_outside(3 * MIB);
    assert_eq!(levels(), (3 * MIB, 3 * MIB, 3 * MIB));
    assert_eq!(
        (
            ctx.snapshot().outside_bytes,
            gpu0.outside(),
            process.outside()
        ),
        (3 * MIB, 3 * MIB, 3 * MIB)
    );
    let err = ctx
        .allocate(&s, Alloc::new(2 * MIB, Role::Activation))
        .unwrap_err();
    let e = err.budget().unwrap();
    assert_eq!(
        (&e.scope, e.outside, e.live),
        (&BudgetScope::Context, 3 * MIB, 0)
    );
    assert!(
        err.to_string()
            .contains("+ 3.0 MiB (3145728 bytes) outside memgov"),
        "{err}"
    );
    drop(weights);
    assert_eq!(levels(), (0, 0, 0), "returned once, on every level");
    // Device: a 5 MiB workspace leaves 1 MiB of gpu0's 6.
    let workspace = gpu0.report_outside(5 * MIB);
    assert_eq!(levels(), (0, 5 * MIB, 5 * MIB));
    let err = ctx
        .allocate(&s, Alloc::new(2 * MIB, Role::Activation))
        .unwrap_err();
    let e = err.budget().unwrap();
    assert_eq!(
        (&e.scope, e.outside),
        (&BudgetScope::Shared("gpu0".into()), 5 * MIB)
    );
    assert!(err.to_string().contains("outside memgov"), "{err}");
    drop(workspace);
    assert_eq!(levels(), (0, 0, 0));
    // Process: recorded over the limit all the same (it exists already).
    let pool = process.report_outside(9 * MIB);
    assert_eq!((process.charged(), process.limit()), (9 * MIB, 8 * MIB));
    let err = ctx
        .allocate(&s, Alloc::new(MIB, Role::Activation))
        .unwrap_err();
    let e = err.budget().unwrap();
    assert_eq!(
        (&e.scope, e.outside, e.available),
        (&BudgetScope::Process("worker".into()), 9 * MIB, 0)
    );
    assert!(err.to_string().contains("outside memgov"), "{err}");
    assert_eq!(pool.bytes(), 9 * MIB);
    drop(pool);
    assert_eq!(levels(), (0, 0, 0));
    drop(
        ctx.allocate(&s, Alloc::new(4 * MIB, Role::Activation))
            .unwrap(),
    );
}

#[test]
fn a_process_refusal_waits_for_a_release_on_another_device() {
    let process = memgov::ProcessBudget::new("worker", 4 * MIB);
    let gpu0 = SharedBudget::with_parent("gpu0", 4 * MIB, &process);
    let gpu1 = SharedBudget::with_parent("gpu1", 4 * MIB, &process);
    let gov = Governor::new();
    // a's frees retire only when the test says so.
    let device = memgov_conformance::Watched::new(host(8 * MIB).0);
    let log = device.log();
    log.hold_retirements(true);
    let a = gov.register(
        device,
        ContextConfig::new().label("a").shared_budget(gpu0.clone()),
    );
    let b = gov.register(
        memgov_conformance::Watched::new(host(8 * MIB).0),
        ContextConfig::new()
            .label("b")
            .shared_budget(gpu1.clone())
            .admission(Admission::WaitForPending {
                timeout: Duration::from_secs(20),
            }),
    );
    let sa = a.create_stream("s").unwrap();
    drop(a.allocate(&sa, Alloc::new(3 * MIB, Role::Weights)).unwrap());
    eventually("a's release parked", || log.held() == 1);
    assert_eq!(
        (process.pending(), gpu0.pending(), gpu1.pending()),
        (3 * MIB, 3 * MIB, 0)
    );
    let sb = b.create_stream("s").unwrap();
    let b2 = b.clone();
    let waiter = std::thread::spawn(move || {
        let x = b2.allocate(&sb, Alloc::new(2 * MIB, Role::Weights))?;
        let n = x.len();
        drop(x);
        sb.synchronize()?;
        Ok::<_, GovernorError>(n)
    });
    // b waits on the process level for a release on gpu0.
    eventually("b waits", || b.snapshot().counters.admission_waits == 1);
    assert_eq!(log.release_held(), 1);
    assert_eq!(
        waiter
            .join()
            .unwrap()
            .expect("admitted once a's release settled"),
        2 * MIB
    );
    assert_eq!((process.pending(), process.charged()), (0, 0));
}

#[test]
fn reclaims_racing_on_one_device_never_over_admit() {
    let limit = 4 * MIB;
    let process = memgov::ProcessBudget::new("worker", 6 * MIB);
    let gpu0 = SharedBudget::with_parent("gpu0", limit, &process);
    let gov = Governor::new();
    // Bytes admitted and not yet released, counted after the admission and
    // before the release: never more than what the device really holds.
    let live = Arc::new(AtomicU64::new(0));
    let over = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..3u32)
        .map(|t| {
            let (ctx, _) = register(
                &gov,
                ContextConfig::new()
                    .label(format!("t{t}"))
                    .shared_budget(gpu0.clone()),
            );
            let (live, over) = (live.clone(), over.clone());
            std::thread::spawn(move || {
                let s = ctx.create_stream("s").unwrap();
                let cache: Arc<std::sync::Mutex<Vec<memgov::DeviceBuffer<HostContext>>>> =
                    Arc::default();
                let (cache2, s2, live2) = (cache.clone(), s.clone(), live.clone());
                ctx.add_pressure_responder(t, move |_| {
                    let freed: Vec<_> = cache2.lock().unwrap().drain(..).collect();
                    let bytes = freed.iter().map(|b| b.len()).sum();
                    live2.fetch_sub(bytes, Ordering::SeqCst);
                    drop(freed);
                    s2.synchronize().unwrap();
                    bytes
                });
                let rounds = if cfg!(miri) { 20 } else { 300u64 };
                for i in 0..rounds {
                    let bytes = [MIB / 2, MIB, 2 * MIB][((i + u64::from(t)) % 3) as usize];
                    if let Ok(b) = ctx.allocate(&s, Alloc::new(bytes, Role::KvCache)) {
                        if live.fetch_add(bytes, Ordering::SeqCst) + bytes > limit {
                            over.store(true, Ordering::SeqCst);
                        }
                        cache.lock().unwrap().push(b);
                    }
                }
                let left: Vec<_> = cache.lock().unwrap().drain(..).collect();
                live.fetch_sub(left.iter().map(|b| b.len()).sum(), Ordering::SeqCst);
                drop(left);
                s.synchronize().unwrap();
                drop(s);
                ctx.retire().wait(soon()).unwrap();
                ctx.snapshot().counters.pressure_calls
            })
        })
        .collect();
    let asked: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(!over.load(Ordering::SeqCst), "more than the limit was live");
    assert!(asked > 0, "no allocation asked a responder");
    assert_eq!((gpu0.charged(), process.charged()), (0, 0));
}

/// A backend with the device tier only: the host backend without its
/// `allocate_in`, so the trait's default answers for the other tiers.
struct DeviceOnly(HostContext);

impl DeviceContext for DeviceOnly {
    type Stream = <HostContext as DeviceContext>::Stream;
    type Memory = <HostContext as DeviceContext>::Memory;

    fn describe(&self) -> DeviceDescription {
        self.0.describe()
    }
    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.0.memory_info()
    }
    fn create_stream(&self) -> Result<Self::Stream, BackendError> {
        self.0.create_stream()
    }
    fn destroy_stream(&self, stream: Self::Stream) -> Result<(), BackendError> {
        self.0.destroy_stream(stream)
    }
    fn allocate(&self, stream: &Self::Stream, bytes: u64) -> Result<Self::Memory, BackendError> {
        self.0.allocate(stream, bytes)
    }
    fn free_async(
        &self,
        stream: &Self::Stream,
        memory: Self::Memory,
        retired: RetireSignal,
    ) -> Result<(), (Self::Memory, RetireSignal, BackendError)> {
        self.0.free_async(stream, memory, retired)
    }
    fn write(
        &self,
        stream: &Self::Stream,
        memory: &Self::Memory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.0.write(stream, memory, offset, src)
    }
    fn read(
        &self,
        stream: &Self::Stream,
        memory: &Self::Memory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.0.read(stream, memory, offset, dst)
    }
    fn synchronize(&self, stream: &Self::Stream) -> Result<(), BackendError> {
        self.0.synchronize(stream)
    }
    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        self.0.teardown(lost)
    }
}

#[test]
fn a_backend_without_a_tier_refuses_it_and_nothing_leaks() {
    use memgov::{BackendErrorKind, Tier};
    use memgov_conformance::{run_case, Outcome};
    let host = HostContext::new(HostConfig::default()).unwrap();
    let probe = host.probe();
    let gov = Governor::new();
    let ctx = gov.register(DeviceOnly(host), ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    let err = ctx
        .allocate(&s, Alloc::new(4096, Role::Other).tier(Tier::PinnedHost))
        .unwrap_err();
    match &err {
        GovernorError::Backend { source, .. } => {
            assert_eq!(source.kind, BackendErrorKind::Unsupported, "{err}");
            assert!(source.message.contains("no pinned-host tier"), "{err}");
        }
        other => panic!("expected the backend's refusal, got {other:?}"),
    }
    let snap = ctx.snapshot();
    assert_eq!(
        (
            snap.pins.total(),
            snap.tier(Tier::PinnedHost).unwrap().charged
        ),
        (1, 0),
        "only the stream's pin; nothing charged: {snap:?}"
    );
    // The device tier is the backend's own.
    drop(
        ctx.allocate(&s, Alloc::new(4096, Role::Other).tier(Tier::Device))
            .unwrap(),
    );
    drop(s);
    ctx.retire().wait(soon()).unwrap();
    assert_eq!(probe.violations(), 0);
    // The conformance cases on pinned memory skip such a backend.
    let factory = || HostContext::new(HostConfig::default()).map(DeviceOnly);
    for case in ["pinned_host_tier", "pinned_host_release_is_stream_ordered"] {
        let outcome = run_case(case, &factory);
        assert!(
            matches!(&outcome, Outcome::Skipped(why) if why.contains("no pinned host tier")),
            "{case}: {outcome}"
        );
    }
}
