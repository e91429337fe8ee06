//! The state a context's threads share (the caller's, the host functions',
//! the free thread's): [`Shared`].

use crate::result::{Cuda, BACKEND};
use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdeviceptr, CUmemoryPool, CUstream};
use memgov_backend::shell::MakeCurrent;
use memgov_backend::vmm::Gate;
use memgov_backend::{lock, BackendError, FreeThread, FreeWork, Stop, Take, Tickets, Unsettled};
use memgov_stream_ordered::state::State;
use memgov_stream_ordered::stream;
use memgov_stream_ordered::table::{Context as _, StreamTable};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// How often the free thread asks the driver about destroyed streams whose
/// work is still queued (the table's poll interval).
pub(crate) const WATCH_INTERVAL: Duration = <Cuda as StreamTable>::POLL_INTERVAL;

/// The CUDA driver's gate ([`memgov_backend::vmm::Gate`]): process-wide, as
/// the driver's rule is.
pub(crate) fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate::new(crate::result::BACKEND, "CudaCapture"))
}

/// The context's stream-ordered frees in flight: the signals waiting for
/// their host function, and the page-locked host frees on their way
/// through the free thread. Shared (in an `Arc`) with the host functions.
pub(crate) struct PendingFrees {
    /// Signals of frees queued on the device whose host function has not
    /// run, claimed by that host function, by the free thread (page-locked
    /// host frees) or by device loss.
    pub(crate) waiting: Tickets<()>,
    /// Page-locked host frees whose host function has not run: ticket ->
    /// (host address, stream id). Apart from `waiting`, because the buffer
    /// must be freed even when device loss abandoned its signal: the host
    /// function (its route kept) still hands it to the free thread.
    pub(crate) host_queued: Mutex<HashMap<u64, (usize, u64)>>,
    /// Page-locked host frees whose host function has run, for the free
    /// thread (or teardown, or a `synchronize`) to `cuMemFreeHost`. The
    /// thread also polls retired streams (see `Shared`'s `FreeWork`).
    pub(crate) host: FreeThread<HostFree>,
    /// Page-locked host frees queued per stream whose signal has not been
    /// settled: `synchronize` waits for its stream's to reach none, since
    /// their free runs off the stream (on the free thread) after the stream
    /// has passed it.
    pub(crate) host_unsettled: Unsettled,
}

impl Default for PendingFrees {
    fn default() -> Self {
        Self {
            waiting: Tickets::default(),
            host_queued: Mutex::default(),
            // One make-current round-trip for every buffer that is ready.
            host: FreeThread::new(Take::All),
            host_unsettled: Unsettled::default(),
        }
    }
}

impl PendingFrees {
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }
}

/// A page-locked host free whose host function has run: the free thread's
/// job.
pub struct HostFree {
    pub(crate) ticket: u64,
    pub(crate) host: usize,
    pub(crate) stream: u64,
}

/// What the books keep of a live allocation. `pub` in a private module:
/// the core's `Books` names it as the books' entry.
pub struct Live {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) bytes: u64,
    /// The host address of a page-locked host allocation (`cuMemHostAlloc`,
    /// freed with `cuMemFreeHost`); 0 for device memory.
    pub(crate) host: usize,
}

/// The state a context's threads share: the caller's, the host functions'
/// (through `pending`) and the free thread's. It extends the core's
/// [`State`] (id, device, shell, streams, sleep gate; reached through
/// `Deref`) with CUDA's own. Dropping it calls no driver function: teardown
/// destroys explicitly.
// `pub` in a private module: the public aliases over the core's generic
// types (`CudaArena`) name it, and nothing outside the crate can.
pub struct Shared {
    /// What every stream-ordered context holds. Its streams: live ones
    /// (created or adopted), adopted ones not yet handed out, and retired
    /// ones: those memgov created and the governor destroyed whose queued
    /// work may still be running (host functions included), destroyed once
    /// `cuStreamQuery` says their work is complete, or at teardown after a
    /// synchronize: the context is never released under a running host
    /// function.
    pub(crate) state: State<Cuda, CUstream>,
    pub(crate) cu_device: CUdevice,
    pub(crate) context: CUcontext,
    /// Whether memgov retained the primary context (and releases it).
    pub(crate) retained: bool,
    /// memgov's own memory pool on the device (`cuMemPoolCreate`), destroyed
    /// at teardown; the device's default pool is never changed.
    pub(crate) pool: CUmemoryPool,
    pub(crate) pending: Arc<PendingFrees>,
    pub(crate) live: Mutex<HashMap<u64, Live>>,
}

