//! loom models of the context lifecycle and the primitives under it.
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target-loom cargo test --release -p memgov-sync --test loom -- --nocapture --test-threads=1
//! ```
//!
//! Under `--cfg loom` every atomic, mutex and condition variable of
//! `memgov-sync` is a loom type, and the models drive the shipped types
//! directly: [`memgov_sync::Lifecycle`] (the phase, the pins and their
//! leases, the pending releases per shard, the gate, the drain and admission
//! waiters, and the transitions the governor's record calls: `begin_retire`,
//! `wait_drained`, `begin_teardown` and its `Destroyer`, `attend` /
//! `unattend` and the reaper hook), `Leases`
//! over a budget, and `Notifier`. What the governor does between two
//! transitions is shipped there too, and the models call it as the governor
//! does (`src/governor/record.rs`, `release.rs`): a backend call under a
//! `GateClaim` (`Lifecycle::enter`); a buffer's pin moved into a pending
//! release by a `Deferral` taken under that claim (`GateClaim::defer_pin`
//! counts the release pending, then `Deferral::queued` gives the pin up, or
//! `Deferral::undo` takes a refused release back) and a real
//! [`memgov_backend::RetireSignal`] fired (or dropped) on a foreign thread,
//! whose settlement is `Lifecycle::settle`. The model's `Ctx` adds only its
//! observations and checks around them, and the destroy done under the
//! `Destroyer`, where it checks that nothing is outstanding.
//!
//! Checked in every explored interleaving:
//! * no acquire succeeds after retire has been observed (by any thread that
//!   saw it happen), and no pin or backend call is ever taken after destroy;
//! * destroy runs exactly once (one `Destroyer`), and only with zero pins,
//!   zero pending releases and zero backend calls in flight;
//! * no lost wake-up: the teardown waiter always wakes after the last release
//!   or settlement, and an admission waiter after a settlement that follows
//!   its read of the epoch (loom reports a deadlock otherwise) -- with the
//!   settlement writing nothing for admission waiters unless its fenced load
//!   sees one registered (`announce_settlement`), and learning whether a
//!   teardown waiter waits from its own read-modify-write of the pending
//!   count (`ShardedCount` over `CountWord`);
//! * a pin moving into a pending release (`Deferral`), the last one of a
//!   retiring context included, never lets the teardown start between the
//!   two steps, and a refused release taken back (`Deferral::undo`) never
//!   holds the teardown;
//! * pending releases are counted per shard (`ShardedCount`) and backend
//!   calls pass through per-shard gate words (`ClaimShards`): teardown still
//!   waits for every one of them;
//! * a retiring, drained context that nobody attends is reaped exactly once,
//!   by whichever of the last pin, the last settlement and the last
//!   attendant goes last (the lifecycle's reaper hook);
//! * pins taken from a stream shard's pin lease (`Leases` over the pin word,
//!   inside `Lifecycle`) are observed by teardown, none is
//!   taken once retire was observed, and `max_pins` refusals stay exact
//!   while holders give pins back and take them again and while two
//!   refusals sweep at once; the budget leases run the same protocol;
//! * the counter never wraps: acquires beyond the maximum are refused and the
//!   count never exceeds it;
//! * a shared-budget admission refused while a retiring context holds bytes
//!   only its teardown returns waits for that teardown, and is woken with the
//!   room back (`a_retiring_member_is_waited_for_until_its_teardown_wakes`);
//! * the `spare` slot that recycles `PendingRelease` boxes (`sync::Slot`,
//!   driven as `src/governor/release.rs` does) never lets two threads own one
//!   box, drops each exactly once, and stays closed once retire has closed it;
//! * the block cache's bins (`sync::Bins`, driven as `src/governor/cache.rs`
//!   does) hand a cached block (and its pin) to one thread only, keep nothing
//!   once retire has closed them, and never keep a retire from draining.
//!
//! Every model prints how many interleavings loom explored.

#![cfg_attr(not(loom), allow(dead_code))]

#[cfg(not(loom))]
#[test]
fn loom_model_requires_cfg_loom() {
    println!("skipped: the loom model runs only under RUSTFLAGS=\"--cfg loom\" (cargo test --release -p memgov-sync --test loom)");
}

#[cfg(loom)]
use memgov_sync as sync;

