//! The ROCm HIP backend (feature `hip`): ROCm's HIP runtime loaded at run
//! time (see the [`raw`] calls), `hipMallocFromPoolAsync` from a memory pool the
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
//! * **Cross-stream order** ([`DeviceContext::order_after`](memgov_backend::DeviceContext::order_after)): an event
//!   recorded on the other stream, `hipStreamWaitEvent` on this one, the
//!   event destroyed at once (the wait keeps what it needs).
//! * **Current device**: every call that needs one reads the thread's
//!   current device (`hipGetDevice`), sets the context's only if it differs,
//!   and sets the old one back before returning, on every path.
//! * **Device loss**: sticky `hipError_t` codes (see [`HipResult`]) mark the
//!   context lost and the device *dead*: from then on the context makes no
//!   HIP call that could block. A context the governor declares lost
//!   ([`DeviceContext::device_lost`](memgov_backend::DeviceContext::device_lost)) while the runtime still answers is
//!   lost, not dead.
//! * **Teardown**: stop and join the free thread, synchronize and destroy
//!   the streams the governor left, free memory it abandoned (force), trim
//!   and destroy the context's pool. A lost teardown drops every pending
//!   signal unfired, then releases the same way while the runtime answers;
//!   on a dead device (or once a sticky code shows up mid-teardown) it stops
//!   calling HIP and leaves the rest to die with the device. It never calls
//!   `hipDeviceReset`, which would destroy every allocation and stream of
//!   the process on that device, other users' included. When teardown
//!   returns, no thread of the context calls HIP again.
//!
//! * **Graph capture** ([`HipContext::begin_capture`]) into a pool of the
//!   arena mapped before capture begins, behind a process-wide gate that
//!   holds the arena's maps and unmaps while a capture is under way.
//! * **Virtual-memory arena** ([`HipConfig::arena`]): device memory from
//!   one address range reserved for the context's life and backed granule
//!   by granule (`hipMemCreate`, `hipMemMap`, `hipMemSetAccess`), with
//!   trim, a limit on mapped bytes, and sleep and wake at stable addresses
//!   ([`HipArena`]); the books and transactions are the core the CUDA
//!   backend shares ([`memgov_backend::vmm`]). A runtime lacking the calls
//!   answers `Unsupported`, naming the first one missing.
//!
//! A stand-in `libamdhip64.so.5` (built from `backends/hip/stand-in/`) names
//! its device `"memgov stand-in ..."`; the context then reports
//! [`Execution::StandIn`](memgov_backend::Execution::StandIn).
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

mod arena;
mod capability;
mod capture;
mod config;
mod context;
mod ffi;
mod memory;
pub mod raw;
mod result;
mod retire;
mod shared;
mod stream;
mod table;
mod teardown;

pub use arena::{ArenaConfig, ArenaSnapshot, HipArena, Quarantined, SleepReport};
pub use capture::{
    capture_gate, capture_supported, CaptureBuffer, CaptureConfig, CaptureMode, HipCapture,
    HipGraph, OutputSlot, PoolExhausted,
};

pub use config::{AllocatorChoice, HipConfig};
pub use ffi::{driver_present, HipResult};
pub use memory::{HipMemory, Origin};
pub use shared::contexts_alive;
pub use stream::HipStream;

use ffi::{
    hipDeviceGetAttribute, hipDriverGetVersion, hipGetDevice, hipRuntimeGetVersion, hipSetDevice,
};
use memgov_backend::shell::{self, MakeCurrent};
use memgov_backend::{
    lock, BackendError, BackendErrorKind, BackendProbe, DeviceDescription, RetireSignal,
};
use memgov_stream_ordered::open::{open, Opened};
use memgov_stream_ordered::parts::Parts;
use memgov_stream_ordered::pool;
use memgov_stream_ordered::table::Context as _;
use result::{check, err, Hip};
use shared::Pool;
use shared::{Allocator, Shared};
use std::sync::Arc;

/// Device names starting with this are the stand-in library's.
pub const STAND_IN_NAME_PREFIX: &str = memgov_stream_ordered::state::STAND_IN_NAME;

/// A HIP device context: one device, a memory pool of its own, and the
/// streams and allocations made through it.
pub struct HipContext {
    /// The shared state, the arena [`HipConfig::arena`] asked for, the
    /// live graphs of captures on it.
    parts: Parts<Shared>,
}

impl std::fmt::Debug for HipContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.parts.shared.debug(f, "HipContext").finish()
    }
}

