//! The driver-agnostic core of a virtual-memory arena: one address range
//! reserved for a context's life, backed granule by granule with physical
//! memory as allocations need it, and given back granule by granule by a
//! trim, a sleep or teardown.
//!
//! The CUDA and HIP backends share it: each implements [`GranuleDriver`]
//! (one granule's map, unmap and release, the context made current, page-
//! locked host memory for sleep) over its driver's calls (`cuMemCreate` /
//! `hipMemCreate`, ...), and this module holds everything else: the
//! granule bookkeeping ([`State`]), the per-granule state machine
//! ([`Slot`]), range carving, the transaction and its undo, the quarantine
//! records, the limit on mapped bytes, sleep and wake, and the [`Gate`]
//! between stream captures and the calls that would invalidate them.
//!
//! Invariants, each enforced where it is written:
//!
//! * **Stable addresses.** The backend reserves the range once and frees it
//!   once, after [`Arena::teardown`] gave every granule back; an
//!   allocation's address never changes, and a large allocation is one
//!   contiguous range whatever the granules behind it.
//! * **Physical bytes are the budget.** [`Arena::limit`] bounds the bytes
//!   the driver holds for the arena (granules in use, cached, being mapped,
//!   or quarantined: still mapped, or unmapped with a handle the driver
//!   would not release), never the reserved address space. A map that would pass the limit first
//!   trims cached granules, then is refused with `OutOfMemory` naming the
//!   numbers.
//! * **Granule by granule, transactional.** Each granule is mapped on its
//!   own ([`GranuleDriver::map`], which undoes its own steps on failure); a
//!   failure half-way then unmaps the granules this call mapped before it,
//!   one by one. Every granule is therefore either mapped and accessible, or
//!   unmapped and released, or (when the driver refuses an unmap or a
//!   release) quarantined: kept out of the allocator for the arena's life
//!   (also when the allocations on it retire), counted against the limit
//!   until teardown gives it back, and listed in the [`ArenaSnapshot`];
//!   copies to an allocation on a granule quarantined unmapped are refused
//!   (its memory is gone).
//! * **Unmapped only after the streams passed.** A granule's users are the
//!   allocations that overlap it; an allocation stops being a user only at
//!   [`Arena::retire`], which the backend calls once the stream released on
//!   has passed the release (and, through the governor's ordering, every
//!   other stream that used it). A granule with no users is cached and may
//!   be unmapped at any time after.
//! * **No lock across the driver.** The state lock is held only to choose
//!   and to commit; granules being mapped or unmapped are marked so, and a
//!   thread that needs one waits on a condition variable.
//! * **Nothing that breaks the caller's own capture.** On a thread whose own
//!   stream capture is under way, an allocation that would wait for a
//!   granule in transition or trim, and a trim, are refused at once with
//!   the gate's typed error ([`GranuleDriver::refuse_own_capture`]): the
//!   wait could be on a thread that waits for that capture to end, and an
//!   unmap would invalidate it.

mod arena;
pub mod gate;
mod pool;
#[cfg(test)]
mod races;
mod sleep;
mod sleep_set;
mod state;

pub use crate::capability::SleepReport;
pub use arena::{Arena, ALIGN};
pub use gate::{Gate, GateCall, SleepGate, SleepGateSleep, SleepGateUse};
pub use pool::{CapturePool, PoolTooLarge};
pub use sleep::{with_host_copy_budget, HostCopyBudget};
pub use state::{ArenaSnapshot, Granule, Quarantined, Slot, State};

use crate::{BackendError, BackendErrorKind};
use std::fmt::Debug;

/// Settings of a context's virtual-memory arena (`CudaConfig::arena`,
/// `HipConfig::arena`).
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
    /// 64 GiB of address space, no limit of its own (the governor's budget
    /// still bounds what is allocated).
    fn default() -> Self {
        Self {
            reserve_bytes: 64 << 30,
            limit_bytes: u64::MAX,
        }
    }
}

