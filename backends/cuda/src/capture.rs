//! Graph capture on a CUDA context's arena: the public types over the
//! core's ([`memgov_stream_ordered::capture`], whose documentation lists
//! the invariants: no driver allocation during capture, the gate, the
//! pins), over CUDA's capture calls (`cuStreamBeginCapture_v2`, ..., and
//! the count of a graph's memory nodes only CUDA reads: its table's,
//! [`crate::table`]), and the process-wide gate ([`capture_gate`]) that
//! keeps memgov's own driver calls (map, unmap, release,
//! `cuCtxSynchronize`, ...) from invalidating a capture begun in
//! `CU_STREAM_CAPTURE_MODE_GLOBAL`.

use crate::result::Cuda;
use crate::shared::Shared;
use crate::{CudaContext, CudaStream};
use cudarc::driver::sys::CUdeviceptr;
use memgov_backend::vmm::Gate;

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