/// `Unavailable` when no HIP runtime memgov can use is loadable here.
fn require_runtime() -> Result<(), BackendError> {
    match ffi::runtime_missing() {
        None => Ok(()),
        Some(why) => Err(err("new", BackendErrorKind::Unavailable, why)),
    }
}

fn int_out(call: &str, f: impl FnOnce(*mut i32) -> HipResult) -> Result<i32, BackendError> {
    let mut v = 0i32;
    check("new", call, f(&mut v))?;
    Ok(v)
}

/// The device being opened, made current on the calling thread while
/// `HipContext::new` asks about it (no context, and so no shell, exists
/// yet: results are checked without marking anything lost).
struct Opening(i32);

impl MakeCurrent for Opening {
    type Handle = i32;

    fn ours(&self) -> i32 {
        self.0
    }

    fn current(&self, op: &'static str) -> Result<i32, BackendError> {
        let mut current = 0i32;
        // SAFETY: valid out-pointer; reads the calling thread's state only.
        check(op, "hipGetDevice", unsafe { hipGetDevice(&mut current) })?;
        Ok(current)
    }

    fn enter(&self, op: &'static str, ours: i32) -> Result<(), BackendError> {
        // SAFETY: plain call with an ordinal below the device count.
        check(op, "hipSetDevice", unsafe { hipSetDevice(ours) })
    }

    fn leave(&self, previous: i32) {
        // SAFETY: plain call with the ordinal the runtime reported as the
        // thread's current device. A failure leaves nothing to undo.
        let _ = unsafe { hipSetDevice(previous) };
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
    // SAFETY: a device of the runtime (checked against the count by
    // `open`), current while it is opened. The release threshold keeps
    // every freed byte in the pool until teardown trims it.
    let Some(raw) = (unsafe { pool::create::<Hip>("new", ordinal, Some(u64::MAX))? }) else {
        return plain("hipMemPoolCreate returned hipErrorNotSupported");
    };
    let own = Pool(raw);
    // The attribute and the pool can exist while the allocator still
    // refuses: ask it once, so that `describe()` (read at registration)
    // tells the truth from the start.
    match memory::probe_stream_ordered(own) {
        Ok(true) => Ok(Allocation {
            pool: Some(own),
            fallback_reason: None,
        }),
        Ok(false) => {
            // SAFETY: the pool just created; the probe's allocation was
            // freed and trimmed away; destroyed once.
            unsafe { pool::destroy::<Hip>("new", raw)? };
            plain("hipMallocFromPoolAsync returned hipErrorNotSupported")
        }
        Err(e) => {
            // SAFETY: as above.
            let _ = unsafe { pool::destroy::<Hip>("new", raw) };
            Err(e)
        }
    }
}

impl HipContext {
    /// The context `memgov check` runs the conformance suite on: device 0
    /// with the default settings. No checking layer is switched on: the
    /// runtime has none, and the stand-in checks its rules (stream order, no
    /// call from a stream callback, teardown order) on every call.
    pub fn for_check() -> Result<Self, BackendError> {
        Self::new(HipConfig::default())
    }

    /// Open device `config.device` through `libamdhip64`.
    ///
    /// Fails with [`BackendErrorKind::Unavailable`] when no HIP runtime can
    /// be loaded ("no HIP runtime") or the runtime finds no device ("no HIP
    /// device"), and with `InvalidArgument` when the
    /// ordinal is out of range. The calling thread's current device is the
    /// same when it returns.
    pub fn new(config: HipConfig) -> Result<Self, BackendError> {
        require_runtime()?;
        // The device (the ordinal, once `open` has checked it against the
        // count) is made current while it is asked about; the thread's own
        // device is set back when `new` returns.
        let opening = Opening(i32::try_from(config.device).unwrap_or(i32::MAX));
        let enter = |_| shell::make_current(&opening, "new");
        let words = |ordinal, _: &str| {
            // SAFETY: valid out-pointers.
            let driver = int_out("hipDriverGetVersion", |p| unsafe { hipDriverGetVersion(p) })?;
            // SAFETY: valid out-pointer.
            let runtime = int_out("hipRuntimeGetVersion", |p| unsafe {
                hipRuntimeGetVersion(p)
            })?;
            let allocation = choose_allocator(&config, ordinal)?;
            Ok((
                format!("HIP runtime {runtime}, driver {driver}"),
                allocation,
            ))
        };
        let Opened {
            device,
            entered: _current,
            own: Allocation {
                pool,
                fallback_reason,
            },
            ..
        } = open::<Hip, _, _>(config.device, enter, words)?;
        let mut ctx = Self {
            parts: Parts::new(Shared::new(device, pool, fallback_reason)),
        };
        if let Some(config) = &config.arena {
            // On failure `ctx` drops here, which tears it down.
            ctx.parts.arena = Some(Arc::new(arena::create(&ctx.parts.shared, config)?));
        }
        Ok(ctx)
    }

