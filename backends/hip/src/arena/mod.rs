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
//! lists the invariants); this module gives it HIP's table
//! ([`crate::table`]), the device made current around the calls (and the
//! thread's own set back: [`granule`]), and the stream-ordered release
//! ([`release`]).
//!
//! * **Where ROCm lacks the calls.** Every virtual memory entry point is
//!   resolved optionally when the runtime is opened; [`create`]
//!   answers `Unsupported` naming the first one missing, before any call.
//! * **The properties' layout.** ROCm 6 reordered `hipMemAllocationProp`;
//!   the arena asks `hipRuntimeGetVersion` once and passes the layout the
//!   loaded runtime reads ([`ffi::allocation_prop`]).

use crate::ffi;
use crate::result::err;
use crate::shared::Shared;
use memgov_backend::{BackendError, BackendErrorKind};
use memgov_stream_ordered::table::Context as _;

pub use memgov_backend::vmm::{ArenaConfig, ArenaSnapshot, Quarantined, SleepReport};

/// A handle on a [`HipContext`](crate::HipContext)'s arena: the core's
/// [`ArenaHandle`](memgov_stream_ordered::arena::ArenaHandle) over HIP.
pub type HipArena = memgov_stream_ordered::arena::ArenaHandle<Shared>;

/// One context's arena: the core's
/// [`Arena`](memgov_stream_ordered::arena::Arena) (books, device, probe,
/// releases) over HIP's handles and its callback releases, keeping the
/// `hipRuntimeGetVersion` that says which `hipMemAllocationProp` layout to
/// pass.
pub type Arena =
    memgov_stream_ordered::arena::Arena<Shared, memgov_stream_ordered::retire::Releases, i32>;

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

/// Ask the granularity and reserve the range on the context's device
/// (made current for the calls, the thread's own set back after).
pub(crate) fn create(s: &Shared, config: &ArenaConfig) -> Result<Arena, BackendError> {
    if let Some(symbol) = ffi::missing(&ffi::VMM_SYMBOLS) {
        return Err(unsupported("arena", "a virtual-memory arena", symbol));
    }
    let _device = s.make_current("arena")?;
    let mut runtime = 0i32;
    // SAFETY: valid out pointer.
    let r = unsafe { ffi::hipRuntimeGetVersion(&mut runtime) };
    s.checked("arena", "hipRuntimeGetVersion", r)?;
    let prop = ffi::allocation_prop(s.ordinal(), runtime);
    Arena::reserve(s, config, (s.ordinal(), &prop), s.probe().clone(), runtime)
}

/// Arena memory handed to the pool's release path (a bug of this crate).
pub(crate) fn misrouted() -> BackendError {
    err(
        "free_async",
        BackendErrorKind::InvalidArgument,
        "arena memory is released through its context's arena (HipContext::free_async)",
    )
}
