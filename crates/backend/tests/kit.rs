//! The deferred-free kit: tickets claimed exactly once, the free thread's
//! order, stop and join, and the per-stream wait for unsettled frees. Every
//! cross-thread step is ordered by channels or joins, never by sleeping.

use memgov_backend::{
    BackendProbe, FreeThread, FreeWork, RetireOutcome, RetireSignal, Stop, Take, Tickets, Unsettled,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

/// How long a test waits for a thread that must finish promptly before it
/// reports a hang as a failure (a lost wake-up would otherwise hang it).
const HANG: Duration = Duration::from_secs(30);

/// Run `f` on a thread; its result, or a failure naming `what` if it has
/// not returned within [`HANG`].
fn returns<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(HANG)
        .unwrap_or_else(|_| panic!("{what} did not return within {HANG:?}"))
}

fn recorded() -> (RetireSignal, Receiver<RetireOutcome>) {
    let (tx, rx) = channel();
    (
        RetireSignal::from_fn(move |o| {
            let _ = tx.send(o);
        }),
        rx,
    )
}

#[test]
fn a_ticket_is_claimed_by_exactly_one_of_two_racing_sides() {
    for round in 0..200u64 {
        let tickets = Arc::new(Tickets::<u64>::default());
        let probe = BackendProbe::new();
        let (signal, outcome) = recorded();
        tickets.park(round, signal, 64, round);
        let start = Arc::new(Barrier::new(2));
        // The driver's callback claims the one ticket; device loss claims
        // every ticket. Exactly one of them gets the signal.
        let callback = {
            let (tickets, start, probe) = (tickets.clone(), start.clone(), probe.clone());
            std::thread::spawn(move || {
                start.wait();
                tickets.claim(round).map(|c| c.retire(&probe)).is_some()
            })
        };
        start.wait();
        let lost: Vec<u64> = tickets
            .claim_all()
            .into_iter()
            .map(|c| c.abandon(&probe))
            .collect();
        let by_callback = callback.join().unwrap();
        assert_eq!(
            usize::from(by_callback) + lost.len(),
            1,
            "round {round}: claimed by the callback: {by_callback}, by the loss: {lost:?}"
        );
        let expected = if by_callback {
            RetireOutcome::Retired
        } else {
            RetireOutcome::Abandoned
        };
        assert_eq!(outcome.recv().unwrap(), expected);
        assert!(outcome.recv().is_err(), "a signal settled twice");
        assert_eq!(probe.frees_retired() + probe.frees_abandoned(), 1);
        assert!(tickets.is_empty());
    }
}

#[test]
fn claims_count_on_the_probe_and_hand_back_what_was_parked() {
    let tickets = Tickets::<&'static str>::default();
    let probe = BackendProbe::new();
    let (a, a_out) = recorded();
    let (b, b_out) = recorded();
    tickets.park(1, a, 100, "a");
    tickets.park(2, b, 30, "b");
    assert_eq!(tickets.len(), 2);
    let claim = tickets.claim(2).unwrap();
    assert_eq!((claim.ticket(), claim.bytes(), *claim.item()), (2, 30, "b"));
    assert_eq!(claim.abandon(&probe), "b");
    assert_eq!(tickets.claim(1).unwrap().retire(&probe), "a");
    assert!(tickets.claim(1).is_none() && tickets.claim(2).is_none());
    assert_eq!(a_out.recv().unwrap(), RetireOutcome::Retired);
    assert_eq!(b_out.recv().unwrap(), RetireOutcome::Abandoned);
    assert_eq!((probe.frees_retired(), probe.frees_abandoned()), (1, 1));
}

#[test]
#[should_panic(expected = "ticket 5 parked twice")]
fn parking_a_ticket_twice_panics() {
    let tickets = Tickets::<()>::default();
    tickets.park(5, RetireSignal::from_fn(|_| {}), 1, ());
    tickets.park(5, RetireSignal::from_fn(|_| {}), 1, ());
}

/// Where a gated `work` reports its rounds, and what lets it go on.
type Gate = (Sender<Vec<u32>>, Receiver<()>);

/// A free thread's owner that records what it ran; with a gate, `work`
/// reports each round and blocks until the test lets it go on.
struct Owner {
    frees: FreeThread<u32>,
    ran: Mutex<Vec<Vec<u32>>>,
    started: AtomicUsize,
    poll: Option<Duration>,
    gate: Mutex<Option<Gate>>,
}

impl Owner {
    fn new(take: Take, poll: Option<Duration>) -> Arc<Self> {
        Arc::new(Self {
            frees: FreeThread::new(take),
            ran: Mutex::default(),
            started: AtomicUsize::new(0),
            poll,
            gate: Mutex::new(None),
        })
    }

    /// `work` reports each round on the first channel and waits for a
    /// message on the second before it returns.
    fn gated(self: &Arc<Self>) -> (Receiver<Vec<u32>>, Sender<()>) {
        let (round_tx, round_rx) = channel();
        let (go_tx, go_rx) = channel();
        *self.gate.lock().unwrap() = Some((round_tx, go_rx));
        (round_rx, go_tx)
    }