/// Why a granule could not be mapped, and, when undoing its own steps
/// failed too, the slot to quarantine it in (`None`: nothing of it is left).
pub type MapError<H> = (BackendError, Option<Slot<H>>);

/// One driver's steps on one granule, the calls an [`Arena`] makes through
/// it. Implemented by a short-lived value that borrows the context (its
/// shared state and the arena), made for one arena operation.
pub trait GranuleDriver {
    /// The driver's handle of physical memory.
    type Handle: Copy + Eq + Debug;
    /// Keeps the arena's device current on the calling thread; dropping it
    /// restores the thread's own.
    type Current;

    /// The backend's name, for errors (`"cuda"`, `"hip"`).
    fn backend(&self) -> &'static str;

    /// Make the arena's device current until the guard drops.
    fn make_current(&self, op: &'static str) -> Result<Self::Current, BackendError>;

    /// Refuse, with the gate's typed error, when the calling thread's own
    /// stream capture is under way (see [`Gate::refuse_own`]): asked before
    /// the arena would wait for a granule in transition (whose owner may be
    /// waiting for that capture to end) or unmap one (which would
    /// invalidate the capture). `Ok` for a driver without captures.
    fn refuse_own_capture(&self, op: &'static str) -> Result<(), BackendError> {
        let _ = op;
        Ok(())
    }

    /// Back granule `g` with fresh physical memory, accessible read-write
    /// from the arena's device (create, map, set access). On failure the
    /// mapping (if made) is unmapped and the handle released; an undo the
    /// driver refuses is named in the error and returned as the slot to
    /// quarantine the granule in.
    fn map(&self, g: usize, op: &'static str) -> Result<Self::Handle, MapError<Self::Handle>>;

    /// Unmap granule `g` (backed by `h`) and release `h`. `Err` carries the
    /// slot to quarantine it in: still mapped, or unmapped but unreleased.
    fn unmap(&self, g: usize, h: Self::Handle, op: &'static str) -> Result<(), Slot<Self::Handle>>;

    /// Release a handle no longer mapped.
    fn release(&self, h: Self::Handle, op: &'static str) -> Result<(), BackendError>;

    /// Free page-locked host memory that held a sleeping granule's contents
    /// (never 0).
    fn free_host(&self, host: usize, op: &'static str);
}

/// What a sleep and a wake need besides the granule steps: the streams
/// drained, and a granule's contents copied to and from page-locked host
/// memory.
pub trait SleepDriver: GranuleDriver {
    /// Wait until every stream of the context has run the work queued on
    /// it (so every release queued has retired).
    fn quiesce(&self, op: &'static str) -> Result<(), BackendError>;

    /// Copy `bytes` at device address `at` (mapped read-write) to fresh
    /// page-locked host memory; returns its address. Nothing is left
    /// allocated on failure.
    fn offload(&self, at: u64, bytes: u64) -> Result<usize, BackendError>;

    /// Copy `bytes` of page-locked host memory at `host` to `at` (just
    /// mapped), and wait for the copy.
    fn restore(&self, at: u64, host: usize, bytes: u64) -> Result<(), BackendError>;
}

/// The arena's context is torn down.
pub fn closed(backend: &'static str, op: &'static str) -> BackendError {
    BackendError::new(
        backend,
        op,
        BackendErrorKind::InvalidArgument,
        "the arena's context is torn down: its arena is gone",
    )
}

/// The arena sleeps; `wake` names the call that wakes it.
pub fn asleep(backend: &'static str, op: &'static str, wake: &str) -> BackendError {
    BackendError::new(
        backend,
        op,
        BackendErrorKind::InvalidArgument,
        format!(
            "the context's arena is asleep (its physical memory is released); wake it first \
             ({wake})"
        ),
    )
}

/// The driver refused to give back the granules at `at`.
pub fn quarantine_error(
    backend: &'static str,
    op: &'static str,
    at: &[u64],
    granule: u64,
    freed: u64,
) -> BackendError {
    BackendError::new(
        backend,
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
