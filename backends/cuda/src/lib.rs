//! The CUDA backend (feature `cuda`): the CUDA driver API through cudarc,
//! with `libcuda` opened at run time, so the crate builds and its tests skip
//! cleanly on machines without CUDA.
//!
//! * **Presence.** No loadable `libcuda` is `Unavailable` ("no CUDA driver"),
//!   checked before any other cudarc call (cudarc panics on a missing library
//!   or symbol; the check catches that panic). `cuInit`
//!   failing or no device is `Unavailable` ("no CUDA device") with the
//!   driver's error name.
//! * **Context.** The device's primary context, retained in
//!   [`CudaContext::new`] and released in teardown: it is the context the CUDA
//!   runtime API and most ML runtimes use, so memory and streams are shared
//!   with them rather than split across contexts. Other users of the device's
//!   primary context in the process keep it alive with their own retains;
//!   memgov's release only drops its own reference. Every call that needs
//!   the context pushes it on the calling thread's context stack
//!   (`cuCtxPushCurrent`) and pops it before returning, on every path, so
//!   the caller's own current context is what it was, and no thread is left
//!   with memgov's context current (the governor calls from any thread);
//!   nothing is pushed when it is current already. A
//!   runtime that already owns a context and streams lends them with the
//!   `unsafe` [`CudaContext::adopt`].
//! * **Handles.** Streams and allocations carry the id of the context that
//!   made them; every safe method checks them against the context's own
//!   registry before any driver call, and refuses another context's handle,
//!   a destroyed stream, a freed allocation or an out-of-range offset with
//!   `InvalidArgument`.
//! * **Memory.** Non-blocking streams; `cuMemAllocFromPoolAsync` from a
//!   memory pool of memgov's own (`cuMemPoolCreate`), whose release
//!   threshold is set from [`CudaConfig::release_threshold`] and which
//!   teardown destroys: the device's default pool, shared by every user of
//!   the device, is never changed. Copies with `cuMemcpy{HtoD,DtoH}Async` on
//!   the stream; see [`CudaMemory`].
//! * **Stream-ordered free.** `cuMemFreeAsync`, then `cuLaunchHostFunc`
//!   whose callback fires the [`RetireSignal`]; see the `retire` module. A
//!   free on another stream than the memory's is ordered by `order_after`:
//!   an event (timing disabled) recorded on the other stream, waited on by
//!   the freeing stream (`cuStreamWaitEvent`) and destroyed at once (legal
//!   while the wait is pending). No host wait.
//! * **Retired streams.** A destroyed stream whose work is still queued is
//!   kept until `cuStreamQuery` reports it complete. A watcher thread asks
//!   every few milliseconds while there are such streams, and
//!   `synchronize` asks too, so an asynchronous fault in that work (after
//!   the last driver call) is observed: the context is marked lost and the
//!   signals of queued frees, whose host functions will never run, are
//!   dropped unfired, which lets retire and force finish. Teardown stops and
//!   joins the watcher first: no thread of the backend calls the driver after
//!   teardown returns.
//! * **Device loss.** The sticky codes (illegal address, launch failure, ECC
//!   uncorrectable, hardware stack error, illegal instruction, misaligned
//!   address, ...) are `DeviceLost`; after one the backend makes no further
//!   device call except releasing its context reference in teardown.
//! * **Teardown** (after the governor's drain): synchronize every stream
//!   (retired ones included), free what a forced retire left, destroy the
//!   streams it created, trim and destroy its pool, restore the thread's
//!   context, release the primary context. With `lost = true`: no frees and
//!   no blocking waits; memgov's pool and its primary context reference are
//!   released, which destroys memgov's allocations and streams with the
//!   context when it was the last reference. When the driver itself
//!   reported the loss that happens at once; when only the caller declared
//!   it, memgov first polls its streams (`cuStreamQuery`, at most 5 s) until
//!   their queued work has finished, and keeps the reference (reporting
//!   it) if work is still running then. An adopted context is never
//!   released: memgov's allocations in it stay until the runtime destroys
//!   it.
//!
//! ```no_run
//! use memgov::cuda::{CudaConfig, CudaContext};
//! use memgov::{DeviceContext, RetireSignal};
//! let ctx = CudaContext::new(CudaConfig::default())?;
//! let s = ctx.create_stream()?;
//! let m = ctx.allocate(&s, 4096)?;
//! ctx.write(&s, &m, 0, b"abc")?;
//! ctx.free_async(&s, m, RetireSignal::from_fn(|_| {})).map_err(|(_, _, e)| e)?;
//! ctx.synchronize(&s)?;
//! ctx.destroy_stream(s)?;
//! let probe = ctx.probe();
//! ctx.teardown(false)?;
//! assert_eq!(probe.check_clean_teardown(), Ok(()));
//! # Ok::<(), memgov::BackendError>(())
//! ```

mod memory;
mod result;
mod retire;
mod stream;

