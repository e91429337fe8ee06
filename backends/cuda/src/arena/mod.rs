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

pub(crate) use release::quiesce;
pub use state::{ArenaSnapshot, Quarantined};

use crate::result::err;
use crate::shared::Shared;
use cudarc::driver::sys::{self, CUdeviceptr};
use memgov_backend::{lock, BackendError, BackendErrorKind};
use state::{Slot, State};
use std::sync::Arc;
use std::sync::{Condvar, Mutex};

/// Settings of a context's virtual-memory arena (see [`CudaConfig::arena`]).
///
/// [`CudaConfig::arena`]: crate::CudaConfig::arena
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaConfig {
    /// Address space to reserve, rounded up to whole granules: the most the
    /// arena's live allocations can span at once. Reserving costs no
    /// physical memory.
    pub reserve_bytes: u64,
    /// The most physical memory the arena holds mapped, rounded down to whole
    /// granules.
    pub limit_bytes: u64,
}

impl Default for ArenaConfig {
    fn default() -> Self {
        Self {
            reserve_bytes: 64 << 30,
            limit_bytes: u64::MAX,
        }
    }
}

/// A handle on a context's arena ([`CudaContext::arena`]): its snapshot,
/// trim, limit, sleep and wake. It stays usable after the context is handed
/// to the governor (a pressure responder can hold one), and refuses work
/// once the context is torn down.
///
/// ```no_run
/// use memgov::cuda::{ArenaConfig, CudaConfig, CudaContext};
/// use memgov::{ContextConfig, Governor};
/// let ctx = CudaContext::new(CudaConfig {
///     arena: Some(ArenaConfig { reserve_bytes: 8 << 30, limit_bytes: 4 << 30 }),
///     ..CudaConfig::default()
/// })?;
/// let arena = ctx.arena().expect("configured");
/// let gov = Governor::new();
/// let handle = gov.register(ctx, ContextConfig::new().budget(4 << 30));
/// // Cached granules are what the arena can give back under pressure.
/// let responder = arena.clone();
/// handle.add_pressure_responder(move |_| responder.trim().unwrap_or(0));
/// # Ok::<(), memgov::BackendError>(())
/// ```
///
/// [`CudaContext::arena`]: crate::CudaContext::arena
#[derive(Clone)]
pub struct CudaArena {
    pub(crate) arena: Arc<Arena>,
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for CudaArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaArena")
            .field("base", &format_args!("{:#x}", self.arena.base))
            .field("reserved", &self.arena.size)
            .field("granule", &self.arena.granule)
            .finish()
    }
}

impl CudaArena {
    /// What the arena holds: reserved, mapped, in use, cached, asleep,
    /// quarantined.
    pub fn snapshot(&self) -> ArenaSnapshot {
        self.arena.snapshot()
    }

    /// Give back every cached granule (mapped, no allocation in it),
    /// unmapped and released one by one; returns the bytes given back.
    ///
    /// While a graph capture is under way anywhere in the process the trim
    /// is deferred (unmapping would invalidate it): it returns 0 at once,
    /// and the end of the last capture runs it.
    pub fn trim(&self) -> Result<u64, BackendError> {
        self.shared.check_usable("trim")?;
        if crate::capture::gate().defer_trim(&self.arena, &self.shared) {
            return Ok(0);
        }
        self.arena.trim(&self.shared, "trim")
    }

    /// Set the most physical memory the arena maps, rounded down to whole
    /// granules. Lowering it unmaps nothing: later maps and wakes are
    /// refused until enough is given back.
    pub fn set_limit(&self, bytes: u64) {
        self.arena.set_limit(bytes);
    }
}

/// Device allocations are aligned to this within the arena, as
/// `cuMemAlloc` aligns them.
const ALIGN: u64 = 256;

/// One context's arena. Lives in an `Arc` shared with the host functions of
/// its releases, which touch only its state lock.
pub(crate) struct Arena {
    pub(crate) base: CUdeviceptr,
    pub(crate) size: u64,
    pub(crate) granule: u64,
    limit: std::sync::atomic::AtomicU64,
    pub(crate) ordinal: i32,
    pub(crate) state: Mutex<State>,
    pub(crate) changed: Condvar,
    /// Releases queued whose host function has not run.
    pub(crate) releases: release::Releases,
}

