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
    /// The allocator's handle was dropped: nothing new is governed.
    #[error("the allocator was dropped; register a new one to govern new allocations")]
    Closed,
    /// The context's memory cannot be handed to ONNX Runtime's CPU kernels.
    #[error(
        "context '{context}' cannot serve ONNX Runtime: {reason}; use a host-addressable context"
    )]
    Unusable {
        /// The context's label.
        context: String,
        /// What is wrong with its memory.
        reason: String,
    },
    /// ONNX Runtime refused a call of the `ort` crate (session creation,
    /// a run).
    #[error(transparent)]
    Runtime(#[from] ort::Error),
    /// The model file could not be read.
    #[error("the model is not a well-formed ONNX file: {0}")]
    Model(String),
    /// An ONNX Runtime API call failed.
    #[error("ONNX Runtime {call} failed: {message}")]
    Ort {
        /// The C API function.
        call: &'static str,
        /// ONNX Runtime's message.
        message: String,
    },
}
