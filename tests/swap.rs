//! Admission around a retiring context, driven as a model swap is: the old
//! model's context retires while the new one waits for room on the same
//! device.
//!
//! * A context that stopped accepting work admits nothing that had to wait,
//!   however the wait ended (room made by a settlement, a limit change, a
//!   pressure responder), and refuses with the documented error when `force`
//!   closed its gate meanwhile.
//! * On a shared budget an admission waits for what a retiring context will
//!   give back at teardown (quarantined memory, abandoned releases), and the
//!   teardown wakes it; with no retiring context it is refused at once.
//!
//! Every outcome is fixed by the order the test drives (parked frees fired
//! by hand, room made while the waiter sleeps); the only polling is
//! `eventually`, which waits for a state, never decides an outcome.

use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
use memgov::null::{NullContext, NullControls};
use memgov::{
    Admission, Alloc, ContextConfig, ContextHandle, GovernedStream, Governor, GovernorError,
    ProviderContextPinError, Role, SharedBudget, Tier, Tuning,
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
        Err(GovernorError::Pin {
            refusal: ProviderContextPinError::ContextUnavailable(_),
            ..
        })
    )
}

/// A context on the null device whose frees park until fired by hand, with
/// a 1 MiB budget and one 1 MiB release pending, and a thread allocating
/// 1 MiB that waits for it.
struct FullContext {
    ctx: ContextHandle<NullContext>,
    stream: GovernedStream<NullContext>,
    parked: NullControls,
    /// The waiting allocation's result.
    result: std::sync::mpsc::Receiver<Result<(), GovernorError>>,
}

/// A [`FullContext`], once its allocation is waiting.
fn waiter_on_a_full_context(gov: &Governor<NullContext>) -> FullContext {
    let null = NullContext::deferred(4);
    let parked = null.controls();
    let ctx = gov.register(
        null,
        ContextConfig::new()
            .budget(MIB)
            .admission(waiting(Duration::from_secs(60))),
    );
    let stream = ctx.create_stream("s").unwrap();
    drop(
        ctx.allocate(&stream, Alloc::new(MIB, Role::Weights))
            .unwrap(),
    ); // parked: pending
    let (tx, result) = std::sync::mpsc::channel();
    let (c2, s2) = (ctx.clone(), stream.clone());
    std::thread::spawn(move || {
        let _ = tx.send(c2.allocate(&s2, Alloc::new(MIB, Role::Weights)).map(drop));
    });
    eventually("the allocation waits", || {
        ctx.snapshot().counters.admission_waits == 1
    });
    FullContext {
        ctx,
        stream,
        parked,
        result,
    }
}

/// Room appears while the waiter sleeps (a limit change wakes nobody), then
/// retire wakes it: the attempt would fit, and it must not be made.
#[test]
fn a_wait_that_retire_ends_admits_nothing_even_where_it_would_fit() {
    let gov = Governor::new();
    let FullContext {
        ctx,
        stream: s,
        parked,
        result: rx,
    } = waiter_on_a_full_context(&gov);
    ctx.set_budget(Tier::Device, 2 * MIB);
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
        let FullContext {
            ctx,
            stream: s,
            parked,
            result: rx,
        } = waiter_on_a_full_context(&gov);
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
        ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).unwrap(),
    )));
    let forced = Arc::new(Mutex::new(None));
    {
        let (ctx2, held, forced) = (ctx.clone(), held.clone(), forced.clone());
        ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
            drop(held.lock().unwrap().take()); // room: the null device frees inline
            let handle = ctx2.retire();
            // This thread's allocation still holds its pin: force revokes
            // the stream, closes the gate, and reports what is outstanding.
            let outstanding = handle.force(Instant::now()).unwrap_err();
            *forced.lock().unwrap() = Some(outstanding.to_string());
            MIB
        });
    }
    let result = ctx.allocate(&s, Alloc::new(MIB, Role::Weights)).map(drop);
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

type Faulty = FaultInjecting<NullContext>;

/// A context on the null device behind the fault wrapper, its parked frees
/// fired by hand.
fn faulty(plan: FaultPlan) -> (Faulty, NullControls) {
    let null = NullContext::deferred(16);
    let parked = null.controls();
    (FaultInjecting::new(null, plan), parked)
}

