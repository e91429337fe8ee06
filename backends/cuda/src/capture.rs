//! Graph capture on a context's arena: a capture pool mapped and reserved
//! before `cuStreamBeginCapture_v2`, carved by the allocations made during
//! capture, pinned by the graph until it is destroyed; and the process-wide
//! gate that keeps memgov's own driver calls from invalidating a capture.
//!
//! The capture's and the graph's logic is the stream-ordered core's
//! ([`memgov_stream_ordered::capture`], over CUDA's [`CaptureTable`] below);
//! this module is CUDA's table of capture calls, its public types wrapping
//! the core's, and the count of a graph's memory nodes only CUDA reads.
//! Invariants, each enforced where it is written:
//!
//! * **No driver allocation during capture.** The pool is taken from the
//!   arena (mapping its granules) in [`CudaContext::begin_capture`], before
//!   the stream begins capturing; [`CudaCapture::allocate`] only carves it,
//!   in Rust, and refuses with [`PoolExhausted`] (the capture stays valid)
//!   when it runs out.
//! * **The gate.** The driver prohibits "potentially unsafe" calls (those
//!   that change memory outside any stream, like `cudaMalloc` in its
//!   documentation) on every thread while a capture begun in
//!   `CU_STREAM_CAPTURE_MODE_GLOBAL` is under way, and invalidates the
//!   capture. The arena's map, unmap and release pass through the gate
//!   ([`memgov_backend::vmm::Gate`], one for CUDA, shared in shape with HIP):
//!   while a capture is under way they wait until the last capture ends (a
//!   public [`CudaArena::trim`](crate::CudaArena::trim) is deferred instead:
//!   it returns 0 at once and the last capture's end runs it). Captures are
//!   keyed by their capture id (`cuStreamGetCaptureInfo_v2`), not by thread;
//!   the thread that began one is remembered only so that a map it asks for
//!   itself during its own capture is refused rather than waited on
//!   forever. The gate is process-wide because the driver's rule is. A
//!   capture leaves the gate when the driver's capture is over, not when
//!   `end` is called: an end that fails with the stream still capturing (or
//!   before it reached the driver) keeps it there, and the context's
//!   teardown ends it.
//! * **Pins.** A [`CudaGraph`] owns its pool and the host buffers its
//!   copies read and write. [`CudaGraph::destroy`] synchronizes the context
//!   (so every launch finished), destroys the executable graph and the
//!   graph, and only then returns the pool to the arena. Teardown destroys
//!   the graphs still live and reports how many.

use crate::result::Cuda;
use crate::shared::Shared;
use crate::{CudaContext, CudaStream};
use cudarc::driver::sys::{self, CUdeviceptr, CUgraph, CUgraphExec, CUresult, CUstream};
use memgov_backend::vmm::{CapturePool, Gate};
use memgov_backend::BackendError;
use memgov_stream_ordered::capture::{CaptureCore, GraphCore};
use memgov_stream_ordered::table::{CaptureNames, CaptureTable};
use std::marker::PhantomData;
use std::sync::OnceLock;

/// Allocations carved from a capture pool, and the pool itself, are
/// aligned to this, as `cuMemAlloc` aligns its allocations.
pub const CAPTURE_ALIGN: u64 = 256;
const ALIGN: u64 = CAPTURE_ALIGN;

pub use memgov_backend::capability::{CaptureConfig, CaptureMode, PoolExhausted};

/// Device memory carved from a capture pool: valid while the graph made by
/// the capture lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureBuffer {
    ptr: CUdeviceptr,
    bytes: u64,
}

impl CaptureBuffer {
    /// Its device address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
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
/// [`CudaGraph::read_output`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputSlot(usize);

// ---- the process-wide gate -----------------------------------------------

/// The CUDA driver's gate ([`memgov_backend::vmm::Gate`]): process-wide, as
/// the driver's rule is.
pub(crate) fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate::new(crate::result::BACKEND, "CudaCapture"))
}

/// The process-wide gate between CUDA stream captures begun through memgov
/// and memgov's own potentially unsafe driver calls (map, unmap, release,
/// `cuCtxSynchronize`, `cuMemHostAlloc`, `cuMemFreeHost`). A runtime that
/// makes such calls itself beside memgov's captures can pass them through
/// it ([`Gate::call`]); [`Gate::waiting`] shows calls held back by a
/// capture.
pub fn capture_gate() -> &'static Gate {
    gate()
}

// ---- CUDA's table of capture calls ---------------------------------------

/// cudarc's `sys` functions under the core's names.
impl CaptureTable for Cuda {
    type Graph = CUgraph;
    type Exec = CUgraphExec;

    const CAPTURE_NAMES: CaptureNames = CaptureNames {
        begin_capture: "cuStreamBeginCapture_v2",
        capture_id: "cuStreamGetCaptureInfo_v2",
        end_capture: "cuStreamEndCapture",
        instantiate: "cuGraphInstantiateWithFlags",
        exec_destroy: "cuGraphExecDestroy",
        graph_destroy: "cuGraphDestroy",
        launch: "cuGraphLaunch",
    };

