//! Graph capture on a HIP context's arena: the public types over the
//! core's ([`memgov_stream_ordered::capture`], whose documentation lists
//! the invariants: no runtime allocation during capture, the gate, the
//! pins), over HIP's capture calls (`hipStreamBeginCapture`, ...: its
//! table's, [`crate::table`]), and the process-wide gate ([`capture_gate`])
//! that keeps memgov's own runtime calls from invalidating a
//! `hipStreamCaptureModeGlobal` capture; synchronizing or destroying a
//! capturing stream is refused to its own thread and waited for on others. Where ROCm lacks the calls,
//! [`HipContext::begin_capture`] answers `Unsupported`, naming the first
//! one missing ([`capture_supported`]).

use crate::ffi;
use crate::result::Hip;
use crate::shared::Shared;
use crate::{HipContext, HipStream};
use memgov_backend::vmm::Gate;
use memgov_backend::BackendError;
use memgov_stream_ordered::table::CaptureTable;

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

memgov_stream_ordered::capture_methods! {
    impl HipContext<Hip> {
        stream: HipStream,
        capture: HipCapture,
    }
    /// Needs an arena ([`HipConfig::arena`](crate::HipConfig::arena)) and a
    /// runtime with the capture calls ([`capture_supported`]).
}
