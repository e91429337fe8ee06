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
use memgov_backend::vmm::Gate;
use memgov_backend::BackendError;
use memgov_stream_ordered::table::{CaptureNames, CaptureTable, Context};

/// Allocations carved from a capture pool, and the pool itself, are
/// aligned to this, as `cuMemAlloc` aligns its allocations.
pub const CAPTURE_ALIGN: u64 = memgov_backend::vmm::ALIGN;

pub use memgov_backend::capability::{CaptureConfig, CaptureMode, PoolExhausted};
pub use memgov_stream_ordered::capture::OutputSlot;

/// Device memory carved from a capture pool, its address a `CUdeviceptr`.
pub type CaptureBuffer = memgov_stream_ordered::capture::CaptureBuffer<CUdeviceptr>;

// ---- the process-wide gate -----------------------------------------------

/// The process-wide gate between CUDA stream captures begun through memgov
/// and memgov's own potentially unsafe driver calls (map, unmap, release,
/// `cuCtxSynchronize`, `cuMemHostAlloc`, `cuMemFreeHost`). A runtime that
/// makes such calls itself beside memgov's captures can pass them through
/// it ([`Gate::call`]); [`Gate::waiting`] shows calls held back by a
/// capture.
pub fn capture_gate() -> &'static Gate {
    crate::shared::gate()
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
        capture: "CudaCapture",
        graph: "CudaGraph",
        arena_setting: "CudaConfig::arena",
    };

    type DevicePtr = CUdeviceptr;
    const READS_GRAPH_NODES: bool = true;

    /// The sum of `bytesize` over the graph's
    /// `CU_GRAPH_NODE_TYPE_MEM_ALLOC` nodes.
    unsafe fn graph_memory<C: Context<Table = Self>>(
        s: &C,
        graph: CUgraph,
    ) -> Result<u64, BackendError> {
        const OP: &str = "graph_memory";
        let mut n: usize = 0;
        // SAFETY: a live graph, its context current (the caller's
        // contract); a null node array asks for the count only.
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

/// A stream capture under way ([`CudaContext::begin_capture`]): the core's
/// [`Capture`](memgov_stream_ordered::capture::Capture) over CUDA.
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
pub type CudaCapture<'a> = memgov_stream_ordered::capture::Capture<'a, Shared>;

/// An instantiated graph made by a [`CudaCapture`]: the core's
/// [`Graph`](memgov_stream_ordered::capture::Graph) over CUDA.
pub type CudaGraph = memgov_stream_ordered::capture::Graph<Shared>;

memgov_stream_ordered::capture_methods! {
    impl CudaContext<Cuda> {
        stream: CudaStream,
        capture: CudaCapture,
    }
    /// Needs an arena ([`CudaConfig::arena`](crate::CudaConfig::arena)).
}
