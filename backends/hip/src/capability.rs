//! The HIP backend's implementations of memgov-backend's capability traits
//! ([`memgov_backend::capability`]): each method is the inherent one of the
//! same name, so that the conformance cases written over the traits test
//! exactly what a caller of the HIP types gets.

use crate::capture::{CaptureBuffer, OutputSlot};
use crate::{HipArena, HipCapture, HipContext, HipGraph, HipMemory, HipStream};
use memgov_backend::capability::{
    ArenaBackend, ArenaUsage, CaptureBackend, CaptureConfig, CapturedGraph, PoolCapture,
    PoolExhausted, SleepReport, SleepWake, VirtualArena,
};
use memgov_backend::BackendError;

impl VirtualArena for HipArena {
    fn usage(&self) -> ArenaUsage {
        let s = HipArena::snapshot(self);
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
        HipArena::trim(self)
    }

    fn set_limit(&self, bytes: u64) {
        HipArena::set_limit(self, bytes);
    }
}

impl SleepWake for HipArena {
    fn sleep(&self, keep_contents: bool) -> Result<SleepReport, BackendError> {
        HipArena::sleep(self, keep_contents)
    }

    fn wake(&self) -> Result<u64, BackendError> {
        HipArena::wake(self)
    }

    fn sleep_ranges(&self, ptrs: &[u64], keep_contents: bool) -> Result<SleepReport, BackendError> {
        HipArena::sleep_ranges(self, ptrs, keep_contents)
    }

    fn wake_ranges(&self, ptrs: &[u64]) -> Result<u64, BackendError> {
        HipArena::wake_ranges(self, ptrs)
    }
}

impl ArenaBackend for HipContext {
    type Arena = HipArena;

    fn arena(&self) -> Option<HipArena> {
        HipContext::arena(self)
    }

    fn device_address(&self, memory: &HipMemory) -> u64 {
        memory.device_ptr() as u64
    }
}

impl CaptureBackend for HipContext {
    type Capture<'a> = HipCapture<'a>;
    type Graph = HipGraph;

    fn begin_capture<'a>(
        &'a self,
        stream: &HipStream,
        config: CaptureConfig,
    ) -> Result<HipCapture<'a>, BackendError> {
        HipContext::begin_capture(self, stream, config)
    }
}

impl PoolCapture for HipCapture<'_> {
    type Buffer = CaptureBuffer;
    type Graph = HipGraph;

    fn id(&self) -> u64 {
        HipCapture::id(self)
    }

    fn pool_free(&self) -> u64 {
        HipCapture::pool_free(self)
    }

    fn allocate(&mut self, bytes: u64) -> Result<CaptureBuffer, PoolExhausted> {
        HipCapture::allocate(self, bytes)
    }

    fn upload(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), BackendError> {
        HipCapture::upload(self, buf, offset, data)
    }

    fn download(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        len: usize,
    ) -> Result<OutputSlot, BackendError> {
        HipCapture::download(self, buf, offset, len)
    }

    fn end(self) -> Result<HipGraph, BackendError> {
        HipCapture::end(self)
    }
}

impl CapturedGraph for HipGraph {
    type Stream = HipStream;
    type Slot = OutputSlot;

    fn launch(&self, stream: &HipStream) -> Result<(), BackendError> {
        HipGraph::launch(self, stream)
    }

    fn read_output(&mut self, slot: OutputSlot) -> Result<Vec<u8>, BackendError> {
        HipGraph::read_output(self, slot)
    }

    fn pool_usage(&self) -> (u64, u64) {
        HipGraph::pool_usage(self)
    }

    fn destroy(self) -> Result<(), BackendError> {
        HipGraph::destroy(self)
    }
}
