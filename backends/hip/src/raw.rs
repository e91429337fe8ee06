//! The raw HIP runtime, for work beside memgov's: tests, raw baselines, a
//! runtime's own calls on a stream memgov lent it.
//!
//! The entry points memgov resolved from the loaded `libamdhip64` (each
//! calls through memgov's table and panics when no HIP runtime can be
//! loaded: check [`crate::driver_present`] or open a
//! [`HipContext`](crate::HipContext) first), their handle types and
//! constants (the values of ROCm's `hip_runtime_api.h`), and how memgov
//! classifies a result ([`check`], [`hip_error`], [`kind_of`],
//! [`is_device_lost`], [`error_name`]), so that a raw call fails the way
//! memgov's own do.
//!
//! Memory and streams made here are not memgov's: the governor does not see
//! them, and teardown does not free them. The loader and the table stay
//! private to the crate, as CUDA's driver bindings do.
//!
//! ```no_run
//! use memgov::hip::raw::{self, hipStreamSynchronize};
//! use memgov::hip::{HipConfig, HipContext};
//!
//! let ctx = HipContext::new(HipConfig::default())?;
//! let s = memgov::DeviceContext::create_stream(&ctx)?;
//! // SAFETY: a live stream of a live context.
//! let r = unsafe { hipStreamSynchronize(s.hip_stream()) };
//! raw::check("example", "hipStreamSynchronize", r)?;
//! # Ok::<(), memgov::BackendError>(())
//! ```

pub use crate::ffi::*;
pub use crate::result::{check, error_name, hip_error, is_device_lost, kind_of};
