//! The ROCm HIP backend (feature `hip`): ROCm's HIP runtime loaded at run
//! time (see [`ffi`]), `hipMallocFromPoolAsync` from a memory pool the
//! context creates, and stream-ordered frees with `hipFreeAsync` retired by
//! a stream callback.
//!
//! * **Presence.** `libamdhip64.so.6`, else `libamdhip64.so.5`, is opened
//!   once per process on first use. Without it a context is `Unavailable`
//!   ("no HIP runtime: ..."); a runtime that finds no AMD GPU is
//!   `Unavailable` too ("no HIP device ..."). Nothing is linked at build
//!   time, so a binary built with every backend starts on any machine.
//! * A **stream** is a non-blocking `hipStream_t` on the chosen device.
//! * **Memory** comes from `hipMallocFromPoolAsync` on the allocating stream,
//!   from a pool of the context's own (`hipMemPoolCreate`, release threshold
//!   `u64::MAX` so that freed memory stays cached for reuse; trimmed and
//!   destroyed at teardown), so the description declares
//!   `stream_ordered_reuse`: bytes freed on a stream are reusable at once by
//!   later allocations on it. The device's default pool is never touched.
//!   Where the runtime has no stream-ordered allocator
//!   (`hipDeviceAttributeMemoryPoolsSupported` is 0, `hipMemPoolCreate` or a
//!   trial one-byte allocation at creation answers `hipErrorNotSupported`),
//!   or [`AllocatorChoice::Plain`] is configured, memory comes from `hipMalloc`
//!   and is freed with `hipFree` after an event recorded on the releasing
//!   stream has completed; `describe()` says which.
//! * A **free** is `hipFreeAsync` followed by `hipStreamAddCallback`; the
//!   callback fires the [`RetireSignal`] and makes no HIP call (see
//!   `retire.rs`).
//! * **Cross-stream order** ([`DeviceContext::order_after`]): an event
//!   recorded on the other stream, `hipStreamWaitEvent` on this one, the
//!   event destroyed at once (the wait keeps what it needs).
//! * **Current device**: every call that needs one reads the thread's
//!   current device (`hipGetDevice`), sets the context's only if it differs,
//!   and sets the old one back before returning, on every path.
//! * **Device loss**: sticky `hipError_t` codes (see [`result`]) mark the
//!   context lost and the device *dead*: from then on the context makes no
//!   HIP call that could block. A context the governor declares lost
//!   ([`DeviceContext::device_lost`]) while the runtime still answers is
//!   lost, not dead.
//! * **Teardown**: stop and join the reaper thread, synchronize and destroy
//!   the streams the governor left, free memory it abandoned (force), trim
//!   and destroy the context's pool. A lost teardown drops every pending
//!   signal unfired, then releases the same way while the runtime answers;
//!   on a dead device (or once a sticky code shows up mid-teardown) it stops
//!   calling HIP and leaves the rest to die with the device. It never calls
//!   `hipDeviceReset`, which would destroy every allocation and stream of
//!   the process on that device, other users' included. When teardown
//!   returns, no thread of the context calls HIP again.
//!
//! A stand-in `libamdhip64.so.5` (built from `backends/hip/stand-in/`) names
//! its device `"memgov stand-in ..."`; the context then reports
//! [`Execution::StandIn`].
//!
//! ```no_run
//! use memgov::hip::{HipConfig, HipContext};
//! use memgov::{DeviceContext, RetireSignal};
//! let ctx = HipContext::new(HipConfig::default())?;
//! let s = ctx.create_stream()?;
//! let m = ctx.allocate(&s, 4096)?;
//! ctx.write(&s, &m, 0, b"abc")?;
//! ctx.free_async(&s, m, RetireSignal::from_fn(|_| {})).map_err(|(_, _, e)| e)?;
//! ctx.synchronize(&s)?;
//! ctx.destroy_stream(s)?;
//! let probe = ctx.probe();
//! ctx.teardown(false)?;
//! assert!(probe.check_clean_teardown().is_ok());
//! # Ok::<(), memgov::BackendError>(())
//! ```

