//! Allocation (`hipMallocFromPoolAsync` from the context's own memory pool,
//! or the `hipMalloc` fallback; page-locked host memory from
//! `hipHostMalloc`), copies on the stream, and the probe of the pool's
//! stream-ordered allocator (the pool itself is the core's `pool` module's,
//! over the table).
//!
//! Pinned host memory ([`Tier::PinnedHost`](memgov_backend::Tier::PinnedHost)) is allocated mapped into the
//! device's address space (`hipHostMallocMapped | hipHostMallocPortable`).
//! HIP's copies take the pointer kind their `hipMemcpyKind` names, and a
//! pointer of the wrong kind is undefined behaviour; the device's view of
//! mapped host memory is the pointer `hipHostGetDevicePointer` returns,
//! whose value may differ from the host pointer. So the tier keeps both: the
//! host pointer (the key in the books, and what `hipHostFree` takes) and the
//! device pointer, which the stream-ordered copies (`hipMemcpyHtoDAsync`,
//! `hipMemcpyDtoHAsync`) and [`HipMemory::device_ptr`] use. Its free,
//! `hipHostFree`, is synchronous: it goes the way of the `hipMalloc`
//! fallback's `hipFree` (an event recorded on the releasing stream, waited
//! for by the free thread before the free), so it never runs under a copy
//! still queued (`retire.rs`).

use super::ffi::{
    self, hipFreeAsync, hipMalloc, hipMallocFromPoolAsync, hipStreamCreateWithFlags,
    hipStreamDestroy, hipStreamSynchronize, hipStream_t, HipResult,
};
use super::result::{check, Hip};
use super::stream::HipStream;
use crate::shared::{Allocator, Pool, Shared};
use memgov_backend::lock;
use memgov_backend::BackendError;
use memgov_stream_ordered::parts::Books;
use memgov_stream_ordered::pinned;
use memgov_stream_ordered::state::Block;
pub use memgov_stream_ordered::state::Origin;
use memgov_stream_ordered::stream::StreamContext as _;
use memgov_stream_ordered::table::Context as _;
use std::ffi::c_void;

const NOT_SUPPORTED: HipResult = ffi::hipErrorNotSupported;
const OUT_OF_MEMORY: HipResult = ffi::hipErrorOutOfMemory;

memgov_stream_ordered::handle! {
    /// A raw device allocation of a [`HipContext`](super::HipContext): the
    /// core's [`Block`] (`len`, `origin`, `tier`, `host_ptr`, ...).
    ///
    /// A plain handle: dropping it does nothing; only a stream-ordered free (or
    /// teardown, for memory the governor abandoned) returns it to the device.
    pub struct HipMemory(Block);
}

impl HipMemory {
    /// The device pointer, for kernels and copies of your own.
    ///
    /// Valid until the allocation is released. The caller must not free it
    /// (`hipFree`/`hipFreeAsync`), must not access it past `len()`
    /// bytes, and must order any work that uses it on the stream the
    /// allocation is released on (or synchronize that work first): the
    /// governor's free is ordered after earlier work on that stream only.
    ///
    /// For page-locked host memory ([`Tier::PinnedHost`](memgov_backend::Tier::PinnedHost)) this is the
    /// device's view of it (`hipHostGetDevicePointer`), which may differ
    /// from `host_ptr()`: pass it where a HIP call takes a
    /// device pointer, and the host pointer where it takes a host one.
    pub fn device_ptr(&self) -> ffi::hipDeviceptr_t {
        self.device as usize as ffi::hipDeviceptr_t
    }
}

pub(crate) fn allocate(
    shared: &Shared,
    stream: &HipStream,
    bytes: u64,
) -> Result<HipMemory, BackendError> {
    let size = memgov_stream_ordered::memory::allocation_size(shared, stream, bytes)?;
    let _device = shared.make_current("allocate")?;
    let mut ptr: *mut c_void = std::ptr::null_mut();
    let mut origin = Origin::Plain;
    if let (Allocator::StreamOrdered, Some(pool)) = (shared.allocator(), shared.pool()) {
        // SAFETY: `ptr` is a valid out-pointer, the pool is the context's
        // own (destroyed only at teardown) and the stream is alive.
        let r = unsafe { hipMallocFromPoolAsync(&mut ptr, size, pool.0, stream.raw()) };
        if r == NOT_SUPPORTED {
            // The runtime has no stream-ordered allocator for this device
            // after all: use the fallback from now on.
            shared.fall_back("hipMallocFromPoolAsync returned hipErrorNotSupported");
        } else {
            shared.checked("allocate", "hipMallocFromPoolAsync", r)?;
            origin = Origin::Pool;
        }
    }
    if origin == Origin::Plain {
        // SAFETY: `ptr` is a valid out-pointer.
        let r = unsafe { hipMalloc(&mut ptr, size) };
        shared.checked("allocate", "hipMalloc", r)?;
    }
    Ok(register(shared, ptr as usize, ptr as usize, bytes, origin))
}