impl std::ops::Deref for Shared {
    type Target = State<Cuda, CUstream>;

    fn deref(&self) -> &Self::Target {
        &self.state
    }
}

// SAFETY: the raw handles (context, pool, streams) are driver handles with no
// thread affinity; every call that uses them first makes the context current
// on the calling thread (`make_current`). Mutable state is behind atomics and
// mutexes, and no mutex is held across a driver call.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// Drop every waiting signal unfired (the governor settles them as
    /// abandoned), with no lock held.
    pub(crate) fn abandon_pending(&self) {
        let taken = self.pending.waiting.claim_all();
        {
            // The routes of pool frees go (their host functions will not
            // run); a page-locked host free's stays, for its buffer.
            let host = lock(&self.pending.host_queued);
            let pool = taken.iter().map(|c| c.ticket());
            memgov_stream_ordered::retire::unroute(pool.filter(|t| !host.contains_key(t)));
        }
        self.pending.host_unsettled.clear();
        for claim in taken {
            claim.abandon(self.probe());
        }
    }

    /// Start the free thread (once) and wake it: a stream was retired with
    /// work still queued, or a page-locked host free was handed to it.
    pub(crate) fn start_free_thread(self: &Arc<Self>) {
        match FreeThread::start(self, "memgov-cuda-free".into()) {
            Ok(_) => self.pending.host.wake(),
            // Without the free thread, retired streams are still queried by
            // later calls and by teardown, and page-locked host frees are
            // done by `synchronize` and teardown.
            Err(e) => self
                .probe()
                .violation(BACKEND, format!("could not start the free thread: {e}")),
        }
    }

    /// Stop the free thread and wait until it has returned: after this, no
    /// thread of this backend calls the driver. What it had not taken stays
    /// queued for teardown.
    pub(crate) fn stop_free_thread(&self) {
        self.pending.host.stop(Stop::Now);
    }
}

/// The free thread: started with the first retired stream or page-locked
/// host free, it frees page-locked host memory once the host function
/// queued behind its last use has run and handed it over (`cuMemFreeHost`
/// is a driver call, which the host function itself may not make), queries
/// retired streams every `WATCH_INTERVAL` while there are any (so an
/// asynchronous fault in their work is observed even when nobody calls the
/// backend), and is stopped and joined by teardown before any other
/// teardown step.
impl FreeWork for Shared {
    type Job = HostFree;

    fn free_thread(&self) -> &FreeThread<HostFree> {
        &self.pending.host
    }

    fn idle_wait(&self) -> Option<Duration> {
        if !self.streams.has_retired() || self.is_lost() {
            Some(WATCH_INTERVAL * 50)
        } else {
            Some(WATCH_INTERVAL)
        }
    }

    fn work(&self, frees: Vec<HostFree>) {
        // An error is kept by the context (a sticky one marks it lost and
        // abandons pending frees).
        let _ = stream::reap_retired(self, "free thread");
        let _ = self.free_host("free thread", frees);
    }
}

/// The CUDA context stack of the calling thread: `make_current` pushes the
/// context (`cuCtxPushCurrent`) unless it is current already, and the guard
/// pops it (`cuCtxPopCurrent`), which makes the thread's previous context
/// current again.
impl MakeCurrent for Shared {
    type Handle = CUcontext;

    fn ours(&self) -> CUcontext {
        self.context
    }

    fn current(&self, op: &'static str) -> Result<CUcontext, BackendError> {
        let mut now: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer; reads the calling thread's state only.
        let r = unsafe { sys::cuCtxGetCurrent(&mut now) };
        self.checked(op, "cuCtxGetCurrent", r)?;
        Ok(now)
    }

    fn enter(&self, op: &'static str, ours: CUcontext) -> Result<(), BackendError> {
        // SAFETY: the context is valid until teardown, which consumes the
        // `CudaContext` (and so runs after every other call has returned) and
        // pops its own push before it releases the context.
        let r = unsafe { sys::cuCtxPushCurrent_v2(ours) };
        self.checked(op, "cuCtxPushCurrent_v2", r)
    }

    fn leave(&self, _previous: CUcontext) {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: balances the successful cuCtxPushCurrent of `enter` on this
        // thread (the guard is neither Send nor cloned); popping makes no
        // device call and restores the context the thread had before. A
        // failure leaves nothing to undo.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}
