//! The free thread: the one thread per context that makes the driver calls
//! a deferred free needs and the driver's callback may not make.
//!
//! A driver forbids calls into itself from its host functions and stream
//! callbacks (CUDA: `cuLaunchHostFunc`; HIP: `hipStreamAddCallback`). A free
//! that must wait for the stream but is itself a synchronous driver call
//! (`cuMemFreeHost`, `hipFree`, `hipHostFree`) is therefore handed to a
//! thread of the backend's own: the callback, or the call that queued the
//! free, [pushes](FreeThread::push) a job, and the thread runs it with the
//! backend's [`FreeWork::work`]. The backend keeps only its driver calls;
//! the queue, the wake-ups, the lazy start, the stop and the join are here.
//!
//! Invariants:
//!
//! * the queue's lock is never held across [`FreeWork::work`] or a join, so
//!   a driver callback may push (it takes that lock only briefly);
//! * jobs are handed to `work` in the order they were pushed;
//! * once [`FreeThread::stop`] returns (called from any thread but the free
//!   thread itself), the thread has returned: no driver call of this thread
//!   follows it, which is what teardown needs before it destroys the
//!   context.
//!
//! The thread holds its owner weakly between rounds: a context dropped
//! without teardown is not kept alive by its free thread, which returns at
//! its next wake-up.
//!
//! ```
//! use memgov_backend::{FreeThread, FreeWork, Stop, Take};
//! use std::sync::{Arc, Mutex};
//!
//! struct Context {
//!     frees: FreeThread<u64>,
//!     freed: Mutex<Vec<u64>>,
//! }
//!
//! impl FreeWork for Context {
//!     type Job = u64;
//!     fn free_thread(&self) -> &FreeThread<u64> {
//!         &self.frees
//!     }
//!     fn work(&self, jobs: Vec<u64>) {
//!         // The driver's synchronous free of each address, here.
//!         self.freed.lock().unwrap().extend(jobs);
//!     }
//! }
//!
//! let ctx = Arc::new(Context { frees: FreeThread::new(Take::One), freed: Mutex::default() });
//! FreeThread::start(&ctx, "memgov-example-free".into()).unwrap();
//! ctx.frees.push(0x1000);
//! ctx.frees.push(0x2000);
//! // Teardown: finish what is queued, then return.
//! ctx.frees.stop(Stop::AfterQueue);
//! assert_eq!(*ctx.freed.lock().unwrap(), [0x1000, 0x2000]);
//! ```

use memgov_sync::lock;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// What a backend gives its free thread: the driver calls.
pub trait FreeWork: Send + Sync + Sized + 'static {
    /// One deferred free (the address, how to free it, its ticket).
    type Job: Send + 'static;

    /// The free thread this owner holds.
    fn free_thread(&self) -> &FreeThread<Self::Job>;

    /// Called once on the thread before anything else (make the device
    /// current on it, note its id).
    fn on_start(&self) {}

    /// How long the thread may sleep with an empty queue before it calls
    /// [`work`](Self::work) with no jobs (to poll the driver for something
    /// that wakes no one); `None` sleeps until pushed to or
    /// [woken](FreeThread::wake). Asked with the queue's
    /// lock held: make no driver call and take no lock a pusher holds.
    fn idle_wait(&self) -> Option<Duration> {
        None
    }

    /// Run the jobs taken off the queue, in order (one or all of them, as
    /// the thread's [`Take`] says; none after an idle wait ran out). Called
    /// with no lock of the free thread held.
    fn work(&self, jobs: Vec<Self::Job>);
}

/// How many queued jobs the thread takes at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// One: each job is the thread's own until `work` returns, and the rest
    /// stay in the queue, where device loss can still take them
    /// ([`FreeThread::stop_and_take`]).
    One,
    /// Every queued job at once, in one call of `work` (one driver
    /// round-trip for a batch).
    All,
}

/// How [`FreeThread::stop`] treats jobs still queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The thread runs every queued job first, then returns.
    AfterQueue,
    /// The thread returns after the round in progress; queued jobs stay
    /// for the caller to [take](FreeThread::take_queued).
    Now,
}

/// A lazily started thread that runs a backend's deferred frees. See the
/// [module](self) docs.
#[derive(Debug)]
pub struct FreeThread<J> {
    state: Mutex<State<J>>,
    wake: Condvar,
    take: Take,
}

#[derive(Debug)]
struct State<J> {
    queue: VecDeque<J>,
    stop: Option<Stop>,
    /// A [`FreeThread::wake`] the thread has not had its round for.
    woken: bool,
    /// Jobs were [put back](FreeThread::put_back): the queue is not taken
    /// until the next push, wake-up or idle wait.
    held_back: bool,
    thread: Option<JoinHandle<()>>,
}

