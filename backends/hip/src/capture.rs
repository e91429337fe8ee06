//! Graph capture on a context's arena: a capture pool mapped before
//! `hipStreamBeginCapture`, carved by the allocations made during capture,
//! pinned by the graph until it is destroyed; and the process-wide gate
//! that keeps memgov's own HIP calls from invalidating a capture.
//!
//! The capture's and the graph's logic is the stream-ordered core's
//! ([`memgov_stream_ordered::capture`], over HIP's [`CaptureTable`] below);
//! this module is HIP's table of capture calls, its public types wrapping
//! the core's, and the check that the loaded runtime has the calls.
//! Invariants, each enforced where it is written:
//!
//! * **No runtime allocation during capture.** The pool is taken from the
//!   arena (mapping its granules) in [`HipContext::begin_capture`], before
//!   the stream begins capturing; [`HipCapture::allocate`] only carves it,
//!   in Rust, and refuses with [`PoolExhausted`] (the capture stays valid)
//!   when it runs out.
//! * **The gate** ([`memgov_backend::vmm::Gate`], one for HIP): the
//!   capture mode ("controls the interaction of this capture sequence with
//!   other API calls that are not safe") prohibits calls that change memory
//!   outside any stream while a `hipStreamCaptureModeGlobal` capture is
//!   under way, and such a call invalidates the capture. The arena's map,
//!   unmap and release pass through the gate and wait until the last
//!   capture ends; a public [`HipArena::trim`](crate::HipArena::trim) is
//!   deferred instead (it returns 0 at once and the last capture's end runs
//!   it); synchronizing or destroying a capturing stream is refused to its
//!   own thread and waited for on others. Captures are keyed by their id
//!   (`hipStreamGetCaptureInfo`), not by thread. A capture leaves the gate
//!   when the runtime's capture is over, not when `end` is called: an end
//!   that fails with the stream still capturing (or before it reached the
//!   runtime) keeps it there, and the context's teardown ends it.
//! * **Pins.** A [`HipGraph`] owns its pool and the host buffers its copies
//!   read and write. [`HipGraph::destroy`] waits for every stream of the
//!   context (so every launch finished), destroys the executable graph and
//!   the graph, and only then returns the pool to the arena. Teardown
//!   destroys the graphs still live and reports how many.
//! * **Where ROCm lacks the calls**, [`HipContext::begin_capture`] answers
//!   `Unsupported`, naming the first one missing.

use crate::arena::Arena;
use crate::ffi::{self, hipGraphExec_t, hipGraph_t, hipStream_t, HipResult};
use crate::result::{err, Hip};
use crate::shared::Shared;
use crate::{HipContext, HipStream};
use memgov_backend::vmm::{CapturePool, Gate, ALIGN};
use memgov_backend::{BackendError, BackendErrorKind};
use memgov_stream_ordered::capture::{CaptureCore, GraphCore};
use memgov_stream_ordered::table::{CaptureNames, CaptureTable};
use std::marker::PhantomData;
use std::sync::OnceLock;

/// The HIP runtime's gate: process-wide, as the runtime's rule is.
pub(crate) fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate::new(crate::result::BACKEND, "HipCapture"))
}

/// The process-wide gate between HIP stream captures begun through memgov
/// and memgov's own potentially unsafe runtime calls (map, unmap, release,
/// device synchronize, `hipHostMalloc`, `hipHostFree`, `hipFree`). A
/// runtime that makes such calls itself beside memgov's captures can pass
/// them through it ([`Gate::call`]); [`Gate::waiting`] shows calls held
/// back by a capture.
pub fn capture_gate() -> &'static Gate {
    gate()
}

pub use memgov_backend::capability::{CaptureConfig, CaptureMode, PoolExhausted};

/// Device memory carved from a capture pool: valid while the graph made by
/// the capture lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureBuffer {
    ptr: u64,
    bytes: u64,
}

