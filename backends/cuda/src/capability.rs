//! The CUDA backend's implementations of memgov-backend's capability traits
//! ([`memgov_backend::capability`]): each method is the inherent one of the
//! same name, so that the conformance cases written over the traits test
//! exactly what a caller of the CUDA types gets.

use crate::{CudaArena, CudaCapture, CudaContext, CudaGraph, CudaMemory, CudaStream};

memgov_backend::impl_capabilities! {
    handles_implemented,
    arena: CudaArena,
    context: CudaContext,
    memory: CudaMemory => |memory| memory.device_ptr(),
    capture: CudaCapture,
    graph: CudaGraph,
    stream: CudaStream,
}