    /// A handle on the context's virtual-memory arena (snapshot, trim,
    /// limit, sleep and wake), or `None` when [`HipConfig::arena`] did not
    /// ask for one.
    pub fn arena(&self) -> Option<HipArena> {
        self.parts.arena_handle()
    }

    /// Device memory of the arena: the checks every allocation makes, then
    /// the arena's transaction.
    fn arena_allocate(
        &self,
        arena: &arena::Arena,
        stream: &HipStream,
        bytes: u64,
    ) -> Result<HipMemory, BackendError> {
        let s = &*self.parts.shared;
        memgov_stream_ordered::memory::allocation_size(s, stream, bytes)?;
        let _device = s.make_current("allocate")?;
        let ptr = arena.allocate(s, bytes)? as usize;
        Ok(memory::register(s, ptr, ptr, bytes, Origin::Arena))
    }

    /// The backend's bookkeeping, readable after teardown.
    pub fn probe(&self) -> BackendProbe {
        self.parts.probe()
    }

    /// Whether allocations come from the context's pool (true) or from the
    /// `hipMalloc` fallback, and why the fallback was chosen.
    pub fn stream_ordered(&self) -> (bool, Option<String>) {
        (
            self.parts.shared.allocator() == Allocator::StreamOrdered,
            lock(&self.parts.shared.fallback_reason).clone(),
        )
    }

    /// Whether the runtime is memgov's stand-in rather than ROCm's.
    pub fn is_stand_in(&self) -> bool {
        self.parts.is_stand_in()
    }

    /// Frees queued and not yet retired (callbacks or the free thread's
    /// queue pending).
    pub fn pending_frees(&self) -> usize {
        self.parts.shared.pending.len() + self.parts.shared.frees.len()
    }

    /// Things the backend noticed that had no caller to report to (a
    /// failed fallback free, a refused stream callback, a teardown that
    /// stopped at a sticky error).
    pub fn notes(&self) -> Vec<String> {
        self.parts.shared.notes()
    }
}

memgov_stream_ordered::device_context!(HipContext, HipStream, HipMemory);

/// What HIP does its own way in `DeviceContext` (see
/// [`memgov_stream_ordered::device_context`]): the allocator's choice and
/// its fallback, frees by origin, streams destroyed at once.
impl HipContext {
    fn describe_impl(&self) -> DeviceDescription {
        let shared = &self.parts.shared;
        let allocator = match (&self.parts.arena, lock(&shared.fallback_reason).as_deref()) {
            (Some(a), _) => format!(
                "a virtual-memory arena of {} B in granules of {} B (hipMemCreate/hipMemMap)",
                a.size, a.granule
            ),
            (None, None) => "hipMallocFromPoolAsync from the context's own pool".to_owned(),
            (None, Some(why)) => format!("hipMalloc/hipFree fallback after an event ({why})"),
        };
        let driver = format!("{}; {allocator}", shared.device.driver);
        let pool = shared.allocator() == Allocator::StreamOrdered;
        self.parts.description("AMD", driver, pool)
    }

    fn allocate_impl(&self, stream: &HipStream, bytes: u64) -> Result<HipMemory, BackendError> {
        match &self.parts.arena {
            Some(a) => self.arena_allocate(a, stream, bytes),
            None => memory::allocate(&self.parts.shared, stream, bytes),
        }
    }

    fn allocate_pinned_impl(
        &self,
        stream: &HipStream,
        bytes: u64,
    ) -> Result<HipMemory, BackendError> {
        memory::allocate_pinned(&self.parts.shared, stream, bytes)
    }

    #[allow(clippy::result_large_err)]
    fn free_async_impl(
        &self,
        stream: &HipStream,
        memory: HipMemory,
        retired: RetireSignal,
    ) -> Result<(), (HipMemory, RetireSignal, BackendError)> {
        retire::free_async(&self.parts.shared, stream, memory, retired)
    }

    fn destroy_stream_impl(&self, stream: HipStream) -> Result<(), BackendError> {
        stream::destroy(&self.parts.shared, stream)
    }

    fn synchronize_impl(&self, stream: &HipStream) -> Result<(), BackendError> {
        stream::synchronize(&self.parts.shared, stream)
    }

    fn device_lost_impl(&self) {
        self.parts.shared.mark_lost("declared lost by the governor");
    }

    fn teardown_impl(self, lost: bool) -> Result<(), BackendError> {
        self.tear_down(lost)
    }
}