impl CaptureBuffer {
    /// Its device address.
    pub fn device_ptr(&self) -> ffi::hipDeviceptr_t {
        self.ptr as ffi::hipDeviceptr_t
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// Whether it is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

/// A host buffer a captured download writes into, read with
/// [`HipGraph::read_output`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputSlot(usize);

// ---- HIP's table of capture calls ----------------------------------------

/// The loaded runtime's functions under the core's names.
impl CaptureTable for Hip {
    type Graph = hipGraph_t;
    type Exec = hipGraphExec_t;

    const CAPTURE_NAMES: CaptureNames = CaptureNames {
        begin_capture: "hipStreamBeginCapture",
        capture_id: "hipStreamGetCaptureInfo",
        end_capture: "hipStreamEndCapture",
        instantiate: "hipGraphInstantiate",
        exec_destroy: "hipGraphExecDestroy",
        graph_destroy: "hipGraphDestroy",
        launch: "hipGraphLaunch",
    };

    unsafe fn begin_capture(stream: hipStream_t, mode: CaptureMode) -> HipResult {
        let mode = match mode {
            CaptureMode::Global => ffi::hipStreamCaptureModeGlobal,
            CaptureMode::ThreadLocal => ffi::hipStreamCaptureModeThreadLocal,
            CaptureMode::Relaxed => ffi::hipStreamCaptureModeRelaxed,
        };
        // SAFETY: the caller's contract (a live stream, its device current).
        unsafe { ffi::hipStreamBeginCapture(stream, mode) }
    }

    unsafe fn capture_id(stream: hipStream_t) -> (HipResult, u64) {
        let (mut status, mut id) = (0i32, 0u64);
        // SAFETY: valid out pointers; a live stream (the caller's contract).
        let r = unsafe { ffi::hipStreamGetCaptureInfo(stream, &mut status, &mut id) };
        (r, id)
    }

    unsafe fn end_capture(stream: hipStream_t) -> (HipResult, Option<hipGraph_t>) {
        let mut graph: hipGraph_t = std::ptr::null_mut();
        // SAFETY: valid out pointer; a live stream (the caller's contract).
        let r = unsafe { ffi::hipStreamEndCapture(stream, &mut graph) };
        (r, (!graph.is_null()).then_some(graph))
    }

    unsafe fn still_capturing(stream: hipStream_t) -> bool {
        let (mut status, mut id) = (0, 0u64);
        // SAFETY: a live stream of this context; valid out pointers.
        let r = unsafe { ffi::hipStreamGetCaptureInfo(stream, &mut status, &mut id) };
        r != ffi::SUCCESS || status != ffi::hipStreamCaptureStatusNone
    }

    unsafe fn instantiate(graph: hipGraph_t) -> (HipResult, hipGraphExec_t) {
        let mut exec: hipGraphExec_t = std::ptr::null_mut();
        // SAFETY: a live graph (the caller's contract); valid out pointer;
        // no error node or log asked for.
        let r = unsafe {
            ffi::hipGraphInstantiate(
                &mut exec,
                graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        (r, exec)
    }

    unsafe fn exec_destroy(exec: hipGraphExec_t) -> HipResult {
        // SAFETY: the caller's contract (destroyed once, after its launches).
        unsafe { ffi::hipGraphExecDestroy(exec) }
    }

    unsafe fn graph_destroy(graph: hipGraph_t) -> HipResult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { ffi::hipGraphDestroy(graph) }
    }

    unsafe fn launch(exec: hipGraphExec_t, stream: hipStream_t) -> HipResult {
        // SAFETY: the caller's contract (both live).
        unsafe { ffi::hipGraphLaunch(exec, stream) }
    }

    fn stream_key(stream: hipStream_t) -> usize {
        stream as usize
    }
}

/// The executable graphs of a context still live, and the captures a
/// failed end left under way (the core's).
pub(crate) type Pins = memgov_stream_ordered::capture::Pins<Hip>;

// ---- capture -------------------------------------------------------------

/// A stream capture under way ([`HipContext::begin_capture`]): allocations
/// carved from its pool and copies recorded on its stream, then
/// [`end`](Self::end) makes the graph.
///
/// ```no_run
/// use memgov::hip::{ArenaConfig, CaptureConfig, CaptureMode, HipConfig, HipContext};
/// use memgov::DeviceContext;
/// let ctx = HipContext::new(HipConfig { arena: Some(ArenaConfig::default()), ..HipConfig::default() })?;
/// let s = ctx.create_stream()?;
/// let mut capture = ctx.begin_capture(&s, CaptureConfig { pool_bytes: 1 << 20, mode: CaptureMode::Global })?;
/// let buf = capture.allocate(4096)?; // carved, no runtime call
/// capture.upload(&buf, 0, vec![7; 4096])?;
/// let out = capture.download(&buf, 0, 4096)?;
/// let mut graph = capture.end()?;
/// graph.launch(&s)?;
/// assert_eq!(graph.read_output(out)?, vec![7; 4096]);
/// graph.destroy()?;
/// ctx.destroy_stream(s)?;
/// ctx.teardown(false)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct HipCapture<'a> {
    core: CaptureCore<Shared>,
    _ctx: PhantomData<&'a HipContext>,
}

impl std::fmt::Debug for HipCapture<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (pool, used) = self.core.pool_usage();
        f.debug_struct("HipCapture")
            .field("id", &self.core.id())
            .field("pool", &pool)
            .field("used", &used)
            .finish()
    }
}