    unsafe fn begin_capture(stream: CUstream, mode: CaptureMode) -> CUresult {
        let mode = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: the caller's contract (a live stream, its context
        // current).
        unsafe { sys::cuStreamBeginCapture_v2(stream, mode) }
    }

    unsafe fn capture_id(stream: CUstream) -> (CUresult, u64) {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: u64 = 0;
        // SAFETY: valid out pointers; the optional ones are null; a live
        // stream (the caller's contract).
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v2(
                stream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        (r, id)
    }

    unsafe fn end_capture(stream: CUstream) -> (CUresult, Option<CUgraph>) {
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: valid out pointer; a live stream (the caller's contract).
        let r = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
        (r, (!graph.is_null()).then_some(graph))
    }

    unsafe fn still_capturing(stream: CUstream) -> bool {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of the current context; valid out pointer.
        let r = unsafe { sys::cuStreamIsCapturing(stream, &mut status) };
        r != CUresult::CUDA_SUCCESS
            || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }

    unsafe fn instantiate(graph: CUgraph) -> (CUresult, CUgraphExec) {
        let mut exec: CUgraphExec = std::ptr::null_mut();
        // SAFETY: a live graph (the caller's contract); valid out pointer.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        (r, exec)
    }

    unsafe fn exec_destroy(exec: CUgraphExec) -> CUresult {
        // SAFETY: the caller's contract (destroyed once, after its launches).
        unsafe { sys::cuGraphExecDestroy(exec) }
    }

    unsafe fn graph_destroy(graph: CUgraph) -> CUresult {
        // SAFETY: the caller's contract (destroyed once).
        unsafe { sys::cuGraphDestroy(graph) }
    }

    unsafe fn launch(exec: CUgraphExec, stream: CUstream) -> CUresult {
        // SAFETY: the caller's contract (both live, the context current).
        unsafe { sys::cuGraphLaunch(exec, stream) }
    }

    fn stream_key(stream: CUstream) -> usize {
        stream as usize
    }
}

/// The executable graphs of a context still live, and the captures a
/// failed end left under way (the core's).
pub(crate) type Pins = memgov_stream_ordered::capture::Pins<Cuda>;

// ---- capture -------------------------------------------------------------

/// A stream capture under way ([`CudaContext::begin_capture`]): allocations
/// carved from its pool and copies recorded on its stream, then
/// [`end`](Self::end) makes the graph.
///
/// ```no_run
/// use memgov::cuda::{ArenaConfig, CaptureConfig, CaptureMode, CudaConfig, CudaContext};
/// use memgov::DeviceContext;
/// let ctx = CudaContext::new(CudaConfig { arena: Some(ArenaConfig::default()), ..CudaConfig::default() })?;
/// let s = ctx.create_stream()?;
/// let mut cap = ctx.begin_capture(&s, CaptureConfig { pool_bytes: 4 << 20, mode: CaptureMode::Global })?;
/// let buf = cap.allocate(4096)?;
/// cap.upload(&buf, 0, vec![7; 4096])?;
/// let out = cap.download(&buf, 0, 4096)?;
/// let mut graph = cap.end()?;
/// for _ in 0..10 {
///     graph.launch(&s)?;
/// }
/// assert_eq!(graph.read_output(out)?, vec![7; 4096]);
/// graph.destroy()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaCapture<'a> {
    core: CaptureCore<Shared>,
    _ctx: PhantomData<&'a CudaContext>,
}

impl std::fmt::Debug for CudaCapture<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (pool, used) = self.core.pool_usage();
        f.debug_struct("CudaCapture")
            .field("id", &self.core.id())
            .field("pool", &pool)
            .field("used", &used)
            .finish()
    }
}

impl CudaContext {
    /// The size of the pool [`begin_capture`](Self::begin_capture) takes for
    /// `pool_bytes`: at least 1, rounded up to [`CAPTURE_ALIGN`], checked
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
    /// ([`CudaConfig::arena`](crate::CudaConfig::arena)).
    ///
    /// Waits for memgov's maps and unmaps under way to finish; while the
    /// capture is under way, later ones wait for it to end.
    pub fn begin_capture(
        &self,
        stream: &CudaStream,
        config: CaptureConfig,
    ) -> Result<CudaCapture<'_>, BackendError> {
        const OP: &str = "begin_capture";
        let s = &*self.shared;
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        let core = CaptureCore::begin(
            self.shared.clone(),
            self.arena.clone(),
            self.pins.clone(),
            stream.raw,
            config,
            ALIGN,
            "CudaConfig::arena",
            |arena, s, bytes| arena.allocate(s, bytes),
        )?;
        Ok(CudaCapture {
            core,
            _ctx: PhantomData,
        })
    }
}