#[cfg(loom)]
mod model {
    use super::sync::{
        AcquireError, Allowance, BudgetWord, Leases, Lifecycle, Notifier, Phase, Teardown,
    };
    use loom::sync::atomic::{AtomicBool, AtomicUsize};
    use loom::sync::Arc;
    use loom::thread;
    use memgov_backend::{RetireOutcome, RetireSignal};
    use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};

    /// Executions explored by all models so far (a plain std atomic: it counts
    /// model runs, it is not part of any model).
    static TOTAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// A context as the governor drives it: the shipped [`Lifecycle`] (two
    /// stream shards), driven through the same calls as the governor (a
    /// backend call under a gate claim, a release deferred, queued and
    /// settled, the destroy under the `Destroyer`), with the model's
    /// observations and checks around them. Every transition and every
    /// sequence of steps is the lifecycle's own.
    struct Ctx {
        life: Lifecycle<2>,
        /// Set by a holder while it holds a pin taken from a lease.
        lease_pin_held: AtomicBool,
        /// Backend calls between entering the gate and leaving it.
        calls_in_flight: AtomicUsize,
        /// Set (Release) right after `begin_retire` returns: a thread that
        /// reads it true has observed the retire.
        retire_seen: AtomicBool,
        destroys: AtomicUsize,
        destroyed: AtomicBool,
        retired: AtomicUsize,
        abandoned: AtomicUsize,
        /// Calls of the lifecycle's reaper hook (the governor starts a
        /// reaper thread there): must end at exactly one when nobody
        /// attends a drained, retiring context.
        reaps: Arc<AtomicUsize>,
    }

    impl Ctx {
        fn new(max_pins: u64) -> Self {
            Self::with_pin_chunk(max_pins, 0)
        }

        /// Pin leases of `chunk` pins per shard (0: off). Admission waiters
        /// may register (`WaitForPending`), so settlements announce.
        fn with_pin_chunk(max_pins: u64, chunk: u64) -> Self {
            let reaps = Arc::new(AtomicUsize::new(0));
            let hook = reaps.clone();
            Self {
                life: Lifecycle::new(
                    max_pins,
                    chunk,
                    true,
                    Box::new(move || {
                        hook.fetch_add(1, AcqRel);
                        true
                    }),
                ),
                lease_pin_held: AtomicBool::new(false),
                calls_in_flight: AtomicUsize::new(0),
                retire_seen: AtomicBool::new(false),
                destroys: AtomicUsize::new(0),
                destroyed: AtomicBool::new(false),
                retired: AtomicUsize::new(0),
                abandoned: AtomicUsize::new(0),
                reaps,
            }
        }

        /// `Lifecycle::acquire_pin` (`ContextInner::acquire_pin`), checked.
        fn acquire(&self) -> Result<(), AcquireError> {
            let seen = self.retire_seen.load(Acquire);
            let r = self.life.acquire_pin();
            self.check_acquired(seen, r)
        }

        /// `Lifecycle::acquire_pin_on`: out of the shard's pin lease, else a
        /// refill, else a reclaim of every idle lease; checked.
        fn acquire_on(&self, shard: usize) -> Result<(), AcquireError> {
            let seen = self.retire_seen.load(Acquire);
            let r = self.life.acquire_pin_on(shard);
            self.check_acquired(seen, r)
        }

        fn check_acquired(
            &self,
            seen: bool,
            r: Result<(), AcquireError>,
        ) -> Result<(), AcquireError> {
            if seen {
                assert_eq!(
                    r,
                    Err(AcquireError::Closed),
                    "a pin was acquired after retire was observed"
                );
            }
            if r.is_ok() {
                assert!(
                    !self.destroyed.load(Acquire),
                    "a pin was acquired after destroy"
                );
                assert!(
                    self.life.pin_claims() <= self.life.max_pins(),
                    "pin count exceeded its maximum"
                );
            }
            r
        }

        /// `Lifecycle::release_pin`.
        fn release_pin(&self) {
            assert!(
                !self.destroyed.load(Acquire),
                "a pin was released after destroy"
            );
            self.life.release_pin();
        }

        /// `Lifecycle::release_pin_on`: back into the shard's lease.
        fn release_pin_on(&self, shard: usize) {
            assert!(
                !self.destroyed.load(Acquire),
                "a pin was released after destroy"
            );
            self.life.release_pin_on(shard);
        }

        /// A backend call through the gate (`ContextInner::enter_on` and
        /// the `BackendGuard`'s `GateClaim` dropped after the call).
        fn backend_call(&self, shard: usize) -> bool {
            let Some(claim) = self.life.enter(shard) else {
                return false;
            };
            self.calls_in_flight.fetch_add(1, AcqRel);
            assert!(
                !self.destroyed.load(Acquire),
                "a backend call ran after destroy"
            );
            self.calls_in_flight.fetch_sub(1, AcqRel);
            drop(claim);
            true
        }

        /// `release()` in release.rs, on a stream of `shard`: under a gate
        /// claim, defer the buffer's pin into a pending release
        /// (`GateClaim::defer_pin`), make the signal the "driver" fires,
        /// then, the free queued, let the deferral give the pin up into the
        /// shard's lease (`Deferral::queued`) and leave the gate.
        fn queue_release(this: &Arc<Self>, shard: usize) -> RetireSignal {
            let claim = this
                .life
                .enter(shard)
                .expect("the gate is open while a buffer lives");
            let deferral = claim.defer_pin();
            let ctx = this.clone();
            let signal = RetireSignal::from_fn(move |outcome| ctx.settle(shard, outcome));
            assert!(
                !this.destroyed.load(Acquire),
                "a pin was released after destroy"
            );
            deferral.queued();
            drop(claim);
            signal
        }

        /// `release()` in release.rs when the backend refuses the free, on a
        /// stream of `shard`: under a gate claim, the pin is deferred, then
        /// the release is taken back (`Deferral::undo`), and the buffer's
        /// pin, still held, goes back on its own path (here: into the
        /// shard's lease) after the gate is left.
        fn refused_release(&self, shard: usize) {
            let claim = self
                .life
                .enter(shard)
                .expect("the gate is open while a buffer lives");
            claim.defer_pin().undo();
            drop(claim);
            self.release_pin_on(shard);
        }

        /// `PendingRelease::settle`: the books (here: the outcome counted),
        /// then `Lifecycle::settle`: atomics and wake-ups only; admission
        /// waiters are woken only if one is registered, teardown waiters
        /// only by the settlement that takes `pending` to zero with one
        /// registered in it.
        fn settle(&self, shard: usize, outcome: RetireOutcome) {
            assert!(
                !self.destroyed.load(Acquire),
                "a free retired after destroy"
            );
            match outcome {
                RetireOutcome::Retired => self.retired.fetch_add(1, Relaxed),
                RetireOutcome::Abandoned => self.abandoned.fetch_add(1, Relaxed),
            };
            self.life.settle(shard);
        }

        /// `Lifecycle::begin_retire`, then the observation of it.
        fn begin_retire(&self) {
            self.life.begin_retire();
            self.retire_seen.store(true, Release);
        }

        /// `RetireHandle::wait(None)` (`Lifecycle::wait_drained`) +
        /// `ContextInner::finish` (`Lifecycle::begin_teardown`; the winner
        /// destroys under the `Destroyer`, checking that nothing is
        /// outstanding, then `Destroyer::terminated`).
        fn wait_and_finish(&self) {
            assert!(
                self.life.wait_drained(None),
                "a wait without deadline returned unready"
            );
            match self.life.begin_teardown() {
                Teardown::Done => assert_eq!(
                    self.destroys.load(Acquire),
                    1,
                    "a second finisher returned before destroy"
                ),
                Teardown::Destroy(destroyer) => {
                    // Destroy: exactly once, at zero.
                    assert_eq!(self.life.pin_claims(), 0, "destroy with pins outstanding");
                    assert_eq!(
                        self.life.pending_count(),
                        0,
                        "destroy with a release pending"
                    );
                    assert_eq!(
                        self.calls_in_flight.load(Acquire),
                        0,
                        "destroy with a backend call in flight"
                    );
                    assert!(
                        !self.lease_pin_held.load(Acquire),
                        "destroy while a pin taken from a lease is held"
                    );
                    assert_eq!(self.destroys.fetch_add(1, AcqRel), 0, "destroy ran twice");
                    self.destroyed.store(true, Release);
                    destroyer.terminated();
                }
            }
        }
    }

    /// `admission::SettlementWaiter`: register in the epoch word, fence,
    /// read the epoch to wait past, wait for it to change (or for the
    /// context to stop accepting work).
    fn admission_wait(ctx: &Ctx, registered: &AtomicBool) -> bool {
        let life = &ctx.life;
        life.settle_epoch.register();
        loom::sync::atomic::fence(SeqCst);
        let seen = life.settle_epoch.epoch();
        registered.store(true, Release);
        let woke = life.settled.wait_until(
            || life.settle_epoch.epoch() != seen || !life.accepting(),
            None,
        );
        life.settle_epoch.unregister();
        woke
    }

    fn run(name: &str, preemption_bound: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = count.clone();
        let mut b = loom::model::Builder::new();
        if b.preemption_bound.is_none() {
            b.preemption_bound = preemption_bound;
        }
        let start = std::time::Instant::now();
        b.check(move || {
            c.fetch_add(1, Relaxed);
            f();
        });
        let n = count.load(Relaxed);
        TOTAL.fetch_add(n, Relaxed);
        println!(
            "loom: {name}: {n} interleavings explored (preemption bound {}) in {:.1?}; all models so far: {}",
            preemption_bound.map_or("none".into(), |p| p.to_string()),
            start.elapsed(),
            TOTAL.load(Relaxed)
        );
        assert!(
            n > 1,
            "loom explored only {n} interleaving(s): the model is not concurrent"
        );
    }

    /// Three threads: the retirer (main) waits for the teardown; a holder
    /// releases a buffer stream-ordered, drops the stream and tries a new pin;
    /// a foreign "driver" thread fires the RetireSignal of a release queued
    /// earlier. Destroy runs once, at zero, after the last settlement.
    #[test]
    fn retire_waits_for_holders_and_a_foreign_signal() {
        run(
            "retire / release / foreign RetireSignal (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(8));
                ctx.acquire().unwrap(); // the stream
                ctx.acquire().unwrap(); // a buffer on it
                ctx.acquire().unwrap(); // a buffer already released ...
                let queued_earlier = Ctx::queue_release(&ctx, 0); // ... whose free is queued

                let driver = thread::spawn(move || queued_earlier.retire());
                let c = ctx.clone();
                let holder = thread::spawn(move || {
                    let signal = Ctx::queue_release(&c, 1); // drop the buffer
                    let late = c.acquire();
                    let called = c.backend_call(1);
                    assert!(called, "the stream's pin keeps the gate open");
                    c.release_pin(); // drop the stream
                    if late.is_ok() {
                        c.release_pin();
                    }
                    signal.retire(); // its free executes on the stream worker
                });
                ctx.begin_retire();
                assert!(
                    ctx.acquire().is_err(),
                    "acquire after retire on the retiring thread"
                );
                ctx.wait_and_finish();
                driver.join().unwrap();
                holder.join().unwrap();
                assert_eq!(ctx.destroys.load(Acquire), 1);
                assert_eq!(ctx.retired.load(Relaxed), 2);
            },
        );
    }

    /// A RetireSignal dropped unfired on the driver thread (device gave up the
    /// free) settles as abandoned and still wakes the waiter.
    #[test]
    fn abandoned_signal_settles_and_wakes() {
        run(
            "abandoned RetireSignal on a foreign thread (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap();
                let s1 = Ctx::queue_release(&ctx, 0);
                ctx.acquire().unwrap();
                let s2 = Ctx::queue_release(&ctx, 0);
                let d1 = thread::spawn(move || drop(s1));
                let d2 = thread::spawn(move || s2.retire());
                ctx.begin_retire();
                ctx.wait_and_finish();
                d1.join().unwrap();
                d2.join().unwrap();
                assert_eq!(ctx.abandoned.load(Relaxed), 1);
                assert_eq!(ctx.retired.load(Relaxed), 1);
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// The last pin of a context moves into a pending release while it
    /// retires: a holder releases its only buffer (nothing else pins the
    /// context), and a foreign "driver" fires the signal. The deferral
    /// counts the release pending before the pin goes, so the teardown never
    /// starts in between: destroy runs once, after the settlement, at zero.
    /// With the pin given up first, loom finds the teardown in that gap.
    #[test]
    fn the_last_pin_moves_into_a_pending_release_while_retire_waits() {
        run(
            "last pin deferred into a pending release + foreign RetireSignal + retire (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire_on(1).unwrap(); // the only buffer
                let c = ctx.clone();
                let holder = thread::spawn(move || {
                    let signal = Ctx::queue_release(&c, 1);
                    thread::spawn(move || signal.retire())
                });
                ctx.begin_retire();
                ctx.wait_and_finish();
                holder.join().unwrap().join().unwrap();
                assert_eq!(ctx.retired.load(Relaxed), 1);
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// A release whose free the backend refuses (`Deferral::undo`) on one
    /// thread, a release settling on a foreign thread, and retire with its
    /// teardown waiter: the undone release never holds the teardown, the
    /// buffer's pin (kept through the undo) does until it goes, and destroy
    /// runs once, at zero (loom reports a deadlock if an undo leaves its
    /// release counted).
    #[test]
    fn a_refused_release_is_undone_while_retire_waits() {
        run(
            "refused release undone + foreign RetireSignal + retire (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap();
                let queued = Ctx::queue_release(&ctx, 0);
                ctx.acquire().unwrap(); // the buffer whose free is refused
                let driver = thread::spawn(move || queued.retire());
                let c = ctx.clone();
                let holder = thread::spawn(move || c.refused_release(1));
                ctx.begin_retire();
                ctx.wait_and_finish();
                driver.join().unwrap();
                holder.join().unwrap();
                assert_eq!(ctx.retired.load(Relaxed), 1);
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// An acquire racing retire: either it wins (and its holder's release is
    /// waited for) or it is refused; destroy never precedes the release.
    #[test]
    fn acquire_races_retire() {
        run(
            "acquire vs retire vs last release (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap();
                let c1 = ctx.clone();
                let racer = thread::spawn(move || {
                    if c1.acquire().is_ok() {
                        assert!(c1.backend_call(0), "a held pin keeps the gate open");
                        c1.release_pin();
                    }
                });
                let c2 = ctx.clone();
                let holder = thread::spawn(move || c2.release_pin());
                ctx.begin_retire();
                ctx.wait_and_finish();
                racer.join().unwrap();
                holder.join().unwrap();
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// Several threads retire and wait at once while the last pin drops:
    /// destroy runs exactly once and every retirer returns after it.
    #[test]
    fn concurrent_retire_destroys_once() {
        run(
            "concurrent retire x2 + last release (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap();
                let c1 = ctx.clone();
                let r1 = thread::spawn(move || {
                    c1.begin_retire();
                    c1.wait_and_finish();
                });
                let c2 = ctx.clone();
                let holder = thread::spawn(move || c2.release_pin());
                ctx.begin_retire();
                ctx.wait_and_finish();
                r1.join().unwrap();
                holder.join().unwrap();
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// Four threads: two retirers, a holder and a foreign driver, with a
    /// preemption bound (the unbounded space is too large for CI).
    #[test]
    fn four_threads_bounded() {
        run(
            "2 retirers + holder + foreign signal (4 threads)",
            Some(2),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap();
                ctx.acquire().unwrap();
                let queued = Ctx::queue_release(&ctx, 0);
                let driver = thread::spawn(move || queued.retire());
                let c1 = ctx.clone();
                let holder = thread::spawn(move || c1.release_pin());
                let c2 = ctx.clone();
                let r2 = thread::spawn(move || {
                    c2.begin_retire();
                    c2.wait_and_finish();
                });
                ctx.begin_retire();
                ctx.wait_and_finish();
                driver.join().unwrap();
                holder.join().unwrap();
                r2.join().unwrap();
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// An admission waiter (allocation refused, waiting for a settlement)
    /// and settlements on two foreign threads, one of them only after the
    /// waiter has read the epoch it waits past: that settlement must wake it
    /// (loom reports a deadlock otherwise), whether it or the other one sees
    /// the registration. The settlements also take `pending` to zero under a
    /// teardown waiter. A settlement writes nothing for the waiter unless
    /// its fenced load sees the registration (`announce_settlement`).
    #[test]
    fn settlement_wakes_a_registered_admission_waiter() {
        run(
            "admission waiter + 2 foreign settlements + teardown waiter (4 threads)",
            Some(2),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap();
                let early = Ctx::queue_release(&ctx, 0);
                ctx.acquire().unwrap();
                let late = Ctx::queue_release(&ctx, 1);
                let registered = Arc::new(AtomicBool::new(false));
                let (c, r) = (ctx.clone(), registered.clone());
                let waiter = thread::spawn(move || assert!(admission_wait(&c, &r)));
                let d1 = thread::spawn(move || early.retire());
                let r2 = registered.clone();
                let d2 = thread::spawn(move || {
                    while !r2.load(Acquire) {
                        thread::yield_now();
                    }
                    late.retire();
                });
                ctx.begin_retire();
                ctx.wait_and_finish();
                waiter.join().unwrap();
                d1.join().unwrap();
                d2.join().unwrap();
                assert_eq!(ctx.retired.load(Relaxed), 2);
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// `admission::admit` with a deadline: the allocation was refused, then
    /// one release settles (making room) while it decides to wait. It
    /// registers, reads the epoch, attempts again, and only then sleeps: the
    /// settlement either made room before the second attempt (which then
    /// fits) or bumps an epoch the waiter registered for (and wakes it).
    /// With the attempt before the registration, a settlement in between
    /// would leave the waiter asleep with room free (loom: deadlock).
    #[test]
    fn admission_attempts_again_after_registering() {
        run(
            "admission re-attempt after registering + one settlement (2 threads)",
            None,
            || {
                let ctx = Arc::new(Ctx::new(4));
                // The room a settlement makes (the budget, in the model).
                let room = Arc::new(AtomicBool::new(false));
                let (c, r) = (ctx.clone(), room.clone());
                let settler = thread::spawn(move || {
                    r.store(true, Release);
                    c.life.announce_settlement();
                });
                // The first attempt was refused (no room yet, as far as it
                // knows); now the wait.
                let life = &ctx.life;
                life.settle_epoch.register();
                loom::sync::atomic::fence(SeqCst);
                let seen = life.settle_epoch.epoch();
                if !room.load(Acquire) {
                    assert!(life
                        .settled
                        .wait_until(|| life.settle_epoch.epoch() != seen, None));
                    assert!(room.load(Acquire), "woken without the room");
                }
                life.settle_epoch.unregister();
                settler.join().unwrap();
            },
        );
    }

    /// An allocation waiting for room (holding its in-flight pin) while the
    /// context is retired: retire's wake-up must reach it (loom reports a
    /// deadlock otherwise), it gives up and drops its pin, and the teardown
    /// waiter, which needs that pin gone, finishes. No settlement ever
    /// happens: only retire can wake the admission waiter.
    #[test]
    fn retire_wakes_admission_waiter_which_drops_its_pin() {
        run(
            "admission waiter + retire + teardown waiter (2 threads)",
            None,
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap(); // the allocation's pin
                let c = ctx.clone();
                let waiter = thread::spawn(move || {
                    let registered = AtomicBool::new(false);
                    assert!(admission_wait(&c, &registered));
                    assert_ne!(
                        c.life.phase(),
                        Phase::Active,
                        "woken without a settlement: only by retire"
                    );
                    c.release_pin();
                });
                ctx.life.attend();
                ctx.begin_retire();
                ctx.wait_and_finish();
                waiter.join().unwrap();
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// Background teardown: nobody waits. The last pin (a holder's), the
    /// last pending release (a foreign signal) and the last `RetireHandle`
    /// go on three threads in any order; exactly one of them starts the
    /// reaper, whichever is last (two racing checks never both miss: each
    /// has a SeqCst fence between its write and its reads).
    #[test]
    fn unattended_drained_context_is_reaped_exactly_once() {
        run(
            "last pin + last settlement + last retire handle (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(4));
                ctx.acquire().unwrap();
                let signal = Ctx::queue_release(&ctx, 0);
                ctx.acquire().unwrap(); // a stream's pin
                ctx.life.attend();
                ctx.begin_retire();
                let c = ctx.clone();
                let holder = thread::spawn(move || c.release_pin());
                let driver = thread::spawn(move || signal.retire());
                ctx.life.unattend();
                holder.join().unwrap();
                driver.join().unwrap();
                assert!(ctx.life.drained());
                assert_eq!(ctx.reaps.load(Acquire), 1, "reaped once, never missed");
            },
        );
    }

    /// The `spare` slots of `release.rs` (one cached `PendingRelease` box per
    /// shard) are `sync::Slot`s, driven here with the governor's protocol:
    /// `boxed` takes the cached box or makes one, `settle` offers its box
    /// last and drops it if the slot is full or closed, `close_spares`
    /// closes the slot and drops what it held.
    mod spare {
        use loom::cell::UnsafeCell;
        use loom::sync::atomic::AtomicUsize;
        use loom::sync::Arc;
        use std::sync::atomic::Ordering::Relaxed;

        pub struct Obj {
            /// Written by whoever owns the box: loom reports a data race if
            /// two threads ever own it without happens-before between them.
            pub uses: UnsafeCell<u64>,
            drops: Arc<AtomicUsize>,
        }
        impl Obj {
            /// Use the box as its owner: a write loom checks.
            pub fn touch(&self) {
                // SAFETY: the pointer is the cell's own, valid for the
                // closure. Whether the write is exclusive is the question
                // the models ask: loom's cell tracking reports a write with
                // no happens-before to another thread's access as a data
                // race, failing the model rather than racing.
                self.uses.with_mut(|u| unsafe { *u += 1 });
            }
        }
        impl Drop for Obj {
            fn drop(&mut self) {
                self.touch();
                self.drops.fetch_add(1, Relaxed);
            }
        }
        pub fn new_obj(drops: &Arc<AtomicUsize>, made: &AtomicUsize) -> Box<Obj> {
            made.fetch_add(1, Relaxed);
            Box::new(Obj {
                uses: UnsafeCell::new(0),
                drops: drops.clone(),
            })
        }
    }

    /// Two releasers each take the cached box (or make one), use it and
    /// offer it back, while retire closes the slot: no box is ever owned by
    /// two threads at once (loom's cell tracking), each is dropped exactly
    /// once, and a closed slot stays closed.
    #[test]
    fn spare_slot_hands_boxes_over_and_closes() {
        run(
            "spare slot: 2 take/offer + close (3 threads)",
            Some(3),
            || {
                let drops = Arc::new(AtomicUsize::new(0));
                let made = Arc::new(AtomicUsize::new(0));
                let first = spare::new_obj(&drops, &made);
                let slot = Arc::new(super::sync::Slot::with(first));
                let mut hs = Vec::new();
                for _ in 0..2 {
                    let (slot, drops, made) = (slot.clone(), drops.clone(), made.clone());
                    hs.push(thread::spawn(move || {
                        let b = slot.take().unwrap_or_else(|| spare::new_obj(&drops, &made));
                        b.touch();
                        if let Err(b) = slot.offer(b) {
                            drop(b);
                        }
                    }));
                }
                drop(slot.close());
                for h in hs {
                    h.join().unwrap();
                }
                assert!(slot.is_closed(), "a closed slot was reopened");
                assert!(slot.take().is_none(), "a closed slot handed a box out");
                assert_eq!(
                    drops.load(Relaxed),
                    made.load(Relaxed),
                    "a box was leaked or dropped twice"
                );
            },
        );
    }

    /// The block cache (`src/governor/cache.rs`): a stream's `sync::Bins`,
    /// driven with the governor's protocol. A cached block holds the pin of
    /// the buffer it was; a release on the block's own stream `put`s it
    /// (and frees it stream-ordered when refused), an allocation `take`s it,
    /// and retire (`begin_retire`, then `cache::flush_all`) closes the bins
    /// and frees what they held. One block starts cached, one buffer live;
    /// a releaser releases the buffer while an allocator takes a block, uses
    /// it and releases it again, and retire flushes and waits for teardown.
    /// Checked: no block is owned by two threads at once (loom's cell
    /// tracking), each is freed exactly once, nothing is kept once the bins
    /// are closed, and the teardown drains (a block left in closed bins
    /// would hold its pin forever: loom reports the deadlock).
    #[test]
    fn cache_bins_hand_over_and_close() {
        run(
            "cache: release into the bins + a hit vs retire's flush (3 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::new(16));
                let freed = Arc::new(AtomicUsize::new(0));
                let made = Arc::new(AtomicUsize::new(0));
                let bins = Arc::new(super::sync::Bins::<Box<spare::Obj>>::new());
                // The cached block and the live buffer, each with its pin.
                ctx.acquire().unwrap();
                assert!(bins
                    .put(512, spare::new_obj(&freed, &made), u64::MAX)
                    .is_ok());
                ctx.acquire().unwrap();
                let live = spare::new_obj(&freed, &made);
                // `release()` of a block: its pin moves into a pending
                // release, which the "driver" retires; the memory goes.
                fn free(ctx: &Arc<Ctx>, block: Box<spare::Obj>) {
                    Ctx::queue_release(ctx, 0).retire();
                    drop(block);
                }
                // `DeviceBuffer::drop` on its own stream: `cache::put`, or
                // an ordinary free when the bins refuse.
                fn release(
                    ctx: &Arc<Ctx>,
                    bins: &super::sync::Bins<Box<spare::Obj>>,
                    b: Box<spare::Obj>,
                ) {
                    if let Err((b, _)) = bins.put(512, b, u64::MAX) {
                        free(ctx, b);
                    }
                }
                let releaser = {
                    let (ctx, bins) = (ctx.clone(), bins.clone());
                    thread::spawn(move || {
                        live.touch();
                        release(&ctx, &bins, live);
                    })
                };
                let allocator = {
                    let (ctx, bins) = (ctx.clone(), bins.clone());
                    thread::spawn(move || {
                        // `cache::hit`: the block brings its pin.
                        if let Some(b) = bins.take(512) {
                            b.touch();
                            release(&ctx, &bins, b);
                        }
                    })
                };
                ctx.begin_retire();
                for (_, b) in bins.close() {
                    free(&ctx, b);
                }
                ctx.wait_and_finish();
                for t in [releaser, allocator] {
                    t.join().unwrap();
                }
                assert!(bins.is_closed());
                assert_eq!((bins.count(), bins.bytes()), (0, 0), "kept after close");
                assert!(bins.take(512).is_none(), "closed bins handed a block out");
                assert_eq!(freed.load(Relaxed), 2, "a block was leaked or freed twice");
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }

    /// The counter never wraps: with a maximum of 2, three concurrent
    /// acquirers get exactly two pins and one `Overflow`, and retire then
    /// drains to zero.
    #[test]
    fn overflow_is_refused_never_wrapped() {
        run("3 acquirers at max_pins = 2 (3 threads)", Some(3), || {
            let ctx = Arc::new(Ctx::new(2));
            let got = Arc::new(AtomicUsize::new(0));
            let overflow = Arc::new(AtomicUsize::new(0));
            let mut hs = Vec::new();
            for _ in 0..2 {
                let (c, g, o) = (ctx.clone(), got.clone(), overflow.clone());
                hs.push(thread::spawn(move || match c.acquire() {
                    Ok(()) => {
                        g.fetch_add(1, AcqRel);
                    }
                    Err(AcquireError::Overflow) => {
                        o.fetch_add(1, AcqRel);
                    }
                    Err(AcquireError::Closed) => panic!("closed before retire"),
                }));
            }
            match ctx.acquire() {
                Ok(()) => {
                    got.fetch_add(1, AcqRel);
                }
                Err(AcquireError::Overflow) => {
                    overflow.fetch_add(1, AcqRel);
                }
                Err(AcquireError::Closed) => panic!("closed before retire"),
            }
            for h in hs {
                h.join().unwrap();
            }
            assert_eq!(got.load(Acquire), 2);
            assert_eq!(overflow.load(Acquire), 1);
            assert_eq!(ctx.life.pin_claims(), 2);
            ctx.begin_retire();
            let c = ctx.clone();
            let h = thread::spawn(move || c.release_pin());
            ctx.release_pin();
            ctx.wait_and_finish();
            h.join().unwrap();
            assert_eq!(ctx.destroys.load(Acquire), 1);
        });
    }

    /// The shipped budget word (`BudgetWord`, the governor's `Budget`), with
    /// `charged` bytes already charged.
    fn budget(limit: u64, charged: u64) -> BudgetWord {
        let b = BudgetWord::new(limit);
        if charged > 0 {
            b.try_charge(charged, 0).expect("the initial charge fits");
        }
        b
    }

    /// A context's budget leases: the shipped lease protocol
    /// (`sync::Leases`, as `lease.rs` and `ContextInner::charge` drive it)
    /// over the shipped budget word, two shards, chunk `CHUNK`.
    struct Leased {
        budget: BudgetWord,
        slots: Leases<2>,
    }

    const CHUNK: u64 = 2;

    impl Leased {
        fn new(limit: u64) -> Self {
            Self {
                budget: budget(limit, 0),
                slots: Leases::new(CHUNK),
            }
        }

        /// `Leases::charge`: the shard's lease, else a refill (with a chunk
        /// when it fits), else reclaim every idle lease and ask the budget
        /// again until it admits, or refuses with no refill in flight and
        /// nothing leased.
        fn charge(&self, shard: usize, bytes: u64) -> bool {
            self.slots.take_leased(&self.budget, shard, bytes)
                || self
                    .slots
                    .take_from_pool(&self.budget, shard, bytes, 0)
                    .is_ok()
        }

        /// `Leases::settled`: back into the shard's lease, two chunks kept.
        fn settle(&self, shard: usize, bytes: u64) {
            self.slots.give(&self.budget, shard, bytes);
        }

        fn close(&self) {
            self.slots.close(&self.budget);
        }
    }

    /// A refusal takes back the lease of a thread that is allocating out of
    /// it at that moment, and is exact: with a limit of 5, shard 0 holding a
    /// 1-byte allocation and a 2-byte lease and allocating 1 byte out of it,
    /// an allocation of 3 on shard 1 always fits (1 + 1 + 3 = 5) and is
    /// never refused; no byte is lost or counted twice (the budget ends at
    /// the allocations plus the idle leases, and at the allocations alone
    /// once the leases close).
    #[test]
    fn refusal_reclaims_leases_from_an_allocating_thread() {
        run(
            "refusal reclaims a lease being allocated from (2 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Leased::new(5));
                assert!(ctx.charge(0, 1));
                assert_eq!(ctx.slots.idle(), CHUNK);
                let c = ctx.clone();
                let holder = thread::spawn(move || assert!(c.charge(0, 1), "2 of 5 refused"));
                assert!(
                    ctx.charge(1, 3),
                    "3 bytes refused while only 2 were allocated"
                );
                holder.join().unwrap();
                let charged = ctx.budget.charged();
                assert_eq!(charged, 5 + ctx.slots.idle());
                ctx.close();
                assert_eq!(ctx.budget.charged(), 5);
                assert_eq!(ctx.slots.idle(), 0);
            },
        );
    }

    /// Teardown closing the leases races a stream refilling its lease and a
    /// release settling into it (late, as a faulty backend may): once both
    /// are done nothing is leased and the budget holds exactly the
    /// allocations still live.
    #[test]
    fn retire_races_a_lease_refill() {
        run(
            "lease close races a refill and a settlement (2 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Leased::new(8));
                assert!(ctx.charge(1, 1));
                let c = ctx.clone();
                let stream = thread::spawn(move || {
                    assert!(c.charge(0, 1), "1 of 8 refused");
                    c.settle(0, 1);
                });
                ctx.close();
                stream.join().unwrap();
                assert_eq!(ctx.slots.idle(), 0, "bytes leased after close");
                assert_eq!(ctx.budget.charged(), 1);
            },
        );
    }

    /// Teardown observes a pin taken from a stream's pin lease: a holder
    /// takes its buffer's pin out of shard 0's lease (no write to the pin
    /// word), calls the backend and gives the pin back into the lease while
    /// the context retires. Retire closes the leases before the pin word, so
    /// the holder's take either came first (and the teardown waits for the
    /// pin to come back through the closed lease) or fails; no take from any
    /// lease succeeds once retire was observed, and destroy never runs while
    /// the pin is held.
    #[test]
    fn teardown_observes_pins_taken_from_a_stream_lease() {
        run(
            "lease pin holder + retire + teardown (2 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::with_pin_chunk(4, 1));
                // A stream on shard 0 leased a chunk with its first pin and
                // gave the pin back: two idle pins in its lease.
                ctx.acquire_on(0).unwrap();
                ctx.release_pin_on(0);
                assert_eq!(ctx.life.pin_count(), 0);
                assert_eq!(ctx.life.pin_claims(), 2);
                let c = ctx.clone();
                let holder = thread::spawn(move || {
                    if c.acquire_on(0).is_ok() {
                        c.lease_pin_held.store(true, Release);
                        assert!(c.backend_call(0), "a held pin keeps the gate open");
                        c.lease_pin_held.store(false, Release);
                        c.release_pin_on(0);
                    }
                });
                ctx.begin_retire();
                assert_eq!(
                    ctx.acquire_on(0),
                    Err(AcquireError::Closed),
                    "a pin taken from a lease after retire"
                );
                assert_eq!(ctx.acquire_on(1), Err(AcquireError::Closed));
                ctx.wait_and_finish();
                holder.join().unwrap();
                assert_eq!(ctx.destroys.load(Acquire), 1);
                assert_eq!(ctx.life.leased_pins(), 0, "pins leased after close");
            },
        );
    }

    /// `max_pins` stays exact with pin leases: with a maximum of 3, shard 0
    /// holding one pin and one idle in its lease while its holder gives its
    /// pin back and takes it again, two pins on shard 1 always fit (at most
    /// 1 + 2 are held) -- the refusal path reclaims shard 0's idle lease
    /// first -- and a fourth is refused with `Overflow` once three are held.
    #[test]
    fn pin_overflow_stays_exact_with_leases() {
        run(
            "pin leases: refusal reclaims from a holder (2 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::with_pin_chunk(3, 1));
                ctx.acquire_on(0).unwrap();
                assert_eq!(ctx.life.pin_claims(), 2, "one held, one leased");
                let c = ctx.clone();
                let holder = thread::spawn(move || {
                    c.release_pin_on(0);
                    c.acquire_on(0).expect("1 of 3 pins refused");
                });
                ctx.acquire_on(1).expect("2 of 3 pins refused");
                ctx.acquire_on(1).expect("3 of 3 pins refused");
                holder.join().unwrap();
                assert_eq!(ctx.life.pin_count(), 3);
                assert_eq!(ctx.acquire_on(1), Err(AcquireError::Overflow));
                assert_eq!(ctx.acquire(), Err(AcquireError::Overflow));
                assert_eq!(ctx.life.pin_claims(), 3, "a refused pin left a claim");
            },
        );
    }

    /// Two refusals at once, on two shards, while a holder gives its pin
    /// back into its lease and takes it again: with a maximum of 3 and at
    /// most three pins held, every take succeeds. One refusal's sweep holds
    /// the units it took until it puts them back; the other must not count
    /// them (`Leases::sweeping`).
    #[test]
    fn two_refusals_at_once_stay_exact() {
        run(
            "pin leases: two refusals + a holder (3 threads)",
            Some(2),
            || {
                let ctx = Arc::new(Ctx::with_pin_chunk(3, 1));
                ctx.acquire_on(0).unwrap();
                let c = ctx.clone();
                let holder = thread::spawn(move || {
                    c.release_pin_on(0);
                    c.acquire_on(0).expect("1 of 3 pins refused");
                });
                let c = ctx.clone();
                let other = thread::spawn(move || c.acquire().expect("a pin of 3 refused"));
                ctx.acquire_on(1).expect("a pin of 3 refused");
                holder.join().unwrap();
                other.join().unwrap();
                assert_eq!(ctx.life.pin_count(), 3);
                assert_eq!(ctx.acquire_on(1), Err(AcquireError::Overflow));
            },
        );
    }

    /// A refusal racing a refill in flight on another shard: with a maximum
    /// of 3 and one pin held elsewhere, shard 0 refills (its pin and a chunk
    /// of one) while shard 1 is refused and reclaims. The refill, seeing the
    /// refusal press, hands its chunk straight back to the pin word; the
    /// refusal must not have counted that chunk, so shard 1's pin always
    /// fits (1 + 1 + 1 = 3). Asking the pin word before checking for
    /// refills in flight misses the chunk in that gap.
    #[test]
    fn a_refill_in_flight_is_waited_for_before_a_refusal() {
        run(
            "pin leases: refusal vs a refill in flight (2 threads)",
            Some(3),
            || {
                let ctx = Arc::new(Ctx::with_pin_chunk(3, 1));
                ctx.acquire().unwrap();
                let c = ctx.clone();
                let refiller = thread::spawn(move || c.acquire_on(0).expect("2 of 3 pins refused"));
                ctx.acquire_on(1).expect("3 of 3 pins refused");
                refiller.join().unwrap();
                assert_eq!(ctx.life.pin_count(), 3);
            },
        );
    }

    /// An allocation waiting for room (`WaitForPending`) decides from what
    /// is pending whether a wait could help, so a settlement must stop
    /// counting as pending only *after* its bytes are back in the budget
    /// (`PendingRelease::settle`), and the allocation must read what is
    /// pending *before* its last attempt (`admission::admit_refused`). Then
    /// "nothing pending" means the attempt saw the room, and a refusal with
    /// nothing pending is final; with either order reversed, a settlement
    /// landing between the attempt and the read leaves the allocation
    /// refused with the room free.
    #[test]
    fn nothing_pending_means_the_room_is_back() {
        run(
            "admission reads pending, attempts, waits; a settlement returns its bytes (2 threads)",
            None,
            || {
                let ctx = Arc::new(Ctx::new(4));
                // The budget is full: one byte, held by a pending release.
                let budget = Arc::new(budget(1, 1));
                let pending = Arc::new(loom::sync::atomic::AtomicU64::new(1));
                let (c, b, p) = (ctx.clone(), budget.clone(), pending.clone());
                let settler = thread::spawn(move || {
                    // `settle`: the charge first, the statistics last.
                    b.uncharge(1);
                    p.fetch_sub(1, Release);
                    // A `WaitForPending` context announces it.
                    c.life.announce_settlement();
                });
                // The first attempt was refused; now `admit_refused`:
                // register, read what is pending, attempt once more.
                let life = &ctx.life;
                life.settle_epoch.register();
                loom::sync::atomic::fence(SeqCst);
                let seen = life.settle_epoch.epoch();
                let was_pending = pending.load(Acquire);
                let mut admitted = budget.try_charge(1, 0).is_ok();
                if !admitted {
                    assert!(
                        was_pending > 0,
                        "refused with nothing pending while the room was free"
                    );
                    assert!(life
                        .settled
                        .wait_until(|| life.settle_epoch.epoch() != seen, None));
                    admitted = budget.try_charge(1, 0).is_ok();
                }
                life.settle_epoch.unregister();
                assert!(admitted, "woken by the settlement, yet no room");
                settler.join().unwrap();
            },
        );
    }

    /// An allocation refused on a shared budget while a retiring context on
    /// it holds bytes only its teardown gives back (quarantined, awaiting
    /// teardown) waits for that teardown (`admission::pending_in_scope`,
    /// `DeviceMember::returning_at_teardown` in `record.rs`). The teardown
    /// takes the bytes off the statistics, then gives the charge back
    /// (`return_charges_at_teardown`), stores Terminated, then bumps the
    /// shared epoch and wakes (`finish`). The waiter reads the epoch, then
    /// the member's amounts, then its phase (counting a teardown in progress
    /// as returning something), then attempts. Then a refusal with nothing
    /// coming back is final, and a waiter always wakes with the room back.
    /// With the phase read before the amounts, or Terminating counted as
    /// nothing, loom finds an interleaving refused with the room free.
    #[test]
    fn a_retiring_member_is_waited_for_until_its_teardown_wakes() {
        run(
            "shared admission waits for a retiring member's teardown (2 threads)",
            None,
            || {
                // A retiring member (the shipped lifecycle), and the shared
                // budget's `retired` notifier.
                let ctx = Arc::new(Ctx::new(4));
                ctx.begin_retire();
                let retired = Arc::new(Notifier::new());
                // The budget is full: one byte, quarantined by the member.
                let budget = Arc::new(budget(1, 1));
                let quarantined = Arc::new(loom::sync::atomic::AtomicU64::new(1));
                let epoch = Arc::new(loom::sync::atomic::AtomicU64::new(0));
                let (c, b, q, r, e) = (
                    ctx.clone(),
                    budget.clone(),
                    quarantined.clone(),
                    retired.clone(),
                    epoch.clone(),
                );
                let teardown = thread::spawn(move || {
                    let Teardown::Destroy(destroyer) = c.life.begin_teardown() else {
                        panic!("the only finisher lost the teardown");
                    };
                    // `return_charges_at_teardown`: the statistics, then the
                    // charge.
                    q.fetch_sub(1, Release);
                    b.uncharge(1);
                    destroyer.terminated();
                    // `SharedBudgetInner::announce_returned`.
                    e.fetch_add(1, SeqCst);
                    r.notify();
                });
                let seen = epoch.load(SeqCst);
                let held = quarantined.load(Acquire);
                let returning = match ctx.life.phase() {
                    Phase::Retiring => held,
                    Phase::Terminating => held.max(1),
                    Phase::Active | Phase::Terminated => 0,
                };
                let mut admitted = budget.try_charge(1, 0).is_ok();
                if !admitted {
                    assert!(
                        returning > 0,
                        "refused with nothing coming back while the room was free"
                    );
                    assert!(retired.wait_until(|| epoch.load(SeqCst) != seen, None));
                    admitted = budget.try_charge(1, 0).is_ok();
                }
                assert!(admitted, "woken by the teardown, yet no room");
                teardown.join().unwrap();
            },
        );
    }

    /// A reservation as `reservation.rs` keeps it: a pin, bytes charged to
    /// the budget up front, and their unused part in an [`Allowance`].
    /// Dropped by the last holder: what is left goes back to the budget,
    /// then the pin (`Drop for Reservation`).
    struct Res {
        ctx: Arc<Ctx>,
        budget: Arc<BudgetWord>,
        left: Allowance,
        /// Bytes handed to allocations and not yet released (the model's
        /// check, not the reservation's).
        handed: loom::sync::atomic::AtomicU64,
        reserved: u64,
    }

    impl Res {
        /// `Reservation::allocate` on `shard`: a pin, the bytes out of the
        /// allowance (put back if the backend call never happens), the
        /// backend call under the gate; then the buffer's release gives the
        /// bytes to the budget and drops its pin.
        fn allocate_and_release(&self, shard: usize, bytes: u64) {
            if self.ctx.acquire_on(shard).is_err() {
                return;
            }
            if self.left.take(bytes).is_ok() {
                let handed = self.handed.fetch_add(bytes, AcqRel) + bytes;
                assert!(
                    handed <= self.reserved,
                    "{handed} bytes handed out of a {}-byte reservation",
                    self.reserved
                );
                if self.ctx.backend_call(shard) {
                    // The buffer's settled release.
                    self.handed.fetch_sub(bytes, AcqRel);
                    self.budget.uncharge(bytes);
                } else {
                    self.handed.fetch_sub(bytes, AcqRel);
                    self.left.add(bytes);
                }
            }
            self.ctx.release_pin_on(shard);
        }
    }

    impl Drop for Res {
        fn drop(&mut self) {
            let left = self.left.close();
            self.budget.uncharge(left);
            self.ctx.release_pin();
        }
    }

    /// A reservation racing retire and a refusal. Main reserves 2 bytes of
    /// a 3-byte budget (pin, charge, allowance) and hands the reservation to
    /// two threads that allocate 2 and 1 bytes out of it (only one can get
    /// its bytes while the other's are out; the last to finish drops the
    /// reservation); a third makes a plain 2-byte allocation, refused only
    /// while the reservation or a buffer out of it holds the room; main
    /// retires and waits. Checks: no byte is handed out twice, the budget
    /// is never over its limit and a refusal is a true one, every reserved
    /// byte goes back exactly once (the budget ends at zero), and the
    /// teardown waits for the reservation's pin.
    #[test]
    fn a_reservation_races_retire_and_a_refusal() {
        run(
            "reservation vs retire vs a plain allocation (3 threads + retirer)",
            Some(2),
            || {
                let ctx = Arc::new(Ctx::new(8));
                let budget = Arc::new(budget(3, 0));
                // `Reservation::new`: the pin, then the charge.
                ctx.acquire().expect("open context");
                budget.try_charge(2, 0).expect("the reservation fits");
                let res = Arc::new(Res {
                    ctx: ctx.clone(),
                    budget: budget.clone(),
                    left: Allowance::new(2),
                    handed: loom::sync::atomic::AtomicU64::new(0),
                    reserved: 2,
                });
                let (r1, r2) = (res.clone(), res);
                let a = thread::spawn(move || r1.allocate_and_release(0, 2));
                let b = thread::spawn(move || r2.allocate_and_release(1, 1));
                let (c, bud) = (ctx.clone(), budget.clone());
                let plain = thread::spawn(move || {
                    if c.acquire_on(1).is_err() {
                        return;
                    }
                    match bud.try_charge(2, 0) {
                        Ok(()) => {
                            assert!(bud.charged() <= 3, "the budget went over its limit");
                            c.backend_call(1);
                            bud.uncharge(2);
                        }
                        Err(r) => assert!(
                            r.charged + 2 > r.limit,
                            "refused with {} of {} charged",
                            r.charged,
                            r.limit
                        ),
                    }
                    c.release_pin_on(1);
                });
                ctx.begin_retire();
                ctx.wait_and_finish();
                for t in [a, b, plain] {
                    t.join().unwrap();
                }
                assert_eq!(budget.charged(), 0, "a reserved byte was not returned once");
                assert_eq!(ctx.destroys.load(Acquire), 1);
            },
        );
    }
}