impl Arena {
    /// Ask the granularity and reserve the range, on the context (current on
    /// the calling thread).
    pub(crate) fn create(s: &Shared, config: &ArenaConfig) -> Result<Self, BackendError> {
        let ordinal = s.ordinal as i32;
        let prop = granule::prop(ordinal);
        let _current = s.make_current("arena")?;
        let mut g: usize = 0;
        // SAFETY: valid out pointer and property struct; the context is
        // current.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        };
        s.checked("arena", "cuMemGetAllocationGranularity", r)?;
        let granule = g as u64;
        if granule == 0 || !granule.is_power_of_two() {
            return Err(err(
                "arena",
                BackendErrorKind::Other,
                format!("the driver reports an allocation granularity of {granule} B, not a power of two"),
            ));
        }
        let size = config
            .reserve_bytes
            .max(1)
            .checked_next_multiple_of(granule)
            .ok_or_else(|| {
                err(
                    "arena",
                    BackendErrorKind::InvalidArgument,
                    format!("a reservation of {} B overflows", config.reserve_bytes),
                )
            })?;
        let limit = config.limit_bytes / granule * granule;
        let mut base: CUdeviceptr = 0;
        // SAFETY: valid out pointer; the context is current; freed once in
        // `teardown`.
        let r =
            unsafe { sys::cuMemAddressReserve(&mut base, size as usize, granule as usize, 0, 0) };
        s.checked("arena", "cuMemAddressReserve", r)
            .map_err(|e| BackendError {
                message: format!(
                    "{} (reserving {size} B of address space for the arena; ask for less with \
                     ArenaConfig::reserve_bytes)",
                    e.message
                ),
                ..e
            })?;
        Ok(Self {
            base,
            size,
            granule,
            limit: limit.into(),
            ordinal,
            state: Mutex::new(State::new(size, granule)),
            changed: Condvar::new(),
            releases: release::Releases::default(),
        })
    }

