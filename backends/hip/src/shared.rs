//! The state a context's threads share (the caller's, the stream
//! callbacks' through their routes, the free thread's): [`Shared`].

use crate::ffi::{self, hipEvent_t, hipGetDevice, hipMemPool_t, hipSetDevice, hipStream_t};
use crate::result::{error_name, Hip};
use memgov_backend::shell::MakeCurrent;
use memgov_backend::vmm::Gate;
use memgov_backend::{lock, BackendError, FreeThread, RetireSignal, Take, Tickets, Unsettled};
use memgov_stream_ordered::state::{Device, State};
use memgov_stream_ordered::table::Context as _;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// The HIP runtime's gate: process-wide, as the runtime's rule is.
pub(crate) fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate::new(crate::result::BACKEND, "HipCapture"))
}

pub use memgov_stream_ordered::state::Origin;

/// A `hipMemPool_t` that may cross threads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pool(pub(crate) hipMemPool_t);

// SAFETY: a hipMemPool_t is an opaque handle the HIP runtime accepts from any
// host thread; this type only carries the value.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

/// Signals of frees queued with `hipFreeAsync` whose callback has not run,
/// each with the id of the stream it was queued on.
pub(crate) type PendingFrees = Tickets<u64>;

/// An event that may cross threads (an opaque runtime handle usable from
/// any thread).
pub(crate) type Event = memgov_stream_ordered::table::Raw<hipEvent_t>;

/// A `hipMalloc` (or `hipHostMalloc`) allocation waiting for its event
/// before `hipFree` (or `hipHostFree`).
pub struct PlainFree {
    pub(crate) event: Event,
    pub(crate) ptr: usize,
    pub(crate) origin: Origin,
    pub(crate) bytes: u64,
    pub(crate) stream: u64,
    pub(crate) signal: RetireSignal,
}

/// The allocator in use (may switch from `StreamOrdered` to `Plain` once, at
/// the first `hipErrorNotSupported`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Allocator {
    StreamOrdered = 0,
    Plain = 1,
}

/// How many [`Shared`]s exist in the process (see [`contexts_alive`]).
static ALIVE: AtomicUsize = AtomicUsize::new(0);

/// How many HIP contexts' shared states are still alive in this process:
/// contexts not yet dropped or torn down, plus any state something still
/// holds after that. memgov hands the runtime no reference to a context
/// (a stream callback's user data is a number, see `retire.rs`), so once
/// every [`HipContext`](crate::HipContext) is torn down or dropped and its
/// free thread joined this reads 0 even when the runtime dropped queued callbacks
/// without running them. For leak checks.
pub fn contexts_alive() -> usize {
    ALIVE.load(Ordering::Acquire)
}

/// What the context, its callbacks and its free thread share: the core's
/// [`State`] (id, device, shell, streams, sleep gate; reached through
/// `Deref`), extended with HIP's own. Dropping it calls no HIP function:
/// teardown releases explicitly.
// `pub` in a private module: the public aliases over the core's generic
// types (`HipArena`) name it, and nothing outside the crate can.
pub struct Shared {
    pub(crate) state: State<Hip, hipStream_t>,
    /// The context's own pool (`None` with the fallback).
    pool: Option<Pool>,
    allocator: AtomicU8,
    pub(crate) fallback_reason: Mutex<Option<String>>,
    /// Allocations not yet handed to a free: pointer -> (bytes, origin).
    pub(crate) live: Mutex<HashMap<usize, (u64, Origin)>>,
    /// Signals of pool frees waiting for their stream callback.
    pub(crate) pending: PendingFrees,
    /// Frees per stream whose signal has not settled, for `synchronize`
    /// (the free thread runs after the stream, and a runtime may run a
    /// callback after the stream's own synchronize has returned).
    pub(crate) outstanding: Unsettled,
    /// The free thread and its queue of fallback (`hipMalloc`) and pinned
    /// host frees, one at a time: the rest stay where device loss can take
    /// them.
    pub(crate) frees: FreeThread<PlainFree>,
    notes: Mutex<Vec<String>>,
}

