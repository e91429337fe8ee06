//! Page-locked host memory for the pinned tier
//! ([`Tier::PinnedHost`](memgov_backend::Tier::PinnedHost)): allocated
//! portable and mapped into the device's address space, so that the same
//! asynchronous, stream-ordered copies reach it through its device address.
//! The vendor's two entry points are [`PinnedTable`]; the steps (the
//! allocation's checks, the capture gate, the device made current, the
//! buffer given back at once when its device address cannot be had) are
//! written here once. How a pinned buffer is freed after its release (CUDA:
//! a host function hands it to the free thread; HIP: an event the free
//! thread waits for) stays the vendor's.

use crate::memory::allocation_size;
use crate::table::{Context, VmmTable};
use memgov_backend::BackendError;

/// The vendor's entry points for pinned host memory.
pub trait PinnedTable: VmmTable {
    /// [`host_alloc_mapped`](Self::host_alloc_mapped)'s name
    /// (`cuMemHostAlloc`).
    const HOST_ALLOC_MAPPED: &'static str;
    /// [`host_device_pointer`](Self::host_device_pointer)'s name
    /// (`cuMemHostGetDevicePointer_v2`).
    const HOST_DEVICE_POINTER: &'static str;

    /// `bytes` of page-locked host memory, portable (usable from every
    /// context) and mapped into the device's address space; its host
    /// address. Freed with [`VmmTable::host_free`].
    ///
    /// # Safety
    ///
    /// The device is current.
    unsafe fn host_alloc_mapped(bytes: usize) -> (Self::Code, usize);

    /// The device's address of mapped host memory at `host` (which may
    /// differ from the host address: HIP documents it may).
    ///
    /// # Safety
    ///
    /// `host` came from [`host_alloc_mapped`](Self::host_alloc_mapped) and
    /// is live; the device is current.
    unsafe fn host_device_pointer(host: usize) -> (Self::Code, u64);
}

/// Page-locked host memory of `bytes` for a context, ordered on `stream`
/// (checked like any allocation): its device address and host address.
///
/// The allocation (and the free on failure) is a potentially unsafe call
/// while a graph is captured: it waits for captures under way and is
/// refused on a thread whose own capture is under way.
pub fn allocate<C: Context<Table: PinnedTable>>(
    ctx: &C,
    stream: &C::Stream,
    bytes: u64,
) -> Result<(u64, usize), BackendError> {
    const OP: &str = "allocate";
    let size = allocation_size(ctx, stream, bytes)?;
    let _call = ctx.capture_gate().call(OP, true)?;
    let _current = ctx.make_current(OP)?;
    // SAFETY: the device is current (above).
    let (r, host) = unsafe { C::Table::host_alloc_mapped(size) };
    ctx.checked(OP, C::Table::HOST_ALLOC_MAPPED, r)?;
    // SAFETY: `host` was just allocated mapped; the device is current.
    let (r, device) = unsafe { C::Table::host_device_pointer(host) };
    if let Err(e) = ctx.checked(OP, C::Table::HOST_DEVICE_POINTER, r) {
        // Nothing is queued on it yet: given back at once.
        // SAFETY: allocated above, used by nothing, freed once.
        let r = unsafe { C::Table::host_free(host) };
        let _ = ctx.checked(OP, C::Table::NAMES.host_free, r);
        return Err(e);
    }
    Ok((device, host))
}
