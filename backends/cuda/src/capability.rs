//! The CUDA backend's implementations of memgov-backend's capability traits
//! ([`memgov_backend::capability`]): each method is the inherent one of the
//! same name, so that the conformance cases written over the traits test
//! exactly what a caller of the CUDA types gets.

use crate::capture::{CaptureBuffer, OutputSlot};
use crate::{CudaArena, CudaCapture, CudaContext, CudaGraph, CudaMemory, CudaStream};
use memgov_backend::capability::{
    ArenaBackend, ArenaUsage, CaptureBackend, CaptureConfig, CapturedGraph, PoolCapture,
    PoolExhausted, SleepReport, SleepWake, VirtualArena,
};
use memgov_backend::BackendError;

impl VirtualArena for CudaArena {
    fn usage(&self) -> ArenaUsage {
        let s = CudaArena::snapshot(self);
        ArenaUsage {
            reserved: s.reserved,
            mapped: s.mapped,
            in_use: s.in_use,
            cached: s.cached,
            asleep: s.asleep,
            granule: s.granule,
            quarantined: s.quarantined.len(),
        }
    }

    fn trim(&self) -> Result<u64, BackendError> {
        CudaArena::trim(self)
    }

    fn set_limit(&self, bytes: u64) {
        CudaArena::set_limit(self, bytes);
    }
}

impl SleepWake for CudaArena {
    fn sleep(&self, keep_contents: bool) -> Result<SleepReport, BackendError> {
        CudaArena::sleep(self, keep_contents)
    }

    fn wake(&self) -> Result<u64, BackendError> {
        CudaArena::wake(self)
    }

    fn sleep_ranges(&self, ptrs: &[u64], keep_contents: bool) -> Result<SleepReport, BackendError> {
        CudaArena::sleep_ranges(self, ptrs, keep_contents)
    }

    fn wake_ranges(&self, ptrs: &[u64]) -> Result<u64, BackendError> {
        CudaArena::wake_ranges(self, ptrs)
    }
}

impl ArenaBackend for CudaContext {
    type Arena = CudaArena;

    fn arena(&self) -> Option<CudaArena> {
        CudaContext::arena(self)
    }

    fn device_address(&self, memory: &CudaMemory) -> u64 {
        memory.device_ptr()
    }
}

impl CaptureBackend for CudaContext {
    type Capture<'a> = CudaCapture<'a>;
    type Graph = CudaGraph;

    fn begin_capture<'a>(
        &'a self,
        stream: &CudaStream,
        config: CaptureConfig,
    ) -> Result<CudaCapture<'a>, BackendError> {
        CudaContext::begin_capture(self, stream, config)
    }
}

impl PoolCapture for CudaCapture<'_> {
    type Buffer = CaptureBuffer;
    type Graph = CudaGraph;

    fn id(&self) -> u64 {
        CudaCapture::id(self)
    }

    fn pool_free(&self) -> u64 {
        CudaCapture::pool_free(self)
    }

    fn allocate(&mut self, bytes: u64) -> Result<CaptureBuffer, PoolExhausted> {
        CudaCapture::allocate(self, bytes)
    }

    fn upload(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), BackendError> {
        CudaCapture::upload(self, buf, offset, data)
    }

    fn download(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        len: usize,
    ) -> Result<OutputSlot, BackendError> {
        CudaCapture::download(self, buf, offset, len)
    }

    fn end(self) -> Result<CudaGraph, BackendError> {
        CudaCapture::end(self)
    }
}

impl CapturedGraph for CudaGraph {
    type Stream = CudaStream;
    type Slot = OutputSlot;

    fn launch(&self, stream: &CudaStream) -> Result<(), BackendError> {
        CudaGraph::launch(self, stream)
    }

    fn read_output(&mut self, slot: OutputSlot) -> Result<Vec<u8>, BackendError> {
        CudaGraph::read_output(self, slot)
    }

    fn pool_usage(&self) -> (u64, u64) {
        CudaGraph::pool_usage(self)
    }

    fn destroy(self) -> Result<(), BackendError> {
        CudaGraph::destroy(self)
    }
}
