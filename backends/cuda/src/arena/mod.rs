//! The virtual-memory arena on CUDA: one address range reserved for the
//! context's life (`cuMemAddressReserve`), backed granule by granule with
//! physical memory (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) as
//! allocations need it, and given back granule by granule (`cuMemUnmap`,
//! `cuMemRelease`) by [`trim`](CudaArena::trim), [`sleep`](CudaArena::sleep)
//! and teardown.
//!
//! The books, the per-granule state machine, the transactions and their
//! undo, quarantine, the limit, sleep and wake are the driver-agnostic core
//! ([`memgov_backend::vmm`], whose documentation lists the invariants, and
//! [`memgov_stream_ordered::arena`], the granule steps over the table);
//! this module gives it CUDA's table ([`crate::table`]), the context pushed
//! around the calls ([`granule`]), and the release queued behind a host function on the
//! releasing stream ([`release`]).

pub(crate) mod state;

pub use memgov_backend::vmm::SleepReport;
pub use state::{ArenaSnapshot, Quarantined};

use crate::shared::Shared;
use memgov_backend::BackendError;
use memgov_stream_ordered::table::Context as _;

/// Settings of a context's virtual-memory arena (see
/// [`CudaConfig::arena`](crate::CudaConfig::arena)); shared with the HIP
/// backend.
pub use memgov_backend::vmm::ArenaConfig;

/// A handle on a [`CudaContext`]'s arena: the core's [`ArenaHandle`]
/// (snapshot, trim, limit, sleep and wake) over CUDA.
///
/// ```no_run
/// use memgov::cuda::{ArenaConfig, CudaConfig, CudaContext};
/// use memgov::{ContextConfig, DeviceContext, Governor};
/// let ctx = CudaContext::new(CudaConfig {
///     arena: Some(ArenaConfig { reserve_bytes: 8 << 30, limit_bytes: 4 << 30 }),
///     ..CudaConfig::default()
/// })?;
/// let s = ctx.create_stream()?;
/// let weights = ctx.allocate(&s, 64 << 20)?;
/// let kv = ctx.allocate(&s, 16 << 20)?;
/// let arena = ctx.arena().expect("configured");
/// arena.sleep_ranges(&[weights.device_ptr()], true)?; // kv stays usable
/// ctx.write(&s, &kv, 0, &[1; 4096])?;
/// arena.wake_ranges(&[weights.device_ptr()])?;        // same address, same bytes
/// let gov = Governor::new();
/// let handle = gov.register(ctx, ContextConfig::new().budget(4 << 30));
/// // Cached granules are what the arena can give back under pressure.
/// let responder = arena.clone();
/// handle.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| responder.trim().unwrap_or(0));
/// # Ok::<(), memgov::BackendError>(())
/// ```
///
/// [`CudaContext`]: crate::CudaContext
/// [`ArenaHandle`]: memgov_stream_ordered::arena::ArenaHandle
pub type CudaArena = memgov_stream_ordered::arena::ArenaHandle<Shared>;

/// One context's arena: the core's
/// [`Arena`](memgov_stream_ordered::arena::Arena) (books, device, releases)
/// over CUDA's handles and its host-function releases.
pub type Arena =
    memgov_stream_ordered::arena::Arena<Shared, memgov_stream_ordered::retire::Releases>;

/// Ask the granularity and reserve the range, on the context (current on
/// the calling thread).
pub(crate) fn create(s: &Shared, config: &ArenaConfig) -> Result<Arena, BackendError> {
    let ordinal = s.device.ordinal as i32;
    let _current = s.make_current("arena")?;
    Arena::reserve(
        s,
        config,
        (ordinal, &crate::table::prop(ordinal)),
        s.probe().clone(),
        (),
    )
}