/// One model swap on a 10 MiB device: the old context holds 8 MiB pending
/// and 2 MiB quarantined and is retired (nobody waits for its teardown: it
/// runs in the background); the new one asks for the whole device with a
/// 20 s timeout, and must get it once the old teardown has given the
/// quarantined bytes back.
fn swap(gov: &Governor<Faulty>, gpu: &SharedBudget, round: u32) {
    let (old_dev, old_parked) = faulty(FaultPlan::new().nth(Operation::FreeAsync, 1, Fault::Error));
    let old = gov.register(
        old_dev,
        ContextConfig::new()
            .label(format!("old-{round}"))
            .shared_budget(gpu.clone()),
    );
    let s = old.create_stream("old").unwrap();
    let quarantined = old
        .allocate(&s, Alloc::new(2 * MIB, Role::Weights))
        .unwrap();
    let pending = old
        .allocate(&s, Alloc::new(8 * MIB, Role::Weights))
        .unwrap();
    drop(quarantined); // refused by the device: quarantined
    drop(pending); // parked: pending
    drop(s);
    assert_eq!(
        (gpu.charged(), gpu.pending(), gpu.quarantined()),
        (10 * MIB, 8 * MIB, 2 * MIB),
        "round {round}"
    );
    drop(old.retire()); // torn down in the background once drained

    let (new_dev, new_parked) = faulty(FaultPlan::new());
    let new = gov.register(
        new_dev,
        ContextConfig::new()
            .label(format!("new-{round}"))
            .shared_budget(gpu.clone())
            .admission(waiting(Duration::from_secs(20))),
    );
    let s = new.create_stream("new").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (n2, s2) = (new.clone(), s.clone());
    std::thread::spawn(move || {
        let _ = tx.send(n2.allocate(&s2, Alloc::new(10 * MIB, Role::Weights)));
    });
    eventually("the new model waits", || {
        new.snapshot().counters.admission_waits >= 1
    });
    // The old model's frees execute; its teardown follows on a reaper.
    assert_eq!(old_parked.retire_parked(), 1, "round {round}");
    let weights = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the allocation returns")
        .unwrap_or_else(|e| panic!("round {round}: the swap was refused: {e}"));
    // The room came back inside the old teardown, which stores its report
    // right after.
    eventually("the old report", || old.teardown_report().is_some());
    let report = old.teardown_report().unwrap();
    assert_eq!(report.quarantined_bytes, 2 * MIB, "round {round}");
    assert!(report.backend_result.is_ok(), "round {round}: {report:?}");
    assert_eq!(gpu.charged(), 10 * MIB, "round {round}");
    drop((weights, s));
    new_parked.retire_parked();
    new.retire().wait(soon()).unwrap();
    assert_eq!(gpu.charged(), 0, "round {round}");
}

#[test]
fn a_model_swap_on_one_shared_budget_waits_for_the_old_teardown() {
    let gov = Governor::new();
    let gpu = SharedBudget::new("gpu0", 10 * MIB);
    for round in 0..50 {
        swap(&gov, &gpu, round);
    }
}

/// The same swap with abandoned releases (bytes awaiting teardown) and a
/// live buffer that holds the old context up while the new one waits.
#[test]
fn a_swap_waits_for_bytes_awaiting_the_old_teardown() {
    let gov = Governor::new();
    let gpu = SharedBudget::new("gpu0", 10 * MIB);
    for round in 0..10 {
        let (old_dev, old_parked) = faulty(
            FaultPlan::new()
                .nth(Operation::FreeAsync, 1, Fault::Error)
                .nth(Operation::FreeAsync, 2, Fault::DropSignal),
        );
        let old = gov.register(old_dev, ContextConfig::new().shared_budget(gpu.clone()));
        let s = old.create_stream("old").unwrap();
        drop(
            old.allocate(&s, Alloc::new(2 * MIB, Role::Weights))
                .unwrap(),
        ); // quarantined
        drop(
            old.allocate(&s, Alloc::new(6 * MIB, Role::Weights))
                .unwrap(),
        ); // abandoned
        let live = old
            .allocate(&s, Alloc::new(2 * MIB, Role::Activation))
            .unwrap();
        drop(s);
        assert_eq!(
            (gpu.quarantined(), gpu.awaiting_teardown()),
            (2 * MIB, 6 * MIB)
        );
        drop(old.retire());

        let (new_dev, new_parked) = faulty(FaultPlan::new());
        let new = gov.register(
            new_dev,
            ContextConfig::new()
                .shared_budget(gpu.clone())
                .admission(waiting(Duration::from_secs(20))),
        );
        let s = new.create_stream("new").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (n2, s2) = (new.clone(), s.clone());
        std::thread::spawn(move || {
            let _ = tx.send(
                n2.allocate(&s2, Alloc::new(10 * MIB, Role::Weights))
                    .map(drop),
            );
        });
        eventually("the new model waits", || {
            new.snapshot().counters.admission_waits >= 1
        });
        drop(live);
        assert_eq!(old_parked.retire_parked(), 1);
        let result = rx.recv_timeout(Duration::from_secs(30)).expect("returns");
        assert!(result.is_ok(), "round {round}: {result:?}");
        drop(s);
        new_parked.retire_parked();
        new.retire().wait(soon()).unwrap();
        assert_eq!(gpu.charged(), 0, "round {round}");
    }
}