    /// Open the gate for good and stop the thread at once.
    fn ungate_and_stop(&self) {
        *self.gate.lock().unwrap() = None;
        self.frees.stop(Stop::Now);
    }

    fn ran(&self) -> Vec<Vec<u32>> {
        self.ran.lock().unwrap().clone()
    }
}

impl FreeWork for Owner {
    type Job = u32;

    fn free_thread(&self) -> &FreeThread<u32> {
        &self.frees
    }

    fn on_start(&self) {
        self.started.fetch_add(1, Ordering::SeqCst);
    }

    fn idle_wait(&self) -> Option<Duration> {
        self.poll
    }

    fn work(&self, jobs: Vec<u32>) {
        self.ran.lock().unwrap().push(jobs.clone());
        let gate = self.gate.lock().unwrap();
        if let Some((round, go)) = &*gate {
            round.send(jobs).unwrap();
            // A test that is done with the gate drops its sender: go on.
            let _ = go.recv();
        }
    }
}

#[test]
fn the_free_thread_runs_jobs_one_at_a_time_in_order_and_finishes_the_queue_on_stop() {
    let owner = Owner::new(Take::One, None);
    for job in 1..=5 {
        owner.frees.push(job);
    }
    assert_eq!(owner.frees.len(), 5);
    assert!(FreeThread::start(&owner, "memgov-kit-test-free".into()).unwrap());
    assert!(
        !FreeThread::start(&owner, "twice".into()).unwrap(),
        "started twice"
    );
    owner.frees.stop(Stop::AfterQueue);
    assert!(!owner.frees.is_running());
    assert_eq!(owner.started.load(Ordering::SeqCst), 1);
    assert_eq!(owner.ran(), [vec![1], vec![2], vec![3], vec![4], vec![5]]);
    // Stopped: not started again, and nothing pushed now runs.
    assert!(!FreeThread::start(&owner, "again".into()).unwrap());
    owner.frees.push(6);
    assert_eq!(owner.frees.take_queued(), [6]);
}

#[test]
fn taking_all_hands_the_queue_to_work_in_one_round() {
    let owner = Owner::new(Take::All, None);
    let (rounds, go) = owner.gated();
    FreeThread::start(&owner, "memgov-kit-test-free".into()).unwrap();
    owner.frees.push(1);
    // Hold the thread in its first round while three more are queued.
    let first = next_round(&rounds);
    for job in 2..=4 {
        owner.frees.push(job);
    }
    go.send(()).unwrap();
    let mut seen = first;
    while seen.len() < 4 {
        let round = next_round(&rounds);
        go.send(()).unwrap();
        seen.extend(round);
    }
    assert_eq!(seen, [1, 2, 3, 4]);
    assert!(owner.ran().len() <= 3, "{:?}", owner.ran());
    assert_eq!(owner.ran()[1..].concat(), [2, 3, 4]);
    drop(go);
    owner.ungate_and_stop();
}

#[test]
fn stop_now_and_device_loss_leave_the_queue_to_the_caller() {
    let owner = Owner::new(Take::One, None);
    let (rounds, go) = owner.gated();
    FreeThread::start(&owner, "memgov-kit-test-free".into()).unwrap();
    for job in 1..=3 {
        owner.frees.push(job);
    }
    // The thread holds job 1; device loss takes 2 and 3 off the queue.
    assert_eq!(next_round(&rounds), [1]);
    assert_eq!(owner.frees.stop_and_take(), [2, 3]);
    owner.frees.push(4);
    go.send(()).unwrap();
    drop(go);
    // The stop is `Now`: joining does not run job 4.
    owner.frees.stop(Stop::AfterQueue);
    assert_eq!(owner.ran(), [vec![1]]);
    assert_eq!(owner.frees.take_queued(), [4]);
}

#[test]
fn an_idle_wait_polls_with_rounds_of_no_jobs() {
    let owner = Owner::new(Take::One, Some(Duration::from_millis(1)));
    let (rounds, go) = owner.gated();
    FreeThread::start(&owner, "memgov-kit-test-free".into()).unwrap();
    // Nothing is pushed: the rounds come from the idle wait running out.
    for _ in 0..3 {
        assert_eq!(next_round(&rounds), Vec::<u32>::new());
        go.send(()).unwrap();
    }
    drop(go);
    owner.ungate_and_stop();
}

#[test]
fn a_wake_with_nothing_queued_is_a_round_with_no_jobs() {
    let owner = Owner::new(Take::One, None);
    let (rounds, go) = owner.gated();
    FreeThread::start(&owner, "memgov-kit-test-free".into()).unwrap();
    // With no idle wait the thread sleeps until woken; each wake is one
    // round, so `work` can look at what the waker changed.
    owner.frees.wake();
    assert_eq!(next_round(&rounds), Vec::<u32>::new());
    go.send(()).unwrap();
    owner.ungate_and_stop();
}

