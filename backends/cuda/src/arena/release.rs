//! Stream-ordered release of arena memory, and the arena's part of device
//! loss and teardown.
//!
//! A release queues a host function on the releasing stream; when it runs,
//! the stream has passed the memory's last use (and, through `order_after`,
//! so has every other stream that used it), and the host function gives the
//! range back to the arena and fires the [`RetireSignal`]. It makes no
//! driver call: unmapping is left to trim, sleep and teardown, which run on
//! a caller's thread. The signal waits in the arena's tickets, so that
//! `device_lost` can take it (unfired) instead, as for the pool's frees;
//! the first steps are the pool's too (`Shared::begin_free`), the ticket,
//! its route and a failed launch the core's
//! ([`memgov_stream_ordered::retire`]).

use super::Arena;
use crate::retire::Refused;
use crate::{CudaContext, CudaMemory, CudaStream};
use memgov_backend::{lock, BackendError, RetireSignal};
use memgov_stream_ordered::table::Context as _;
use memgov_stream_ordered::teardown::LOST_DRAIN;
use memgov_stream_ordered::{retire, stream};
use std::sync::Arc;

pub(crate) use retire::Releases;

impl CudaContext {
    /// `free_async` of memory in the arena.
    #[allow(clippy::result_large_err)]
    pub(crate) fn arena_free_async(
        &self,
        arena: &Arc<Arena>,
        stream: &CudaStream,
        memory: CudaMemory,
        signal: RetireSignal,
    ) -> Result<(), Refused> {
        let s = &*self.parts.shared;
        let (_live, _current, memory, signal) =
            s.begin_free(stream, memory, signal, "arena allocation")?;
        // SAFETY: the stream is a live stream of this context (checked);
        // the context is current; the memory left the live set.
        unsafe {
            retire::queue_release(s, arena, stream.raw(), signal, memory.bytes, memory.device)
        };
        Ok(())
    }

    /// The arena's part of teardown, before the context's own: wait for
    /// every stream (so every queued release has retired), forget what a
    /// forced retire left, unmap and release every granule and free the
    /// reservation. On a dead device nothing is called: the memory goes with
    /// the device. A context declared lost whose driver answers is polled
    /// (`cuStreamQuery`, at most 5 s) instead of synchronized.
    pub(crate) fn arena_teardown(
        &self,
        arena: &Arc<Arena>,
        lost: bool,
    ) -> Result<(), BackendError> {
        let s = &*self.parts.shared;
        let leftover: Vec<u64> = {
            let mut live = lock(&s.live);
            let ids: Vec<u64> = live
                .iter()
                .filter(|(_, l)| l.host == 0 && arena.contains(l.ptr))
                .map(|(&id, _)| id)
                .collect();
            ids.iter()
                .filter_map(|id| live.remove(id))
                .map(|l| l.bytes)
                .collect()
        };
        for bytes in leftover {
            s.probe().freed(bytes);
        }
        let lost = lost || s.is_lost();
        if s.shell.is_dead() {
            retire::abandon_all(&arena.releases, s.probe());
            return Ok(());
        }
        let current = s.make_current("teardown")?;
        if let Err(e) = stream::quiesce(s, "teardown", lost.then_some(LOST_DRAIN)) {
            retire::abandon_all(&arena.releases, s.probe());
            return Err(e);
        }
        // Every host function queued before has run; any signal still here
        // was launched on no stream that exists (cannot happen) or lost.
        retire::abandon_all(&arena.releases, s.probe());
        let r = arena.teardown(s);
        drop(current);
        r
    }
}