/// Nothing will come back: the other context holds quarantined and live
/// bytes and is not retiring. A waiting admission is refused at once, with
/// the numbers, not at its 20 s timeout.
#[test]
fn a_shared_budget_waiter_is_refused_at_once_when_nothing_will_come_back() {
    let gov = Governor::new();
    let gpu = SharedBudget::new("gpu0", 10 * MIB);
    let (a_dev, a_parked) = faulty(FaultPlan::new().nth(Operation::FreeAsync, 1, Fault::Error));
    let a = gov.register(a_dev, ContextConfig::new().shared_budget(gpu.clone()));
    let sa = a.create_stream("a").unwrap();
    drop(a.allocate(&sa, Alloc::new(2 * MIB, Role::Weights)).unwrap()); // quarantined
    let live = a.allocate(&sa, Alloc::new(8 * MIB, Role::Weights)).unwrap();
    let (b_dev, _) = faulty(FaultPlan::new());
    let b = gov.register(
        b_dev,
        ContextConfig::new()
            .shared_budget(gpu.clone())
            .admission(waiting(Duration::from_secs(20))),
    );
    let sb = b.create_stream("b").unwrap();
    let started = Instant::now();
    let err = b
        .allocate(&sb, Alloc::new(10 * MIB, Role::Weights))
        .unwrap_err();
    let took = started.elapsed();
    let numbers = err.budget().unwrap_or_else(|| panic!("{err}"));
    assert_eq!(
        (numbers.quarantined, numbers.pending),
        (2 * MIB, 0),
        "{err}"
    );
    assert!(took < Duration::from_secs(5), "refused after {took:?}");
    assert_eq!(b.snapshot().counters.admission_waits, 0);
    drop((live, sa, sb));
    a_parked.retire_parked();
    b.retire().wait(soon()).unwrap();
    a.retire().wait(soon()).unwrap();
    assert_eq!(gpu.charged(), 0);
}

// ---------------------------------------------------------------------------
// The snapshot's peak: the most bytes live at once, whether the allocations
// were served from budget leases or not; exact across streams with
// `exact_peak`, else the sum of each stream shard's own peak.

mod peak {
    use super::*;
    use memgov::DeviceBuffer;
    use proptest::prelude::*;
    use std::sync::Barrier;

    const KIB: u64 = 1024;

