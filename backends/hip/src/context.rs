//! The context half of HIP's table for the core: the core's [`Context`]
//! and [`StreamContext`] on HIP's shared state (its device set on the
//! calling thread around the calls, its lost state and the waits a sticky
//! code wakes, its streams, the properties its granules are created with in
//! the loaded runtime's layout, the capture gate). The entry points
//! themselves are the other half ([`crate::table`]); the steps over them
//! (the arena's, the streams', the copies') are the core's
//! ([`memgov_stream_ordered`]).

use crate::ffi::{self, hipStream_t};
use crate::result::Hip;
use crate::shared::Shared;
use memgov_backend::vmm::Gate;
use memgov_backend::BackendError;
use memgov_stream_ordered::state::State;
use memgov_stream_ordered::stream::StreamContext;
use memgov_stream_ordered::table::{Context, VmmTable};

/// The arena's calls run with the context's device set on the calling
/// thread (the shell's [`MakeCurrent`](memgov_backend::shell::MakeCurrent)
/// for HIP: the thread's own device set back after).
impl Context for Shared {
    type Table = Hip;
    type Stream = crate::HipStream;
    type Arena = crate::arena::Arena;

    fn on_sticky(&self) {
        self.outstanding.wake();
    }

    fn capture_gate(&self) -> &'static Gate {
        crate::shared::gate()
    }

    fn granule_prop(arena: &crate::arena::Arena) -> ffi::AllocationProp {
        ffi::allocation_prop(arena.ordinal, arena.vendor)
    }

    fn raw_stream(
        &self,
        op: &'static str,
        stream: &crate::HipStream,
    ) -> Result<<Hip as VmmTable>::Stream, BackendError> {
        // The registry's check returns the handle it checked.
        memgov_stream_ordered::stream::check(self, op, stream)
    }

    fn state(&self) -> &State<Hip, hipStream_t> {
        &self.state
    }

    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        memgov_stream_ordered::stream::quiesce(self, op, None)
    }

    /// HIP has no per-context synchronize: every stream of the context is.
    fn wait_launches(&self, op: &'static str) -> Result<(), BackendError> {
        memgov_stream_ordered::stream::quiesce(self, op, None)
    }
}

/// The context's streams are the core's (its [`State`]'s registry).
impl StreamContext for Shared {
    fn wrap(stream: memgov_stream_ordered::stream::Stream<hipStream_t>) -> crate::HipStream {
        crate::HipStream(stream)
    }
}
