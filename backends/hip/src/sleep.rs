//! Sleep and wake of a context's arena on HIP: its physical memory unmapped
//! and released (its contents kept in page-locked host memory,
//! `hipHostMalloc`, when asked) while the addresses stay reserved, then
//! mapped again at the same addresses with the contents restored; the whole
//! arena or a chosen set of its allocations.
//!
//! The state machine is the shared core's ([`memgov_backend::vmm`]): each
//! granule's slot is its mapped state, `Mapped` → `Asleep` on sleep,
//! `Asleep` → `Mapped` on wake, each step taken once, so no handle is
//! released twice and none is forgotten. A wake that would pass the arena's
//! limit is refused (`OutOfMemory`, with the numbers) before any granule is
//! mapped; one that fails half-way unmaps what it mapped and stays asleep.
//! While asleep, allocation and copies to and from sleeping memory are refused
//! (`InvalidArgument`), and releases retire as usual. The copies (on a
//! stream of the sleep's own, synchronized after each granule) are the
//! stream-ordered core's ([`memgov_stream_ordered::arena`]), over HIP's
//! table; this module is the public face on [`HipArena`].

use crate::arena::{HipArena, SleepReport};
use memgov_backend::BackendError;

impl HipArena {
    /// Sleeps of this arena waiting for copies or graph launches between
    /// their awake check and their enqueue (for tests that force that
    /// interleaving).
    pub fn sleeps_waiting(&self) -> usize {
        self.shared.sleep_gate.counts().1
    }

    /// Put the arena to sleep: wait for every stream of the context, then
    /// unmap and release every granule, copying the contents of those in
    /// use to page-locked host memory first when `keep_contents` is set.
    /// Addresses stay reserved and allocations stay live (but unusable until
    /// [`wake`](Self::wake)).
    pub fn sleep(&self, keep_contents: bool) -> Result<SleepReport, BackendError> {
        memgov_stream_ordered::arena::sleep(&*self.shared, &self.arena, keep_contents)
    }

    /// Wake the arena: map every sleeping granule again at its address and
    /// copy back the contents kept. Refused with `OutOfMemory` before any
    /// mapping when the granules do not fit the arena's limit. Returns the
    /// bytes mapped.
    pub fn wake(&self) -> Result<u64, BackendError> {
        memgov_stream_ordered::arena::wake(&*self.shared, &self.arena)
    }

    /// Put the allocations at `ptrs` (device pointers of live allocations of
    /// this arena) to sleep: wait for every stream of the device, then
    /// unmap and release each granule that only they use, copying its
    /// contents to page-locked host memory first when `keep_contents` is
    /// set. Granules shared with other allocations stay mapped; the other
    /// allocations stay usable. Copies to and from the set are refused
    /// until [`wake_ranges`](Self::wake_ranges). The rules are the shared
    /// core's (`memgov_backend::vmm`, its `sleep_set` module).
    pub fn sleep_ranges(
        &self,
        ptrs: &[u64],
        keep_contents: bool,
    ) -> Result<SleepReport, BackendError> {
        memgov_stream_ordered::arena::sleep_ranges(&*self.shared, &self.arena, ptrs, keep_contents)
    }

    /// Wake the allocations at `ptrs`: map every sleeping granule under them
    /// again at its address and copy back the contents kept. Refused with
    /// `OutOfMemory` before any mapping when they do not fit the arena's
    /// limit; one that fails half-way unmaps what it mapped and leaves the
    /// set asleep. Returns the bytes mapped.
    pub fn wake_ranges(&self, ptrs: &[u64]) -> Result<u64, BackendError> {
        memgov_stream_ordered::arena::wake_ranges(&*self.shared, &self.arena, ptrs)
    }
}
