//! Graph capture on a HIP context's arena: HIP's table of capture calls
//! (`hipStreamBeginCapture`, ...), its public types over the core's
//! ([`memgov_stream_ordered::capture`], whose documentation lists the
//! invariants: no runtime allocation during capture, the gate, the pins),
//! and the process-wide gate ([`capture_gate`]) that keeps memgov's own
//! runtime calls from invalidating a `hipStreamCaptureModeGlobal` capture;
//! synchronizing or destroying a capturing stream is refused to its own
//! thread and waited for on others. Where ROCm lacks the calls,
//! [`HipContext::begin_capture`] answers `Unsupported`, naming the first
//! one missing ([`capture_supported`]).

use crate::ffi::{self, hipGraphExec_t, hipGraph_t, hipStream_t, HipResult};
use crate::result::{err, Hip};
use crate::shared::Shared;
use crate::{HipContext, HipStream};
use memgov_backend::vmm::Gate;
use memgov_backend::{BackendError, BackendErrorKind};
use memgov_stream_ordered::table::{CaptureNames, CaptureTable, Context};

/// The process-wide gate between HIP stream captures begun through memgov
/// and memgov's own potentially unsafe runtime calls (map, unmap, release,
/// device synchronize, `hipHostMalloc`, `hipHostFree`, `hipFree`). A
/// runtime that makes such calls itself beside memgov's captures can pass
/// them through it ([`Gate::call`]); [`Gate::waiting`] shows calls held
/// back by a capture.
pub fn capture_gate() -> &'static Gate {
    crate::shared::gate()
}

pub use memgov_backend::capability::{CaptureConfig, CaptureMode, PoolExhausted};
pub use memgov_stream_ordered::capture::OutputSlot;

/// Device memory carved from a capture pool, its address a
/// `hipDeviceptr_t`.
pub type CaptureBuffer = memgov_stream_ordered::capture::CaptureBuffer<ffi::hipDeviceptr_t>;

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
        capture: "HipCapture",
        graph: "HipGraph",
        arena_setting: "HipConfig::arena",
    };

    type DevicePtr = ffi::hipDeviceptr_t;
    /// memgov does not read a graph's nodes on HIP.
    const READS_GRAPH_NODES: bool = false;

    fn capture_supported() -> Result<(), BackendError> {
        capture_calls()
    }

    unsafe fn graph_memory<C: Context<Table = Self>>(
        _: &C,
        _: hipGraph_t,
    ) -> Result<u64, BackendError> {
        Ok(0)
    }

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

// ---- capture -------------------------------------------------------------

/// A stream capture under way ([`HipContext::begin_capture`]): the core's
/// [`Capture`](memgov_stream_ordered::capture::Capture) over HIP.
pub type HipCapture<'a> = memgov_stream_ordered::capture::Capture<'a, Shared>;

/// An instantiated graph made by a [`HipCapture`]: the core's
/// [`Graph`](memgov_stream_ordered::capture::Graph) over HIP.
pub type HipGraph = memgov_stream_ordered::capture::Graph<Shared>;

/// `Ok` when the loaded HIP runtime has every call a capture needs;
/// otherwise `Unavailable` (no runtime) or `Unsupported`, naming the first
/// call missing. A capture also needs a context with an arena.
pub fn capture_supported() -> Result<(), BackendError> {
    <Hip as CaptureTable>::capture_supported()
}

fn capture_calls() -> Result<(), BackendError> {
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

memgov_stream_ordered::capture_methods! {
    impl HipContext<Hip> {
        stream: HipStream,
        capture: HipCapture,
    }
    /// Needs an arena ([`HipConfig::arena`](crate::HipConfig::arena)) and a
    /// runtime with the capture calls ([`capture_supported`]).
}