pub mod ffi;
mod memory;
pub mod result;
mod retire;
mod stream;

pub use ffi::{runtime_present, HipResult};
pub use memory::{HipMemory, Origin};
pub use stream::HipStream;

use ffi::{
    hipDeviceGetAttribute, hipDeviceGetName, hipDeviceTotalMem, hipDriverGetVersion, hipFree,
    hipGetDevice, hipGetDeviceCount, hipMemGetInfo, hipRuntimeGetVersion, hipSetDevice,
    hipStreamSynchronize, SUCCESS,
};
use memgov_backend::LostState;
use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireSignal,
};
use memgov_sync::lock;
use memory::Pool;
use result::{check, err, error_name, hip_error};
use retire::{Outstanding, PendingFrees, Reaper, ReaperThread};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Device names starting with this are the stand-in library's.
pub const STAND_IN_NAME_PREFIX: &str = "memgov stand-in";

/// Which allocator the context uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllocatorChoice {
    /// `hipMallocFromPoolAsync` from a pool of the context's own where the
    /// device supports memory pools, else the `hipMalloc` fallback.
    #[default]
    Auto,
    /// Always `hipMalloc`, freed with `hipFree` after an event on the
    /// releasing stream.
    Plain,
}

/// Settings of a HIP context.
#[derive(Debug, Clone, Default)]
pub struct HipConfig {
    /// Device ordinal (`hipSetDevice`), 0 by default.
    pub device: u32,
    /// Stream-ordered pool or the `hipMalloc` fallback.
    pub allocator: AllocatorChoice,
}

/// The allocator in use (may switch from `StreamOrdered` to `Plain` once, at
/// the first `hipErrorNotSupported`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Allocator {
    StreamOrdered = 0,
    Plain = 1,
}

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

/// How many [`Inner`]s exist in the process (see [`contexts_alive`]).
static ALIVE: AtomicUsize = AtomicUsize::new(0);

/// How many HIP contexts' shared states are still alive in this process:
/// contexts not yet dropped or torn down, plus any state something still
/// holds after that. memgov hands the runtime no reference to a context
/// (a stream callback's user data is a number, see `retire.rs`), so once
/// every [`HipContext`] is torn down or dropped and its reaper joined this
/// reads 0 even when the runtime dropped queued callbacks without running
/// them. For leak checks.
pub fn contexts_alive() -> usize {
    ALIVE.load(Ordering::Acquire)
}

/// What the context, its callbacks and the reaper share. Dropping it calls
/// no HIP function: teardown releases explicitly.
pub(crate) struct Inner {
    pub(crate) id: u64,
    ordinal: i32,
    name: String,
    total: u64,
    driver: String,
    execution: Execution,
    /// The context's own pool (`None` with the fallback).
    pool: Option<Pool>,
    allocator: AtomicU8,
    fallback_reason: Mutex<Option<String>>,
    pub(crate) lost: LostState,
    /// A HIP call returned a sticky code: the device is dead, and the
    /// context makes no further call that could block on it.
    dead: AtomicBool,
    closing: AtomicBool,
    pub(crate) probe: BackendProbe,
    pub(crate) next_id: AtomicU64,
    /// Allocations not yet handed to a free: pointer -> (bytes, origin).
    pub(crate) live: Mutex<HashMap<usize, (u64, Origin)>>,
    /// Streams not yet destroyed.
    pub(crate) streams: Mutex<HashMap<u64, stream::RawStream>>,
    pub(crate) pending: PendingFrees,
    pub(crate) outstanding: Outstanding,
    pub(crate) reaper: Reaper,
    pub(crate) reaper_thread: ReaperThread,
    notes: Mutex<Vec<String>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        ALIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The thread's current device while a call of the context runs; sets the
/// device the thread had back when dropped (only if it had to change it).
#[must_use = "the previous device is restored when this is dropped"]
pub(crate) struct CurrentDevice<'a> {
    inner: &'a Inner,
    restore: Option<i32>,
}