/// Enter a new allocation in the context's books (the live map, keyed by
/// its own pointer `ptr`, and the probe) and hand it out: `device` is the
/// device's view of it, which differs for page-locked host memory.
pub(crate) fn register(
    shared: &Shared,
    ptr: usize,
    device: usize,
    bytes: u64,
    origin: Origin,
) -> HipMemory {
    lock(&shared.live).insert(ptr, (bytes, origin));
    shared.probe().allocated(bytes);
    let host = if origin == Origin::PinnedHost { ptr } else { 0 };
    HipMemory(Block {
        device: device as u64,
        host,
        bytes,
        id: shared.next_id(),
        context: shared.id,
        origin,
    })
}

/// `allocate_in` for [`Tier::PinnedHost`]: `hipHostMalloc`.
pub(crate) fn allocate_pinned(
    shared: &Shared,
    stream: &HipStream,
    bytes: u64,
) -> Result<HipMemory, BackendError> {
    let (device, host) = pinned::allocate(shared, stream, bytes)?;
    let origin = Origin::PinnedHost;
    Ok(register(shared, host, device as usize, bytes, origin))
}

/// Whether the stream-ordered allocator works on the current device: one
/// one-byte trial allocation from the pool on a temporary stream, freed,
/// synchronized and trimmed away. `Ok(false)` when the runtime answers
/// `hipErrorNotSupported`. An out-of-memory answer (a device with almost
/// nothing free) still shows that the allocator is there: `Ok(true)`.
pub(crate) fn probe_stream_ordered(pool: Pool) -> Result<bool, BackendError> {
    let mut s: hipStream_t = std::ptr::null_mut();
    // SAFETY: valid out-pointer, documented flag.
    check("new", "hipStreamCreateWithFlags", unsafe {
        hipStreamCreateWithFlags(&mut s, ffi::hipStreamNonBlocking)
    })?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the pool and the stream were just created.
    let r = unsafe { hipMallocFromPoolAsync(&mut p, 1, pool.0, s) };
    let allocated = r == ffi::SUCCESS;
    let mut result = if r == NOT_SUPPORTED {
        Ok(false)
    } else if r == OUT_OF_MEMORY {
        Ok(true)
    } else {
        check("new", "hipMallocFromPoolAsync", r).map(|()| true)
    };
    if allocated {
        // SAFETY: `p` came from hipMallocAsync just above and is unused.
        let r = unsafe { hipFreeAsync(p, s) };
        result = check("new", "hipFreeAsync", r).map(|()| true);
    }
    // SAFETY: the temporary stream is alive until destroyed below.
    let synced = check("new", "hipStreamSynchronize", unsafe {
        hipStreamSynchronize(s)
    });
    // SAFETY: synchronized (or failing, where HIP still accepts the destroy);
    // nothing else knows this stream.
    let destroyed = check("new", "hipStreamDestroy", unsafe { hipStreamDestroy(s) });
    let ordered = result?;
    synced?;
    destroyed?;
    if allocated {
        // SAFETY: the pool just created, alive; the probe's allocation was
        // freed and its free executed (the stream synchronized).
        unsafe { memgov_stream_ordered::pool::trim::<Hip>("new", pool.0)? };
    }
    Ok(ordered)
}

/// The live map is keyed by the allocation's own pointer.
impl Books for Shared {
    type Entry = (u64, Origin);

    fn is_live(&self, memory: &Block) -> bool {
        lock(&self.live).contains_key(&memory.own())
    }

    fn take_live(&self, memory: &Block) -> Option<(u64, Origin)> {
        lock(&self.live).remove(&memory.own())
    }

    fn put_back(&self, memory: &Block, entry: (u64, Origin)) {
        lock(&self.live).insert(memory.own(), entry);
    }

    fn forget_arena_allocations(&self, _: &Self::Arena) -> Vec<u64> {
        let mut live = lock(&self.live);
        let mut sizes = Vec::new();
        live.retain(|_, &mut (bytes, origin)| {
            let ours = origin == Origin::Arena;
            if ours {
                sizes.push(bytes);
            }
            !ours
        });
        sizes
    }
}
