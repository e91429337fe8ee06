//! The virtual-memory arena on HIP: one address range reserved for the
//! context's life (`hipMemAddressReserve`), backed granule by granule with
//! physical memory (`hipMemCreate`, `hipMemMap`, `hipMemSetAccess`) as
//! allocations need it, and given back granule by granule (`hipMemUnmap`,
//! `hipMemRelease`) by [`trim`](HipArena::trim), [`sleep`](HipArena::sleep)
//! and teardown.
//!
//! The books, the per-granule state machine, the transactions and their
//! undo, quarantine, the limit, sleep and wake are the driver-agnostic core
//! the CUDA backend uses too ([`memgov_backend::vmm`], whose documentation
//! lists the invariants); this module gives it HIP's steps ([`granule`]),
//! the device made current around them (and the thread's own set back), and
//! the stream-ordered release ([`release`]).
//!
//! * **Where ROCm lacks the calls.** Every virtual memory entry point is
//!   resolved optionally when the runtime is opened; [`Arena::create`]
//!   answers `Unsupported` naming the first one missing, before any call.
//! * **The properties' layout.** ROCm 6 reordered `hipMemAllocationProp`;
//!   the arena asks `hipRuntimeGetVersion` once and passes the layout the
//!   loaded runtime reads ([`ffi::allocation_prop`]).

pub(crate) mod granule;
pub(crate) mod release;

use crate::ffi;
use crate::result::err;
use crate::shared::Shared;
use granule::Handle;
use memgov_backend::vmm;
use memgov_backend::{BackendError, BackendErrorKind, BackendProbe};

pub use memgov_backend::vmm::{ArenaConfig, ArenaSnapshot, Quarantined, SleepReport};

/// A handle on a [`HipContext`](crate::HipContext)'s arena: the core's
/// [`ArenaHandle`](memgov_stream_ordered::arena::ArenaHandle) over HIP.
pub type HipArena = memgov_stream_ordered::arena::ArenaHandle<Shared>;

/// One context's arena: the driver-agnostic books and transactions
/// ([`vmm::Arena`], reached through `Deref`), the device it maps on, and
/// the releases queued on its streams. Lives in an `Arc` that the stream
/// callbacks of its releases reach through a route table (`release.rs`).
pub struct Arena {
    core: vmm::Arena<Handle>,
    pub(crate) ordinal: i32,
    /// `hipRuntimeGetVersion`: which `hipMemAllocationProp` layout to pass.
    runtime: i32,
    pub(crate) probe: BackendProbe,
    /// Releases queued whose callback has not run.
    pub(crate) releases: release::Releases,
}

impl std::ops::Deref for Arena {
    type Target = vmm::Arena<Handle>;

    fn deref(&self) -> &Self::Target {
        &self.core
    }
}

/// `Unsupported`, naming the entry point the loaded ROCm lacks.
pub(crate) fn unsupported(op: &'static str, what: &str, symbol: &str) -> BackendError {
    err(
        op,
        BackendErrorKind::Unsupported,
        format!(
            "{what} needs {symbol}, which the loaded HIP runtime does not export (ROCm 5.1 or \
             newer has HIP's virtual memory management calls); use the context's pool \
             (HipConfig::arena = None) on this runtime"
        ),
    )
}

impl Arena {
    /// Ask the granularity and reserve the range on the context's device
    /// (made current for the calls, the thread's own set back after).
    pub(crate) fn create(s: &Shared, config: &ArenaConfig) -> Result<Self, BackendError> {
        if let Some(symbol) = ffi::missing(&ffi::VMM_SYMBOLS) {
            return Err(unsupported("arena", "a virtual-memory arena", symbol));
        }
        let ordinal = s.ordinal;
        let _device = s.make_current("arena")?;
        let mut runtime = 0i32;
        // SAFETY: valid out pointer.
        let r = unsafe { ffi::hipRuntimeGetVersion(&mut runtime) };
        s.checked("arena", "hipRuntimeGetVersion", r)?;
        let prop = ffi::allocation_prop(ordinal, runtime);
        let core = memgov_stream_ordered::arena::reserve(s, config, &prop)?;
        Ok(Self {
            core,
            ordinal,
            runtime,
            probe: s.probe().clone(),
            releases: release::Releases::default(),
        })
    }

    /// The allocation properties in the loaded runtime's layout.
    pub(crate) fn prop(&self) -> ffi::AllocationProp {
        ffi::allocation_prop(self.ordinal, self.runtime)
    }

    pub(crate) fn driver<'a>(&'a self, s: &'a Shared) -> Driver<'a> {
        memgov_stream_ordered::arena::driver(s, self)
    }

    /// Take `bytes` of the arena, mapping the granules it needs; returns its
    /// device address. The device must be current on the calling thread.
    pub(crate) fn allocate(&self, s: &Shared, bytes: u64) -> Result<u64, BackendError> {
        self.core.allocate(&self.driver(s), bytes)
    }

    /// Give everything back at teardown (every stream synchronized first),
    /// then free the reservation; a refused unmap keeps the reservation
    /// (freeing it under a mapping is undefined), and both are reported.
    pub(crate) fn teardown(&self, s: &Shared) -> Result<(), BackendError> {
        self.core.teardown(&self.driver(s))?;
        memgov_stream_ordered::arena::free_reservation(s, &self.core)
    }
}

/// One arena operation's driver: the core's granule steps and sleep copies
/// ([`memgov_stream_ordered::arena`]) over HIP's table ([`granule`]).
pub(crate) type Driver<'a> = memgov_stream_ordered::arena::Driver<'a, Shared>;

/// Arena memory handed to the pool's release path (a bug of this crate).
pub(crate) fn misrouted() -> BackendError {
    err(
        "free_async",
        BackendErrorKind::InvalidArgument,
        "arena memory is released through its context's arena (HipContext::free_async)",
    )
}