impl Drop for CurrentDevice<'_> {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // SAFETY: plain call with an ordinal the runtime reported as the
            // thread's current device.
            let r = unsafe { hipSetDevice(previous) };
            if r != SUCCESS {
                self.inner.note(format!(
                    "could not set the thread's device {previous} back: hipSetDevice returned {}",
                    error_name(r)
                ));
            }
        }
    }
}

impl Inner {
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_lost()
    }

    pub(crate) fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Whether a sticky code was seen: no HIP call that may block any more.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Mark the context lost, keeping the first reason for later errors.
    pub(crate) fn mark_lost(&self, why: &str) {
        if self.lost.mark(Some(why)) {
            self.probe.device_lost();
        }
        self.outstanding.wake();
    }

    /// A sticky code was seen: lost and dead.
    pub(crate) fn mark_dead(&self, why: &str) {
        self.dead.store(true, Ordering::Release);
        self.mark_lost(why);
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

    /// `Ok` on success; else the classified error, marking the context lost
    /// and dead when the code is sticky.
    pub(crate) fn checked(
        &self,
        op: &'static str,
        call: &str,
        code: HipResult,
    ) -> Result<(), BackendError> {
        check(op, call, code).inspect_err(|e| {
            if e.is_device_lost() {
                self.mark_dead(&e.message);
            }
        })
    }

    pub(crate) fn check_lost(&self, op: &'static str) -> Result<(), BackendError> {
        if self.is_lost() {
            let why = self.lost.reason_or("declared lost by the governor");
            return Err(err(
                op,
                BackendErrorKind::DeviceLost,
                format!(
                    "HIP device {} was lost ({why}); nothing is sent to it any more: retire this context",
                    self.ordinal
                ),
            ));
        }
        Ok(())
    }

    /// Refuse work on a lost or closing context.
    pub(crate) fn check_usable(&self, op: &'static str) -> Result<(), BackendError> {
        self.check_lost(op)?;
        if self.closing.load(Ordering::Acquire) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                "the HIP context is being torn down; no new work is accepted",
            ));
        }
        Ok(())
    }

    pub(crate) fn check_stream(&self, op: &'static str, s: &HipStream) -> Result<(), BackendError> {
        if s.context != self.id || !lock(&self.streams).contains_key(&s.id) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "stream {} is not a live stream of HIP context {} (it belongs to context {})",
                    s.id, self.id, s.context
                ),
            ));
        }
        Ok(())
    }

    /// Make this context's device current on the calling thread (HIP keeps
    /// a current device per host thread; the governor calls from any) until
    /// the returned guard is dropped, which sets the thread's own device
    /// back. The runtime's or application's choice of device on its threads
    /// is theirs: memgov changes it only for the duration of its own call.
    pub(crate) fn make_current(&self, op: &'static str) -> Result<CurrentDevice<'_>, BackendError> {
        let mut current = 0i32;
        // SAFETY: valid out-pointer.
        let r = unsafe { hipGetDevice(&mut current) };
        self.checked(op, "hipGetDevice", r)?;
        if current == self.ordinal {
            return Ok(CurrentDevice {
                inner: self,
                restore: None,
            });
        }
        // SAFETY: plain call with an ordinal validated at creation.
        let r = unsafe { hipSetDevice(self.ordinal) };
        self.checked(op, "hipSetDevice", r)?;
        Ok(CurrentDevice {
            inner: self,
            restore: Some(current),
        })
    }
}

/// A HIP device context: one device, a memory pool of its own, and the
/// streams and allocations made through it.
pub struct HipContext {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HipContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipContext")
            .field("id", &self.inner.id)
            .field("device", &self.inner.name)
            .field("ordinal", &self.inner.ordinal)
            .field("execution", &self.inner.execution)
            .field("lost", &self.inner.is_lost())
            .finish()
    }
}

/// `Unavailable` when no HIP runtime memgov can use is loadable here.
fn require_runtime() -> Result<(), BackendError> {
    match ffi::runtime_missing() {
        None => Ok(()),
        Some(why) => Err(err("new", BackendErrorKind::Unavailable, why)),
    }
}