    #[derive(Debug, Clone)]
    enum Step {
        /// Allocate on stream `stream` (of 3) `kib` KiB of role `role`.
        Alloc {
            stream: usize,
            kib: u64,
            role: usize,
        },
        /// Release the `pick`-th live buffer (modulo how many there are),
        /// on its own stream or on stream `on`.
        Release { pick: usize, on: Option<usize> },
        /// The device executes every parked free.
        Settle,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0..3usize, 1..3072u64, 0..5usize)
                .prop_map(|(stream, kib, role)| Step::Alloc { stream, kib, role }),
            3 => (any::<usize>(), proptest::option::of(0..3usize))
                .prop_map(|(pick, on)| Step::Release { pick, on }),
            1 => Just(Step::Settle),
        ]
    }

    /// Runs `steps` on a context of the null device whose frees park until a
    /// `Settle` (so bytes stay pending, charged and not live), with budget
    /// leases of `chunk` bytes (0: off) and a 16 MiB budget (some
    /// allocations are refused), and compares after every step the
    /// snapshot's peak with the most bytes the reference ever held live
    /// (`exact`), or with the sum of the most each stream ever held (its
    /// three streams are on three shards).
    fn run(steps: &[Step], chunk: u64, exact: bool) -> Result<(), TestCaseError> {
        let gov = Governor::new();
        let null = NullContext::deferred(64);
        let parked = null.controls();
        let ctx = gov.register(
            null,
            ContextConfig::new()
                .budget(16 * MIB)
                .tuning(Tuning::new().lease_chunk(chunk).exact_peak(exact)),
        );
        let streams: Vec<GovernedStream<NullContext>> = (0..3)
            .map(|i| ctx.create_stream(format!("s{i}")).unwrap())
            .collect();
        let mut live: Vec<DeviceBuffer<NullContext>> = Vec::new();
        let (mut live_bytes, mut peak) = (0u64, 0u64);
        // Per stream: bytes live on it, and the most ever.
        let (mut on_stream, mut stream_peak) = ([0u64; 3], [0u64; 3]);
        for (i, s) in steps.iter().enumerate() {
            match *s {
                Step::Alloc { stream, kib, role } => {
                    let bytes = kib * KIB;
                    match ctx.allocate(&streams[stream], Alloc::new(bytes, Role::ALL[role])) {
                        Ok(b) => {
                            live.push(b);
                            live_bytes += bytes;
                            peak = peak.max(live_bytes);
                            on_stream[stream] += bytes;
                            stream_peak[stream] = stream_peak[stream].max(on_stream[stream]);
                        }
                        Err(GovernorError::BudgetExceeded(_)) => {}
                        Err(e) => return Err(TestCaseError::fail(format!("step {i}: {e}"))),
                    }
                }
                Step::Release { pick, on } => {
                    if live.is_empty() {
                        continue;
                    }
                    let b = live.swap_remove(pick % live.len());
                    live_bytes -= b.len();
                    let own = streams
                        .iter()
                        .position(|s| s.label() == b.stream_label())
                        .unwrap();
                    on_stream[own] -= b.len();
                    match on {
                        Some(k) => b
                            .release_on(&streams[k])
                            .map_err(|e| TestCaseError::fail(format!("step {i}: {}", e.error)))?,
                        None => drop(b),
                    }
                }
                Step::Settle => {
                    parked.retire_parked();
                }
            }
            let snap = ctx.snapshot();
            prop_assert_eq!(snap.total().live_bytes, live_bytes, "step {}: live", i);
            let used = stream_peak.iter().filter(|&&p| p > 0).count();
            if exact {
                prop_assert_eq!(snap.peak, peak, "step {}: peak", i);
                prop_assert!(snap.peak_exact);
            } else {
                let sum: u64 = stream_peak.iter().sum();
                prop_assert_eq!(snap.peak, sum, "step {}: sum of the streams' peaks", i);
                prop_assert!(
                    snap.peak >= peak,
                    "step {}: {} < {} ever live",
                    i,
                    snap.peak,
                    peak
                );
                prop_assert_eq!(
                    snap.peak_exact,
                    used <= 1,
                    "step {}: {} streams used",
                    i,
                    used
                );
                if used <= 1 {
                    prop_assert_eq!(snap.peak, peak, "step {}: one stream", i);
                }
            }
            prop_assert!(
                snap.peak_budget_held >= snap.charged && snap.peak_budget_held >= peak,
                "step {}: {} held at most, {} charged, {} peak",
                i,
                snap.peak_budget_held,
                snap.charged,
                peak
            );
        }
        drop(live);
        drop(streams);
        parked.retire_parked();
        let report = ctx.retire().wait(soon()).unwrap();
        prop_assert!(report.backend_result.is_ok());
        if exact {
            prop_assert_eq!(ctx.snapshot().peak, peak);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn peak_is_the_most_ever_live_with_and_without_leases(
            steps in proptest::collection::vec(step(), 1..60),
            chunk in prop_oneof![Just(0u64), Just(64 * KIB), Just(2 * MIB)],
            exact in any::<bool>(),
        ) {
            run(&steps, chunk, exact)?;
        }
    }

    /// Four threads on four streams of one context (leases on), in rounds:
    /// each allocates its size for the round, all meet, each releases, all
    /// meet again. With exact peaks, the most live at once is exactly the
    /// largest round's sum, whichever shard served what; without, the peak
    /// is the sum of each thread's largest size, and says it is not exact.
    #[test]
    fn peak_is_exact_across_streams_allocating_together() {
        rounds_of_four_threads(true);
    }

    #[test]
    fn per_stream_peaks_add_up_across_streams_allocating_together() {
        rounds_of_four_threads(false);
    }

    fn rounds_of_four_threads(exact: bool) {
        const THREADS: usize = 4;
        const ROUNDS: u64 = 200;
        let size = |t: usize, r: u64| (1 + (r * 7 + t as u64 * 13) % 37) * 16 * KIB;
        let expected = if exact {
            (0..ROUNDS)
                .map(|r| (0..THREADS).map(|t| size(t, r)).sum::<u64>())
                .max()
                .unwrap()
        } else {
            (0..THREADS)
                .map(|t| (0..ROUNDS).map(|r| size(t, r)).max().unwrap())
                .sum::<u64>()
        };
        let gov = Governor::new();
        let ctx = gov.register(
            NullContext::new(),
            ContextConfig::new()
                .budget(64 * MIB)
                .tuning(Tuning::new().exact_peak(exact)),
        );
        let (held, freed) = (Barrier::new(THREADS), Barrier::new(THREADS));
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (ctx, held, freed) = (&ctx, &held, &freed);
                scope.spawn(move || {
                    let s = ctx.create_stream(format!("t{t}")).unwrap();
                    for r in 0..ROUNDS {
                        let b = ctx
                            .allocate(&s, Alloc::new(size(t, r), Role::Activation))
                            .unwrap();
                        held.wait();
                        drop(b);
                        freed.wait();
                    }
                });
            }
        });
        let snap = ctx.snapshot();
        assert_eq!((snap.peak, snap.peak_exact), (expected, exact));
        assert_eq!((snap.charged, snap.total().live_bytes), (0, 0));
        if exact {
            assert!(snap.peak_budget_held >= expected);
        }
    }
}

// --- Sleep and wake: suspended bytes leave every level and come back
// through admission. ---

mod sleep {
    use super::MIB;
    use memgov::host::{HostConfig, HostContext, HostControls};
    use memgov::{
        Alloc, BackendError, BackendErrorKind, BudgetScope, CacheConfig, ContextConfig,
        ContextHandle, Governor, GovernorError, ProcessBudget, ProviderContextPinError, Role,
        SharedBudget, SleepState,
    };
    use std::time::Duration;

    /// Two devices under one process budget: `a` on gpu0, `b` on gpu1.
    struct Tree {
        gov: Governor<HostContext>,
        process: ProcessBudget,
        gpu0: SharedBudget,
        gpu1: SharedBudget,
        a: ContextHandle<HostContext>,
        b: ContextHandle<HostContext>,
        a_controls: HostControls,
    }

