//! Stream-ordered release of arena memory, and the arena's part of device
//! loss and teardown.
//!
//! A release queues a stream callback (`hipStreamAddCallback`) on the
//! releasing stream; when it runs, the stream has passed the memory's last
//! use (and, through `order_after`, so has every other stream that used
//! it), and the callback gives the range back to the arena and fires the
//! [`RetireSignal`]. It makes no HIP call (the runtime forbids it):
//! unmapping is left to trim, sleep and teardown, which run on a caller's
//! thread. As for the pool's frees (`retire.rs`), the callback's user data
//! is a number, a ticket that the core's process-wide table routes to its
//! arena ([`memgov_stream_ordered::retire`]), and the signal waits in the
//! arena's table under it, so that device loss can take it (unfired) and a
//! runtime that drops callbacks leaks nothing.

use super::Arena;
use crate::memory::{HipMemory, Origin};
use crate::stream::HipStream;
use crate::HipContext;
use memgov_backend::{lock, BackendError, RetireSignal};
use memgov_stream_ordered::retire;
use memgov_stream_ordered::table::Context as _;
use std::sync::Arc;

pub(crate) use retire::Releases;

impl HipContext {
    /// `free_async` of memory in the arena.
    #[allow(clippy::result_large_err)]
    pub(crate) fn arena_free_async(
        &self,
        arena: &Arc<Arena>,
        stream: &HipStream,
        memory: HipMemory,
        signal: RetireSignal,
    ) -> Result<(), (HipMemory, RetireSignal, BackendError)> {
        let s = &*self.parts.shared;
        let what = format_args!("arena allocation {:#x} ({} B)", memory.own(), memory.bytes);
        let taken = retire::begin_free(s, stream, memory.context, what, || {
            lock(&s.live).remove(&memory.own())
        });
        if let Err(e) = taken {
            return Err((memory, signal, e));
        }
        let device = match s.make_current("free_async") {
            Ok(d) => d,
            Err(e) => {
                lock(&s.live).insert(memory.own(), (memory.bytes, Origin::Arena));
                return Err((memory, signal, e));
            }
        };
        let at = memory.device;
        // SAFETY: the stream is live; the device is current; the memory left
        // the live set.
        unsafe { retire::queue_release(s, arena, stream.raw(), signal, memory.bytes, at) };
        drop(device);
        Ok(())
    }
}