impl<J: Send + 'static> FreeThread<J> {
    /// A free thread not yet started, taking jobs as `take` says.
    pub fn new(take: Take) -> Self {
        Self {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                stop: None,
                woken: false,
                held_back: false,
                thread: None,
            }),
            wake: Condvar::new(),
            take,
        }
    }

    /// Start `owner`'s free thread, named `name`, unless it is running or
    /// was stopped (`Ok(false)` then: a stopped thread is not restarted).
    /// An error is the OS refusing a thread.
    pub fn start<W: FreeWork<Job = J>>(owner: &Arc<W>, name: String) -> std::io::Result<bool> {
        let this = owner.free_thread();
        let mut st = lock(&this.state);
        if st.thread.is_some() || st.stop.is_some() {
            return Ok(false);
        }
        let weak = Arc::downgrade(owner);
        st.thread = Some(
            std::thread::Builder::new()
                .name(name)
                .spawn(move || run(weak))?,
        );
        Ok(true)
    }

    /// Queue a job and wake the thread. Takes the queue's lock briefly; a
    /// driver callback may call this.
    pub fn push(&self, job: J) {
        let mut st = lock(&self.state);
        st.queue.push_back(job);
        st.held_back = false;
        drop(st);
        self.wake.notify_all();
    }

    /// Wake the thread for a round with no jobs: something its
    /// [`FreeWork::work`] looks at changed. The wake-up is kept until the
    /// thread's next round, so one made before the thread sleeps (or
    /// starts) is not lost.
    pub fn wake(&self) {
        let mut st = lock(&self.state);
        st.woken = true;
        st.held_back = false;
        drop(st);
        self.wake.notify_all();
    }

    /// Put back, at the front of the queue and in their order, jobs a round
    /// could not run (the device could not be made current): the thread
    /// tries them again at its next wake-up or idle wait, not at once, and
    /// [`take_queued`](Self::take_queued) finds them.
    pub fn put_back(&self, jobs: Vec<J>) {
        let mut st = lock(&self.state);
        for job in jobs.into_iter().rev() {
            st.queue.push_front(job);
        }
        st.held_back = true;
    }

    /// Every queued job, removed (to run on the caller's thread, in order).
    pub fn take_queued(&self) -> Vec<J> {
        lock(&self.state).queue.drain(..).collect()
    }

    /// How many jobs are queued (not counting those `work` is running).
    pub fn len(&self) -> usize {
        lock(&self.state).queue.len()
    }

    /// Whether no job is queued.
    pub fn is_empty(&self) -> bool {
        lock(&self.state).queue.is_empty()
    }

    /// Whether the thread was started and not yet joined.
    pub fn is_running(&self) -> bool {
        lock(&self.state).thread.is_some()
    }

    /// Stop the thread without joining it and take every queued job (device
    /// loss: their signals are abandoned by the caller). The thread returns
    /// after the job it holds.
    pub fn stop_and_take(&self) -> Vec<J> {
        let jobs = {
            let mut st = lock(&self.state);
            st.stop = Some(Stop::Now);
            st.queue.drain(..).collect()
        };
        self.wake.notify_all();
        jobs
    }

    /// Stop the thread (as `how` says) and join it, unless the caller is the
    /// free thread itself (a signal it fired tore its context down): that
    /// thread returns by itself once this round is done. Idempotent; a
    /// stop that is already [`Stop::Now`] stays so.
    pub fn stop(&self, how: Stop) {
        let thread = {
            let mut st = lock(&self.state);
            if st.stop != Some(Stop::Now) {
                st.stop = Some(how);
            }
            st.thread.take()
        };
        self.wake.notify_all();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                // A panic in `work` has already been reported by the panic
                // hook; there is nothing left to undo here.
                let _ = t.join();
            }
        }
    }
}

/// The thread's body: take jobs (or sleep), run them, until stopped or the
/// owner is gone.
fn run<W: FreeWork>(weak: Weak<W>) {
    match weak.upgrade() {
        Some(owner) => owner.on_start(),
        None => return,
    }
    loop {
        let Some(owner) = weak.upgrade() else { return };
        let this = owner.free_thread();
        let jobs = {
            let mut st = lock(&this.state);
            let mut ran_out = false;
            loop {
                if st.stop == Some(Stop::Now) {
                    return;
                }
                if ran_out {
                    st.held_back = false;
                }
                if !st.queue.is_empty() && !st.held_back {
                    break match this.take {
                        Take::One => st.queue.pop_front().into_iter().collect(),
                        Take::All => st.queue.drain(..).collect(),
                    };
                }
                if st.stop == Some(Stop::AfterQueue) {
                    return;
                }
                if std::mem::take(&mut st.woken) || ran_out {
                    // Woken (or the idle wait ran out) with nothing queued:
                    // a round with no jobs, for what `idle_wait` polls.
                    break Vec::new();
                }
                st = match owner.idle_wait() {
                    None => this.wake.wait(st).unwrap_or_else(|e| e.into_inner()),
                    Some(every) => {
                        let (st, waited) = this
                            .wake
                            .wait_timeout(st, every)
                            .unwrap_or_else(|e| e.into_inner());
                        ran_out = waited.timed_out();
                        st
                    }
                };
            }
        };
        owner.work(jobs);
    }
}
