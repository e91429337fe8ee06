//! The HIP bench row: a governed allocate + stream-ordered free cycle against
//! raw `hipMallocAsync` / `hipFreeAsync` on the same stream.
//!
//! Self-contained (memgov's public API only; the raw side calls the HIP
//! runtime through the table the backend loaded) so that both
//! `memgov bench` and `benches/hip_cycle.rs` include it. On the stand-in
//! library the figure measures the governor's bookkeeping against the
//! stand-in's queue, not an AMD GPU: callers label it as a stand-in figure.
//! The `memgov` binary calls only [`cycle_ratio`]; the criterion bench uses
//! the rest.

#![allow(dead_code)]

use memgov::hip::raw::{self, hipFreeAsync, hipMallocAsync, hipStreamSynchronize, hipStream_t};
use memgov::hip::{HipConfig, HipContext};
use memgov::{
    Alloc, BackendError, ContextConfig, ContextHandle, Execution, GovernedStream, Governor, Role,
};
use std::ffi::c_void;

/// Bytes allocated per cycle.
pub const CYCLE_BYTES: u64 = 64 << 10;

fn gov_err(e: impl std::fmt::Display) -> BackendError {
    super::cycle::governed_error("hip", e)
}

/// One governor, one HIP context, one stream; both sides run on that stream.
pub struct Cycles {
    _gov: Governor<HipContext>,
    ctx: ContextHandle<HipContext>,
    stream: Option<GovernedStream<HipContext>>,
    raw: RawStream,
}

struct RawStream(hipStream_t);

impl Cycles {
    /// Open the device, register it and create the stream.
    pub fn new() -> Result<Self, BackendError> {
        let gov = Governor::new();
        let ctx = gov.register(
            HipContext::new(HipConfig::default())?,
            ContextConfig::new().label("bench-hip"),
        );
        let stream = ctx.create_stream("bench").map_err(gov_err)?;
        let raw = RawStream(
            stream
                .raw()
                .ok_or_else(|| gov_err("the new stream has no raw handle"))?
                .hip_stream(),
        );
        Ok(Self {
            _gov: gov,
            ctx,
            stream: Some(stream),
            raw,
        })
    }

    /// How the context ran (a stand-in figure is labelled as one).
    pub fn execution(&self) -> Execution {
        self.ctx.description().execution
    }

    /// One governed cycle: allocate, then drop (a stream-ordered free).
    pub fn governed(&mut self) -> Result<(), BackendError> {
        let stream = self.stream.as_ref().expect("stream until finish");
        let buf = self
            .ctx
            .allocate(stream, Alloc::new(CYCLE_BYTES, Role::Workspace))
            .map_err(gov_err)?;
        drop(buf);
        Ok(())
    }

    /// One raw cycle: `hipMallocAsync` then `hipFreeAsync` on the same stream.
    pub fn raw(&mut self) -> Result<(), BackendError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the stream is the governed stream's,
        // alive until `finish` (the governed stream is dropped there).
        let r = unsafe { hipMallocAsync(&mut p, CYCLE_BYTES as usize, self.raw.0) };
        raw::check("bench", "hipMallocAsync", r)?;
        // SAFETY: `p` came from hipMallocAsync just above; nothing uses it.
        let r = unsafe { hipFreeAsync(p, self.raw.0) };
        raw::check("bench", "hipFreeAsync", r)
    }

    /// Synchronize, retire the context and tear it down.
    pub fn finish(mut self) -> Result<(), BackendError> {
        // SAFETY: the stream is alive (the governed stream still exists).
        let r = unsafe { hipStreamSynchronize(self.raw.0) };
        raw::check("bench", "hipStreamSynchronize", r)?;
        super::cycle::retire("hip", &self.ctx, self.stream.take())
    }
}

/// Run `iterations` governed and `iterations` raw cycles (after a warm-up of
/// each), interleaved in rounds, and return nanoseconds per cycle:
/// `(governed, raw)`.
pub fn cycle_ratio(iterations: u32) -> Result<(u64, u64), BackendError> {
    let mut c = Cycles::new()?;
    let ns = super::cycle::interleaved(iterations, &mut c, Cycles::governed, Cycles::raw)?;
    c.finish()?;
    Ok(ns)
}