    /// The most bytes the arena maps.
    pub(crate) fn limit(&self) -> u64 {
        self.limit.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Change the limit (rounded down to whole granules). Lowering it below
    /// what is mapped unmaps nothing: later maps and wakes are refused until
    /// enough is given back.
    pub(crate) fn set_limit(&self, bytes: u64) {
        let limit = bytes / self.granule * self.granule;
        self.limit
            .store(limit, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether `ptr` lies in the arena's reservation.
    pub(crate) fn contains(&self, ptr: CUdeviceptr) -> bool {
        ptr >= self.base && ptr - self.base < self.size
    }

    pub(crate) fn snapshot(&self) -> ArenaSnapshot {
        lock(&self.state).snapshot(self.base, self.size, self.granule)
    }

    /// Take `bytes` of the arena, mapping the granules it needs; returns its
    /// device address. The context must be current on the calling thread.
    pub(crate) fn allocate(&self, s: &Shared, bytes: u64) -> Result<CUdeviceptr, BackendError> {
        let len = bytes.checked_next_multiple_of(ALIGN).unwrap_or(u64::MAX);
        let mut trimmed = false;
        let (offset, mine) = loop {
            let mut st = lock(&self.state);
            if st.closed {
                return Err(closed("allocate"));
            }
            if st.asleep {
                return Err(asleep("allocate"));
            }
            let Some(offset) = st.take_range(len) else {
                return Err(err(
                    "allocate",
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "the arena's {} B reservation has no free range of {len} B ({} B in use); \
                         release memory or reserve more with ArenaConfig::reserve_bytes",
                        self.size, st.in_use
                    ),
                ));
            };
            let granules = st.granules_of(offset, len);
            if granules.clone().any(|g| st.slots[g].slot.in_transition()) {
                st.put_range(offset, len);
                drop(self.changed.wait(st));
                continue;
            }
            let need: Vec<usize> = granules
                .clone()
                .filter(|&g| matches!(st.slots[g].slot, Slot::Unmapped))
                .collect();
            let adding = need.len() as u64 * self.granule;
            if st.mapped + st.mapping + adding > self.limit() {
                st.put_range(offset, len);
                let cached = st.cached();
                drop(st);
                if !trimmed && cached > 0 {
                    trimmed = true;
                    self.trim(s, "allocate")?;
                    continue;
                }
                let st = lock(&self.state);
                return Err(err(
                    "allocate",
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "{bytes} B needs {adding} B more mapped, but the arena holds {} B of its \
                         {} B limit ({} B in use); release memory or raise ArenaConfig::limit_bytes",
                        st.mapped + st.mapping,
                        self.limit(),
                        st.in_use
                    ),
                ));
            }
            for &g in &need {
                st.slots[g].slot = Slot::Mapping;
            }
            st.mapping += adding;
            for g in granules {
                st.slots[g].users += 1;
            }
            st.in_use += len;
            st.blocks.insert(offset, len);
            break (offset, need);
        };
        // Map each granule this call owns; on failure undo them one by one.
        let mut done: Vec<(usize, sys::CUmemGenericAllocationHandle)> = Vec::new();
        let mut failure = None;
        for &g in &mine {
            match granule::map(s, self, g, "allocate") {
                Ok(h) => done.push((g, h)),
                Err(e) => {
                    failure = Some((g, e));
                    break;
                }
            }
        }
        let Some((failed, (e, leftover))) = failure else {
            let mut st = lock(&self.state);
            for (g, h) in done {
                st.slots[g].slot = Slot::Mapped(h);
                st.mapping -= self.granule;
                st.mapped += self.granule;
            }
            drop(st);
            self.changed.notify_all();
            return Ok(self.base + offset);
        };
        let mut undone: Vec<(usize, Result<(), Slot>)> = done
            .into_iter()
            .map(|(g, h)| (g, granule::unmap(s, self, g, h, "allocate")))
            .collect();
        undone.push((failed, leftover.map_or(Ok(()), Err)));
        let mut st = lock(&self.state);
        st.blocks.remove(&offset);
        st.in_use -= len;
        for g in st.granules_of(offset, len) {
            st.slots[g].users -= 1;
        }
        for &g in &mine {
            st.mapping -= self.granule;
            st.slots[g].slot = Slot::Unmapped;
        }
        // Back to the free list first: a quarantine carves its granule out.
        st.put_range(offset, len);
        for (g, r) in undone {
            if let Err(q) = r {
                // Counted as mapped until the quarantine says otherwise.
                st.mapped += self.granule;
                st.quarantine(g, q, self.base, self.granule);
            }
        }
        drop(st);
        self.changed.notify_all();
        Err(e)
    }

    /// Give back the allocation at `ptr`: its range returns to the free list
    /// and its granules lose a user. Called once the stream passed its last
    /// use (a host function: no driver call here).
    pub(crate) fn retire(&self, ptr: CUdeviceptr) {
        let offset = ptr - self.base;
        let mut st = lock(&self.state);
        if let Some(len) = st.blocks.remove(&offset) {
            for g in st.granules_of(offset, len) {
                st.slots[g].users -= 1;
            }
            st.in_use -= len;
            st.put_range(offset, len);
            crate::sleep_set::keep_asleep_out(&mut st, offset, len, self.granule);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Unmap and release every cached granule (mapped, no users). Returns
    /// the bytes given back; granules the driver refused to give back are
    /// quarantined and named in the error.
    pub(crate) fn trim(&self, s: &Shared, op: &'static str) -> Result<u64, BackendError> {
        // Current before any granule is marked: a failure here leaves none
        // in transition.
        let _current = s.make_current(op)?;
        let victims: Vec<(usize, sys::CUmemGenericAllocationHandle)> = {
            let mut st = lock(&self.state);
            if st.closed {
                return Err(closed(op));
            }
            let v: Vec<_> = (0..st.slots.len())
                .filter_map(|g| match st.slots[g].slot {
                    Slot::Mapped(h) if st.slots[g].users == 0 => Some((g, h)),
                    _ => None,
                })
                .collect();
            for &(g, _) in &v {
                st.slots[g].slot = Slot::Unmapping;
            }
            v
        };
        if victims.is_empty() {
            return Ok(0);
        }
        let results: Vec<(usize, Result<(), Slot>)> = victims
            .into_iter()
            .map(|(g, h)| (g, granule::unmap(s, self, g, h, op)))
            .collect();
        let mut st = lock(&self.state);
        let mut freed = 0;
        let mut refused = Vec::new();
        for (g, r) in results {
            match r {
                Ok(()) => {
                    st.slots[g].slot = Slot::Unmapped;
                    st.mapped -= self.granule;
                    freed += self.granule;
                }
                Err(q) => {
                    refused.push(self.base + g as u64 * self.granule);
                    st.quarantine(g, q, self.base, self.granule);
                }
            }
        }
        drop(st);
        self.changed.notify_all();
        if refused.is_empty() {
            Ok(freed)
        } else {
            Err(quarantine_error(op, &refused, self.granule, freed))
        }
    }

    /// Give everything back at teardown: every mapped granule (in use or
    /// not: every stream was synchronized), then the reservation. A granule
    /// whose unmap is refused keeps the reservation alive (freeing it under
    /// a mapping is undefined); both are reported.
    pub(crate) fn teardown(&self, s: &Shared) -> Result<(), BackendError> {
        let held: Vec<(usize, Slot)> = {
            let mut st = lock(&self.state);
            st.closed = true;
            // A trim, sleep or wake under way finishes its granules first.
            while st.slots.iter().any(|g| g.slot.in_transition()) {
                st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.blocks.clear();
            (0..st.slots.len())
                .filter_map(|g| {
                    let slot = std::mem::replace(&mut st.slots[g].slot, Slot::Unmapped);
                    (!matches!(slot, Slot::Unmapped)).then_some((g, slot))
                })
                .collect()
        };
        let _current = s.make_current("teardown")?;
        let mut refused = Vec::new();
        for (g, slot) in held {
            let r = match slot {
                Slot::Mapped(h)
                | Slot::Quarantined {
                    handle: Some(h),
                    mapped: true,
                } => granule::unmap(s, self, g, h, "teardown"),
                Slot::Quarantined {
                    handle: Some(h),
                    mapped: false,
                } => granule::release(s, h, "teardown").map_err(|_| Slot::Unmapped),
                Slot::Asleep { host } => {
                    if host != 0 {
                        // SAFETY: page-locked memory this arena allocated for
                        // the granule's contents, freed once (the slot was
                        // taken out of the state above); no copy uses it
                        // (every stream was synchronized).
                        let r = unsafe { sys::cuMemFreeHost(host as *mut std::ffi::c_void) };
                        let _ = s.checked("teardown", "cuMemFreeHost", r);
                    }
                    Ok(())
                }
                _ => Ok(()),
            };
            if r.is_err() {
                refused.push(self.base + g as u64 * self.granule);
            }
        }
        if !refused.is_empty() {
            return Err(quarantine_error("teardown", &refused, self.granule, 0));
        }
        // SAFETY: the range reserved in `create`, freed once; nothing is
        // mapped in it any more.
        let r = unsafe { sys::cuMemAddressFree(self.base, self.size as usize) };
        s.checked("teardown", "cuMemAddressFree", r)
    }
}

pub(crate) fn closed(op: &'static str) -> BackendError {
    err(
        op,
        BackendErrorKind::InvalidArgument,
        "the arena's context is torn down: its arena is gone",
    )
}

pub(crate) fn asleep(op: &'static str) -> BackendError {
    err(
        op,
        BackendErrorKind::InvalidArgument,
        "the context's arena is asleep (its physical memory is released); wake it first \
         (CudaContext::wake)",
    )
}

fn quarantine_error(
    op: &'static str,
    at: &[CUdeviceptr],
    granule: u64,
    freed: u64,
) -> BackendError {
    err(
        op,
        BackendErrorKind::Other,
        format!(
            "the driver refused to give back {} granule(s) of {granule} B (at {}); they are \
             quarantined (kept out of use, listed in the arena's snapshot); {freed} B were given back",
            at.len(),
            at.iter().map(|a| format!("{a:#x}")).collect::<Vec<_>>().join(", ")
        ),
    )
}