pub use memory::CudaMemory;
pub use stream::CudaStream;

use cudarc::driver::sys::{
    self, CUcontext, CUdevice, CUdeviceptr, CUmemoryPool, CUresult, CUstream,
};
use memgov_backend::LostState;
use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireSignal,
};
use result::{check, err, BACKEND};
use retire::PendingFrees;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Ids of `CudaContext`s in this process, stamped into their streams and
/// allocations so that another context's handles are refused.
static CONTEXT_IDS: AtomicU64 = AtomicU64::new(1);

/// How often the watcher asks the driver about destroyed streams whose work
/// is still queued.
const WATCH_INTERVAL: Duration = Duration::from_millis(2);

/// How long a lost teardown on a device whose driver still answers waits for
/// queued work to finish before it releases the primary context.
const LOST_DRAIN: Duration = Duration::from_secs(5);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device name prefix of memgov's stand-in driver (see
/// `backends/stand-ins/README.md`), which makes the context report
/// [`Execution::StandIn`]. No NVIDIA device is named so.
const STAND_IN_NAME: &str = "memgov stand-in";

/// Why no driver could be loaded, or `Ok`. Checked once per process.
fn driver_status() -> &'static Result<(), String> {
    static STATUS: OnceLock<Result<(), String>> = OnceLock::new();
    STATUS.get_or_init(|| {
        // cudarc 0.19.0 resolves every symbol of its CUDA 12.0 bindings when
        // it opens a candidate library and panics (rather than failing) if
        // one is missing: a driver older than 12.0, or a partial imitation.
        // SAFETY: only opens candidate libraries, resolves symbols and
        // closes them again.
        match std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }) {
            Ok(true) => Ok(()),
            Ok(false) => Err(
                "no CUDA driver (libcuda could not be loaded; install the NVIDIA \
                              driver or put a libcuda.so.1 on LD_LIBRARY_PATH)"
                    .to_owned(),
            ),
            Err(_) => Err(
                "no CUDA driver usable by memgov: the libcuda found lacks entry points \
                           of the CUDA 12.0 driver API (update the NVIDIA driver to CUDA 12.0 or \
                           newer)"
                    .to_owned(),
            ),
        }
    })
}

/// Whether a CUDA driver library that memgov can use is loadable here.
/// Never panics.
pub fn driver_present() -> bool {
    driver_status().is_ok()
}

fn require_driver() -> Result<(), BackendError> {
    driver_status()
        .clone()
        .map_err(|why| err("new", BackendErrorKind::Unavailable, why))
}