/// `Ok` when the loaded HIP runtime has every call a capture needs;
/// otherwise `Unavailable` (no runtime) or `Unsupported`, naming the first
/// call missing. A capture also needs a context with an arena.
pub fn capture_supported() -> Result<(), BackendError> {
    if let Some(why) = ffi::runtime_missing() {
        return Err(err("begin_capture", BackendErrorKind::Unavailable, why));
    }
    match ffi::missing(&ffi::CAPTURE_SYMBOLS) {
        None => Ok(()),
        Some(symbol) => Err(err(
            "begin_capture",
            BackendErrorKind::Unsupported,
            format!(
                "a stream capture needs {symbol}, which the loaded HIP runtime does not export \
                 (ROCm 4.3 or newer has HIP's graph calls)"
            ),
        )),
    }
}

impl HipContext {
    /// The size of the pool [`begin_capture`](Self::begin_capture) takes for
    /// `pool_bytes`: at least 1, rounded up to 256 bytes, checked
    /// (`PoolTooLarge`, an `InvalidArgument`, when that passes `u64::MAX`).
    pub fn capture_pool_bytes(pool_bytes: u64) -> Result<u64, BackendError> {
        Ok(CapturePool::size_for(
            crate::result::BACKEND,
            pool_bytes,
            ALIGN,
        )?)
    }

    /// Begin capturing `stream` into a graph, with a pool of
    /// `config.pool_bytes` taken from the context's arena first (mapped
    /// now, so nothing maps during the capture). Needs an arena
    /// ([`HipConfig::arena`](crate::HipConfig::arena)) and a runtime with
    /// the capture calls (`Unsupported` otherwise, naming what is missing).
    ///
    /// Waits for memgov's maps and unmaps under way to finish; while the
    /// capture is under way, later ones wait for it to end.
    pub fn begin_capture(
        &self,
        stream: &HipStream,
        config: CaptureConfig,
    ) -> Result<HipCapture<'_>, BackendError> {
        const OP: &str = "begin_capture";
        let s = &*self.shared;
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        capture_supported()?;
        let core = CaptureCore::begin(
            self.shared.clone(),
            self.arena.clone(),
            self.pins.clone(),
            stream.raw.0,
            config,
            ALIGN,
            "HipConfig::arena",
            |arena, s, bytes| arena.allocate(s, bytes),
        )?;
        Ok(HipCapture {
            core,
            _ctx: PhantomData,
        })
    }

    /// The context's part of teardown for its graphs (before the arena's):
    /// destroy the live ones after their launches, and say how many there
    /// were; on a lost context forget them.
    pub(crate) fn graphs_teardown(&self, arena: &Arena, lost: bool) -> Result<(), BackendError> {
        self.pins.finish(
            &*self.shared,
            Some(arena),
            lost || self.shared.is_lost(),
            "HipGraph::destroy",
        )
    }
}