    fn tree(process_limit: u64, config: impl Fn(ContextConfig) -> ContextConfig) -> Tree {
        let process = ProcessBudget::new("proc", process_limit);
        let gpu0 = SharedBudget::with_parent("gpu0", 100 * MIB, &process);
        let gpu1 = SharedBudget::with_parent("gpu1", 100 * MIB, &process);
        let gov = Governor::new();
        let host_a = HostContext::new(HostConfig::default()).unwrap();
        let a_controls = host_a.controls();
        let a = gov.register(
            host_a,
            config(ContextConfig::new().label("a").shared_budget(gpu0.clone())),
        );
        let b = gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new().label("b").shared_budget(gpu1.clone()),
        );
        Tree {
            gov,
            process,
            gpu0,
            gpu1,
            a,
            b,
            a_controls,
        }
    }

    impl Tree {
        /// Charged on a's context, gpu0, and the process.
        fn charged(&self) -> (u64, u64, u64) {
            (
                self.a.snapshot().charged,
                self.gpu0.charged(),
                self.process.charged(),
            )
        }

        /// Retire both contexts and check that every level holds nothing.
        fn balance(self) {
            for c in [&self.a, &self.b] {
                let report = c.retire().wait_timeout(Duration::from_secs(10)).unwrap();
                assert!(report.backend_result.is_ok(), "{report:?}");
                let s = c.snapshot();
                assert_eq!((s.charged, s.suspended), (0, 0), "{s:?}");
            }
            assert_eq!(
                (
                    self.gpu0.charged(),
                    self.gpu1.charged(),
                    self.process.charged()
                ),
                (0, 0, 0),
                "every level back to 0 after teardown"
            );
            drop(self.gov);
        }
    }

    fn no_op(_: &HostContext) -> Result<(), BackendError> {
        Ok(())
    }

    /// The identity the books keep, read from a quiet context's snapshot.
    fn identity_holds<C: memgov::DeviceContext>(c: &ContextHandle<C>) {
        let s = c.snapshot();
        let device = &s.by_tier[0];
        assert_eq!(
            s.charged,
            device.live_bytes
                + device.pending_bytes
                + device.quarantined_bytes
                + s.awaiting_teardown
                + s.reserved
                + s.outside_bytes
                + s.cache.cached_bytes
                - s.suspended,
            "charged = live + pending + quarantined + awaiting + reserved + outside + cached - suspended: {s:?}"
        );
    }

    #[test]
    fn sleep_frees_every_level_and_wake_readmits_or_refuses_with_nothing_changed() {
        let t = tree(100 * MIB, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let weights =
            t.a.allocate(&sa, Alloc::new(60 * MIB, Role::Weights))
                .unwrap();
        let kv =
            t.a.allocate(&sa, Alloc::new(20 * MIB, Role::KvCache))
                .unwrap();
        assert_eq!(t.charged(), (80 * MIB, 80 * MIB, 80 * MIB));

        let slept = t.a.sleep_with(&[], no_op).unwrap();
        assert_eq!(slept.suspended, 80 * MIB);
        assert_eq!(slept.by_role[Role::Weights as usize], 60 * MIB);
        assert_eq!(t.charged(), (0, 0, 0), "the sleeping bytes are on no level");
        let s = t.a.snapshot();
        assert_eq!((s.suspended, s.sleep), (80 * MIB, SleepState::Asleep));
        assert_eq!(s.role(Role::KvCache).suspended_bytes, 20 * MIB);
        assert_eq!(s.role(Role::KvCache).live_bytes, 20 * MIB, "still live");
        identity_holds(&t.a);

        // Another device under the same process uses the room.
        let sb = t.b.create_stream("b").unwrap();
        let big =
            t.b.allocate(&sb, Alloc::new(90 * MIB, Role::Activation))
                .unwrap();
        // The wake no longer fits under the process budget: refused, by that
        // level, with nothing changed.
        let err = t.a.wake_with(&[], no_op).unwrap_err();
        let b = err.budget().expect("a budget refusal");
        assert_eq!(b.scope, BudgetScope::Process("proc".into()), "{err}");
        assert_eq!(b.requested, 60 * MIB, "the first role's suspended bytes");
        assert_eq!(t.a.sleep_state(), SleepState::Asleep);
        assert_eq!(t.charged(), (0, 0, 90 * MIB));
        assert_eq!(t.a.snapshot().suspended, 80 * MIB);

        drop(big);
        sb.synchronize().unwrap();
        let woken = t.a.wake_with(&[], no_op).unwrap();
        assert_eq!(woken.resumed, 80 * MIB);
        assert_eq!(t.a.sleep_state(), SleepState::Awake);
        assert_eq!(t.charged(), (80 * MIB, 80 * MIB, 80 * MIB));
        assert_eq!(t.a.snapshot().suspended, 0);
        identity_holds(&t.a);
        drop((weights, kv, sa, sb));
        t.balance();
    }

    #[test]
    fn sleeping_some_roles_suspends_only_their_device_bytes() {
        let t = tree(u64::MAX, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let weights =
            t.a.allocate(&sa, Alloc::new(30 * MIB, Role::Weights))
                .unwrap();
        let kv =
            t.a.allocate(&sa, Alloc::new(20 * MIB, Role::KvCache))
                .unwrap();
        let pinned =
            t.a.allocate(
                &sa,
                Alloc::new(5 * MIB, Role::KvCache).tier(memgov::Tier::PinnedHost),
            )
            .unwrap();
        let slept = t.a.sleep_with(&[Role::KvCache], no_op).unwrap();
        assert_eq!(slept.suspended, 20 * MIB, "pinned host bytes do not sleep");
        assert_eq!(t.charged(), (30 * MIB, 30 * MIB, 30 * MIB));
        identity_holds(&t.a);
        // A weights buffer released while the cache sleeps gives back its own
        // bytes, not the sleeping ones.
        drop(weights);
        sa.synchronize().unwrap();
        assert_eq!(t.charged(), (0, 0, 0));
        assert_eq!(t.a.snapshot().suspended, 20 * MIB);
        t.a.wake_with(&[], no_op).unwrap();
        assert_eq!(t.charged(), (20 * MIB, 20 * MIB, 20 * MIB));
        drop((kv, pinned, sa));
        t.balance();
    }

    #[test]
    fn roles_put_to_sleep_together_wake_apart_and_the_books_follow_each() {
        let t = tree(100 * MIB, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let weights =
            t.a.allocate(&sa, Alloc::new(30 * MIB, Role::Weights))
                .unwrap();
        let kv =
            t.a.allocate(&sa, Alloc::new(20 * MIB, Role::KvCache))
                .unwrap();
        let slept =
            t.a.sleep_with(&[Role::Weights, Role::KvCache], no_op)
                .unwrap();
        assert_eq!(slept.suspended, 50 * MIB);
        assert_eq!(t.a.sleeping_roles(), [Role::Weights, Role::KvCache]);

        // vLLM's level-2 wake: the weights first (to reload them), the KV
        // cache later.
        let woken = t.a.wake_with(&[Role::Weights], no_op).unwrap();
        assert_eq!(woken.resumed, 30 * MIB, "only the weights' bytes");
        assert_eq!(woken.by_role[Role::Weights as usize], 30 * MIB);
        assert_eq!(woken.by_role[Role::KvCache as usize], 0);
        assert_eq!(t.charged(), (30 * MIB, 30 * MIB, 30 * MIB));
        let s = t.a.snapshot();
        assert_eq!(s.sleep, SleepState::Asleep, "the KV cache still sleeps");
        assert!(s.role(Role::KvCache).asleep, "{s:?}");
        assert!(!s.role(Role::Weights).asleep, "{s:?}");
        assert_eq!(s.role(Role::KvCache).suspended_bytes, 20 * MIB);
        assert_eq!(s.suspended, 20 * MIB);
        assert_eq!(t.a.sleeping_roles(), [Role::KvCache]);
        identity_holds(&t.a);

        // The weights are awake: waking them again is refused by name, with
        // nothing changed; so is putting the KV cache to sleep again.
        let again = t.a.wake_with(&[Role::Weights], no_op).unwrap_err();
        assert!(
            matches!(
                again,
                GovernorError::Sleep {
                    operation: "wake",
                    state: SleepState::Awake,
                    role: Some(Role::Weights),
                    ..
                }
            ),
            "{again}"
        );
        assert!(again.to_string().contains("weights role"), "{again}");
        let twice = t.a.sleep_with(&[Role::KvCache], no_op).unwrap_err();
        assert!(
            matches!(
                twice,
                GovernorError::Sleep {
                    state: SleepState::Asleep,
                    role: Some(Role::KvCache),
                    ..
                }
            ),
            "{twice}"
        );
        assert_eq!(t.a.snapshot().suspended, 20 * MIB);

        // The KV cache wakes later, on its own.
        let woken = t.a.wake_with(&[Role::KvCache], no_op).unwrap();
        assert_eq!(woken.resumed, 20 * MIB);
        assert_eq!(t.a.sleep_state(), SleepState::Awake);
        assert!(t.a.sleeping_roles().is_empty());
        assert_eq!(t.charged(), (50 * MIB, 50 * MIB, 50 * MIB));
        identity_holds(&t.a);

        // A role sleeps while another sleeps already, and a wake naming none
        // wakes both.
        t.a.sleep_with(&[Role::KvCache], no_op).unwrap();
        t.a.sleep_with(&[Role::Weights], no_op).unwrap();
        assert_eq!(t.charged(), (0, 0, 0));
        assert_eq!(t.a.wake_with(&[], no_op).unwrap().resumed, 50 * MIB);
        assert_eq!(t.a.sleep_state(), SleepState::Awake);
        drop((weights, kv, sa));
        t.balance();
    }

    #[test]
    fn a_wake_of_one_role_while_another_wakes_is_refused_and_neither_loses_its_state() {
        use std::sync::Barrier;
        let t = tree(u64::MAX, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let weights =
            t.a.allocate(&sa, Alloc::new(30 * MIB, Role::Weights))
                .unwrap();
        let kv =
            t.a.allocate(&sa, Alloc::new(20 * MIB, Role::KvCache))
                .unwrap();
        t.a.sleep_with(&[Role::Weights, Role::KvCache], no_op)
            .unwrap();
        // The weights' wake is held inside its backend call while another
        // thread wakes the KV cache.
        let (inside, tried) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|scope| {
            let a = &t.a;
            let waking = scope.spawn(|| {
                a.wake_with(&[Role::Weights], |_| {
                    inside.wait();
                    tried.wait();
                    Ok(())
                })
            });
            inside.wait();
            assert_eq!(t.a.sleep_state(), SleepState::Waking);
            let refused = t.a.wake_with(&[Role::KvCache], no_op).unwrap_err();
            assert!(
                matches!(
                    refused,
                    GovernorError::Sleep {
                        state: SleepState::Waking,
                        role: None,
                        ..
                    }
                ),
                "{refused}"
            );
            tried.wait();
            assert_eq!(waking.join().unwrap().unwrap().resumed, 30 * MIB);
        });
        // The weights' wake ended with the KV cache still asleep; its own
        // wake, retried, admits its bytes.
        assert_eq!(t.a.sleeping_roles(), [Role::KvCache]);
        assert_eq!(t.a.snapshot().suspended, 20 * MIB);
        assert_eq!(
            t.a.wake_with(&[Role::KvCache], no_op).unwrap().resumed,
            20 * MIB
        );
        assert_eq!(t.charged(), (50 * MIB, 50 * MIB, 50 * MIB));
        identity_holds(&t.a);
        drop((weights, kv, sa));
        t.balance();
    }

    #[test]
    fn a_release_while_asleep_gives_back_nothing_twice() {
        let t = tree(u64::MAX, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let one =
            t.a.allocate(&sa, Alloc::new(10 * MIB, Role::KvCache))
                .unwrap();
        let two =
            t.a.allocate(&sa, Alloc::new(30 * MIB, Role::KvCache))
                .unwrap();
        t.a.sleep_with(&[], no_op).unwrap();
        // Released and settled while asleep: nothing is given back (it was
        // on no level), and it is no longer suspended.
        drop(one);
        sa.synchronize().unwrap();
        assert_eq!(t.charged(), (0, 0, 0));
        assert_eq!(t.a.snapshot().suspended, 30 * MIB);
        identity_holds(&t.a);
        // A buffer allocated while asleep is charged like any other.
        let three =
            t.a.allocate(&sa, Alloc::new(5 * MIB, Role::Workspace))
                .unwrap();
        assert_eq!(t.charged(), (5 * MIB, 5 * MIB, 5 * MIB));
        let woken = t.a.wake_with(&[], no_op).unwrap();
        assert_eq!(woken.resumed, 30 * MIB, "only what is still suspended");
        assert_eq!(t.charged(), (35 * MIB, 35 * MIB, 35 * MIB));
        identity_holds(&t.a);
        drop((two, three, sa));
        t.balance();
    }

    #[test]
    fn a_release_queued_asleep_is_pending_on_no_level_until_it_settles_or_is_abandoned() {
        use memgov::null::NullContext;
        let gpu = SharedBudget::new("gpu", 100 * MIB);
        let gov = Governor::new();
        let null = NullContext::deferred(8);
        let parked = null.controls();
        let c = gov.register(null, ContextConfig::new().shared_budget(gpu.clone()));
        let s = c.create_stream("s").unwrap();
        let settles = c.allocate(&s, Alloc::new(10 * MIB, Role::KvCache)).unwrap();
        let abandoned = c.allocate(&s, Alloc::new(20 * MIB, Role::KvCache)).unwrap();
        let kept = c.allocate(&s, Alloc::new(30 * MIB, Role::KvCache)).unwrap();
        // A release queued before the sleep stays charged until it settles.
        let before = c.allocate(&s, Alloc::new(5 * MIB, Role::KvCache)).unwrap();
        drop(before);
        c.sleep_with(&[], |_| Ok(())).unwrap();
        assert_eq!(
            gpu.charged(),
            5 * MIB,
            "the pending release is still charged"
        );
        drop(settles);
        let snap = c.snapshot();
        assert_eq!(snap.role(Role::KvCache).pending_bytes, 15 * MIB);
        assert_eq!(
            snap.suspended,
            60 * MIB,
            "50 MiB live asleep + 10 MiB released asleep"
        );
        assert_eq!((gpu.charged(), gpu.pending()), (5 * MIB, 5 * MIB));
        identity_holds(&c);
        // Both settle: only the release queued awake gives bytes back.
        assert_eq!(parked.retire_parked(), 2);
        assert_eq!((gpu.charged(), gpu.pending()), (0, 0));
        assert_eq!(c.snapshot().suspended, 50 * MIB);
        identity_holds(&c);
        // One queued asleep that never runs: abandoned by the teardown of a
        // lost device, and nothing is held for it.
        drop(abandoned);
        c.mark_lost("test");
        drop((kept, s));
        let report = c.retire().wait_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(report.abandoned_releases, 1, "{report:?}");
        assert_eq!(report.awaiting_teardown_bytes, 0, "{report:?}");
        let snap = c.snapshot();
        assert_eq!((snap.charged, snap.suspended), (0, 0), "{snap:?}");
        assert_eq!(
            (gpu.charged(), gpu.pending(), gpu.awaiting_teardown()),
            (0, 0, 0)
        );
    }

    #[test]
    fn teardown_while_asleep_balances_every_level() {
        let t = tree(u64::MAX, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let kept =
            t.a.allocate(&sa, Alloc::new(10 * MIB, Role::Weights))
                .unwrap();
        let refused =
            t.a.allocate(&sa, Alloc::new(20 * MIB, Role::KvCache))
                .unwrap();
        t.a.sleep_with(&[], no_op).unwrap();
        // A release refused while asleep: quarantined, still suspended.
        t.a_controls.refuse_next_frees(1);
        drop(refused);
        let s = t.a.snapshot();
        assert_eq!(s.role(Role::KvCache).quarantined_bytes, 20 * MIB);
        assert_eq!((s.charged, s.suspended), (0, 30 * MIB));
        identity_holds(&t.a);
        // Teardown while asleep, with a live buffer reclaimed by force.
        let report =
            t.a.retire()
                .force(std::time::Instant::now() + Duration::from_secs(10))
                .unwrap();
        assert_eq!(report.reclaimed_buffers, 1);
        drop((kept, sa));
        t.balance();
    }

    #[test]
    fn a_lost_device_while_asleep_balances_every_level() {
        let t = tree(u64::MAX, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let buffer =
            t.a.allocate(&sa, Alloc::new(10 * MIB, Role::Weights))
                .unwrap();
        t.a.sleep_with(&[], no_op).unwrap();
        t.a.mark_lost("test");
        drop(buffer);
        assert!(matches!(
            t.a.wake_with(&[], no_op),
            Err(GovernorError::DeviceLost { .. })
        ));
        drop(sa);
        t.balance();
    }

    #[test]
    fn sleep_empties_the_block_cache_first() {
        let t = tree(u64::MAX, |c| c.cache(CacheConfig::new(64 * MIB)));
        let sa = t.a.create_stream("a").unwrap();
        let live =
            t.a.allocate(&sa, Alloc::new(4 * MIB, Role::KvCache))
                .unwrap();
        drop(
            t.a.allocate(&sa, Alloc::new(8 * MIB, Role::KvCache))
                .unwrap(),
        );
        assert!(
            t.a.snapshot().cache.cached_bytes > 0,
            "the block was cached"
        );
        let slept = t.a.sleep_with(&[], no_op).unwrap();
        sa.synchronize().unwrap();
        assert_eq!(t.a.snapshot().cache.cached_bytes, 0);
        assert_eq!(
            slept.suspended,
            4 * MIB,
            "the cached block is not suspended"
        );
        assert_eq!(t.charged(), (0, 0, 0));
        t.a.wake_with(&[], no_op).unwrap();
        drop((live, sa));
        t.balance();
    }

    #[test]
    fn sleep_and_wake_out_of_turn_are_typed_errors_with_nothing_changed() {
        let t = tree(u64::MAX, |c| c);
        let sa = t.a.create_stream("a").unwrap();
        let buffer =
            t.a.allocate(&sa, Alloc::new(10 * MIB, Role::Weights))
                .unwrap();
        let not_asleep = t.a.wake_with(&[], no_op).unwrap_err();
        assert!(
            matches!(
                not_asleep,
                GovernorError::Sleep {
                    operation: "wake",
                    state: SleepState::Awake,
                    ..
                }
            ),
            "{not_asleep}"
        );
        assert!(
            not_asleep.to_string().contains("sleep_with"),
            "{not_asleep}"
        );

        // The backend's sleep fails: nothing suspended, still awake.
        let failed =
            t.a.sleep_with(&[], |_| -> Result<(), _> {
                Err(BackendError::new(
                    "host",
                    "sleep",
                    BackendErrorKind::Other,
                    "planted",
                ))
            })
            .unwrap_err();
        assert!(matches!(failed, GovernorError::Backend { .. }), "{failed}");
        assert_eq!(t.a.sleep_state(), SleepState::Awake);
        assert_eq!(t.charged(), (10 * MIB, 10 * MIB, 10 * MIB));

        t.a.sleep_with(&[], no_op).unwrap();
        let twice = t.a.sleep_with(&[], no_op).unwrap_err();
        assert!(
            matches!(
                twice,
                GovernorError::Sleep {
                    state: SleepState::Asleep,
                    ..
                }
            ),
            "{twice}"
        );
        // The backend's wake fails: the admission is given back, still asleep.
        let failed =
            t.a.wake_with(&[], |_| -> Result<(), _> {
                Err(BackendError::new(
                    "host",
                    "wake",
                    BackendErrorKind::Other,
                    "planted",
                ))
            })
            .unwrap_err();
        assert!(matches!(failed, GovernorError::Backend { .. }), "{failed}");
        assert_eq!(t.a.sleep_state(), SleepState::Asleep);
        assert_eq!(t.charged(), (0, 0, 0));
        assert_eq!(t.a.snapshot().suspended, 10 * MIB);

        // A retiring context neither sleeps nor wakes.
        let retire = t.a.retire();
        assert!(matches!(
            t.a.wake_with(&[], no_op),
            Err(GovernorError::Pin {
                refusal: ProviderContextPinError::ContextUnavailable(_),
                ..
            })
        ));
        assert_eq!(t.a.sleep_state(), SleepState::Asleep);
        drop((buffer, sa, retire));
        t.balance();
    }
}