/// Settings of a CUDA context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaConfig {
    /// Device ordinal (`cuDeviceGet`).
    pub ordinal: u32,
    /// Release threshold of memgov's own memory pool
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`), or `None` for the driver's
    /// default (0: freed memory goes back to the driver at every
    /// synchronization). The default, `u64::MAX`, keeps freed memory cached
    /// in the pool instead: the governor's budget already bounds what is live
    /// or pending, so the cache never grows past the budget's high-water
    /// mark, and teardown trims and destroys the pool. The pool is created by
    /// the context (`cuMemPoolCreate`) and used by it alone; the device's
    /// default pool, which other users of the device share, is never changed.
    pub release_threshold: Option<u64>,
}

impl Default for CudaConfig {
    fn default() -> Self {
        Self {
            ordinal: 0,
            release_threshold: Some(u64::MAX),
        }
    }
}

/// A context and streams a runtime already owns, lent to memgov by
/// [`CudaContext::adopt`].
#[derive(Debug)]
pub struct AdoptedContext {
    /// The device the context belongs to.
    pub ordinal: u32,
    /// The runtime's context (primary or not).
    pub context: CUcontext,
    /// Streams of that context that `create_stream` hands out, in order,
    /// before it creates streams of its own.
    pub streams: Vec<CUstream>,
}

pub(crate) struct Live {
    pub ptr: CUdeviceptr,
    pub bytes: u64,
}

/// A raw stream handle that may cross threads (see `CudaStream`).
pub(crate) struct RawStream(pub CUstream);
// SAFETY: a driver handle with no thread affinity; used only with its
// context current.
unsafe impl Send for RawStream {}

/// State shared by the context and its host functions. Dropping it calls no
/// driver function: teardown destroys explicitly.
pub(crate) struct Shared {
    /// This context's id (see `CONTEXT_IDS`).
    pub(crate) id: u64,
    device: CUdevice,
    ordinal: u32,
    context: CUcontext,
    /// Whether memgov retained the primary context (and releases it).
    retained: bool,
    /// memgov's own memory pool on the device (`cuMemPoolCreate`), destroyed
    /// at teardown; the device's default pool is never changed.
    pool: CUmemoryPool,
    name: String,
    total_bytes: u64,
    driver_version: i32,
    execution: Execution,
    pub(crate) probe: BackendProbe,
    /// The governor declared the device lost, or the driver returned a
    /// sticky code; the reason kept is the first sticky error the driver
    /// returned.
    lost: LostState,
    /// The driver itself returned a sticky code.
    driver_lost: AtomicBool,
    next_id: AtomicU64,
    pub(crate) pending: Arc<PendingFrees>,
    pub(crate) live: Mutex<HashMap<u64, Live>>,
    /// Live streams: id -> (handle, adopted).
    pub(crate) streams: Mutex<HashMap<u64, (CUstream, bool)>>,
    /// Adopted streams not yet handed out.
    pub(crate) lendable: Mutex<VecDeque<RawStream>>,
    /// Streams memgov created and the governor destroyed whose queued work
    /// may still be running (host functions included). Destroyed once
    /// `cuStreamQuery` says their work is complete, or at teardown after a
    /// synchronize: the context is never released under a running host
    /// function.
    pub(crate) retired_streams: Mutex<Vec<RawStream>>,
    /// The watcher thread that asks the driver about retired streams.
    watch: Watch,
}

/// The watcher: started with the first retired stream, it queries retired
/// streams every `WATCH_INTERVAL` while there are any (so an asynchronous
/// fault in their work is observed even when nobody calls the backend), and
/// is stopped and joined by teardown before any other teardown step.
#[derive(Default)]
struct Watch {
    state: Mutex<WatchState>,
    wake: Condvar,
}

#[derive(Default)]
struct WatchState {
    stop: bool,
    thread: Option<JoinHandle<()>>,
}

/// The calling thread's previous context, restored when dropped
/// (`cuCtxPopCurrent`): returned by [`Shared::make_current`].
#[must_use = "the context stays current only while the guard lives"]
pub(crate) struct Current {
    /// Whether this guard pushed (and so pops); false when the context was
    /// already current on the thread.
    pushed: bool,
    /// Not Send: a push must be popped on the thread that pushed.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Drop for Current {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: balances the successful cuCtxPushCurrent that created this
        // guard on this thread (the guard is neither Send nor cloned);
        // popping makes no device call and restores the context the thread
        // had before.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
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
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_lost()
    }

    pub(crate) fn mark_lost(&self) {
        self.mark_lost_because(None);
    }

    fn mark_lost_because(&self, why: Option<&str>) {
        if self.lost.mark(why) {
            self.probe.device_lost();
        }
    }

    /// Refuse work on a lost context without calling the driver.
    pub(crate) fn check_usable(&self, op: &'static str) -> Result<(), BackendError> {
        if !self.is_lost() {
            return Ok(());
        }
        let why = self.lost.reason_or("the device was declared lost");
        Err(err(
            op,
            BackendErrorKind::DeviceLost,
            format!(
                "the CUDA device is lost ({why}); no further call is made on it: retire this \
                 context and create a new one"
            ),
        ))
    }

    /// Make the context current on the calling thread until the returned
    /// guard drops, which restores the context the thread had before
    /// (`cuCtxPushCurrent` / `cuCtxPopCurrent`): a runtime's own current
    /// context is never replaced behind its back, and no thread is left with
    /// memgov's context current after memgov returns.
    ///
    /// When the context is already current (a runtime sharing the primary
    /// context usually has it current), nothing is pushed or popped.
    pub(crate) fn make_current(&self, op: &'static str) -> Result<Current, BackendError> {
        let mut now: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer; reads the calling thread's state only.
        let r = unsafe { sys::cuCtxGetCurrent(&mut now) };
        self.checked(op, "cuCtxGetCurrent", r)?;
        if now == self.context {
            return Ok(Current {
                pushed: false,
                _thread: std::marker::PhantomData,
            });
        }
        // SAFETY: the context is valid until teardown, which consumes the
        // `CudaContext` (and so runs after every other call has returned) and
        // pops its own push before it releases the context.
        let r = unsafe { sys::cuCtxPushCurrent_v2(self.context) };
        self.checked(op, "cuCtxPushCurrent_v2", r)?;
        Ok(Current {
            pushed: true,
            _thread: std::marker::PhantomData,
        })
    }

    /// Classify a failure; a sticky code marks the context lost and drops
    /// the signals of queued frees unfired (queued work no longer executes
    /// after a sticky error, so their host functions never run).
    pub(crate) fn classify(&self, op: &'static str, call: &str, r: CUresult) -> BackendError {
        let e = result::error(op, call, r);
        if e.is_device_lost() {
            self.driver_lost.store(true, Ordering::Release);
            self.mark_lost_because(Some(&e.message));
            self.abandon_pending();
        }
        e
    }

    /// Drop every waiting signal unfired (the governor settles them as
    /// abandoned), with no lock held.
    pub(crate) fn abandon_pending(&self) {
        let taken = self.pending.take_all();
        for (_, bytes) in &taken {
            self.probe.free_abandoned(*bytes);
        }
        drop(taken);
    }

    /// A stream handle of this context that is live, or `InvalidArgument`
    /// (another context's stream, or one already destroyed) with no driver
    /// call.
    pub(crate) fn check_stream(
        &self,
        op: &'static str,
        stream: &CudaStream,
    ) -> Result<(), BackendError> {
        if stream.context != self.id || !lock(&self.streams).contains_key(&stream.id) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "stream {} is not a live stream of CUDA context {} (it belongs to context {},                      or was destroyed): use a stream this context created and has not destroyed",
                    stream.id, self.id, stream.context
                ),
            ));
        }
        Ok(())
    }

    /// An allocation of this context that is live, or `InvalidArgument`
    /// (another context's, or already freed) with no driver call.
    pub(crate) fn check_memory(
        &self,
        op: &'static str,
        memory: &CudaMemory,
    ) -> Result<(), BackendError> {
        if memory.context != self.id || !lock(&self.live).contains_key(&memory.id) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "allocation {} ({} B at {:#x}) is not live in CUDA context {} (it belongs to                      context {}, or was freed)",
                    memory.id, memory.bytes, memory.ptr, self.id, memory.context
                ),
            ));
        }
        Ok(())
    }

    /// Destroy the retired streams whose work has completed; a sticky error
    /// from a query is observed here (the device is then lost).
    pub(crate) fn reap_retired(&self, op: &'static str) -> Result<(), BackendError> {
        if lock(&self.retired_streams).is_empty() || self.is_lost() {
            return Ok(());
        }
        let _current = self.make_current(op)?;
        let retired: Vec<RawStream> = std::mem::take(&mut *lock(&self.retired_streams));
        let mut keep = Vec::new();
        let mut result = Ok(());
        for raw in retired {
            if self.is_lost() {
                keep.push(raw);
                continue;
            }
            // SAFETY: a stream this context created and the governor
            // destroyed; held only in the retired list, which this call took,
            // so no other call uses it; the context is current.
            let r = unsafe { sys::cuStreamQuery(raw.0) };
            match r {
                CUresult::CUDA_SUCCESS => {
                    // SAFETY: as above; its work has completed.
                    let r = unsafe { sys::cuStreamDestroy_v2(raw.0) };
                    result = result.and(self.checked(op, "cuStreamDestroy_v2", r));
                }
                CUresult::CUDA_ERROR_NOT_READY => keep.push(raw),
                r => {
                    keep.push(raw);
                    result = result.and(Err(self.classify(op, "cuStreamQuery", r)));
                }
            }
        }
        lock(&self.retired_streams).extend(keep);
        result
    }

    /// Start the watcher (once) and wake it: a stream was retired with work
    /// still queued.
    pub(crate) fn watch_retired(self: &Arc<Self>) {
        let mut st = lock(&self.watch.state);
        if st.stop {
            return;
        }
        if st.thread.is_none() {
            let weak = Arc::downgrade(self);
            match std::thread::Builder::new()
                .name("memgov-cuda-watch".into())
                .spawn(move || watch_loop(weak))
            {
                Ok(t) => st.thread = Some(t),
                // Without the watcher, retired streams are still queried by
                // later calls and by teardown.
                Err(e) => self.probe.violation(
                    BACKEND,
                    format!("could not start the retired-stream watcher: {e}"),
                ),
            }
        }
        drop(st);
        self.watch.wake.notify_all();
    }

    /// Stop the watcher and wait until it has returned: after this, no
    /// thread of this backend calls the driver.
    fn stop_watcher(&self) {
        let thread = {
            let mut st = lock(&self.watch.state);
            st.stop = true;
            st.thread.take()
        };
        self.watch.wake.notify_all();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    pub(crate) fn checked(
        &self,
        op: &'static str,
        call: &str,
        r: CUresult,
    ) -> Result<(), BackendError> {
        if r == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.classify(op, call, r))
        }
    }
}

/// The watcher thread's body: while retired streams exist, query them every
/// `WATCH_INTERVAL`; otherwise sleep until woken. Returns when stopped, or
/// when the context was dropped without teardown.
fn watch_loop(weak: Weak<Shared>) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        {
            let st = lock(&shared.watch.state);
            if st.stop {
                return;
            }
            let idle = lock(&shared.retired_streams).is_empty() || shared.is_lost();
            let st = if idle {
                shared
                    .watch
                    .wake
                    .wait_timeout(st, WATCH_INTERVAL * 50)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0)
            } else {
                shared
                    .watch
                    .wake
                    .wait_timeout(st, WATCH_INTERVAL)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0)
            };
            if st.stop {
                return;
            }
        }
        // No lock held across the driver calls; an error is kept by the
        // context (a sticky one marks it lost and abandons pending frees).
        let _ = shared.reap_retired("watch");
    }
}

/// One CUDA device context: the device's primary context (or an adopted
/// one), its streams and allocations.
pub struct CudaContext {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaContext")
            .field("ordinal", &self.shared.ordinal)
            .field("name", &self.shared.name)
            .field("execution", &self.shared.execution)
            .field("retained", &self.shared.retained)
            .field("lost", &self.shared.is_lost())
            .finish()
    }
}

struct Found {
    device: CUdevice,
    name: String,
    total_bytes: u64,
    driver_version: i32,
    execution: Execution,
}

/// Load the driver, initialise it and find device `ordinal`.
fn find_device(ordinal: u32) -> Result<Found, BackendError> {
    require_driver()?;
    let no_device = |call: &str, r: CUresult| {
        err(
            "new",
            BackendErrorKind::Unavailable,
            format!(
                "no CUDA device: {call} returned {} ({})",
                result::name(r),
                r as i32
            ),
        )
        .with_code(i64::from(r as i32))
    };
    // SAFETY: cuInit(0) may be called any number of times from any thread.
    let r = unsafe { sys::cuInit(0) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(no_device("cuInit", r));
    }
    let mut count: c_int = 0;
    // SAFETY: valid out pointer; the driver is initialised.
    let r = unsafe { sys::cuDeviceGetCount(&mut count) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(no_device("cuDeviceGetCount", r));
    }
    if count <= 0 {
        return Err(err(
            "new",
            BackendErrorKind::Unavailable,
            "no CUDA device: the driver reports 0 devices",
        ));
    }
    if i64::from(ordinal) >= i64::from(count) {
        return Err(err(
            "new",
            BackendErrorKind::InvalidArgument,
            format!("device ordinal {ordinal} is out of range: the driver reports {count} devices (0..{count})"),
        ));
    }
    let mut device: CUdevice = 0;
    // SAFETY: valid out pointer; ordinal checked against the count.
    check("new", "cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal as c_int)
    })?;
    let mut buf = [0 as c_char; 256];
    // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates.
    check("new", "cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device)
    })?;
    buf[buf.len() - 1] = 0;
    // SAFETY: the buffer is NUL-terminated within its length (last byte set
    // above, whatever the driver wrote) and outlives the borrow.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let execution = if name.starts_with(STAND_IN_NAME) {
        Execution::StandIn
    } else {
        Execution::RealHardware
    };
    let mut total: usize = 0;
    // SAFETY: valid out pointer, valid device.
    check("new", "cuDeviceTotalMem_v2", unsafe {
        sys::cuDeviceTotalMem_v2(&mut total, device)
    })?;
    let mut pools: c_int = 0;
    // SAFETY: valid out pointer, valid device.
    check("new", "cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut pools,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
            device,
        )
    })?;
    if pools == 0 {
        return Err(err(
            "new",
            BackendErrorKind::Unsupported,
            format!("CUDA device {ordinal} ({name}) does not support stream-ordered memory pools (cuMemAllocAsync)"),
        ));
    }
    let mut driver_version: c_int = 0;
    // SAFETY: valid out pointer.
    check("new", "cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut driver_version)
    })?;
    Ok(Found {
        device,
        name,
        total_bytes: total as u64,
        driver_version,
        execution,
    })
}

impl CudaContext {
    /// Retain device `config.ordinal`'s primary context.
    ///
    /// Fails with `Unavailable` when no CUDA driver can be loaded ("no CUDA
    /// driver") or the driver reports no device ("no CUDA device"), never
    /// with a panic.
    pub fn new(config: CudaConfig) -> Result<Self, BackendError> {
        let found = find_device(config.ordinal)?;
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer, valid device; balanced by the release in
        // teardown (or below on failure).
        check("new", "cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut context, found.device)
        })?;
        let release = |e: BackendError| {
            // SAFETY: balances the retain above; memgov has queued no work
            // and allocated nothing on the context yet.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(found.device) };
            e
        };
        let pool = Self::setup_pool(found.device, context, &config).map_err(release)?;
        Ok(Self::from_parts(
            found,
            config.ordinal,
            context,
            true,
            pool,
            Vec::new(),
        ))
    }

    /// Govern a context and streams that a runtime already owns.
    ///
    /// memgov never destroys the context or the adopted streams, and never
    /// releases a context reference: teardown synchronizes the adopted
    /// streams, frees what memgov allocated, destroys the streams it created
    /// itself and destroys its own memory pool.
    ///
    /// # Safety
    ///
    /// `adopted.context` must be a valid context of device `adopted.ordinal`,
    /// and every stream in `adopted.streams` a valid stream of it. All must
    /// stay valid until this context's teardown has returned (or, for a
    /// governed stream, until it is destroyed), and the runtime must not
    /// destroy them, nor reset the device, before then.
    pub unsafe fn adopt(adopted: AdoptedContext, config: CudaConfig) -> Result<Self, BackendError> {
        if adopted.context.is_null() {
            return Err(err(
                "adopt",
                BackendErrorKind::InvalidArgument,
                "the adopted CUcontext is null",
            ));
        }
        let found = find_device(adopted.ordinal)?;
        let pool = Self::setup_pool(found.device, adopted.context, &config)?;
        Ok(Self::from_parts(
            found,
            adopted.ordinal,
            adopted.context,
            false,
            pool,
            adopted.streams,
        ))
    }

    /// Create memgov's own pool on the device and set its release
    /// threshold. The calling thread's current context is restored before
    /// returning.
    fn setup_pool(
        device: CUdevice,
        context: CUcontext,
        config: &CudaConfig,
    ) -> Result<CUmemoryPool, BackendError> {
        // SAFETY: the context is valid (just retained, or per adopt's
        // contract); popped below on every path.
        check("new", "cuCtxPushCurrent_v2", unsafe {
            sys::cuCtxPushCurrent_v2(context)
        })?;
        let result = Self::create_pool(device, config);
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: balances the push above, on this thread.
        let popped_ok = check("new", "cuCtxPopCurrent_v2", unsafe {
            sys::cuCtxPopCurrent_v2(&mut popped)
        });
        match (result, popped_ok) {
            (Ok(pool), Ok(())) => Ok(pool),
            (Ok(pool), Err(e)) => {
                // SAFETY: the pool just created, unused, destroyed once.
                let _ = unsafe { sys::cuMemPoolDestroy(pool) };
                Err(e)
            }
            (Err(e), _) => Err(e),
        }
    }

    fn create_pool(device: CUdevice, config: &CudaConfig) -> Result<CUmemoryPool, BackendError> {
        // SAFETY: CUmemPoolProps is a plain C struct for which all-zero bytes
        // are valid (null pointer, zero sizes); the fields memgov needs are
        // set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = device;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out pointer and properties for a device-resident
        // pool of a valid device.
        check("new", "cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(&mut pool, &props)
        })?;
        if let Some(threshold) = config.release_threshold {
            let mut value: u64 = threshold;
            // SAFETY: the release threshold attribute takes a cuuint64_t;
            // the pool is the one just created.
            let r = unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut value as *mut u64).cast(),
                )
            };
            if let Err(e) = check("new", "cuMemPoolSetAttribute", r) {
                // SAFETY: the pool just created, unused, destroyed once.
                let _ = unsafe { sys::cuMemPoolDestroy(pool) };
                return Err(e);
            }
        }
        Ok(pool)
    }

    fn from_parts(
        found: Found,
        ordinal: u32,
        context: CUcontext,
        retained: bool,
        pool: CUmemoryPool,
        streams: Vec<CUstream>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                id: CONTEXT_IDS.fetch_add(1, Ordering::Relaxed),
                device: found.device,
                ordinal,
                context,
                retained,
                pool,
                name: found.name,
                total_bytes: found.total_bytes,
                driver_version: found.driver_version,
                execution: found.execution,
                probe: BackendProbe::new(),
                lost: LostState::default(),
                driver_lost: AtomicBool::new(false),
                next_id: AtomicU64::new(1),
                pending: Arc::default(),
                live: Mutex::default(),
                streams: Mutex::default(),
                lendable: Mutex::new(streams.into_iter().map(RawStream).collect()),
                retired_streams: Mutex::default(),
                watch: Watch::default(),
            }),
        }
    }

    /// The probe every backend reports through; it outlives teardown.
    pub fn probe(&self) -> BackendProbe {
        self.shared.probe.clone()
    }

    /// The raw `CUcontext`. The caller must not destroy or release it, and
    /// must not use it after teardown.
    pub fn cu_context(&self) -> CUcontext {
        self.shared.context
    }

    /// Whether the driver is memgov's stand-in rather than NVIDIA's.
    pub fn is_stand_in(&self) -> bool {
        self.shared.execution == Execution::StandIn
    }

    /// Signals of stream-ordered frees whose host function has not run yet.
    pub fn pending_frees(&self) -> usize {
        self.shared.pending.len()
    }

    fn teardown_impl(self, lost: bool) -> Result<(), BackendError> {
        let s = &*self.shared;
        // First of all: no backend thread calls the driver from here on but
        // this one, and none after teardown returns.
        s.stop_watcher();
        let mut first: Option<BackendError> = None;
        let mut keep = |r: Result<(), BackendError>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        let lost = lost || s.is_lost();
        let pending = s.pending.len();
        if pending != 0 && !lost {
            // The governor tears down only after every release retired: a
            // direct caller broke the contract. Teardown still waits for the
            // frees (every stream is synchronized below) before releasing.
            s.probe.violation(
                BACKEND,
                format!("teardown with {pending} stream-ordered frees still pending"),
            );
        }
        if lost {
            self.teardown_lost(&mut keep);
            s.probe.torn_down_now();
            return first.map_or(Ok(()), Err);
        }
        let current = match s.make_current("teardown") {
            Ok(c) => Some(c),
            Err(e) => {
                keep(Err(e));
                None
            }
        };
        let streams: Vec<(u64, CUstream, bool)> = lock(&s.streams)
            .iter()
            .map(|(&id, &(raw, adopted))| (id, raw, adopted))
            .collect();
        for &(_, raw, _) in &streams {
            // SAFETY: a live stream of this context; the context is current.
            let r = unsafe { sys::cuStreamSynchronize(raw) };
            keep(s.checked("teardown", "cuStreamSynchronize", r));
        }
        // Destroyed streams whose work may still run: wait, then destroy
        // (before the leftovers are freed: that work may use them).
        let retired: Vec<RawStream> = std::mem::take(&mut *lock(&s.retired_streams));
        for raw in retired {
            // SAFETY: a stream this context created, removed from the
            // retired list above so destroyed once; the context is current.
            let r = unsafe { sys::cuStreamSynchronize(raw.0) };
            keep(s.checked("teardown", "cuStreamSynchronize", r));
            // SAFETY: as above; its work has completed.
            let r = unsafe { sys::cuStreamDestroy_v2(raw.0) };
            keep(s.checked("teardown", "cuStreamDestroy_v2", r));
        }
        // Memory a forced retire left live: free it on a stream of its own
        // and wait, so the pool gets it back before the context goes. Every
        // stream that used it was synchronized above, which orders the frees
        // after that use.
        let leftover: Vec<Live> = lock(&s.live).drain().map(|(_, l)| l).collect();
        if !leftover.is_empty() {
            keep(self.free_leftover(&leftover));
        }
        for (id, raw, adopted) in streams {
            lock(&s.streams).remove(&id);
            s.probe.stream_destroyed();
            if !adopted {
                // SAFETY: created by this context, destroyed once (removed
                // from the live set above); its work has completed.
                let r = unsafe { sys::cuStreamDestroy_v2(raw) };
                keep(s.checked("teardown", "cuStreamDestroy_v2", r));
            }
        }
        let stragglers = s.pending.take_all();
        if !stragglers.is_empty() {
            for (_, bytes) in &stragglers {
                s.probe.free_abandoned(*bytes);
            }
            drop(stragglers);
        }
        // SAFETY: memgov's own pool; every allocation from it was freed and
        // every free has executed (all streams synchronized).
        let r = unsafe { sys::cuMemPoolTrimTo(s.pool, 0) };
        keep(s.checked("teardown", "cuMemPoolTrimTo", r));
        // SAFETY: as above; destroyed once, here.
        let r = unsafe { sys::cuMemPoolDestroy(s.pool) };
        keep(s.checked("teardown", "cuMemPoolDestroy", r));
        // The thread's previous context is current again before the release.
        drop(current);
        if s.retained {
            // SAFETY: balanced with the retain in `new`; every stream memgov
            // queued work on was synchronized, so no free or host function
            // of memgov's is pending and no memory of memgov's is allocated.
            let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(s.device) };
            keep(s.checked("teardown", "cuDevicePrimaryCtxRelease_v2", r));
        }
        s.probe.torn_down_now();
        first.map_or(Ok(()), Err)
    }

    /// Teardown of a lost context: no frees and no synchronization. What
    /// memgov allocated and the streams it created go with its reference to
    /// the primary context, which is released:
    ///
    /// * when the driver reported the loss (a sticky error), at once: queued
    ///   work no longer executes;
    /// * when only the caller declared the loss and the driver still answers,
    ///   after the queued work of memgov's streams has finished, polled with
    ///   `cuStreamQuery` (no blocking call) for at most `LOST_DRAIN`; if it
    ///   is still running then, the reference is kept (releasing the last
    ///   reference under running work is undefined) and the error says so.
    ///
    /// An adopted context is the runtime's: nothing is released, and memgov's
    /// allocations in it stay until the runtime destroys it.
    fn teardown_lost(&self, keep: &mut impl FnMut(Result<(), BackendError>)) {
        let s = &*self.shared;
        s.mark_lost();
        s.abandon_pending();
        for (_, l) in lock(&s.live).drain() {
            s.probe.freed(l.bytes);
        }
        let streams: Vec<CUstream> = lock(&s.streams)
            .drain()
            .map(|(_, (raw, _))| {
                s.probe.stream_destroyed();
                raw
            })
            .collect();
        let retired: Vec<RawStream> = std::mem::take(&mut *lock(&s.retired_streams));
        // SAFETY: memgov's own pool, destroyed once, here. The call does not
        // wait: with allocations or frees outstanding the driver releases the
        // pool once they are gone (with the context, when it is released
        // below). On a device in the sticky state it fails harmlessly.
        let _ = unsafe { sys::cuMemPoolDestroy(s.pool) };
        if !s.retained {
            return;
        }
        let mut release = s.driver_lost.load(Ordering::Acquire);
        if !release {
            let mut queued: Vec<CUstream> = streams;
            queued.extend(retired.iter().map(|r| r.0));
            match self.drain_lost(&queued) {
                Ok(()) => release = true,
                Err(e) => keep(Err(e)),
            }
        }
        if release {
            // SAFETY: balanced with the retain in `new`; no work of memgov's
            // is running (drained above, or the device no longer executes
            // any). Releasing the last reference destroys the context with
            // memgov's allocations and streams.
            let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(s.device) };
            keep(check("teardown", "cuDevicePrimaryCtxRelease_v2", r));
        }
    }

    /// Poll `streams` until their queued work has finished, a sticky error
    /// shows the device really is lost, or `LOST_DRAIN` has passed.
    fn drain_lost(&self, streams: &[CUstream]) -> Result<(), BackendError> {
        let s = &*self.shared;
        let deadline = Instant::now() + LOST_DRAIN;
        let _current = s.make_current("teardown")?;
        let mut waiting: Vec<CUstream> = streams.to_vec();
        loop {
            let mut still = Vec::new();
            for &raw in &waiting {
                // SAFETY: a stream this context created or adopted, not
                // destroyed (teardown holds the only copies now); the
                // context is current.
                let r = unsafe { sys::cuStreamQuery(raw) };
                match r {
                    CUresult::CUDA_SUCCESS => {}
                    CUresult::CUDA_ERROR_NOT_READY => still.push(raw),
                    r => {
                        let e = result::error("teardown", "cuStreamQuery", r);
                        if e.is_device_lost() {
                            s.driver_lost.store(true, Ordering::Release);
                            return Ok(());
                        }
                        return Err(e);
                    }
                }
            }
            if still.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(err(
                    "teardown",
                    BackendErrorKind::DeviceLost,
                    format!(
                        "the context was declared lost, the driver still answers and {} of                          memgov's streams still have queued work after {:?}: the primary context                          reference (with memgov's allocations) is kept rather than released                          under running work; reset the device (cuDevicePrimaryCtxReset) to                          reclaim it",
                        still.len(),
                        LOST_DRAIN
                    ),
                ));
            }
            waiting = still;
            std::thread::sleep(WATCH_INTERVAL);
        }
    }

    fn free_leftover(&self, leftover: &[Live]) -> Result<(), BackendError> {
        let s = &*self.shared;
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: valid out pointer; the context is current (teardown).
        let r = unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        };
        s.checked("teardown", "cuStreamCreate", r)?;
        let mut result = Ok(());
        for l in leftover {
            // SAFETY: a live allocation of this context, freed once (drained
            // from the live set); every stream that used it was synchronized.
            let r = unsafe { sys::cuMemFreeAsync(l.ptr, stream) };
            match s.checked("teardown", "cuMemFreeAsync", r) {
                Ok(()) => s.probe.freed(l.bytes),
                Err(e) => {
                    result = result.and(Err(e));
                }
            }
        }
        // SAFETY: the stream created above.
        let r = unsafe { sys::cuStreamSynchronize(stream) };
        result = result.and(s.checked("teardown", "cuStreamSynchronize", r));
        // SAFETY: the stream created above, destroyed once.
        let r = unsafe { sys::cuStreamDestroy_v2(stream) };
        result.and(s.checked("teardown", "cuStreamDestroy_v2", r))
    }
}

impl DeviceContext for CudaContext {
    type Stream = CudaStream;
    type Memory = CudaMemory;

    fn describe(&self) -> DeviceDescription {
        let s = &*self.shared;
        let v = s.driver_version;
        DeviceDescription {
            backend: BACKEND,
            vendor: "NVIDIA".into(),
            name: s.name.clone(),
            ordinal: s.ordinal,
            total_bytes: s.total_bytes,
            driver: format!("CUDA driver API {}.{}", v / 1000, (v % 1000) / 10),
            execution: s.execution,
            stream_ordered_reuse: true,
        }
    }

    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.memory_info_impl()
    }

    fn create_stream(&self) -> Result<CudaStream, BackendError> {
        self.create_stream_impl()
    }

    fn destroy_stream(&self, stream: CudaStream) -> Result<(), BackendError> {
        self.destroy_stream_impl(stream)
    }

    fn allocate(&self, stream: &CudaStream, bytes: u64) -> Result<CudaMemory, BackendError> {
        self.allocate_impl(stream, bytes)
    }

    fn free_async(
        &self,
        stream: &CudaStream,
        memory: CudaMemory,
        retired: RetireSignal,
    ) -> Result<(), (CudaMemory, RetireSignal, BackendError)> {
        self.free_async_impl(stream, memory, retired)
    }

    fn write(
        &self,
        stream: &CudaStream,
        memory: &CudaMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.write_impl(stream, memory, offset, src)
    }

    fn read(
        &self,
        stream: &CudaStream,
        memory: &CudaMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.read_impl(stream, memory, offset, dst)
    }

    fn synchronize(&self, stream: &CudaStream) -> Result<(), BackendError> {
        self.synchronize_impl(stream)
    }

    fn order_after(&self, stream: &CudaStream, after: &CudaStream) -> Result<(), BackendError> {
        self.order_after_impl(stream, after)
    }

    fn device_lost(&self) {
        self.device_lost_impl();
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        self.teardown_impl(lost)
    }
}
