//! The state a context's threads share (the caller's, the stream
//! callbacks' through their routes, the free thread's): [`Shared`].

use crate::ffi::{
    self, hipEvent_t, hipGetDevice, hipMemPool_t, hipSetDevice, hipStream_t, HipResult,
};
use crate::result::{error_name, Hip};
use memgov_backend::shell::{MakeCurrent, Shell};
use memgov_backend::vmm::Gate;
use memgov_backend::{
    lock, BackendError, BackendProbe, Execution, FreeThread, RetireSignal, Take, Tickets, Unsettled,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// The HIP runtime's gate: process-wide, as the runtime's rule is.
pub(crate) fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate::new(crate::result::BACKEND, "HipCapture"))
}

/// Where an allocation came from, and so how it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `hipMallocFromPoolAsync` from the context's own pool; freed with
    /// `hipFreeAsync` on a stream.
    Pool,
    /// `hipMalloc`; freed with `hipFree` once an event recorded on the
    /// releasing stream has completed.
    Plain,
    /// `hipHostMalloc` (page-locked host memory,
    /// [`Tier::PinnedHost`](memgov_backend::Tier::PinnedHost));
    /// freed with `hipHostFree` once an event recorded on the releasing
    /// stream has completed.
    PinnedHost,
    /// Carved from the context's virtual-memory arena
    /// ([`HipConfig::arena`](crate::HipConfig::arena)); its range returns
    /// to the arena once a stream callback queued behind its release ran.
    Arena,
}

/// A `hipMemPool_t` that may cross threads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pool(pub(crate) hipMemPool_t);

// SAFETY: a hipMemPool_t is an opaque handle the HIP runtime accepts from any
// host thread; this type only carries the value.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

/// A `hipStream_t` that may cross threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawStream(pub(crate) hipStream_t);

// SAFETY: a hipStream_t is an opaque handle into the HIP runtime, which
// accepts it from any host thread; this type only carries the value.
unsafe impl Send for RawStream {}
// SAFETY: as above; shared references only copy the handle.
unsafe impl Sync for RawStream {}

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

/// Context ids, unique in the process.
pub(crate) static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

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

/// What the context, its callbacks and its free thread share. Dropping it calls
/// no HIP function: teardown releases explicitly.
// `pub` in a private module: the public aliases over the core's generic
// types (`HipArena`) name it, and nothing outside the crate can.
pub struct Shared {
    pub(crate) id: u64,
    pub(crate) ordinal: i32,
    pub(crate) name: String,
    /// UUID and PCI address (`hipDeviceGetUuid`, `hipDeviceGetPCIBusId`).
    pub(crate) identity: memgov_backend::DeviceIdentity,
    pub(crate) total: u64,
    pub(crate) driver: String,
    pub(crate) execution: Execution,
    /// The context's own pool (`None` with the fallback).
    pool: Option<Pool>,
    allocator: AtomicU8,
    pub(crate) fallback_reason: Mutex<Option<String>>,
    /// Lost (declared by the governor, or a sticky code from the runtime,
    /// whose message is the reason kept), dead (the runtime's own sticky
    /// code: no HIP call that could block is made any more), closing, and
    /// the probe the loss is reported to.
    pub(crate) shell: Shell<memgov_stream_ordered::Checked<Hip>>,
    pub(crate) next_id: AtomicU64,
    /// Allocations not yet handed to a free: pointer -> (bytes, origin).
    pub(crate) live: Mutex<HashMap<usize, (u64, Origin)>>,
    /// Streams not yet destroyed.
    pub(crate) streams: memgov_stream_ordered::stream::Streams<hipStream_t>,
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
    /// Sleeps of the arena against copies and launches between their
    /// awake check and their enqueue.
    pub(crate) sleep_gate: memgov_backend::vmm::SleepGate,
    notes: Mutex<Vec<String>>,
}

/// What `HipContext::new` learnt about the device, to share.
pub(crate) struct Opened {
    pub(crate) ordinal: i32,
    pub(crate) name: String,
    pub(crate) identity: memgov_backend::DeviceIdentity,
    pub(crate) total: u64,
    pub(crate) driver: String,
    pub(crate) execution: Execution,
    pub(crate) pool: Option<Pool>,
    pub(crate) fallback_reason: Option<String>,
}

impl Shared {
    /// The shared state of a context just opened; counted in
    /// [`contexts_alive`] until dropped.
    pub(crate) fn new(opened: Opened) -> Self {
        let allocator = if opened.fallback_reason.is_some() {
            Allocator::Plain
        } else {
            Allocator::StreamOrdered
        };
        ALIVE.fetch_add(1, Ordering::AcqRel);
        Self {
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
            shell: Shell::new(
                format!("HIP device {}", opened.ordinal),
                BackendProbe::new(),
            ),
            ordinal: opened.ordinal,
            name: opened.name,
            identity: opened.identity,
            total: opened.total,
            driver: opened.driver,
            execution: opened.execution,
            pool: opened.pool,
            allocator: AtomicU8::new(allocator as u8),
            fallback_reason: Mutex::new(opened.fallback_reason),
            next_id: AtomicU64::new(1),
            live: Mutex::new(HashMap::new()),
            streams: Default::default(),
            pending: PendingFrees::default(),
            outstanding: Unsettled::default(),
            frees: FreeThread::new(Take::One),
            sleep_gate: Default::default(),
            notes: Mutex::new(Vec::new()),
        }
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

    /// `Ok` on success; else the classified error. A sticky code marks the
    /// context lost and dead (the shell) and wakes every wait for
    /// outstanding work.
    pub(crate) fn checked(
        &self,
        op: &'static str,
        call: &str,
        code: HipResult,
    ) -> Result<(), BackendError> {
        self.shell.checked(op, call, code).inspect_err(|e| {
            if e.is_device_lost() {
                self.outstanding.wake();
            }
        })
    }

    /// `DeviceLost` (with the first reason) on a lost context, with no HIP
    /// call.
    pub(crate) fn check_lost(&self, op: &'static str) -> Result<(), BackendError> {
        self.shell.check_lost(op)
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
        self.ordinal
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
