//! Sessions whose weights live in governed memory.
//!
//! ONNX Runtime keeps a model's initializers in its own heap: it does not
//! allocate them through the registered allocator (only the copies its
//! kernels prepack are). The documented way to place them elsewhere is
//! `AddInitializer` (`SessionBuilder::with_initializer`): an initializer
//! given as an `OrtValue` over memory the caller owns is used in place of
//! the model's, without a copy, for as long as the session lives.
//! [`GovernedAllocator::session`] copies each initializer of the model (and
//! each `Constant` value, which ONNX Runtime turns into one), in the main
//! graph and in its subgraphs, into a governed buffer charged to
//! [`Role::Weights`] and hands it to ONNX Runtime that way; the weights it cannot place (see [`Weight::raw`]
//! and [`WeightKind`]) are measured and recorded on the context as memory
//! allocated outside memgov: charged to its budgets while the session lives.

use crate::allocator::{GovernedAllocator, HostAddressable, PAD};
use crate::error::Error;
use crate::model::{weights, Weight, WeightKind};
use memgov::{Alloc, DeviceBuffer, OutsideUsage, Role};
use ort::environment::Environment;
use ort::memory::Allocator;
use ort::session::builder::SessionBuilder;
use ort::session::Session;
use ort::sys as ffi;
use ort::value::DynValue;
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};

/// The site the governed buffers holding a session's initializers are
/// counted at, with call-site attribution on.
pub const WEIGHTS_SITE: &str = "onnxruntime weights";

/// A session made by [`GovernedAllocator::session`], with the governed
/// buffers that hold its initializers. Use it as a [`Session`] (it derefs to
/// one). Dropping it drops the session first, then the weights.
pub struct GovernedSession<C: HostAddressable> {
    // Field order is drop order: the session stops using the weights first.
    session: Session,
    weights: Vec<DeviceBuffer<C>>,
    outside: OutsideUsage<C>,
    governed_weight_bytes: u64,
}

impl<C: HostAddressable> GovernedSession<C> {
    /// Bytes of initializers held in governed memory (padding included).
    pub fn governed_weight_bytes(&self) -> u64 {
        self.governed_weight_bytes
    }

    /// Bytes of the model's weights that ONNX Runtime keeps in its own heap,
    /// recorded (and charged) on the context as allocated outside memgov.
    pub fn outside_weight_bytes(&self) -> u64 {
        self.outside.bytes()
    }

    /// Number of governed weight buffers.
    pub fn governed_weights(&self) -> usize {
        self.weights.len()
    }

    /// The governed buffer holding the `index`-th placed weight, in the
    /// order of [`weights`](crate::weights) (the weights left outside
    /// skipped).
    pub fn weight_buffer(&self, index: usize) -> Option<&DeviceBuffer<C>> {
        self.weights.get(index)
    }
}

impl<C: HostAddressable> Deref for GovernedSession<C> {
    type Target = Session;
    fn deref(&self) -> &Session {
        &self.session
    }
}

impl<C: HostAddressable> DerefMut for GovernedSession<C> {
    fn deref_mut(&mut self) -> &mut Session {
        &mut self.session
    }
}

impl<C: HostAddressable> std::fmt::Debug for GovernedSession<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernedSession")
            .field("governed_weights", &self.weights.len())
            .field("governed_weight_bytes", &self.governed_weight_bytes)
            .field("outside_weight_bytes", &self.outside.bytes())
            .finish()
    }
}

/// Whether `w` can be handed to ONNX Runtime as a governed `OrtValue`: an
/// initializer (or a `Constant` value, which becomes one) of any graph,
/// stored as bytes that can be used as they are, under a name no other
/// weight has (`AddInitializer` matches by name).
fn placeable(w: &Weight, all: &[Weight]) -> bool {
    matches!(w.kind, WeightKind::Initializer | WeightKind::Constant)
        && w.raw.is_some()
        && !w.name.is_empty()
        && all.iter().filter(|o| o.name == w.name).count() == 1
}

/// The ONNX Runtime element type of ONNX data type `t`, for the types
/// [`Weight::raw`] is given for.
fn element_type(t: i32) -> Option<ffi::ONNXTensorElementDataType> {
    use ffi::ONNXTensorElementDataType as T;
    Some(match t {
        1 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
        2 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
        3 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
        4 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16,
        5 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16,
        6 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
        7 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
        9 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL,
        10 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
        11 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE,
        12 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32,
        13 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64,
        16 => T::ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16,
        _ => return None,
    })
}