impl std::ops::Deref for Shared {
    type Target = State<Hip, hipStream_t>;

    fn deref(&self) -> &Self::Target {
        &self.state
    }
}

impl Shared {
    /// The shared state of a context just opened on `device`, with its
    /// pool (`None`: the fallback, and why); counted in [`contexts_alive`]
    /// until dropped.
    pub(crate) fn new(device: Device, pool: Option<Pool>, fallback: Option<String>) -> Self {
        let allocator = if fallback.is_some() {
            Allocator::Plain
        } else {
            Allocator::StreamOrdered
        };
        ALIVE.fetch_add(1, Ordering::AcqRel);
        Self {
            state: State::new(device, Vec::new()),
            pool,
            allocator: AtomicU8::new(allocator as u8),
            fallback_reason: Mutex::new(fallback),
            live: Mutex::new(HashMap::new()),
            pending: PendingFrees::default(),
            outstanding: Unsettled::default(),
            frees: FreeThread::new(Take::One),
            notes: Mutex::new(Vec::new()),
        }
    }

    /// The device's ordinal as HIP's calls take it (below the device count,
    /// checked at creation).
    pub(crate) fn ordinal(&self) -> i32 {
        self.device.ordinal as i32
    }

    /// Whether a sticky code was seen: no HIP call that may block any more.
    pub(crate) fn is_dead(&self) -> bool {
        self.shell.is_dead()
    }

    /// Mark the context lost, keeping the first reason for later errors,
    /// and wake every wait for outstanding work (it will not complete).
    pub(crate) fn mark_lost(&self, why: &str) {
        self.shell.mark_lost(Some(why));
        self.outstanding.wake();
    }

    pub(crate) fn allocator(&self) -> Allocator {
        if self.allocator.load(Ordering::Acquire) == Allocator::Plain as u8 {
            Allocator::Plain
        } else {
            Allocator::StreamOrdered
        }
    }

    pub(crate) fn pool(&self) -> Option<Pool> {
        self.pool
    }

    pub(crate) fn fall_back(&self, why: &str) {
        self.allocator
            .store(Allocator::Plain as u8, Ordering::Release);
        lock(&self.fallback_reason).get_or_insert_with(|| why.to_owned());
    }

    pub(crate) fn note(&self, what: String) {
        #[cfg(feature = "tracing")]
        tracing::warn!(context = self.id, "memgov hip: {what}");
        lock(&self.notes).push(what);
    }

    pub(crate) fn notes(&self) -> Vec<String> {
        lock(&self.notes).clone()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        ALIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// HIP keeps a current device per host thread, and the governor calls from
/// any thread: `make_current` reads the thread's device (`hipGetDevice`),
/// sets the context's (`hipSetDevice`) only if it differs, and the guard
/// sets the old one back. The runtime's or application's choice of device
/// on its threads is theirs: memgov changes it only for the duration of its
/// own call.
impl MakeCurrent for Shared {
    type Handle = i32;

    fn ours(&self) -> i32 {
        self.ordinal()
    }

    fn current(&self, op: &'static str) -> Result<i32, BackendError> {
        let mut current = 0i32;
        // SAFETY: valid out-pointer; reads the calling thread's state only.
        let r = unsafe { hipGetDevice(&mut current) };
        self.checked(op, "hipGetDevice", r)?;
        Ok(current)
    }

    fn enter(&self, op: &'static str, ours: i32) -> Result<(), BackendError> {
        // SAFETY: plain call with an ordinal validated at creation.
        let r = unsafe { hipSetDevice(ours) };
        self.checked(op, "hipSetDevice", r)
    }

    fn leave(&self, previous: i32) {
        // SAFETY: plain call with an ordinal the runtime reported as the
        // thread's current device.
        let r = unsafe { hipSetDevice(previous) };
        if r != ffi::SUCCESS {
            self.note(format!(
                "could not set the thread's device {previous} back: hipSetDevice returned {}",
                error_name(r)
            ));
        }
    }
}
