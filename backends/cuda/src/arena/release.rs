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
use memgov_backend::RetireSignal;
use memgov_stream_ordered::retire;
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
}
