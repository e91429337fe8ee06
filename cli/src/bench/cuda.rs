//! The CUDA bench row: a governed allocate + stream-ordered free cycle
//! against the raw cudarc cycle (`cuMemAllocAsync` / `cuMemFreeAsync`) on the
//! same kind of stream of the same primary context. Target on a GPU: a ratio
//! of at most 1.05.
//!
//! Self-contained: uses only memgov's public API and cudarc, so the `memgov`
//! binary and `benches/cuda_cycle.rs` share it. On memgov's stand-in driver
//! the figures measure the stand-in's host threads, not a GPU: callers label
//! them with [`stand_in`].

use cudarc::driver::sys;
use memgov::cuda::{CudaConfig, CudaContext};
use memgov::{
    Alloc, BackendError, BackendErrorKind, ContextConfig, ContextHandle, DeviceContext, Execution,
    GovernedStream, Governor, Role,
};

/// Bytes allocated by each cycle.
pub const CYCLE_BYTES: u64 = 64 << 10;

/// Both sides synchronize their stream every this many cycles, so that
/// neither queues unbounded work on the device.
const SYNC_EVERY: u32 = 256;

fn gov_err(e: impl std::fmt::Display) -> BackendError {
    super::cycle::governed_error("cuda", e)
}

fn fail(op: &'static str, call: &str, r: sys::CUresult) -> BackendError {
    BackendError::new(
        "cuda",
        op,
        BackendErrorKind::Other,
        format!("{call} returned {r:?} ({})", r as i32),
    )
    .with_code(i64::from(r as i32))
}

fn check(op: &'static str, call: &str, r: sys::CUresult) -> Result<(), BackendError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(fail(op, call, r))
    }
}

/// Whether the driver the loader finds is memgov's stand-in (so figures are
/// stand-in figures, not GPU figures).
pub fn stand_in() -> Result<bool, BackendError> {
    let ctx = CudaContext::new(CudaConfig::default())?;
    let stand_in = ctx.describe().execution == Execution::StandIn;
    ctx.teardown(false)?;
    Ok(stand_in)
}

/// One governed cycle after another on one governed stream.
struct GovernedCycle {
    _gov: Governor<CudaContext>,
    ctx: ContextHandle<CudaContext>,
    stream: Option<GovernedStream<CudaContext>>,
    n: u32,
}

impl GovernedCycle {
    fn new() -> Result<Self, BackendError> {
        let backend = CudaContext::new(CudaConfig::default())?;
        let gov = Governor::new();
        let ctx = gov.register(backend, ContextConfig::new().label("bench"));
        let stream = ctx.create_stream("bench").map_err(gov_err)?;
        Ok(Self {
            _gov: gov,
            ctx,
            stream: Some(stream),
            n: 0,
        })
    }

    fn cycle(&mut self) -> Result<(), BackendError> {
        let s = self.stream.as_ref().expect("stream until finish");
        let buf = self
            .ctx
            .allocate(s, Alloc::new(CYCLE_BYTES, Role::Activation))
            .map_err(gov_err)?;
        drop(buf); // stream-ordered free, retired by a host function
        self.n += 1;
        if self.n % SYNC_EVERY == 0 {
            s.synchronize().map_err(gov_err)?;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<(), BackendError> {
        super::cycle::retire("cuda", &self.ctx, self.stream.take())
    }
}

/// The same cycle in raw cudarc: the device's primary context, a
/// non-blocking stream, `cuMemAllocAsync` + `cuMemFreeAsync`.
struct RawCycle {
    device: sys::CUdevice,
    context: sys::CUcontext,
    stream: sys::CUstream,
    n: u32,
}

impl RawCycle {
    /// Call only after a `CudaContext` was created (the driver and every
    /// symbol used here are then known to be present).
    fn new() -> Result<Self, BackendError> {
        let mut device = 0;
        let mut context = std::ptr::null_mut();
        let mut stream = std::ptr::null_mut();
        // SAFETY: the driver is loaded and initialised (a CudaContext was
        // created first); valid out pointers; device 0 exists.
        unsafe {
            check("bench", "cuDeviceGet", sys::cuDeviceGet(&mut device, 0))?;
            check(
                "bench",
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut context, device),
            )?;
            // Pushed, and popped in `finish`: the thread gets back the
            // context it had, and the release below leaves none dangling.
            check(
                "bench",
                "cuCtxPushCurrent_v2",
                sys::cuCtxPushCurrent_v2(context),
            )?;
            check(
                "bench",
                "cuStreamCreate",
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
            )?;
        }
        Ok(Self {
            device,
            context,
            stream,
            n: 0,
        })
    }

    fn cycle(&mut self) -> Result<(), BackendError> {
        let mut ptr = 0;
        // SAFETY: the context is current on this thread (set in `new`, and
        // the bench runs on one thread); the stream is live; the pointer is
        // freed once, right after it was allocated.
        unsafe {
            check(
                "bench",
                "cuCtxSetCurrent",
                sys::cuCtxSetCurrent(self.context),
            )?;
            check(
                "bench",
                "cuMemAllocAsync",
                sys::cuMemAllocAsync(&mut ptr, CYCLE_BYTES as usize, self.stream),
            )?;
            check(
                "bench",
                "cuMemFreeAsync",
                sys::cuMemFreeAsync(ptr, self.stream),
            )?;
        }
        self.n += 1;
        if self.n % SYNC_EVERY == 0 {
            // SAFETY: the live stream of the current context.
            check("bench", "cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(self.stream)
            })?;
        }
        Ok(())
    }

    fn finish(self) -> Result<(), BackendError> {
        // SAFETY: the stream and context reference created in `new`, each
        // released once, after the stream's work has completed; the pop
        // balances the push in `new` on this (the bench's only) thread.
        unsafe {
            check(
                "bench",
                "cuCtxSetCurrent",
                sys::cuCtxSetCurrent(self.context),
            )?;
            check(
                "bench",
                "cuStreamSynchronize",
                sys::cuStreamSynchronize(self.stream),
            )?;
            check(
                "bench",
                "cuStreamDestroy_v2",
                sys::cuStreamDestroy_v2(self.stream),
            )?;
            let mut popped = std::ptr::null_mut();
            check(
                "bench",
                "cuCtxPopCurrent_v2",
                sys::cuCtxPopCurrent_v2(&mut popped),
            )?;
            check(
                "bench",
                "cuDevicePrimaryCtxRelease_v2",
                sys::cuDevicePrimaryCtxRelease_v2(self.device),
            )
        }
    }
}

/// Run `iterations` governed cycles and `iterations` raw cycles (after a
/// warm-up of each), interleaved in rounds, and return nanoseconds per cycle:
/// `(governed, raw)`. `Unavailable` when there is no CUDA driver.
pub fn cycle_ratio(iterations: u32) -> Result<(u64, u64), BackendError> {
    let mut pair = (GovernedCycle::new()?, RawCycle::new()?);
    let ns = super::cycle::interleaved(iterations, &mut pair, |p| p.0.cycle(), |p| p.1.cycle())?;
    let (g, r) = pair;
    r.finish()?;
    g.finish()?;
    Ok(ns)
}
