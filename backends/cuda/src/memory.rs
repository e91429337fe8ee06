//! Allocation from the device's stream-ordered memory pool, page-locked
//! host allocation, and copies ordered on a stream.
//!
//! Memory comes from `cuMemAllocFromPoolAsync` on the context's own memory
//! pool, so a free queued on a stream is reusable at once by allocations
//! ordered after it on that stream (the context declares
//! `stream_ordered_reuse`).
//!
//! Pinned host memory ([`Tier::PinnedHost`](memgov_backend::Tier::PinnedHost)) comes from `cuMemHostAlloc`
//! (portable, mapped), and copies reach it through its device pointer
//! (`cuMemHostGetDevicePointer_v2`): the same asynchronous, stream-ordered
//! copies as device memory. Its free is `cuMemFreeHost`, queued behind the
//! stream as `retire.rs` describes.
//!
//! Every safe method checks its handles against the context's own registry
//! before any driver call: a stream or allocation of another context, a
//! destroyed stream, an allocation already freed, or a range outside the
//! allocation is refused with `InvalidArgument`.
//! The backend owns raw `CUdeviceptr`s, not cudarc's `CudaSlice` (which frees
//! itself in `Drop` without telling anyone): only `free_async` and teardown
//! free device memory, so the retire signal can fire after the free.

use crate::shared::Live;
use crate::CudaContext;
use cudarc::driver::sys::{self, CUdeviceptr};
use memgov_backend::lock;
use memgov_backend::BackendError;
use memgov_stream_ordered::parts::Books;
use memgov_stream_ordered::pinned;
use memgov_stream_ordered::state::{Block, Origin};
use memgov_stream_ordered::stream::StreamContext as _;
use memgov_stream_ordered::table::Context as _;

memgov_stream_ordered::handle! {
    /// A raw device allocation: the core's [`Block`] (`len`, `tier`,
    /// `host_ptr`, ...). A plain handle: dropping it does nothing; only
    /// `free_async` or teardown release it.
    pub struct CudaMemory(Block);
}

impl CudaMemory {
    /// The raw `CUdeviceptr`, for a runtime's kernels and copies.
    ///
    /// Valid for `len()` bytes while the governed buffer that owns this
    /// memory is alive. The caller must not free it (`cuMemFree*`), must
    /// order every use on the buffer's stream (or synchronize with it) so
    /// that no use runs after the buffer is released, and must not keep the
    /// pointer past the buffer's release or the context's retirement.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device
    }
}

impl CudaContext {
    pub(crate) fn allocate_impl(
        &self,
        stream: &super::CudaStream,
        bytes: u64,
    ) -> Result<CudaMemory, BackendError> {
        let s = &*self.parts.shared;
        let size = memgov_stream_ordered::memory::allocation_size(s, stream, bytes)?;
        let _current = s.make_current("allocate")?;
        if let Some(arena) = &self.parts.arena {
            let ptr = arena.allocate(s, bytes)?;
            return Ok(self.register(ptr, bytes, 0));
        }
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out pointer; the stream is a live stream
        // of this context (checked above), which is current on this thread;
        // the pool is this context's own, alive until teardown.
        let r = unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, size, s.pool, stream.raw()) };
        s.checked("allocate", "cuMemAllocFromPoolAsync", r)?;
        Ok(self.register(ptr, bytes, 0))
    }

    /// Enter a new allocation in the context's books (the live map and the
    /// probe) and hand it out: `host` is its page-locked host address, 0
    /// for device memory.
    fn register(&self, ptr: CUdeviceptr, bytes: u64, host: usize) -> CudaMemory {
        let s = &*self.parts.shared;
        let id = s.next_id();
        lock(&s.live).insert(id, Live { ptr, bytes, host });
        s.probe().allocated(bytes);
        let origin = match (host, &self.parts.arena) {
            (0, Some(_)) => Origin::Arena,
            (0, None) => Origin::Pool,
            _ => Origin::PinnedHost,
        };
        CudaMemory(Block {
            device: ptr,
            host,
            bytes,
            id,
            context: s.id,
            origin,
        })
    }

    /// `allocate_in` for [`Tier::PinnedHost`](memgov_backend::Tier::PinnedHost): `cuMemHostAlloc`, portable
    /// and mapped, reached by copies through its device pointer.
    pub(crate) fn allocate_pinned_impl(
        &self,
        stream: &super::CudaStream,
        bytes: u64,
    ) -> Result<CudaMemory, BackendError> {
        let (device, host) = pinned::allocate(&*self.parts.shared, stream, bytes)?;
        Ok(self.register(device, bytes, host))
    }
}

/// The live map is keyed by the allocation's number.
impl Books for crate::shared::Shared {
    type Entry = Live;

    fn is_live(&self, memory: &Block) -> bool {
        lock(&self.live).contains_key(&memory.id)
    }

    fn take_live(&self, memory: &Block) -> Option<Live> {
        lock(&self.live).remove(&memory.id)
    }

    fn put_back(&self, memory: &Block, entry: Live) {
        lock(&self.live).insert(memory.id, entry);
    }

    fn forget_arena_allocations(&self, arena: &Self::Arena) -> Vec<u64> {
        let mut live = lock(&self.live);
        let mut sizes = Vec::new();
        live.retain(|_, l| {
            let ours = l.host == 0 && arena.contains(l.ptr);
            if ours {
                sizes.push(l.bytes);
            }
            !ours
        });
        sizes
    }
}
