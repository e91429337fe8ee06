//! Admission around a retiring context, driven as a model swap is: the old
//! model's context retires while the new one waits for room on the same
//! device.
//!
//! * A context that stopped accepting work admits nothing that had to wait,
//!   however the wait ended (room made by a settlement, a limit change, a
//!   pressure responder), and refuses with the documented error when `force`
//!   closed its gate meanwhile.
//!
//! Every outcome is fixed by the order the test drives (parked frees fired
//! by hand, room made while the waiter sleeps); the only polling is
//! `eventually`, which waits for a state, never decides an outcome.

use memgov::null::{NullContext, NullControls};
use memgov::{
    Admission, ContextConfig, ContextHandle, Governor, GovernorError, ProviderContextPinError, Role,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn waiting(timeout: Duration) -> Admission {
    Admission::WaitForPending { timeout }
}

fn is_unavailable(r: &Result<(), GovernorError>) -> bool {
    matches!(
        r,
        Err(GovernorError::Pin(
            ProviderContextPinError::ContextUnavailable(_)
        ))
    )
}

/// A context on the null device whose frees park until fired by hand, with
/// a 1 MiB budget and one 1 MiB release pending; a thread allocating 1 MiB
/// waits for it. Returns the context, its stream, the parked frees and the
/// waiter's result channel, once the waiter is waiting.
fn waiter_on_a_full_context(
    gov: &Governor<NullContext>,
) -> (
    ContextHandle<NullContext>,
    memgov::GovernedStream<NullContext>,
    NullControls,
    std::sync::mpsc::Receiver<Result<(), GovernorError>>,
) {
    let null = NullContext::deferred(4);
    let parked = null.controls();
    let ctx = gov.register(
        null,
        ContextConfig::new()
            .budget(MIB)
            .admission(waiting(Duration::from_secs(60))),
    );
    let s = ctx.create_stream("s").unwrap();
    drop(ctx.allocate(&s, MIB, Role::Weights).unwrap()); // parked: pending
    let (tx, rx) = std::sync::mpsc::channel();
    let (c2, s2) = (ctx.clone(), s.clone());
    std::thread::spawn(move || {
        let _ = tx.send(c2.allocate(&s2, MIB, Role::Weights).map(drop));
    });
    eventually("the allocation waits", || {
        ctx.snapshot().counters.admission_waits == 1
    });
    (ctx, s, parked, rx)
}

/// Room appears while the waiter sleeps (a limit change wakes nobody), then
/// retire wakes it: the attempt would fit, and it must not be made.
#[test]
fn a_wait_that_retire_ends_admits_nothing_even_where_it_would_fit() {
    let gov = Governor::new();
    let (ctx, s, parked, rx) = waiter_on_a_full_context(&gov);
    ctx.set_budget(2 * MIB);
    let handle = ctx.retire();
    let result = rx.recv_timeout(Duration::from_secs(10)).expect("woken");
    assert!(is_unavailable(&result), "{result:?}");
    let snap = ctx.snapshot();
    assert_eq!(
        snap.counters.allocations, 1,
        "nothing admitted after retire"
    );
    assert_eq!(snap.pins.other, 0, "the waiter's pin is gone");
    drop(s);
    parked.retire_parked();
    let report = handle.wait(soon()).unwrap();
    assert_eq!(report.retired_releases, 1);
    assert_eq!(ctx.snapshot().charged, 0);
}

/// Retire while the parked free settles: whichever the waiter sees first,
/// it is refused, every time.
#[test]
fn retire_racing_a_settlement_never_admits_a_waiter() {
    for round in 0..40 {
        let gov = Governor::new();
        let (ctx, s, parked, rx) = waiter_on_a_full_context(&gov);
        let handle = ctx.retire();
        assert!(parked.retire_one());
        let result = rx.recv_timeout(Duration::from_secs(10)).expect("woken");
        assert!(is_unavailable(&result), "round {round}: {result:?}");
        assert_eq!(ctx.snapshot().counters.allocations, 1, "round {round}");
        drop(s);
        parked.retire_parked();
        handle.wait(soon()).unwrap();
    }
}

/// A pressure responder frees room, then retires and forces the context:
/// the next attempt finds room and a closed gate. The allocation is refused
/// with the error a retiring context gives (`allocate` documents it), not
/// with `Reclaimed`, which is for buffers and streams that existed.
#[test]
fn an_allocation_after_force_is_refused_as_retiring() {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new().budget(MIB));
    let s = ctx.create_stream("s").unwrap();
    let held = Arc::new(Mutex::new(Some(
        ctx.allocate(&s, MIB, Role::Weights).unwrap(),
    )));
    let forced = Arc::new(Mutex::new(None));
    {
        let (ctx2, held, forced) = (ctx.clone(), held.clone(), forced.clone());
        ctx.add_pressure_responder(move |_| {
            drop(held.lock().unwrap().take()); // room: the null device frees inline
            let handle = ctx2.retire();
            // This thread's allocation still holds its pin: force revokes
            // the stream, closes the gate, and reports what is outstanding.
            let outstanding = handle.force(Instant::now()).unwrap_err();
            *forced.lock().unwrap() = Some(outstanding.to_string());
            MIB
        });
    }
    let result = ctx.allocate(&s, MIB, Role::Weights).map(drop);
    assert!(is_unavailable(&result), "{result:?}");
    assert!(forced.lock().unwrap().is_some(), "the responder ran force");
    assert_eq!(ctx.snapshot().counters.allocations, 1);
    drop(s);
    // The responder's RetireHandle is gone: the last pin's exit tears down.
    eventually("the background teardown", || {
        ctx.teardown_report().is_some()
    });
    assert_eq!(ctx.snapshot().charged, 0);
}
