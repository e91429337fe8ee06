//! ONNX Runtime on memgov: an `OrtAllocator` whose memory is governed.
//!
//! Register a [`GovernedAllocator`] on the ONNX Runtime environment and
//! create sessions with [`GovernedAllocator::session`]: the model's weights
//! are copied into governed buffers and handed to ONNX Runtime, which reads
//! them in place, and every CPU allocation the session makes (prepacked
//! weights, intermediate tensors, outputs) is allocated through the same
//! memgov context, charged to its budgets, released stream-ordered when ONNX
//! Runtime frees it, and holds the context against teardown until it is
//! freed. Weights that cannot be placed are measured and recorded on the
//! context as outside memgov, charged to its budgets
//! (`ContextSnapshot::outside_bytes`).
//!
//! ```no_run
//! use memgov::{ContextConfig, Governor, Role, host::{HostConfig, HostContext}};
//! use memgov_onnxruntime::{GovernedAllocator, MatMulAdd};
//! use ort::session::Session;
//! use ort::value::Tensor;
//!
//! let env = ort::init().build()?;
//! let gov = Governor::new();
//! let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().label("cpu0"));
//! let alloc = GovernedAllocator::register(&env, &ctx, Role::Activation)?;
//! let model = MatMulAdd::new(3, 4);
//! let mut session = alloc.session(&env, &model.to_onnx(), Ok)?;
//! let x = Tensor::from_array(([2usize, 3], model.input(2)))?;
//! let outputs = session.run(ort::inputs!["X" => x])?;
//! let (_, y) = outputs["Y"].try_extract_tensor::<f32>()?;
//! assert_eq!(y, model.reference(&model.input(2)).as_slice());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The rules (see `docs/onnxruntime.md` in the memgov repository):
//!
//! * **Lifetime.** ONNX Runtime keeps the allocator's raw pointer for as long
//!   as any session or tensor made with it lives, even after
//!   `UnregisterAllocator`. The C-visible block is therefore never freed
//!   (a few hundred bytes per allocator, nothing it holds reaches the
//!   context); what holds the context is.
//! * **Refusals.** Admission runs first (waiting for pending releases,
//!   pressure responders). A refusal that remains is never answered with
//!   null, because ONNX Runtime writes to some allocations without checking
//!   them: it is served from the process heap as an overdraft, reported in
//!   [`AllocatorStats::overdrafts`]. Inside [`GovernedAllocator::strict`]
//!   (which [`GovernedAllocator::session`] uses for session creation) the
//!   scope then fails with the governor's error, after dropping what was
//!   made.
//! * **Panics** never cross the FFI boundary: every callback runs under
//!   `catch_unwind`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod allocator;
mod error;
mod model;
mod session;

pub use allocator::{
    AllocatorStats, GovernedAllocator, HostAddressable, ALIGN, ALLOCATOR_SITE, HOLDER, PAD,
};
pub use error::Error;
pub use model::{weights, ConvTranspose, MatMulAdd, Weight, WeightKind};
pub use session::{GovernedSession, WEIGHTS_SITE};

/// Load the ONNX Runtime library named by `ORT_DYLIB_PATH` and build the
/// process's environment, or say why not (for tests and examples that skip
/// when the library is absent).
pub fn environment() -> Result<ort::environment::Environment, String> {
    let path = std::env::var_os("ORT_DYLIB_PATH").ok_or(
        "ORT_DYLIB_PATH is not set (scripts/ci/60-onnxruntime.sh fetches the onnxruntime wheel and sets it)",
    )?;
    if !std::path::Path::new(&path).is_file() {
        return Err(format!(
            "ORT_DYLIB_PATH={} is not a file",
            path.to_string_lossy()
        ));
    }
    ort::init_from(&path)
        .map_err(|e| format!("loading {}: {e}", path.to_string_lossy()))?
        .with_name("memgov-onnxruntime")
        .build()
        .map_err(|e| format!("creating the ONNX Runtime environment: {e}"))
}
