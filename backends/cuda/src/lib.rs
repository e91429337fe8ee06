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
//!   whose callback fires the [`RetireSignal`](memgov_backend::RetireSignal); see the `retire` module. A
//!   free on another stream than the memory's is ordered by `order_after`:
//!   an event (timing disabled) recorded on the other stream, waited on by
//!   the freeing stream (`cuStreamWaitEvent`) and destroyed at once (legal
//!   while the wait is pending). No host wait.
//! * **Retired streams.** A destroyed stream whose work is still queued is
//!   kept until `cuStreamQuery` reports it complete. The free thread asks
//!   every few milliseconds while there are such streams, and
//!   `synchronize` asks too, so an asynchronous fault in that work (after
//!   the last driver call) is observed: the context is marked lost and the
//!   signals of queued frees, whose host functions will never run, are
//!   dropped unfired, which lets retire and force finish. Teardown stops and
//!   joins the free thread first: no thread of the backend calls the driver after
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

mod arena;
mod capability;
mod capture;
mod config;
mod context;
mod memory;
mod result;
mod retire;
mod shared;
mod stream;
mod table;
mod teardown;

pub use arena::{ArenaConfig, ArenaSnapshot, CudaArena, Quarantined, SleepReport};
pub use capture::{
    capture_gate, CaptureBuffer, CaptureConfig, CaptureMode, CudaCapture, CudaGraph, OutputSlot,
    PoolExhausted, CAPTURE_ALIGN,
};
pub use config::{AdoptedContext, CudaConfig};
pub use memory::CudaMemory;
pub use stream::CudaStream;

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUmemoryPool, CUresult, CUstream};
use memgov_backend::{BackendError, BackendErrorKind, BackendProbe, DeviceDescription};
use memgov_stream_ordered::open::open;
use memgov_stream_ordered::parts::Parts;
use memgov_stream_ordered::pool;
use memgov_stream_ordered::state::{Device, State};
use memgov_stream_ordered::table::Context as _;
use result::{check, err, Cuda};
use shared::Shared;
use std::ffi::c_int;
use std::sync::{Arc, Mutex, OnceLock};

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

/// One CUDA device context: the device's primary context (or an adopted
/// one), its streams and allocations.
pub struct CudaContext {
    /// The shared state, the arena [`CudaConfig::arena`] asked for, the
    /// live graphs of captures on it.
    parts: Parts<Shared>,
}

impl std::fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.parts.shared;
        s.debug(f, "CudaContext")
            .field("retained", &s.retained)
            .finish()
    }
}

/// What `find_device` learnt: the device's handle and its facts.
type Found = (CUdevice, Device);

/// Load the driver, initialise it and open device `ordinal` (the core's
/// [`open`]); CUDA's own steps are `cuInit`, the memory-pools attribute
/// and the driver's version.
fn find_device(ordinal: u32) -> Result<Found, BackendError> {
    require_driver()?;
    // SAFETY: cuInit(0) may be called any number of times from any thread.
    let r = unsafe { sys::cuInit(0) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(err(
            "new",
            BackendErrorKind::Unavailable,
            format!(
                "no CUDA device: cuInit returned {} ({})",
                result::name(r),
                r as i32
            ),
        )
        .with_code(i64::from(r as i32)));
    }
    let words = |device: CUdevice, name: &str| {
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
        let mut v: c_int = 0;
        // SAFETY: valid out pointer.
        check("new", "cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut v)
        })?;
        Ok((
            format!("CUDA driver API {}.{}", v / 1000, (v % 1000) / 10),
            (),
        ))
    };
    let opened = open::<Cuda, _, _>(ordinal, |_| Ok(()), words)?;
    Ok((opened.handle, opened.device))
}