impl CudaCapture<'_> {
    /// The driver's id of this capture.
    pub fn id(&self) -> u64 {
        self.core.id()
    }

    /// Bytes of the pool not carved yet.
    pub fn pool_free(&self) -> u64 {
        self.core.pool_free()
    }

    /// Carve `bytes` from the pool: no driver call. Refused with
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
    /// [`CudaGraph::read_output`].
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
    /// graph until [`CudaGraph::destroy`] (or teardown). A capture dropped
    /// without `end` is ended and its graph discarded.
    pub fn end(self) -> Result<CudaGraph, BackendError> {
        self.core.end().map(|core| CudaGraph { core })
    }
}

/// An instantiated graph made by a capture: launched any number of times on
/// any stream of its context, then destroyed. It pins its pool and its host
/// buffers until then.
///
/// Dropping it destroys it as [`destroy`](Self::destroy) does; when that is
/// refused (on a thread whose own capture is under way) the graph stays
/// pinned, its host buffers kept, until teardown.
pub struct CudaGraph {
    core: GraphCore<Shared>,
}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (used, pool) = self.core.pool_usage();
        f.debug_struct("CudaGraph")
            .field("pool", &pool)
            .field("used", &used)
            .finish()
    }
}

impl CudaGraph {
    /// Bytes of the pool the capture carved, and the pool's size.
    pub fn pool_usage(&self) -> (u64, u64) {
        self.core.pool_usage()
    }

    /// Bytes of device memory the graph's own allocation nodes take: the
    /// sum of `bytesize` over its `CU_GRAPH_NODE_TYPE_MEM_ALLOC` nodes
    /// (`cuGraphGetNodes`, `cuGraphNodeGetType`,
    /// `cuGraphMemAllocNodeGetParams`). Such nodes come from stream-ordered
    /// allocations (`cuMemAllocAsync`) a runtime queued on the capturing
    /// stream itself; memgov's capture makes none (its allocations carve
    /// the pool). The driver keeps that memory for the graph while it may
    /// launch, so the sum is what the graph holds at most (the driver may
    /// reuse memory between allocations whose lifetimes do not overlap).
    pub fn graph_memory_bytes(&self) -> Result<u64, BackendError> {
        const OP: &str = "graph_memory";
        let s = self.core.shared();
        s.check_usable(OP)?;
        let graph = self.core.raw_graph(OP)?;
        let _current = s.make_current(OP)?;
        let mut n: usize = 0;
        // SAFETY: a live graph of this context (pinned until destroy);
        // a null node array asks for the count only; the context is current.
        let r = unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) };
        s.checked(OP, "cuGraphGetNodes", r)?;
        if n == 0 {
            return Ok(0);
        }
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` holds `n` entries, the count passed in.
        let r = unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) };
        s.checked(OP, "cuGraphGetNodes", r)?;
        let mut bytes = 0u64;
        for &node in &nodes[..n.min(nodes.len())] {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node the driver just listed; valid out pointer.
            let r = unsafe { sys::cuGraphNodeGetType(node, &mut kind) };
            s.checked(OP, "cuGraphNodeGetType", r)?;
            if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC {
                continue;
            }
            // SAFETY: all-zero is a valid value of this plain-data struct
            // (null pointers, zero sizes, the first enum variants).
            let mut params: sys::CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
            // SAFETY: an allocation node (its type checked above); valid out
            // pointer.
            let r = unsafe { sys::cuGraphMemAllocNodeGetParams(node, &mut params) };
            s.checked(OP, "cuGraphMemAllocNodeGetParams", r)?;
            bytes = bytes.saturating_add(params.bytesize as u64);
        }
        Ok(bytes)
    }

    /// Queue one run of the graph on `stream` (`cuGraphLaunch`).
    ///
    /// Refused with `InvalidArgument` while the arena sleeps (the pool's
    /// memory is reserved, not mapped: the graph's copies would fault), as
    /// copies to sleeping memory are; wake the arena first. A sleep asked
    /// for meanwhile waits until the launch is queued, then waits for it.
    pub fn launch(&self, stream: &CudaStream) -> Result<(), BackendError> {
        const OP: &str = "graph_launch";
        let s = self.core.shared();
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        self.core.launch(stream.raw)
    }

    /// Wait for every launch of the context (`cuCtxSynchronize`, admitted
    /// by the gate) and copy out what the graph's download `slot` holds.
    /// `&mut self`: no launch of this graph can be queued meanwhile.
    pub fn read_output(&mut self, slot: OutputSlot) -> Result<Vec<u8>, BackendError> {
        self.core.read_output(slot.0)
    }

    /// Wait for every launch (`cuCtxSynchronize`, admitted by the gate),
    /// destroy the executable graph and the graph, and only then return the
    /// pool to the arena and free the host buffers.
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
}
