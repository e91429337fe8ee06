//! Graph capture on a CUDA context's arena: CUDA's table of capture calls
//! (`cuStreamBeginCapture_v2`, ...), its public types over the core's
//! ([`memgov_stream_ordered::capture`], whose documentation lists the
//! invariants: no driver allocation during capture, the gate, the pins),
//! the count of a graph's memory nodes only CUDA reads, and the
//! process-wide gate ([`capture_gate`]) that keeps memgov's own driver
//! calls (map, unmap, release, `cuCtxSynchronize`, ...) from invalidating
//! a capture begun in `CU_STREAM_CAPTURE_MODE_GLOBAL`.

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