impl<C: HostAddressable> GovernedAllocator<C> {
    /// Create a session for the ONNX model `model` with its weights in
    /// governed memory, under [`strict`](Self::strict).
    ///
    /// Each initializer and `Constant` value of the model (main graph and
    /// subgraphs) stored as raw data is copied into a governed buffer charged to [`Role::Weights`] and given to ONNX
    /// Runtime with `AddInitializer`, which uses it in place, without a
    /// copy. A refused weight fails the call before ONNX Runtime is asked.
    /// `configure` sets the session's options (threads, optimisation level);
    /// the builder already has `with_env_allocators()`. The weights left
    /// outside (tensors stored in typed fields other than packed floats and
    /// doubles, strings, external data, tensor attributes of other nodes,
    /// names given twice) are summed from the model file
    /// and recorded on the context, charged to its budgets
    /// ([`memgov::ContextSnapshot::outside_bytes`]) while the session lives.
    ///
    /// # Errors
    ///
    /// [`Error::Governor`] for a refused weight or a refusal while ONNX
    /// Runtime creates the session; [`Error::Model`] if `model` is not a
    /// well-formed ONNX file; [`Error::Runtime`] or [`Error::Ort`] for ONNX
    /// Runtime's own errors; [`Error::Closed`] never (the handle is alive).
    pub fn session(
        &self,
        env: &Environment,
        model: &[u8],
        configure: impl FnOnce(SessionBuilder) -> ort::Result<SessionBuilder>,
    ) -> Result<GovernedSession<C>, Error> {
        let all = weights(model).map_err(Error::Model)?;
        let stream = self.stream().ok_or(Error::Closed)?;
        let ctx = self.context();
        let mut buffers = Vec::new();
        let mut values = Vec::new();
        let mut governed_weight_bytes = 0;
        let mut outside = 0;
        for w in &all {
            let (true, Some(raw), Some(ty)) =
                (placeable(w, &all), w.raw.clone(), element_type(w.data_type))
            else {
                outside += w.bytes;
                continue;
            };
            let bytes = w.bytes + PAD;
            let weights = Alloc::new(bytes, Role::Weights).site(WEIGHTS_SITE);
            let buffer = ctx.allocate(&stream, weights)?;
            buffer.write(0, &model[raw])?;
            let p = buffer
                .raw()
                .and_then(C::host_ptr)
                .ok_or_else(|| Error::Unusable {
                    context: ctx.label().to_owned(),
                    reason: "its memory is not CPU-addressable".into(),
                })?;
            let mut value = ptr::null_mut();
            // SAFETY: `p` addresses `w.bytes` (+ PAD) bytes that stay valid
            // until the buffer is dropped, which `GovernedSession` does only
            // after the session; the shape pointer is valid for the call; the
            // memory info is the allocator's, alive for the process.
            crate::allocator::check(
                unsafe {
                    (ort::api().CreateTensorWithDataAsOrtValue)(
                        self.memory_info(),
                        p.as_ptr().cast(),
                        usize::try_from(w.bytes).unwrap_or(usize::MAX),
                        w.dims.as_ptr(),
                        w.dims.len(),
                        ty,
                        &mut value,
                    )
                },
                "CreateTensorWithDataAsOrtValue",
            )?;
            let value = NonNull::new(value).ok_or(Error::Ort {
                call: "CreateTensorWithDataAsOrtValue",
                message: "returned no value".into(),
            })?;
            // SAFETY: `value` is a tensor just created, owned by us; the
            // default allocator is only recorded (a tensor over caller-owned
            // memory is never freed through it).
            let value: DynValue = unsafe { DynValue::from_ptr(value, Some(&Allocator::default())) };
            values.push((w.name.clone(), value));
            governed_weight_bytes += bytes;
            buffers.push(buffer);
        }
        stream.synchronize()?;
        let session = self.strict(|| {
            let mut builder = configure(Session::builder(env)?.with_env_allocators()?)?;
            for (name, value) in values {
                builder = builder.with_initializer(name, value)?;
            }
            builder.commit_from_memory(model)
        })?;
        Ok(GovernedSession {
            session,
            weights: buffers,
            outside: ctx.report_outside(outside),
            governed_weight_bytes,
        })
    }
}
