//! The HIP backend's implementations of memgov-backend's capability traits
//! ([`memgov_backend::capability`]): each method is the inherent one of the
//! same name, so that the conformance cases written over the traits test
//! exactly what a caller of the HIP types gets.

use crate::{HipArena, HipCapture, HipContext, HipGraph, HipMemory, HipStream};

memgov_backend::impl_capabilities! {
    handles_implemented,
    arena: HipArena,
    context: HipContext,
    memory: HipMemory => |memory| memory.device_ptr() as u64,
    capture: HipCapture,
    graph: HipGraph,
    stream: HipStream,
}