impl CudaContext {
    /// The context `memgov check` runs the conformance suite on: device 0
    /// with the default settings. No checking layer is switched on: the
    /// driver has none, and the stand-in checks its rules (stream order, no
    /// call from a host function, teardown order) on every call.
    pub fn for_check() -> Result<Self, BackendError> {
        Self::new(CudaConfig::default())
    }

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
            sys::cuDevicePrimaryCtxRetain(&mut context, found.0)
        })?;
        let release = |e: BackendError| {
            // SAFETY: balances the retain above; memgov has queued no work
            // and allocated nothing on the context yet.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(found.0) };
            e
        };
        let pool = Self::setup_pool(found.0, context, &config).map_err(release)?;
        Self::from_parts(found, context, true, pool, Vec::new()).with_arena(config.arena.as_ref())
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
        let pool = Self::setup_pool(found.0, adopted.context, &config)?;
        Self::from_parts(found, adopted.context, false, pool, adopted.streams)
            .with_arena(config.arena.as_ref())
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
            (Ok(made), Ok(())) => Ok(made),
            (Ok(made), Err(e)) => {
                // SAFETY: the pool just created, unused, destroyed once.
                let _ = unsafe { pool::destroy::<Cuda>("new", made) };
                Err(e)
            }
            (Err(e), _) => Err(e),
        }
    }

    fn create_pool(device: CUdevice, config: &CudaConfig) -> Result<CUmemoryPool, BackendError> {
        // SAFETY: a device of the driver (from `open`); its context is
        // current (pushed by `setup_pool`).
        let made = unsafe { pool::create::<Cuda>("new", device, config.release_threshold)? };
        // A device without memory pools: CUDA has no fallback.
        made.ok_or_else(|| {
            result::error("new", "cuMemPoolCreate", CUresult::CUDA_ERROR_NOT_SUPPORTED)
        })
    }

    fn from_parts(
        (cu_device, device): Found,
        context: CUcontext,
        retained: bool,
        pool: CUmemoryPool,
        streams: Vec<CUstream>,
    ) -> Self {
        Self {
            parts: Parts::new(Shared {
                state: State::new(device, streams),
                cu_device,
                context,
                retained,
                pool,
                pending: Arc::default(),
                live: Mutex::default(),
            }),
        }
    }

    /// Create the arena `config` asks for; on failure tear the context down
    /// again and return why.
    fn with_arena(mut self, config: Option<&ArenaConfig>) -> Result<Self, BackendError> {
        let Some(config) = config else {
            return Ok(self);
        };
        match arena::create(&self.parts.shared, config) {
            Ok(a) => {
                self.parts.arena = Some(Arc::new(a));
                Ok(self)
            }
            Err(e) => {
                let _ = self.tear_down(false);
                Err(e)
            }
        }
    }

    /// A handle on the context's virtual-memory arena (snapshot, trim,
    /// limit, sleep and wake), or `None` when [`CudaConfig::arena`] did not
    /// ask for one.
    pub fn arena(&self) -> Option<CudaArena> {
        self.parts.arena_handle()
    }

    /// The probe every backend reports through; it outlives teardown.
    pub fn probe(&self) -> BackendProbe {
        self.parts.probe()
    }

    /// The raw `CUcontext`. The caller must not destroy or release it, and
    /// must not use it after teardown.
    pub fn cu_context(&self) -> CUcontext {
        self.parts.shared.context
    }

    /// Whether the driver is memgov's stand-in rather than NVIDIA's.
    pub fn is_stand_in(&self) -> bool {
        self.parts.is_stand_in()
    }

    /// Signals of stream-ordered frees whose host function has not run yet.
    pub fn pending_frees(&self) -> usize {
        self.parts.shared.pending.len()
    }
}

memgov_stream_ordered::device_context!(CudaContext, CudaStream, CudaMemory);

/// What CUDA does its own way in `DeviceContext` (see
/// [`memgov_stream_ordered::device_context`]); the rest of those steps are
/// in `memory.rs`, `retire.rs`, `stream.rs` and `teardown.rs`.
impl CudaContext {
    fn describe_impl(&self) -> DeviceDescription {
        let driver = self.parts.shared.device.driver.clone();
        self.parts.description("NVIDIA", driver, true)
    }

    fn teardown_impl(self, lost: bool) -> Result<(), BackendError> {
        // Captures a failed end left live: ended (or abandoned) before
        // anything here waits at the gate they hold closed; the graphs and
        // the arena go before the context.
        let stranded_lost = lost || self.parts.shared.is_lost();
        let arena =
            self.parts
                .close_captures_and_arena(lost, (stranded_lost, lost), "CudaGraph::destroy");
        let context = self.tear_down(lost);
        arena.and(context)
    }
}
