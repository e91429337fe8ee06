//! What can go wrong between memgov and ONNX Runtime.

use memgov::{GovernorError, ProviderContextPinError};

/// An error of the glue.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The governed context refused a stream or an allocation.
    #[error(transparent)]
    Governor(#[from] GovernorError),
    /// The governed context refused a pin: it is retiring or lost; register
    /// the allocator on a live context.
    #[error(
        "the context refused the onnxruntime pin: {0}; register on a context that is not retiring"
    )]
    Pin(#[from] ProviderContextPinError),
    /// An ONNX Runtime API call failed.
    #[error("ONNX Runtime {call} failed: {message}")]
    Ort {
        /// The C API function.
        call: &'static str,
        /// ONNX Runtime's message.
        message: String,
    },
}