/// The next round a gated owner reports.
fn next_round(rounds: &Receiver<Vec<u32>>) -> Vec<u32> {
    rounds
        .recv_timeout(HANG)
        .expect("the free thread ran no round")
}

/// An owner whose `work` stops its own free thread (a signal it fired tore
/// the context down).
struct StopsItself {
    frees: FreeThread<()>,
    done: Mutex<Option<Sender<()>>>,
}

impl FreeWork for StopsItself {
    type Job = ();

    fn free_thread(&self) -> &FreeThread<()> {
        &self.frees
    }

    fn work(&self, _: Vec<()>) {
        self.frees.stop(Stop::AfterQueue);
        if let Some(done) = self.done.lock().unwrap().take() {
            done.send(()).unwrap();
        }
    }
}

#[test]
fn the_free_thread_may_stop_itself_without_joining_itself() {
    let (tx, rx) = channel();
    let owner = Arc::new(StopsItself {
        frees: FreeThread::new(Take::One),
        done: Mutex::new(Some(tx)),
    });
    FreeThread::start(&owner, "memgov-kit-test-free".into()).unwrap();
    owner.frees.push(());
    rx.recv().unwrap();
    // The thread returned by itself (it would have deadlocked joining
    // itself); its handle was taken, so this stop joins nothing.
    owner.frees.stop(Stop::AfterQueue);
    assert!(!owner.frees.is_running());
}

/// An owner that reports where it is dropped.
struct ReportsDrop {
    frees: FreeThread<()>,
    dropped: Mutex<Sender<String>>,
}

impl FreeWork for ReportsDrop {
    type Job = ();

    fn free_thread(&self) -> &FreeThread<()> {
        &self.frees
    }

    fn idle_wait(&self) -> Option<Duration> {
        Some(Duration::from_millis(1))
    }

    fn work(&self, _: Vec<()>) {}
}

impl Drop for ReportsDrop {
    fn drop(&mut self) {
        let here = std::thread::current().name().unwrap_or("").to_owned();
        let _ = self.dropped.lock().unwrap().send(here);
    }
}

#[test]
fn a_free_thread_does_not_keep_its_dropped_owner_alive() {
    let (tx, rx) = channel();
    let owner = Arc::new(ReportsDrop {
        frees: FreeThread::new(Take::One),
        dropped: Mutex::new(tx),
    });
    FreeThread::start(&owner, "memgov-kit-test-free".into()).unwrap();
    drop(owner);
    // Dropped here, or on the free thread at the end of the round it held
    // the owner for; either way it is dropped (and the thread returns at
    // its next upgrade).
    let at = rx.recv().unwrap();
    assert!(
        [
            "memgov-kit-test-free",
            "a_free_thread_does_not_keep_its_dropped_owner_alive"
        ]
        .contains(&at.as_str()),
        "{at}"
    );
}

#[test]
fn synchronize_waits_for_its_streams_unsettled_frees() {
    let unsettled = Arc::new(Unsettled::default());
    unsettled.add(1);
    unsettled.add(1);
    unsettled.add(2);
    let (waiting_tx, waiting_rx) = channel();
    let (done_tx, done_rx) = channel();
    {
        let unsettled = unsettled.clone();
        std::thread::spawn(move || {
            waiting_tx.send(()).unwrap();
            unsettled.wait(1, || false, None);
            let _ = done_tx.send(unsettled.count(1));
        });
    }
    waiting_rx.recv().unwrap();
    unsettled.settle(2);
    unsettled.settle(1);
    // A guarded free settles when its guard drops; a handed-on one does not.
    unsettled.add_guarded(3).hand_on();
    assert_eq!(unsettled.count(3), 1);
    drop(unsettled.add_guarded(3));
    assert_eq!(unsettled.count(3), 1);
    assert!(
        done_rx.try_recv().is_err(),
        "returned with a free unsettled"
    );
    unsettled.settle(1);
    let left = done_rx
        .recv_timeout(HANG)
        .expect("the wait did not return once its stream's frees settled");
    assert_eq!(left, 0);
}

#[test]
fn a_loss_ends_the_wait_for_unsettled_frees() {
    let unsettled = Arc::new(Unsettled::default());
    let lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
    unsettled.add(9);
    let waiter = {
        let (unsettled, lost) = (unsettled.clone(), lost.clone());
        std::thread::spawn(move || unsettled.wait(9, || lost.load(Ordering::SeqCst), None))
    };
    lost.store(true, Ordering::SeqCst);
    unsettled.wake();
    returns("a wait woken after the loss", move || {
        waiter.join().unwrap()
    });
    // A loss declared without a wake is seen by a waiter that rechecks.
    let rechecks = unsettled.clone();
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let set = flag.clone();
    let waiter = std::thread::spawn(move || {
        rechecks.wait(
            9,
            || flag.load(Ordering::SeqCst),
            Some(Duration::from_millis(1)),
        )
    });
    set.store(true, Ordering::SeqCst);
    returns("a rechecking wait after a silent loss", move || {
        waiter.join().unwrap()
    });
    unsettled.clear();
    assert_eq!(unsettled.count(9), 0);
}
