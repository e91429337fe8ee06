//! The context half of CUDA's table for the core: the core's [`Context`]
//! and [`StreamContext`] on CUDA's shared state (its primary context pushed
//! around the calls, its lost state and what a sticky code abandons, its
//! streams, the properties its granules are created with, the capture
//! gate). The entry points themselves are the other half ([`crate::table`]);
//! the steps over them (the arena's, the streams', the copies') are the
//! core's ([`memgov_stream_ordered`]).

use crate::result::Cuda;
use crate::shared::Shared;
use crate::table::prop;
use cudarc::driver::sys::{self, CUstream};
use memgov_backend::vmm::Gate;
use memgov_backend::BackendError;
use memgov_stream_ordered::state::State;
use memgov_stream_ordered::stream::StreamContext;
use memgov_stream_ordered::table::{Context, VmmTable};

/// The arena's calls run with the context's primary context pushed (the
/// shell's [`MakeCurrent`](memgov_backend::shell::MakeCurrent) for CUDA).
impl Context for Shared {
    type Table = Cuda;
    type Stream = crate::CudaStream;
    type Arena = crate::arena::Arena;

    fn on_sticky(&self) {
        self.abandon_pending();
    }

    fn capture_gate(&self) -> &'static Gate {
        crate::shared::gate()
    }

    fn granule_prop(arena: &crate::arena::Arena) -> sys::CUmemAllocationProp {
        prop(arena.ordinal)
    }

    fn raw_stream(
        &self,
        op: &'static str,
        stream: &crate::CudaStream,
    ) -> Result<<Cuda as VmmTable>::Stream, BackendError> {
        // The registry's check returns the handle it checked.
        memgov_stream_ordered::stream::check(self, op, stream)
    }

    fn state(&self) -> &State<Cuda, CUstream> {
        &self.state
    }

    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        memgov_stream_ordered::stream::quiesce(self, op, None)
    }

    /// `cuCtxSynchronize`: every launch of the context finished (the
    /// context current, the call admitted by the capture gate).
    fn wait_launches(&self, op: &'static str) -> Result<(), BackendError> {
        // SAFETY: the context is current (the caller's guard).
        let r = unsafe { sys::cuCtxSynchronize() };
        self.checked(op, "cuCtxSynchronize", r)
    }
}

/// The context's streams are the core's (its [`State`]'s registry).
impl StreamContext for Shared {
    fn wrap(stream: memgov_stream_ordered::stream::Stream<CUstream>) -> crate::CudaStream {
        crate::CudaStream(stream)
    }
}
