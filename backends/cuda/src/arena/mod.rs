//! The virtual-memory arena: one address range reserved for the context's
//! life (`cuMemAddressReserve`), backed granule by granule with physical
//! memory (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) as allocations need
//! it, and given back granule by granule (`cuMemUnmap`, `cuMemRelease`) by
//! [`trim`](CudaArena::trim) or [`sleep`](CudaArena::sleep).
//!
//! Invariants, each enforced where it is written:
//!
//! * **Stable addresses.** The reservation is made once, in [`Arena::create`],
//!   and freed once, in [`Arena::teardown`]; an allocation's address never
//!   changes, and a large allocation is one contiguous range whatever the
//!   granules behind it.
//! * **Physical bytes are the budget.** [`ArenaConfig::limit_bytes`] bounds the
//!   bytes mapped (granules held, whether in use, cached or being mapped),
//!   never the reserved address space. A map that would pass the limit first
//!   trims cached granules, then is refused with `OutOfMemory` naming the
//!   numbers.
//! * **Granule by granule, transactional.** Each granule is created, mapped
//!   and made accessible on its own ([`granule`]); a failure half-way undoes
//!   that granule's own steps and then the granules this call mapped before
//!   it, one by one. Every granule is therefore either mapped and accessible,
//!   or unmapped and released, or (when the driver refuses an unmap or a
//!   release) quarantined: kept out of the allocator for the arena's life and
//!   listed in the [`ArenaSnapshot`].
//! * **Unmapped only after the streams passed.** A granule's users are the
//!   allocations that overlap it; an allocation stops being a user only when
//!   the host function queued behind its release has run on the releasing
//!   stream, which the governor orders after every other stream that used it
//!   (`order_after`, as for any release). A granule with no users is cached
//!   and may be unmapped at any time after.
//! * **No lock across the driver.** The state lock is held only to choose
//!   and to commit; granules being mapped or unmapped are marked so, and a
//!   thread that needs one waits on a condition variable.

pub(crate) mod granule;
mod release;
pub(crate) mod state;

pub use memgov_backend::vmm::SleepReport;
pub(crate) use release::quiesce;
pub use state::{ArenaSnapshot, Quarantined};

use crate::shared::Shared;
use cudarc::driver::sys::{self, CUdeviceptr};
use memgov_backend::vmm;
use memgov_backend::BackendError;

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

/// One context's arena: the driver-agnostic books and transactions
/// ([`vmm::Arena`], reached through `Deref`), the device it maps on, and
/// the releases queued on its streams. Lives in an `Arc` shared with the
/// host functions of its releases, which touch only its state lock.
pub struct Arena {
    core: vmm::Arena<sys::CUmemGenericAllocationHandle>,
    pub(crate) ordinal: i32,
    /// The context's probe, which the releases' host functions count on.
    pub(crate) probe: memgov_backend::BackendProbe,
    /// Releases queued whose host function has not run.
    pub(crate) releases: release::Releases,
}

impl std::ops::Deref for Arena {
    type Target = vmm::Arena<sys::CUmemGenericAllocationHandle>;

    fn deref(&self) -> &Self::Target {
        &self.core
    }
}

/// One arena operation's driver: the core's granule steps and sleep copies
/// ([`memgov_stream_ordered::arena`]) over CUDA's table ([`granule`]).
pub(crate) type Driver<'a> = memgov_stream_ordered::arena::Driver<'a, Shared>;

impl Arena {
    /// Ask the granularity and reserve the range, on the context (current on
    /// the calling thread).
    pub(crate) fn create(s: &Shared, config: &ArenaConfig) -> Result<Self, BackendError> {
        let ordinal = s.ordinal as i32;
        let prop = granule::prop(ordinal);
        let _current = s.make_current("arena")?;
        let core = memgov_stream_ordered::arena::reserve(s, config, &prop)?;
        Ok(Self {
            core,
            ordinal,
            probe: s.probe().clone(),
            releases: release::Releases::default(),
        })
    }

    pub(crate) fn driver<'a>(&'a self, s: &'a Shared) -> Driver<'a> {
        memgov_stream_ordered::arena::driver(s, self)
    }

    /// Take `bytes` of the arena, mapping the granules it needs; returns its
    /// device address. The context must be current on the calling thread.
    pub(crate) fn allocate(&self, s: &Shared, bytes: u64) -> Result<CUdeviceptr, BackendError> {
        self.core.allocate(&self.driver(s), bytes)
    }

    /// Give everything back at teardown: every mapped granule (in use or
    /// not: every stream was synchronized), then the reservation. A granule
    /// whose unmap is refused keeps the reservation alive (freeing it under
    /// a mapping is undefined); both are reported.
    pub(crate) fn teardown(&self, s: &Shared) -> Result<(), BackendError> {
        self.core.teardown(&self.driver(s))?;
        memgov_stream_ordered::arena::free_reservation(s, &self.core)
    }
}