fn device_name(ordinal: i32) -> Result<String, BackendError> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the buffer holds `len` bytes; HIP writes a NUL-terminated name
    // of at most that length.
    let r = unsafe { hipDeviceGetName(buf.as_mut_ptr(), buf.len() as i32 - 1, ordinal) };
    check("new", "hipDeviceGetName", r)?;
    // SAFETY: the last byte is never written (len - 1 above), so the buffer
    // is NUL-terminated.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

fn int_out(call: &str, f: impl FnOnce(*mut i32) -> HipResult) -> Result<i32, BackendError> {
    let mut v = 0i32;
    check("new", call, f(&mut v))?;
    Ok(v)
}

/// Sets the thread's device back when `HipContext::new` returns.
struct RestoreDevice(Option<i32>);

impl Drop for RestoreDevice {
    fn drop(&mut self) {
        if let Some(d) = self.0 {
            // SAFETY: plain call with the ordinal the runtime reported as the
            // thread's current device. A failure leaves nothing to undo.
            let _ = unsafe { hipSetDevice(d) };
        }
    }
}

/// What `HipContext::new` learnt about the device's allocator.
struct Allocation {
    pool: Option<Pool>,
    fallback_reason: Option<String>,
}

/// The context's own pool, or why the fallback is used.
fn choose_allocator(config: &HipConfig, ordinal: i32) -> Result<Allocation, BackendError> {
    let plain = |why: &str| {
        Ok(Allocation {
            pool: None,
            fallback_reason: Some(why.to_owned()),
        })
    };
    if config.allocator == AllocatorChoice::Plain {
        return plain("configured (AllocatorChoice::Plain)");
    }
    // SAFETY: valid out-pointer, ordinal in range, listed attribute.
    let pools = int_out("hipDeviceGetAttribute", |p| unsafe {
        hipDeviceGetAttribute(p, ffi::hipDeviceAttributeMemoryPoolsSupported, ordinal)
    })?;
    if pools == 0 {
        return plain("hipDeviceAttributeMemoryPoolsSupported is 0 on this device");
    }
    let Some(pool) = memory::create_pool(ordinal)? else {
        return plain("hipMemPoolCreate returned hipErrorNotSupported");
    };
    // The attribute and the pool can exist while the allocator still
    // refuses: ask it once, so that `describe()` (read at registration)
    // tells the truth from the start.
    match memory::probe_stream_ordered(pool) {
        Ok(true) => Ok(Allocation {
            pool: Some(pool),
            fallback_reason: None,
        }),
        Ok(false) => {
            memory::destroy_pool(pool)?;
            plain("hipMallocFromPoolAsync returned hipErrorNotSupported")
        }
        Err(e) => {
            let _ = memory::destroy_pool(pool);
            Err(e)
        }
    }
}