impl HipCapture<'_> {
    /// The runtime's id of this capture.
    pub fn id(&self) -> u64 {
        self.core.id()
    }

    /// Bytes of the pool not carved yet.
    pub fn pool_free(&self) -> u64 {
        self.core.pool_free()
    }

    /// Carve `bytes` from the pool: no runtime call. Refused with
    /// [`PoolExhausted`] when they do not fit; the capture stays valid.
    pub fn allocate(&mut self, bytes: u64) -> Result<CaptureBuffer, PoolExhausted> {
        let ptr = self.core.allocate(bytes, ALIGN)?;
        Ok(CaptureBuffer { ptr, bytes })
    }

    /// Record a copy of `data` into `buf` at `offset`; every launch of the
    /// graph repeats it. The graph keeps `data`.
    pub fn upload(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), BackendError> {
        self.core.upload((buf.ptr, buf.bytes), offset, data)
    }

    /// Record a copy of `len` bytes of `buf` at `offset` into a host buffer
    /// the graph owns; read it after a launch with
    /// [`HipGraph::read_output`].
    pub fn download(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        len: usize,
    ) -> Result<OutputSlot, BackendError> {
        self.core
            .download((buf.ptr, buf.bytes), offset, len)
            .map(OutputSlot)
    }

    /// End the capture and instantiate its graph. The pool is pinned by the
    /// graph until [`HipGraph::destroy`] (or teardown). A capture dropped
    /// without `end` is ended and its graph discarded.
    pub fn end(self) -> Result<HipGraph, BackendError> {
        self.core.end().map(|core| HipGraph { core })
    }
}

/// An instantiated graph made by a capture: launched any number of times on
/// any stream of its context, then destroyed. It pins its pool and its host
/// buffers until then.
///
/// Dropping it destroys it as [`destroy`](Self::destroy) does; when that is
/// refused (on a thread whose own capture is under way) the graph stays
/// pinned, its host buffers kept, until teardown.
pub struct HipGraph {
    core: GraphCore<Shared>,
}

impl std::fmt::Debug for HipGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (used, pool) = self.core.pool_usage();
        f.debug_struct("HipGraph")
            .field("pool", &pool)
            .field("used", &used)
            .finish()
    }
}

impl HipGraph {
    /// Bytes of the pool the capture carved, and the pool's size.
    pub fn pool_usage(&self) -> (u64, u64) {
        self.core.pool_usage()
    }

    /// Queue one run of the graph on `stream` (`hipGraphLaunch`).
    ///
    /// Refused with `InvalidArgument` while the arena sleeps (the pool's
    /// memory is reserved, not mapped: the graph's copies would fault), as
    /// copies to sleeping memory are; wake the arena first. A sleep asked
    /// for meanwhile waits until the launch is queued, then waits for it.
    pub fn launch(&self, stream: &HipStream) -> Result<(), BackendError> {
        const OP: &str = "graph_launch";
        let s = self.core.shared();
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        self.core.launch(stream.raw.0)
    }

    /// Wait for every stream of the context (admitted by the gate) and
    /// copy out what the graph's download `slot` holds. `&mut self`: no
    /// launch of this graph can be queued meanwhile.
    pub fn read_output(&mut self, slot: OutputSlot) -> Result<Vec<u8>, BackendError> {
        self.core.read_output(slot.0)
    }

    /// Wait for every stream of the context (admitted by the gate), destroy
    /// the executable graph and the graph, and only then return the pool to
    /// the arena and free the host buffers.
    pub fn destroy(mut self) -> Result<(), BackendError> {
        self.core.destroy_now("graph_destroy")
    }

    /// [`destroy`](Self::destroy) in place: on failure the graph is kept
    /// (still pinned, its pool still taken) so that the caller can try
    /// again; once it succeeded, later calls do nothing and
    /// [`launch`](Self::launch) is refused.
    pub fn try_destroy(&mut self) -> Result<(), BackendError> {
        self.core.destroy_now("graph_destroy")
    }

    /// Whether [`try_destroy`](Self::try_destroy) (or teardown) destroyed it.
    pub fn is_destroyed(&self) -> bool {
        self.core.is_destroyed()
    }

    /// Bytes of device memory the graph's own allocation nodes take. Always
    /// 0 on HIP: memgov's capture makes no allocation nodes (its
    /// allocations carve the pool), and memgov does not read a graph's
    /// nodes on HIP, so graph memory a runtime's own `hipMallocAsync` on
    /// the capturing stream makes is not charged.
    pub fn graph_memory_bytes(&self) -> Result<u64, BackendError> {
        Ok(0)
    }
}