impl HipContext {
    /// Open device `config.device` through `libamdhip64`.
    ///
    /// Fails with [`BackendErrorKind::Unavailable`] when no HIP runtime can
    /// be loaded ("no HIP runtime") or the runtime finds no device ("no HIP
    /// device"), and with `InvalidArgument` when the
    /// ordinal is out of range. The calling thread's current device is the
    /// same when it returns.
    pub fn new(config: HipConfig) -> Result<Self, BackendError> {
        require_runtime()?;
        let mut count = 0i32;
        // SAFETY: valid out-pointer.
        let r = unsafe { hipGetDeviceCount(&mut count) };
        let no_device = ffi::hipErrorNoDevice;
        if r == no_device || (r == SUCCESS && count == 0) {
            return Err(err(
                "new",
                BackendErrorKind::Unavailable,
                format!(
                    "no HIP device (hipGetDeviceCount returned {}, {count} devices)",
                    error_name(r)
                ),
            ));
        }
        if r != SUCCESS {
            let mut e = hip_error("new", "hipGetDeviceCount", r);
            if e.kind == BackendErrorKind::Unavailable {
                e.message = format!("no HIP device: {}", e.message);
            }
            return Err(e);
        }
        let ordinal = i32::try_from(config.device).unwrap_or(i32::MAX);
        if ordinal >= count {
            return Err(err(
                "new",
                BackendErrorKind::InvalidArgument,
                format!(
                    "HIP device {} asked for, but the runtime has {count} (0..={})",
                    config.device,
                    count - 1
                ),
            ));
        }
        // SAFETY: valid out-pointer.
        let previous = int_out("hipGetDevice", |p| unsafe { hipGetDevice(p) })?;
        let _restore = if previous != ordinal {
            // SAFETY: ordinal is in range.
            check("new", "hipSetDevice", unsafe { hipSetDevice(ordinal) })?;
            RestoreDevice(Some(previous))
        } else {
            RestoreDevice(None)
        };
        let name = device_name(ordinal)?;
        let mut total = 0usize;
        // SAFETY: valid out-pointer, ordinal in range.
        check("new", "hipDeviceTotalMem", unsafe {
            hipDeviceTotalMem(&mut total, ordinal)
        })?;
        // SAFETY: valid out-pointers.
        let driver = int_out("hipDriverGetVersion", |p| unsafe { hipDriverGetVersion(p) })?;
        // SAFETY: valid out-pointer.
        let runtime = int_out("hipRuntimeGetVersion", |p| unsafe {
            hipRuntimeGetVersion(p)
        })?;
        let Allocation {
            pool,
            fallback_reason,
        } = choose_allocator(&config, ordinal)?;
        let execution = if name.starts_with(STAND_IN_NAME_PREFIX) {
            Execution::StandIn
        } else {
            Execution::RealHardware
        };
        let allocator = if fallback_reason.is_some() {
            Allocator::Plain
        } else {
            Allocator::StreamOrdered
        };
        ALIVE.fetch_add(1, Ordering::AcqRel);
        Ok(Self {
            inner: Arc::new(Inner {
                id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
                ordinal,
                name,
                total: total as u64,
                driver: format!("HIP runtime {runtime}, driver {driver}"),
                execution,
                pool,
                allocator: AtomicU8::new(allocator as u8),
                fallback_reason: Mutex::new(fallback_reason),
                lost: LostState::default(),
                dead: AtomicBool::new(false),
                closing: AtomicBool::new(false),
                probe: BackendProbe::new(),
                next_id: AtomicU64::new(1),
                live: Mutex::new(HashMap::new()),
                streams: Mutex::new(HashMap::new()),
                pending: PendingFrees::default(),
                outstanding: Outstanding::default(),
                reaper: Reaper::default(),
                reaper_thread: Mutex::new(None),
                notes: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The backend's bookkeeping, readable after teardown.
    pub fn probe(&self) -> BackendProbe {
        self.inner.probe.clone()
    }

    /// Whether allocations come from the context's pool (true) or from the
    /// `hipMalloc` fallback, and why the fallback was chosen.
    pub fn stream_ordered(&self) -> (bool, Option<String>) {
        (
            self.inner.allocator() == Allocator::StreamOrdered,
            lock(&self.inner.fallback_reason).clone(),
        )
    }

    /// Whether the runtime is memgov's stand-in rather than ROCm's.
    pub fn is_stand_in(&self) -> bool {
        self.inner.execution == Execution::StandIn
    }

    /// Frees queued and not yet retired (callbacks or reaper pending).
    pub fn pending_frees(&self) -> usize {
        self.inner.pending.len() + self.inner.reaper.len()
    }

    /// Things the backend noticed that had no caller to report to (a
    /// failed fallback free, a refused stream callback, a teardown that
    /// stopped at a sticky error).
    pub fn notes(&self) -> Vec<String> {
        lock(&self.inner.notes).clone()
    }

    /// Synchronize and destroy the streams left, free the memory left (and
    /// the fallback frees a lost teardown took from the reaper), trim and
    /// destroy the pool. Stops calling HIP at the first sticky code (or at
    /// once on a dead device): what is left then dies with the device, and
    /// is only counted.
    fn release_everything(&self, taken: Vec<retire::Taken>) -> Result<(), BackendError> {
        let inner = &self.inner;
        let mut first_err: Option<BackendError> = None;
        let mut keep = |r: Result<(), BackendError>| {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        };
        let streams: Vec<stream::RawStream> =
            lock(&inner.streams).drain().map(|(_, s)| s).collect();
        let left: Vec<(usize, (u64, Origin))> = lock(&inner.live).drain().collect();
        let device = if inner.is_dead() {
            None
        } else {
            match inner.make_current("teardown") {
                Ok(d) => Some(d),
                Err(e) => {
                    keep(Err(e));
                    None
                }
            }
        };
        if device.is_some() {
            for s in &streams {
                if inner.is_dead() {
                    break;
                }
                // SAFETY: the stream is alive (just taken out of the table).
                let r = unsafe { hipStreamSynchronize(s.0) };
                keep(inner.checked("teardown", "hipStreamSynchronize", r));
            }
        }
        // The reaper finishes what is queued (or, on a dead device, settles
        // it without a call) and is joined: no thread of this context calls
        // HIP after teardown.
        retire::stop_reaper(inner);
        for s in streams {
            if device.is_some() && !inner.is_dead() {
                keep(stream::destroy_raw(inner, "teardown", s));
            } else {
                inner.probe.stream_destroyed();
            }
        }
        if device.is_some() && !inner.is_dead() {
            for t in &taken {
                keep(retire::free_taken(inner, t));
            }
        }
        if device.is_some() && !inner.is_dead() && left.iter().any(|(_, (_, o))| *o == Origin::Pool)
        {
            keep(self.free_pool_leftovers(&left));
        }
        for (ptr, (bytes, origin)) in &left {
            if *origin == Origin::Plain && device.is_some() && !inner.is_dead() {
                // SAFETY: the pointer came from hipMalloc of this context;
                // every stream is synchronized and destroyed, so no work
                // uses it.
                let r = unsafe { hipFree(*ptr as *mut c_void) };
                keep(inner.checked("teardown", "hipFree", r));
            }
            inner.probe.freed(*bytes);
        }
        if let Some(pool) = inner.pool() {
            if device.is_some() && !inner.is_dead() {
                keep(memory::trim_pool(pool));
                if !inner.is_dead() {
                    keep(memory::destroy_pool(pool).map_err(|e| BackendError {
                        operation: "teardown",
                        ..e
                    }));
                }
            }
        }
        if inner.is_dead() {
            inner.note(
                "teardown stopped calling HIP at a sticky error: what was left dies with the device"
                    .to_owned(),
            );
        }
        drop(device);
        first_err.map_or(Ok(()), Err)
    }

    /// Pool allocations the governor abandoned (force): free them on a
    /// temporary stream and wait.
    fn free_pool_leftovers(&self, left: &[(usize, (u64, Origin))]) -> Result<(), BackendError> {
        let s = stream::create_raw(&self.inner, "teardown")?;
        let mut result = Ok(());
        for (ptr, (_, origin)) in left {
            if *origin == Origin::Pool && !self.inner.is_dead() {
                // SAFETY: the pointer came from hipMallocFromPoolAsync of
                // this context; every stream that used it is synchronized.
                let r = unsafe { ffi::hipFreeAsync(*ptr as *mut c_void, s.0) };
                result = result.and(self.inner.checked("teardown", "hipFreeAsync", r));
            }
        }
        if self.inner.is_dead() {
            return result;
        }
        // SAFETY: the temporary stream is alive until destroyed below.
        let r = unsafe { hipStreamSynchronize(s.0) };
        result = result.and(self.inner.checked("teardown", "hipStreamSynchronize", r));
        if self.inner.is_dead() {
            return result;
        }
        // SAFETY: synchronized above; nothing else knows this stream.
        let r = unsafe { ffi::hipStreamDestroy(s.0) };
        result.and(self.inner.checked("teardown", "hipStreamDestroy", r))
    }
}

impl DeviceContext for HipContext {
    type Stream = HipStream;
    type Memory = HipMemory;

    fn describe(&self) -> DeviceDescription {
        let inner = &self.inner;
        let allocator = match lock(&inner.fallback_reason).as_deref() {
            None => "hipMallocFromPoolAsync from the context's own pool".to_owned(),
            Some(why) => format!("hipMalloc/hipFree fallback after an event ({why})"),
        };
        DeviceDescription {
            backend: result::BACKEND,
            vendor: "AMD".to_owned(),
            name: inner.name.clone(),
            ordinal: inner.ordinal as u32,
            total_bytes: inner.total,
            driver: format!("{}; {allocator}", inner.driver),
            execution: inner.execution,
            stream_ordered_reuse: inner.allocator() == Allocator::StreamOrdered,
        }
    }

    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.inner.check_lost("memory_info")?;
        let _device = self.inner.make_current("memory_info")?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the device is current on this thread.
        let r = unsafe { hipMemGetInfo(&mut free, &mut total) };
        self.inner.checked("memory_info", "hipMemGetInfo", r)?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn create_stream(&self) -> Result<HipStream, BackendError> {
        stream::create(&self.inner)
    }

    fn destroy_stream(&self, stream: HipStream) -> Result<(), BackendError> {
        stream::destroy(&self.inner, stream)
    }

    fn allocate(&self, stream: &HipStream, bytes: u64) -> Result<HipMemory, BackendError> {
        memory::allocate(&self.inner, stream, bytes)
    }

    fn free_async(
        &self,
        stream: &HipStream,
        memory: HipMemory,
        retired: RetireSignal,
    ) -> Result<(), (HipMemory, RetireSignal, BackendError)> {
        retire::free_async(&self.inner, stream, memory, retired)
    }

    fn write(
        &self,
        stream: &HipStream,
        memory: &HipMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        memory::write(&self.inner, stream, memory, offset, src)
    }

    fn read(
        &self,
        stream: &HipStream,
        memory: &HipMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        memory::read(&self.inner, stream, memory, offset, dst)
    }

    fn synchronize(&self, stream: &HipStream) -> Result<(), BackendError> {
        stream::synchronize(&self.inner, stream)
    }

    fn order_after(&self, stream: &HipStream, after: &HipStream) -> Result<(), BackendError> {
        stream::order_after(&self.inner, stream, after)
    }

    fn device_lost(&self) {
        self.inner.mark_lost("declared lost by the governor");
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        self.close(lost)
    }
}

/// A context dropped without `teardown` (a probe that only checked for a
/// device, a panic unwinding past it) is torn down here, as by
/// `teardown(false)` (or as lost, if it is): its pool, streams and memory are
/// released, and its reaper joined. The result has no one to go to; the
/// probe and `notes()` keep what went wrong.
impl Drop for HipContext {
    fn drop(&mut self) {
        if !self.inner.closing.load(Ordering::Acquire) {
            let _ = self.close(false);
        }
    }
}

impl HipContext {
    /// Teardown proper; the first call closes the context, and `Drop` does
    /// nothing after it.
    fn close(&self, lost: bool) -> Result<(), BackendError> {
        let inner = &self.inner;
        inner.closing.store(true, Ordering::Release);
        if lost {
            inner.mark_lost("torn down as lost");
        }
        let result = if inner.is_lost() {
            // Every signal still held is dropped unfired; the fallback frees
            // the reaper had not started come back to be freed here (their
            // signals dropped too), and the reaper is joined below.
            let taken = retire::abandon_all(inner);
            self.release_everything(taken)
        } else {
            let pending = self.pending_frees();
            if pending > 0 {
                inner.probe.violation(
                    "hip",
                    format!("teardown with {pending} stream-ordered frees not yet retired"),
                );
            }
            self.release_everything(Vec::new())
        };
        if inner.is_dead() {
            // A sticky code found mid-teardown: the frees still queued will
            // not execute, and their callbacks may never run. Their signals
            // are dropped now, not whenever the runtime gets to them.
            retire::abandon_all(inner);
        }
        retire::forget_routes(inner);
        inner.probe.torn_down_now();
        result
    }
}
